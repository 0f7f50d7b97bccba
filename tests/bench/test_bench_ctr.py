"""The CTR benchmark item's harness: its pure parts (sizes, `ss` parsing, ratios,
targets) as table tests, and smoke runs of its real measurements at tiny sizes (no
numbers are judged here)."""

from __future__ import annotations

import os
import socket
import sys
import threading

import pytest

from bench import ctr, torchrec_ref
from bench.core import Config, Figure, run_parts
from bench.report import evaluate_targets, render_markdown

pytestmark = pytest.mark.timeout(240)  # the smoke run spawns 5 processes

SS_OUTPUT = """\
0      0      127.0.0.1:44335 127.0.0.1:47408 users:(("python",pid=11,fd=19))
\t bbr wscale:10,10 rto:212 bytes_sent:1000 bytes_acked:1000 bytes_received:250 segs_out:24
0      0      127.0.0.1:46852 127.0.0.1:43441 users:(("python",pid=11,fd=4))
\t bbr bytes_sent:5 bytes_acked:5 segs_out:25
0      0      127.0.0.1:43896 127.0.0.1:44335 users:(("pstrain",pid=12,fd=24),("pstrain",pid=13,fd=24))
\t bbr bytes_received:7 segs_in:2
0      0      127.0.0.1:1 127.0.0.1:2
\t bbr bytes_sent:99
"""


def fig(key: str, median: float, unit: str = "samples/s", note: str = "") -> Figure:
    return Figure(key, key, unit, median, median, median, 5, note)


def test_parse_ss_sums_sent_and_received_per_process():
    # the shared socket counts once (first owner); a socket without owner is skipped
    assert ctr.parse_ss(SS_OUTPUT) == {11: 1255, 12: 7}


def test_wire_bytes_reads_this_process_sockets():
    server = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(server.getsockname())
    conn, _ = server.accept()
    before = ctr.wire_bytes([os.getpid()])
    got = bytearray()
    reader = threading.Thread(target=lambda: [got.extend(conn.recv(1 << 16))
                                              for _ in iter(lambda: len(got) < 100_000, False)])
    reader.start()
    client.sendall(b"x" * 100_000)
    reader.join(timeout=10)
    moved = ctr.wire_bytes([os.getpid()]) - before
    for s in (client, conn, server):
        s.close()
    assert moved >= 2 * 100_000, "sent by one socket and received by the other, same pid"


@pytest.mark.parametrize(("total", "name", "per_table"), [
    (1_000_000, "1M", 38_462), (10_000_000, "10M", 384_616), (50_000_000, "50M", 1_923_077),
    (26_000, "26k", 1_000)])
def test_sizes(total, name, per_table):
    assert ctr.size_name(total) == name
    assert ctr.size_rows(name) == total
    assert ctr.rows_per_table(total) == per_table
    assert ctr.table_bytes(total) == per_table * 26 * 32 * 4


def test_derive_ratios_and_spread():
    figs = {f.key: f for f in [fig("ctr.ps.1M", 1200.0), fig("ctr.ps.10M", 1000.0),
                               fig("ctr.ddp_dense.10M", 250.0),
                               fig("ctr.ddp_sparse.10M", 500.0), fig("ctr.ps.10M.cpu", 9.0)]}
    got = {f.key: f.median for f in ctr.derive(figs)}
    assert got == pytest.approx({"ctr.ps.10M.vs_ddp_dense": 4.0,
                                 "ctr.ps.10M.vs_ddp_sparse": 2.0, "ctr.ps.spread": 0.2})


@pytest.mark.parametrize(("side", "size", "ids", "metric", "key"), [
    ("ps", "1M", "zipf", "", "ctr.ps.1M"),  # the Zipf keys pstrain and DDP always had
    ("ps", "10M", "zipf", "cpu", "ctr.ps.10M.cpu"),
    ("ddp_sparse", "1M", "zipf", "auc", "ctr.ddp_sparse.1M.auc"),
    ("ps", "1M", "uniform", "", "ctr.ps.1M.uniform"),
    ("ps", "1M", "uniform", "worker_rss", "ctr.ps.1M.uniform.worker_rss"),
    ("ddp_sparse", "10M", "uniform", "auc", "ctr.ddp_sparse.10M.uniform.auc"),
    ("torchrec", "1M", "zipf", "", "ctr.torchrec.1M.zipf"),
    ("torchrec", "1M", "zipf", "cpu", "ctr.torchrec.1M.zipf.cpu"),
    ("torchrec", "10M", "uniform", "auc", "ctr.torchrec.10M.uniform.auc"),
])
def test_figure_keys(side, size, ids, metric, key):
    assert ctr.fig_key(side, size, ids, metric) == key


def test_figure_keys_refuse_an_unknown_id_law():
    with pytest.raises(ValueError, match="ids is 'normal'"):
        ctr.fig_key("ps", "1M", "normal")


def test_torchrec_keys_and_labels():
    assert torchrec_ref.keys("10M", "uniform") == {
        "samples/s": "ctr.torchrec.10M.uniform", "cpu": "ctr.torchrec.10M.uniform.cpu",
        "worker_rss": "ctr.torchrec.10M.uniform.worker_rss",
        "auc": "ctr.torchrec.10M.uniform.auc"}
    assert "1M rows x 32, Zipf 1.2 ids: TorchRec" in torchrec_ref.label(1_000_000, "zipf")
    assert ctr.ids_label("uniform") == "uniform ids"


def test_task_args_name_the_id_law():
    assert ctr.task_args(1_000_000, "ps")["zipf"] == 1.2
    assert ctr.task_args(1_000_000, "ps", "uniform")["zipf"] == 0.0
    assert ctr.ADAGRAD["eps"] == ctr.ADAGRAD_EPS, "every side's Adagrad eps, from one constant"


def test_derive_against_torchrec_and_with_uniform_ids():
    figs = {f.key: f for f in [
        fig("ctr.ps.1M", 1200.0), fig("ctr.torchrec.1M.zipf", 600.0),
        fig("ctr.ps.1M.cpu", 60.0, "CPU-ms"), fig("ctr.torchrec.1M.zipf.cpu", 120.0, "CPU-ms"),
        fig("ctr.ps.1M.uniform", 800.0), fig("ctr.ddp_sparse.1M.uniform", 400.0),
        fig("ctr.torchrec.1M.uniform", 1000.0),
        fig("ctr.ps.1M.uniform.cpu", 90.0, "CPU-ms"),
        fig("ctr.ps.1M.auc", 0.85, "AUC"), fig("ctr.torchrec.1M.zipf.auc", 0.85, "AUC")]}
    got = {f.key: f for f in ctr.derive(figs)}
    assert {k: f.median for k, f in got.items()} == pytest.approx({
        "ctr.ps.1M.vs_torchrec": 2.0, "ctr.ps.1M.cpu.vs_torchrec": 0.5,
        "ctr.ps.1M.uniform.vs_ddp_sparse": 2.0, "ctr.ps.1M.uniform.vs_torchrec": 0.8,
        "ctr.ps.1M.uniform.cpu.vs_torchrec": None}, nan_ok=True)
    assert got["ctr.ps.1M.uniform.cpu.vs_torchrec"].note == "an input figure is missing"
    assert got["ctr.ps.1M.vs_torchrec"].label == (
        "1M rows, Zipf 1.2 ids: pstrain / torchrec samples/s")
    assert got["ctr.ps.1M.cpu.vs_torchrec"].note == (
        "ctr.ps.1M.cpu / ctr.torchrec.1M.zipf.cpu")
    assert "ctr.ps.spread" not in got, "one size: no spread; uniform ids never count"


def test_process_plan_and_auc_notes():
    assert ctr.process_note([("PS", 20), ("PS", 21), ("workers", 30), ("workers", 31)]) == (
        "4 processes (PS 20, 21; workers 30, 31 OS threads), 1 compute thread each "
        "(torch.set_num_threads(1))")
    assert torchrec_ref.plan_note({"table_wise": [13, 13]}) == (
        "default planner's plan: table_wise, 13 + 13 tables per rank")
    auc = ctr.auc_figure("ctr.ps.1M.auc", "AUC", {"auc": 0.851, "logloss": 0.45}, 524_288,
                         "the chief's")
    assert (auc.median, auc.unit) == (0.851, "AUC")
    assert auc.note.startswith("after 524,288 samples trained; 16,384 held-out samples")
    assert ctr.auc_figure("k", "AUC", None, 0, "").median is None


def _block_torchrec(monkeypatch: pytest.MonkeyPatch) -> None:
    """torchrec as if not installed: an import of it raises ImportError."""
    monkeypatch.setitem(sys.modules, "torchrec", None)


def test_torchrec_missing_gives_missing_figures_with_the_install_command(monkeypatch):
    _block_torchrec(monkeypatch)

    def no_processes(*args, **kwargs):
        raise AssertionError("nothing is started when torchrec is missing")

    monkeypatch.setattr("bench.procs.run_group", no_processes)
    figs = torchrec_ref.throughput(Config.build(quick=True), 1_000_000, 512, "uniform", 1024)
    assert [f.key for f in figs] == ["ctr.torchrec.1M.uniform", "ctr.torchrec.1M.uniform.cpu",
                                     "ctr.torchrec.1M.uniform.worker_rss",
                                     "ctr.torchrec.1M.uniform.auc"]
    assert all(f.median is None for f in figs)
    assert {f.note for f in figs} == {
        "torchrec is not installed: pip install --no-deps torchrec==1.8.0 "
        "fbgemm-gpu-cpu==1.8.0 && pip install tensordict torchmetrics tqdm pyre-extensions"}


def test_torchrec_rank_reports_a_failed_import_before_any_process_group(monkeypatch):
    """Installed but not importable (a broken fbgemm_gpu, say): the rank function says
    so at once, and the figures are the same missing ones."""
    monkeypatch.setitem(sys.modules, "fbgemm_gpu", None)
    got = torchrec_ref._torchrec_rank(0, 2, 1, 26_000, "zipf", 64, 0.1, 1, 1, 0)
    assert got["missing"].startswith(torchrec_ref.MISSING + " (ModuleNotFoundError: "
                                     "import of fbgemm_gpu halted")
    figs = torchrec_ref.figures(Config.build(quick=True), 26_000, "zipf", 64, [got, got])
    assert [f.median for f in figs] == [None] * 4
    assert figs[0].note == torchrec_ref.MISSING


def test_lockstep_figures_from_rank_results():
    """samples/s of each window from the slower rank, CPU of both ranks over the measured
    windows (the warm-up excluded), the larger peak RSS, rank 0's AUC."""
    cfg = Config.build(quick=True, repeats=2)

    def rank(seconds: list[float], cpu: list[float], eval_=None) -> dict:
        return {"points": [(t, 10 * i, c) for i, (t, c) in enumerate(zip(seconds, cpu))],
                "eval_steps": 40, "eval": eval_, "peak_rss": 300e6, "threads": 5}

    res = [rank([0.0, 1.0, 2.0, 3.0], [0.0, 1.0, 1.5, 2.0], {"auc": 0.8, "logloss": 0.5}),
           rank([0.0, 1.0, 2.5, 3.0], [0.0, 1.0, 2.0, 2.5])]
    figs = {f.key: f for f in ctr.lockstep_figures(cfg, "torchrec", 26_000, "zipf", 64, "L",
                                                   res, "rank 0")}
    per_step = 64 * 2
    assert figs["ctr.torchrec.26k.zipf"].samples == pytest.approx(
        [10 * per_step / 1.5, 10 * per_step / 1.0])  # windows 2 and 3, the slower rank's
    assert figs["ctr.torchrec.26k.zipf.cpu"].median == pytest.approx(
        1e6 * (1.0 + 1.5) / (20 * per_step))
    assert figs["ctr.torchrec.26k.zipf.worker_rss"].median == pytest.approx(300.0)
    auc = figs["ctr.torchrec.26k.zipf.auc"]
    assert auc.median == 0.8 and "after 5,120 samples trained" in auc.note
    assert "2 processes (ranks 5, 5 OS threads)" in figs["ctr.torchrec.26k.zipf"].note


class FakeClock:
    """perf_counter and process_time of a process whose steps take 10 ms each."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize("eval_at", [500, 3000, None])
def test_lockstep_run_evaluates_at_its_step_outside_the_measured_time(monkeypatch, eval_at):
    """The evaluation (5 s here) at step `eval_at`: inside the windows (step 500: the
    calibration takes about 100 steps, then windows of about 200) its time is left out of
    the points after it; past the windows (3000), training goes on to it; None: none."""
    import time

    import torch.distributed as dist

    clock = FakeClock()
    monkeypatch.setattr(time, "perf_counter", clock)
    monkeypatch.setattr(time, "process_time", clock)
    monkeypatch.setattr(dist, "barrier", lambda: None)
    done = []

    def step() -> None:
        clock.now += 0.01
        done.append(1)

    def evaluate() -> dict[str, float]:
        clock.now += 5.0
        return {"auc": 0.75}

    got = ctr.lockstep_run(step, lambda n: n, evaluate, window_s=2.0, skip=1, count=5,
                           eval_at=eval_at)
    points = got["points"]
    gaps = [(b[0] - a[0], b[1] - a[1], b[2] - a[2]) for a, b in zip(points, points[1:])]
    n = gaps[0][1]
    assert 190 <= n <= 210
    assert gaps == [pytest.approx((n * 0.01, n, n * 0.01))] * 6, "no window holds the eval"
    if eval_at == 500:
        assert points[0][1] < 500 < points[-1][1], "the evaluation was inside the windows"
    assert len(done) >= max(eval_at or 0, 6 * n)
    if eval_at == 3000:
        assert len(done) == 3000
    assert got["eval"] == ({"auc": 0.75} if eval_at else None)
    assert got["eval_steps"] == eval_at


@pytest.mark.parametrize(("figures", "expected"), [
    pytest.param([fig("ctr.ps.10M.vs_ddp_dense", 3.5, "x"), fig("ctr.ps.spread", 0.1, "x"),
                  fig("ctr.ps.10M.worker_rss", 300.0, "MB")],
                 ["met", "met", "met"], id="all-met"),
    pytest.param([fig("ctr.ps.1M.vs_ddp_dense", 5.0, "x"),
                  fig("ctr.ps.10M.vs_ddp_dense", 2.0, "x"), fig("ctr.ps.spread", 0.3, "x"),
                  fig("ctr.ps.10M.worker_rss", 400.0, "MB")],
                 ["missed", "missed", "missed"], id="largest-size-judged"),
    pytest.param([fig("ctr.ps.1M", 1.0), fig("ctr.ps.1M.worker_rss", 900.0, "MB")],
                 ["not measured", "not measured", "not measured"], id="small-only"),
    pytest.param([fig("ctr.ps.10M.worker_rss", 300.0, "MB"),
                  fig("ctr.ps.10M.uniform.worker_rss", 330.0, "MB")],
                 ["not measured", "not measured", "missed"], id="uniform-rss-judged-too"),
])
def test_ctr_targets(figures, expected):
    targets = [t for t in evaluate_targets(figures) if t.name.startswith("CTR")]
    assert [t.status for t in targets] == expected


def test_markdown_has_the_ctr_section():
    figs = [fig("ctr.ps.10M", 1000.0), fig("ctr.ddp_dense.10M", 200.0)]
    allf = [*figs, *ctr.derive({f.key: f for f in figs})]
    md = render_markdown({"figures": [f.as_json() for f in allf],
                          "targets": [t.__dict__ for t in evaluate_targets(allf)]})
    assert "## 7. CTR model with sparse embedding tables" in md
    assert "| 10M rows: pstrain / ddp dense samples/s | 5.00 x |" in md


def test_unique_ids_and_ddp_memory_rule():
    ids = ctr.unique_ids(26_000, 64, batches=3)
    assert len(ids) == 3 and all(26 <= n <= 64 * 26 for n in ids)
    assert ctr.ddp_bytes_needed(10_000_000, sparse=False) == 2 * 4 * ctr.table_bytes(10_000_000)


def test_row_fill_counts_rows_and_bytes():
    got = ctr._fill_rows(0, 5000)
    assert got["rows"] == 5000 and got["bytes"] >= 0


def test_lookup_smoke():
    """The real lookup path (2 PS processes, a sparse client, loopback TCP between two
    more), one repetition: it runs and produces every figure."""
    figs = {f.key: f for f in ctr.lookup_path(Config.build(quick=True, repeats=1))}
    assert set(figs) == {"ctr.lookup.pull", "ctr.lookup.pull_gbs", "ctr.lookup.tcp",
                         "ctr.lookup.tcp_gbs", "ctr.lookup.vs_tcp"}
    assert all(f.median is not None and f.median > 0 for f in figs.values())


def test_run_parts_keeps_going_after_a_failed_part():
    def broken() -> list[Figure]:
        raise RuntimeError("rank 1 failed:\nTraceback ...\nMemoryError: no room")

    got = run_parts("ctr", [("ddp 10M dense", broken), ("ok", lambda: [fig("ctr.x", 1.0)])])
    assert [(f.key, f.median, f.note) for f in got] == [
        ("ctr.failed.ddp_10M_dense", None, "MemoryError: no room"), ("ctr.x", 1.0, "")]
