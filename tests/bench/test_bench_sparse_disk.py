"""Item `sparse_disk`'s pure parts: its jobs (the disk side carries the budget and the
directory, the Zipf sides an AUC job), the ratio over rounds, and the targets."""

from __future__ import annotations

import pytest

from bench import sparse_disk
from bench.core import Config, Figure
from bench.report import evaluate_targets


def fig(key: str, median: float, unit: str = "", note: str = "") -> Figure:
    return Figure(key, key, unit, median, median, median, 5, note=note)


@pytest.mark.parametrize("ids, side, jobs", [("zipf", "disk", 2), ("zipf", "ram", 2),
                                             ("uniform", "disk", 1), ("zipf", "disk_ckpt", 1)])
def test_each_side_runs_its_jobs_with_the_budget_on_disk_only(ids: str, side: str,
                                                               jobs: int) -> None:
    cfg = Config.build(quick=True)
    got = sparse_disk.side_jobs(cfg, ids, side, "/rows" if side != "ram" else None)
    assert len(got) == jobs
    storage = [job["training"].get("sparseStorage") for job in got]
    want = ({"serverMemory": sparse_disk.QUICK_BUDGET_MIB, "directory": "/rows"}
            if side != "ram" else None)
    assert storage == [want] * jobs
    # Checkpoints at the default interval on the checkpoint side only.
    assert [job["training"].get("checkpoint") for job in got] == (
        [{"directory": "/rows/checkpoints", "intervalSteps": 100}] if side == "disk_ckpt"
        else [None] * jobs)
    assert got[0]["key"] == f"sparse_disk.{ids}.{side}"
    assert got[0]["training"]["args"]["zipf"] == sparse_disk.IDS[ids]
    # Rounds after the first measure speed alone.
    assert len(sparse_disk.side_jobs(cfg, ids, side, "/rows", auc=False)) == 1


def test_the_table_is_many_times_a_servers_budget() -> None:
    for quick in (False, True):
        total, budget, _, _ = sparse_disk.sizes(Config.build(quick=quick))
        assert total / 2 * sparse_disk.ROW_BYTES >= 4 * (budget << 20)


def a_round(cfg: Config, ids: str, side: str, steps_per_s: float) -> sparse_disk.Round:
    """A round whose measured job steps at `steps_per_s` (progress every 0.1 s)."""
    jobs = sparse_disk.side_jobs(cfg, ids, side, "/rows" if side == "disk" else None)
    events = [(0.1 * i, "progress", {"step": round(0.1 * i * steps_per_s)})
              for i in range(200)]
    return jobs, [{"events": events}]


def test_the_ratio_is_the_median_over_rounds_of_each_rounds_ratio() -> None:
    cfg = Config.build(quick=True)
    disk = [a_round(cfg, "zipf", "disk", r) for r in (50.0, 80.0, 30.0)]
    ram = [a_round(cfg, "zipf", "ram", r) for r in (100.0, 100.0, 100.0)]
    got = sparse_disk.round_ratio(cfg, "zipf", [*disk[:2], None, disk[2]],
                                  [*ram, None])
    assert got.samples == pytest.approx([0.5, 0.8])  # rounds missing a side are left out
    assert got.median == pytest.approx(0.65)
    figs = sparse_disk.side_figures(cfg, "zipf", "disk", (0, 0), disk)
    rates = next(f for f in figs if f.key == "sparse_disk.zipf.disk")
    batch = disk[0][0][0]["per_step"]
    assert len(rates.samples) == 3 * cfg.repeats  # every round's windows
    assert sorted({round(v / batch) for v in rates.samples}) == [30, 50, 80]
    missing = sparse_disk.round_ratio(cfg, "zipf", [None], [ram[0]])
    assert missing.median is None
    other = sparse_disk.round_ratio(cfg, "zipf", disk, ram, "k", "label")
    assert (other.key, other.label, other.median) == ("k", "label", pytest.approx(0.5))


def test_each_round_puts_another_side_first() -> None:
    assert sparse_disk.sides("uniform") == ("ram", "disk")
    three = sparse_disk.sides("zipf")
    assert three == ("ram", "disk", "disk_ckpt")
    assert [sparse_disk._turn(three, k) for k in range(4)] == [
        three, ("disk", "disk_ckpt", "ram"), ("disk_ckpt", "ram", "disk"), three]
    assert sparse_disk._turn(("ram", "disk"), 1) == ("disk", "ram")


@pytest.mark.parametrize("disk, auc_gap, growth, met", [
    (0.6, 0.002, 40.0, ["met", "met", "met"]),
    (0.3, 0.010, 90.0, ["missed", "missed", "missed"]),
])
def test_targets(disk: float, auc_gap: float, growth: float, met: list[str]) -> None:
    figs = [fig("sparse_disk.zipf.vs_ram", disk, "x"),
            fig("sparse_disk.zipf.disk.auc", 0.8 - auc_gap),
            fig("sparse_disk.zipf.ram.auc", 0.8), fig("sparse_disk.budget", 67.1, "MB"),
            fig("sparse_disk.zipf.disk.ps0_rss_growth", growth, "MB"),
            fig("sparse_disk.zipf.disk.ps1_rss_growth", growth / 2, "MB")]
    figs += sparse_disk.auc_gap(figs)
    targets = [t for t in evaluate_targets(figs) if t.name.startswith("sparse disk tier")]
    assert [t.status for t in targets] == met
