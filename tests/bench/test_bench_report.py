"""The benchmark harness's pure parts (ratios, targets, markdown) as table tests, and
one smoke run of the real harness with tiny sizes (a few seconds)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.core import Config, Figure, summarise
from bench.report import by_key, derive, evaluate_targets, render_markdown

ROOT = Path(__file__).resolve().parents[2]


def fig(key: str, median: float, unit: str = "GB/s", spread: float = 0.0) -> Figure:
    return Figure(key, key, unit, median, median - spread, median + spread, 5)


def test_summarise_median_min_max():
    s = summarise([3.0, 1.0, 2.0, 10.0, 4.0])
    assert (s.median, s.min, s.max, s.n) == (3.0, 1.0, 10.0, 5)


def test_summarise_rejects_empty():
    with pytest.raises(ValueError, match="at least one"):
        summarise([])


def test_config_rejects_zero_repeats():
    with pytest.raises(ValueError, match="--repeats is 0"):
        Config.build(quick=True, repeats=0)


@pytest.mark.parametrize(
    ("figures", "key", "expected"),
    [
        pytest.param([fig("transport.push.64MiB", 3.0), fig("limits.tcp.64MiB", 4.0)],
                     "transport.push.64MiB.vs_tcp", 0.75, id="push-vs-tcp-same-size"),
        pytest.param([fig("transport.pull.64MiB", 3.0), fig("limits.tcp.64MiB", 4.0),
                      fig("transport.tcp.64MiB", 3.0)],
                     "transport.pull.64MiB.vs_tcp", 1.0, id="interleaved-tcp-preferred"),
        pytest.param([fig("ps_step.ps1.64MiB", 0.3, "s"), fig("ps_step.allreduce.64MiB", 0.1, "s")],
                     "ps_step.ps1.64MiB.vs_allreduce", 3.0, id="ps-step-vs-allreduce"),
        pytest.param([fig("ps_step.ps2.64MiB", 0.3, "s"), fig("ps_step.allreduce.64MiB", 0.1, "s"),
                      fig("ps_step.allreduce_ps2.64MiB", 0.15, "s")],
                     "ps_step.ps2.64MiB.vs_allreduce", 2.0, id="interleaved-allreduce-preferred"),
        pytest.param([fig("training.wide.async", 600, "samples/s"),
                      fig("training.wide.ddp", 500, "samples/s")],
                     "training.wide.async.vs_ddp", 1.2, id="training-vs-ddp"),
        pytest.param([fig("training.digits.tta.async", 4.0, "s"),
                      fig("training.digits.tta.single", 2.0, "s")],
                     "training.digits.tta.async.vs_single", 2.0, id="time-to-accuracy"),
        pytest.param([fig("overlap.wide.on", 450, "samples/s"),
                      fig("overlap.wide.off", 500, "samples/s")],
                     "overlap.wide.on_vs_off", 0.9, id="overlap-on-vs-off"),
    ],
)
def test_derive_ratios(figures, key, expected):
    got = by_key(derive(figures))[key]
    assert got.median == pytest.approx(expected)
    assert got.unit == "x"


def test_derive_marks_missing_baseline():
    got = by_key(derive([fig("transport.pull.4MiB", 1.0)]))["transport.pull.4MiB.vs_tcp"]
    assert got.median is None and "missing" in got.note


def _statuses(figures, prefix):
    figs = [*figures, *derive(figures)]
    return {t.status for t in evaluate_targets(figs) if t.name.startswith(prefix)}


@pytest.mark.parametrize(
    ("figures", "prefix", "expected"),
    [
        pytest.param([fig("transport.push_stream.64MiB", 3.5), fig("transport.pull.64MiB", 3.3),
                      fig("transport.push_stream.4MiB", 0.1), fig("limits.tcp.64MiB", 4.0),
                      fig("limits.tcp.4MiB", 2.0)],
                     "transport", "met", id="transport-met-small-sizes-ignored"),
        pytest.param([fig("transport.push_stream.64MiB", 3.5), fig("transport.pull.64MiB", 3.0),
                      fig("limits.tcp.64MiB", 4.0)],
                     "transport", "missed", id="transport-missed-by-pull"),
        pytest.param([fig("transport.push_stream.64MiB", 2.0), fig("transport.pull.64MiB", 3.5),
                      fig("limits.tcp.64MiB", 4.0)],
                     "transport", "missed", id="transport-missed-by-push-stream"),
        pytest.param([fig("transport.push_stream.64MiB", 3.5), fig("transport.pull.64MiB", 3.5),
                      fig("transport.push.64MiB", 1.0), fig("limits.tcp.64MiB", 4.0)],
                     "transport", "met", id="push-to-reply-shown-not-judged"),
        pytest.param([], "transport", "not measured", id="transport-not-measured"),
        pytest.param([fig("ps_step.ps1.64MiB", 0.2, "s"), fig("ps_step.allreduce.64MiB", 0.1, "s")],
                     "PS step", "met", id="ps-step-at-byte-parity"),
        pytest.param([fig("ps_step.ps1.64MiB", 0.35, "s"),
                      fig("ps_step.allreduce.64MiB", 0.1, "s")],
                     "PS step", "missed", id="ps-step-3.5x"),
        pytest.param([fig("operator.peak_rss", 120, "MB", spread=10)],
                     "operator: peak", "met", id="rss-under"),
        pytest.param([fig("operator.peak_rss", 145, "MB", spread=10)],
                     "operator: peak", "met", id="rss-judged-on-median"),
        pytest.param([fig("operator.peak_rss", 155, "MB", spread=10)],
                     "operator: peak", "missed", id="rss-over"),
        pytest.param([fig("sparse_ckpt.every100.vs_none", 0.96, "x")],
                     "sparse checkpoints", "met", id="sparse-ckpt-within-5pct"),
        pytest.param([fig("sparse_ckpt.every100.vs_none", 0.9, "x")],
                     "sparse checkpoints", "missed", id="sparse-ckpt-over-5pct"),
    ],
)
def test_target_status(figures, prefix, expected):
    assert _statuses(figures, prefix) == {expected}


def test_training_targets_need_their_own_ratio():
    figs = [fig("training.digits.async", 1100, "samples/s"),
            fig("training.digits.ddp", 1000, "samples/s"),
            fig("training.wide.async", 1000, "samples/s"),
            fig("training.wide.ddp", 1000, "samples/s")]
    targets = {t.name: t.status for t in evaluate_targets([*figs, *derive(figs)])}
    assert targets == {
        **{k: v for k, v in targets.items() if not k.startswith("training")},
        "training: wide MLP async samples/s >= 1.0x DDP over gloo (2 workers)": "met",
        "training: digits MLP async samples/s >= 1.2x DDP over gloo (2 workers)": "missed",
    }


def test_markdown_has_every_item_and_target():
    figs = [fig("limits.memcpy", 10.0), fig("transport.push.64MiB", 3.0),
            fig("transport.push_stream.64MiB", 3.0),
            fig("limits.tcp.64MiB", 4.0)]
    allf = [*figs, *derive(figs)]
    result = {"date": "d", "quick": True, "machine": {"cpu": "x"},
              "figures": [f.as_json() for f in allf],
              "targets": [t.__dict__ for t in evaluate_targets(allf)],
              "errors": {"operator": "Traceback\nRuntimeError: no emulator"}}
    md = render_markdown(result)
    assert "## 1. Limits" in md and "## 2. Transport" in md
    assert "| push 64 MiB / loopback TCP 64 MiB | 0.75 x |" in md
    assert "RuntimeError: no emulator" in md
    assert "| transport: tensor stream >= 16 MB at >= 0.8x loopback TCP | **missed** |" in md


def test_harness_runs_limits_quick(tmp_path):
    """The real harness, one cheap item, tiny sizes: it runs and writes both files."""
    proc = subprocess.run(
        [sys.executable, "-m", "bench", "--quick", "--only", "limits", "--out", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    data = json.loads((tmp_path / "results.json").read_text())
    keys = {f["key"]: f for f in data["figures"]}
    assert keys["limits.memcpy"]["n"] == 5 and keys["limits.memcpy"]["median"] > 0
    assert keys["limits.tcp.4MiB"]["median"] > 0
    assert (tmp_path / "results.md").read_text().startswith("# pstrain benchmark results")


@pytest.mark.parametrize(
    ("points", "window", "skip", "count", "expected"),
    [
        pytest.param([(0.0, 0), (1.0, 10), (2.0, 30), (3.0, 60)], 1.0, 0, 5, [10.0, 20.0, 30.0],
                     id="one-window-per-point"),
        pytest.param([(0.0, 0), (1.0, 10), (2.0, 30), (3.0, 60)], 1.0, 1, 1, [20.0],
                     id="warm-up-window-dropped"),
        pytest.param([(0.0, 0), (0.5, 5), (1.0, 10), (1.5, 20), (2.0, 30)], 1.0, 0, 5,
                     [10.0, 20.0], id="windows-span-several-points"),
        pytest.param([(0.0, 0), (1.0, 0), (2.0, 10)], 1.0, 0, 5, [5.0],
                     id="no-progress-no-window"),
        pytest.param([], 1.0, 0, 5, [], id="no-points"),
    ],
)
def test_window_rates(points, window, skip, count, expected):
    from bench.training import window_rates

    assert window_rates(points, 1.0, window, skip, count) == pytest.approx(expected)


def test_accuracy_stop_rule():
    from bench.training import reached_accuracy

    check = reached_accuracy(0.95)
    assert not check([(1.0, "eval", {"accuracy": 0.94}), (1.5, "progress", {"step": 3})])
    assert check([(1.0, "eval", {"accuracy": 0.94}), (2.0, "eval", {"accuracy": 0.95})])


def test_measured_span_skips_warm_up_window():
    from bench.training import measured_span

    points = [(0.0, 0), (1.0, 10), (2.0, 30), (3.0, 60), (3.5, 70)]
    assert measured_span(points, 1.0, skip=1, count=2) == (1, 3)
    assert measured_span(points, 1.0, skip=5, count=2) is None


def test_operator_target_names_a_worst_run_over_the_bound():
    figs = [fig("operator.many_jobs.all_pods", 6.0, "s", spread=5.0)]
    (t,) = [t for t in evaluate_targets(figs) if t.name.startswith("operator: all pods of 50")]
    assert t.status == "met"
    assert "worst of 5 runs was over the bound" in t.detail
