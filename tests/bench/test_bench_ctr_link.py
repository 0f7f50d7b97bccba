"""Item `ctr_link` (item `ctr` over a held link): how its rounds' figures are merged,
renamed and compared, and what it reports where it cannot make its namespace. The run
itself needs root and minutes (`python -m bench --only ctr_link`)."""

from __future__ import annotations

import pytest

from bench import ctr_link
from bench.core import Config, Figure

pytestmark = pytest.mark.timeout(60)


def fig(key: str, samples: list[float], note: str = "n") -> Figure:
    return Figure.of(key, key, "samples/s", samples, note=note)


def test_rounds_are_merged_per_key_in_first_seen_order() -> None:
    one = [fig("ctr.ps.10M", [1.0, 3.0]), Figure("ctr.table", "t", "MB", 5.0),
           Figure.missing("ctr.torchrec.10M.zipf", "t", "samples/s", "not installed")]
    two = [fig("ctr.ps.10M", [2.0]), Figure("ctr.table", "t", "MB", 6.0),
           Figure.missing("ctr.torchrec.10M.zipf", "t", "samples/s", "not installed")]
    got = {f.key: f for f in ctr_link.merged([one, two])}
    assert list(got) == ["ctr.ps.10M", "ctr.table", "ctr.torchrec.10M.zipf"]
    assert got["ctr.ps.10M"].samples == [1.0, 3.0, 2.0] and got["ctr.ps.10M"].median == 2.0
    assert got["ctr.ps.10M"].note.startswith("2 rounds")
    assert got["ctr.table"].median == 5.0  # no samples: the first round's value
    assert got["ctr.torchrec.10M.zipf"].median is None
    assert got["ctr.torchrec.10M.zipf"].note == "not installed"


def test_figures_take_the_items_keys_and_the_ratios_compare_the_sides() -> None:
    figs = [ctr_link.renamed(f) for f in (
        fig("ctr.ps.10M", [30.0]), fig("ctr.ps_cache16.10M.zipf", [36.0]),
        fig("ctr.torchrec.10M.zipf", [20.0]), fig("ctr.ps.10M.cpu", [40.0]),
        fig("ctr.torchrec.10M.zipf.cpu", [50.0]))]
    assert [f.key for f in figs][:3] == ["ctr_link.ps.10M", "ctr_link.ps_cache16.10M.zipf",
                                         "ctr_link.torchrec.10M.zipf"]
    assert ctr_link.RATE in figs[0].label
    ratios = {f.key: f for f in ctr_link.derive(figs, [10_000_000])}
    assert ratios["ctr_link.ps_cache16.10M.zipf.vs_ps"].median == pytest.approx(1.2)
    assert ratios["ctr_link.ps.10M.vs_torchrec"].median == pytest.approx(1.5)
    assert ratios["ctr_link.ps_cache16.10M.zipf.vs_torchrec"].median == pytest.approx(1.8)
    assert ratios["ctr_link.ps.10M.cpu.vs_torchrec"].median == pytest.approx(0.8)
    # uniform ids were not measured here: their ratios say an input is missing
    assert ratios["ctr_link.ps.10M.uniform.vs_torchrec"].median is None


def test_each_round_measures_every_side_the_next_in_reverse_order() -> None:
    calls = []

    def measure(cfg: Config, side: str, total: int, ids: str, batch: int) -> list[Figure]:
        calls.append((side, ids))
        return [fig(f"ctr.{side}.{total}.{ids}", [float(len(calls))])]

    got = ctr_link.inner(Config.build(quick=True), [26_000], 2, measure)
    per_round = len(ctr_link.SIDES) * 2
    assert len(calls) == 2 * per_round and calls[per_round:] == calls[:per_round][::-1]
    assert all(f.n == 2 for f in got) and len(got) == per_round


def test_without_root_every_figure_says_why(monkeypatch) -> None:
    monkeypatch.setattr(ctr_link.os, "geteuid", lambda: 1000)
    figs = ctr_link.run(Config.build(quick=True))
    assert figs and all(f.median is None and "needs root" in f.note for f in figs)
    assert len(figs) == len(ctr_link.QUICK_SIZES) * 2 * len(ctr_link.SIDES)
