"""Item `sparse_disk`'s pure parts: its jobs (the disk side carries the budget and the
directory, the Zipf sides an AUC job), the comparisons and the targets."""

from __future__ import annotations

import pytest

from bench import sparse_disk
from bench.core import Config, Figure
from bench.report import evaluate_targets


def fig(key: str, median: float, unit: str = "", note: str = "") -> Figure:
    return Figure(key, key, unit, median, median, median, 5, note=note)


@pytest.mark.parametrize("ids, side, jobs", [("zipf", "disk", 2), ("zipf", "ram", 2),
                                             ("uniform", "disk", 1)])
def test_each_side_runs_its_jobs_with_the_budget_on_disk_only(ids: str, side: str,
                                                               jobs: int) -> None:
    cfg = Config.build(quick=True)
    got = sparse_disk.side_jobs(cfg, ids, side, "/rows" if side == "disk" else None)
    assert len(got) == jobs
    storage = [job["training"].get("sparseStorage") for job in got]
    want = ({"serverMemory": sparse_disk.QUICK_BUDGET_MIB, "directory": "/rows"}
            if side == "disk" else None)
    assert storage == [want] * jobs
    assert got[0]["key"] == f"sparse_disk.{ids}.{side}"
    assert got[0]["training"]["args"]["zipf"] == sparse_disk.IDS[ids]


def test_the_table_is_many_times_a_servers_budget() -> None:
    for quick in (False, True):
        total, budget, _, _ = sparse_disk.sizes(Config.build(quick=quick))
        assert total / 2 * sparse_disk.ROW_BYTES >= 4 * (budget << 20)


@pytest.mark.parametrize("disk, auc_gap, growth, met", [
    (600.0, 0.002, 40.0, ["met", "met", "met"]),
    (300.0, 0.010, 90.0, ["missed", "missed", "missed"]),
])
def test_targets(disk: float, auc_gap: float, growth: float, met: list[str]) -> None:
    figs = [fig("sparse_disk.zipf.disk", disk), fig("sparse_disk.zipf.ram", 1000.0),
            fig("sparse_disk.zipf.disk.auc", 0.8 - auc_gap),
            fig("sparse_disk.zipf.ram.auc", 0.8), fig("sparse_disk.budget", 67.1, "MB"),
            fig("sparse_disk.zipf.disk.ps0_rss_growth", growth, "MB"),
            fig("sparse_disk.zipf.disk.ps1_rss_growth", growth / 2, "MB")]
    figs += sparse_disk.compare(figs)
    targets = [t for t in evaluate_targets(figs) if t.name.startswith("sparse disk tier")]
    assert [t.status for t in targets] == met
