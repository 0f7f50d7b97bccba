"""`python -m bench.tier_calls`: one server's table calls in-process, each side a few
steps (the full sizes: a shard of the `sparse_disk` item's table)."""

from __future__ import annotations

import threading

import pytest

pytest.importorskip("rocksdict")

from bench import tier_calls  # noqa: E402


@pytest.mark.parametrize("side", ["ram", "disk"])
def test_each_side_reports_its_calls(side: str, capsys: pytest.CaptureFixture[str]) -> None:
    got = tier_calls.main([side, "--steps", "3", "--warmup", "2", "--zipf", "1.2"])
    assert got["side"] == side and got["steps"] == 3
    assert got["ms_per_call"] > 0 and got["ids_per_call"] > 1000  # a batch's share
    assert got["cpu_ms_per_call"] > 0  # every thread's, the id draws excluded
    assert got["minor_faults"] >= 0 and got["peak_anon_mib"] > 0
    if side == "disk":
        assert 0 < got["hot_rows"] <= got["hot_row_budget"]
    else:
        assert "hot_rows" not in got
    assert capsys.readouterr().out.count("\n") == 1  # one JSON line
    assert "rss-anon-peak" not in [t.name for t in threading.enumerate()], \
        "the RSS sampler outlived the run"


def test_deltas_export_as_checkpoints_do(capsys: pytest.CaptureFixture[str]) -> None:
    got = tier_calls.main(["disk", "--steps", "3", "--warmup", "2", "--deltas", "2",
                           "--interval", "3"])
    full, *deltas = got["export_ms"]
    assert full["kind"] == "full" and full["rows"] == got["hot_rows"] + got["disk_rows"]
    assert [d["kind"] for d in deltas] == ["delta", "delta"]
    # A delta holds at most the rows three steps' updates touched (and some).
    assert all(0 < d["rows"] <= 3 * got["ids_per_call"] and d["steps_cpu_ms"] > 0
               for d in deltas)


def test_a_table_with_eviction_sweeps_its_disk(capsys: pytest.CaptureFixture[str]) -> None:
    got = tier_calls.main(["disk", "--steps", "6", "--warmup", "2", "--evict", "4"])
    assert got["evict"] == 4 and got["cpu_ms_per_call"] > 0
    assert got["hot_rows"] + got["disk_rows"] < 8 * got["ids_per_call"]  # rows dropped


def test_bad_arguments_are_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        tier_calls.main(["disk", "--zipf", "-1"])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.endswith("--zipf is -1.0; it must be at least 0")
    with pytest.raises(SystemExit):
        tier_calls.main(["disk", "--evict", "0"])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.endswith("--evict is 0; it must be at least 1")
