"""A fixed-size table's reserve mapped up front (`sparse.prefault`): values untouched,
updates beside it exact, memory counted, and made only where it fits."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

from pstrain_runtime.optim import OptimizerConfig
from pstrain_runtime.sparse import prefault
from pstrain_runtime.sparse.prefault import Prefault, free_bytes, should_prefault
from pstrain_runtime.sparse.service import NamespaceTables, reserve_bytes, reserve_rows
from pstrain_runtime.sparse.spec import TableSpec
from pstrain_runtime.sparse.table import RowTable
from pstrain_runtime.sparse.tiered import StorageSettings

WAIT_S = 30.0
linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="MADV_POPULATE_WRITE is Linux's")


def _spec(rows: int | None = 200_000, name: str = "adagrad") -> TableSpec:
    return TableSpec("t", rows, 16, 0.1,
                     optimizer=OptimizerConfig(name=name, learning_rate=0.5))


def _rss() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@linux_only
def test_pages_are_mapped_and_values_kept() -> None:
    block = torch.empty(16 << 20)  # 64 MiB, allocated, not written
    block[:1000] = torch.arange(1000, dtype=torch.float32)
    before = _rss()
    job = Prefault([block], "test")
    assert job.done.wait(WAIT_S)
    if not job.ok:
        pytest.skip("this kernel has no MADV_POPULATE_WRITE")
    assert job.mapped >= block.numel() * 4 - (4 << 20)  # all but partial edge pages
    assert _rss() - before >= 48 << 20
    assert torch.equal(block[:1000], torch.arange(1000, dtype=torch.float32))
    assert job not in prefault._running and job.blocks  # kept until stopped
    job.stop()
    assert job.blocks == []


@linux_only
def test_updates_beside_a_running_prefault_equal_a_lazy_tables() -> None:
    spec = _spec()
    lazy = RowTable(spec, reserve=reserve_rows(spec, 2), num_ps=2)
    early = RowTable(spec, reserve=reserve_rows(spec, 2), num_ps=2, prefault=True)
    assert early.prefault is not None and lazy.prefault is None
    gen = torch.Generator().manual_seed(3)
    for t in range(1, 30):
        ids = torch.randint(0, 100_000, (2000,), generator=gen) * 2
        grads = torch.randn((2000, 16), generator=gen)
        for table in (lazy, early):
            table.apply(ids, grads, t=t, now=t)
    assert early.prefault.done.wait(WAIT_S)
    probe = torch.arange(0, 200_000, 2)
    assert torch.equal(lazy.read(probe), early.read(probe))
    assert torch.equal(lazy.versions(probe), early.versions(probe))
    if early.prefault.ok:  # the reserve's memory is held, and counted
        held = early.stats().bytes - lazy.stats().bytes
        assert held > 0 and early.stats().rows == lazy.stats().rows


def test_growing_past_the_reserve_stops_mapping_the_old_blocks() -> None:
    spec = _spec(rows=None)
    table = RowTable(spec, reserve=50_000, prefault=True)
    job = table.prefault
    assert job is not None
    ids = torch.arange(200_000)
    table.apply(ids, torch.ones((200_000, 16)), t=1, now=1)
    assert table.prefault is None and job.done.is_set() and job.blocks == []
    assert table.stats().rows == 200_000


def test_a_process_exits_cleanly_while_its_prefault_maps(tmp_path: Path) -> None:
    """The thread runs no torch code: an interpreter exiting under it does not abort."""
    import subprocess

    script = tmp_path / "exit.py"
    script.write_text(
        "import sys\n"
        "from pstrain_runtime.optim import OptimizerConfig\n"
        "from pstrain_runtime.sparse.spec import TableSpec\n"
        "from pstrain_runtime.sparse.table import RowTable\n"
        "spec = TableSpec('t', 400_000, 32, 0.01, optimizer=OptimizerConfig("
        "name='adagrad', learning_rate=0.05))\n"
        "table = RowTable(spec, reserve=210_000, num_ps=2, prefault=True)\n"
        "if len(sys.argv) > 1:\n"
        "    table.prefault.done.wait(30)\n")
    for args in ([], ["wait"]) * 3:
        got = subprocess.run([sys.executable, str(script), *args], capture_output=True,
                             text=True, timeout=120)
        assert got.returncode == 0, got.stderr


def test_stop_ends_it_and_drops_the_blocks() -> None:
    job = Prefault([torch.empty(64 << 20)], "big")  # 256 MiB
    job.stop(WAIT_S)
    assert job.done.is_set() and job.blocks == [] and job.mapped <= 256 << 20


def test_should_prefault_only_what_fits_and_not_when_turned_off(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(prefault.ENV, raising=False)
    assert should_prefault(100, free=1000)
    assert not should_prefault(600, free=1000)  # more than half of what is free
    assert not should_prefault(0, free=1000)  # nothing to map (a dynamic table)
    monkeypatch.setattr(prefault, "free_bytes", lambda: None)
    assert not should_prefault(100)  # free memory unknown
    monkeypatch.setenv(prefault.ENV, "0")
    assert not should_prefault(100, free=1000)


def test_running_prefaults_count_against_what_is_free(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(prefault.ENV, raising=False)
    monkeypatch.setattr(prefault, "pending_bytes", lambda: 800)
    assert not should_prefault(200, free=1000)  # (1000 - 800) / 2 = 100 left
    assert should_prefault(100, free=1000)


def test_free_bytes_is_the_nearer_of_available_memory_and_the_cgroup_limit(
        tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal: 1000 kB\nMemAvailable: 800 kB\n")
    cgroup = tmp_path / "cg"
    cgroup.mkdir()
    assert free_bytes(meminfo, cgroup) == 800 * 1024  # no cgroup files: the machine's
    (cgroup / "memory.max").write_text("max\n")
    (cgroup / "memory.current").write_text("1\n")
    assert free_bytes(meminfo, cgroup) == 800 * 1024  # no limit
    (cgroup / "memory.max").write_text("500000\n")
    (cgroup / "memory.current").write_text("100000\n")
    assert free_bytes(meminfo, cgroup) == 400_000
    assert free_bytes(tmp_path / "none", tmp_path / "none") is None
    v1 = tmp_path / "v1"
    (v1 / "memory").mkdir(parents=True)
    (v1 / "memory" / "memory.limit_in_bytes").write_text(f"{(1 << 63) - 4096}\n")
    (v1 / "memory" / "memory.usage_in_bytes").write_text("1000\n")
    assert free_bytes(meminfo, v1) == 800 * 1024  # v1's "no limit" is a huge number
    (v1 / "memory" / "memory.limit_in_bytes").write_text("301000\n")
    assert free_bytes(meminfo, v1) == 300_000


def test_it_stops_where_what_is_left_no_longer_fits(monkeypatch: pytest.MonkeyPatch) -> None:
    """Other processes may take the memory meanwhile (the other servers of `pstrain
    run` prefaulting theirs): each chunk is mapped only while the rest still fits."""
    monkeypatch.setattr(prefault, "free_bytes", lambda: 1 << 20)  # 1 MiB free
    block = torch.empty(16 << 20)
    job = Prefault([block], "short")
    assert job.done.wait(WAIT_S)
    assert job.mapped == 0 and job.fraction() == 0.0


def test_a_server_prefaults_fixed_tables_that_fit_and_never_a_disk_tier(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(prefault.ENV, raising=False)
    fixed, dynamic = _spec(), TableSpec("d", None, 16, 0.1, optimizer=_spec().optimizer)
    assert reserve_bytes(dynamic, 2) == 0
    assert reserve_bytes(fixed, 2) == reserve_rows(fixed, 2) * (16 * 4 * 2 + 20) + 4 * 200_000
    tables = NamespaceTables()
    tables.configure([fixed, dynamic], reset=True, num_ps=2, where="t")
    assert tables.tables["t"].prefault is not None  # type: ignore[union-attr]
    assert tables.tables["d"].prefault is None  # type: ignore[union-attr]
    tables.close()
    assert tables.tables["t"].prefault.done.is_set()  # type: ignore[union-attr]

    monkeypatch.setattr(prefault, "free_bytes", lambda: reserve_bytes(fixed, 2))
    tight = NamespaceTables()  # the reserve needs more than half of what is free
    tight.configure([fixed], reset=True, num_ps=2, where="t")
    assert tight.tables["t"].prefault is None  # type: ignore[union-attr]

    monkeypatch.setattr(prefault, "free_bytes", lambda: 1 << 40)
    tiered = NamespaceTables()
    tiered.configure([fixed], reset=True, num_ps=2, where="t",
                     storage=StorageSettings(memory_bytes=64 << 20, directory=str(tmp_path)))
    assert not hasattr(tiered.tables["t"], "prefault") or \
        tiered.tables["t"].hot.prefault is None  # type: ignore[union-attr]
    tiered.close()
