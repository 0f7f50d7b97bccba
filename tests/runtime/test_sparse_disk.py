"""Sparse tables larger than the servers' memory (`sparse.tiered`, `sparse.cold`): the
rows past a table's share of `spec.training.sparseStorage.serverMemory` live on disk,
with values equal to an in-RAM table's after the same updates (SGD, Adagrad, admission,
eviction), rows moving to disk and back, the RAM tier within its budget under a burst of
new ids, checkpoints (full and delta) that page over both tiers and restore exactly,
also after a crash mid-write, one-line errors for an unusable directory, and
`pstrain run` of the CTR example with most rows on disk."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import yaml

pytest.importorskip("rocksdict")

from pstrain_runtime.checkpoint import (Checkpoint, CheckpointStore,  # noqa: E402
                                        load_checkpoint)
from pstrain_runtime.failure import ConfigurationError  # noqa: E402
from pstrain_runtime.optim import OptimizerConfig  # noqa: E402
from pstrain_runtime.ps.store import ParameterStore, PSError  # noqa: E402
from pstrain_runtime.sparse import saving  # noqa: E402
from pstrain_runtime.sparse.client import SparseClient  # noqa: E402
from pstrain_runtime.sparse.cold import MIN_MEMORY  # noqa: E402
from pstrain_runtime.sparse.ids import split_by_owner  # noqa: E402
from pstrain_runtime.sparse import tiered as tiered_module  # noqa: E402
from pstrain_runtime.sparse.session import SparseSession  # noqa: E402
from pstrain_runtime.sparse.spec import TableSpec  # noqa: E402
from pstrain_runtime.sparse.table import RowBlock, RowTable  # noqa: E402
from pstrain_runtime.sparse.tiered import (HASH_BYTES_PER_ROW, ROW_BOOKKEEPING,  # noqa: E402
                                           StorageSettings, TieredTable, hot_row_budget,
                                           shard_directory)
from pstrain_runtime.worker.client import LocalTransport  # noqa: E402

pytestmark = pytest.mark.timeout(120)
ROOT = Path(__file__).resolve().parents[2]
HOT = 1024  # rows in RAM per table in these tests
Rows = dict[int, tuple[torch.Tensor, ...]]


@pytest.fixture(autouse=True)
def one_thread() -> None:
    torch.set_num_threads(1)


def make_spec(optimizer: str = "sgd", dim: int = 4, num_embeddings: int | None = None,
              **options: Any) -> TableSpec:
    return TableSpec("t", num_embeddings, dim, 0.1,
                     optimizer=OptimizerConfig(name=optimizer, learning_rate=0.1), **options)


def budget_for(spec: TableSpec, rows: int = HOT) -> int:
    """The bytes of memory that hold `rows` rows of the table in RAM (below 16 MiB
    the disk store takes its minimum, MIN_MEMORY; 3/16 is working memory; a fixed-size
    table's id maps come off)."""
    per_row = spec.row_bytes() + ROW_BOOKKEEPING
    fixed = MIN_MEMORY
    if spec.num_embeddings is None:
        per_row += HASH_BYTES_PER_ROW
    else:
        fixed += 4 * spec.num_embeddings * (2 if spec.admit_after > 1 else 1)
        fixed += (spec.num_embeddings + 7) // 8
    budget = (fixed + rows * per_row) * 16 // 13 + 16  # 3/16 is working memory
    while hot_row_budget(spec, 1, budget) > rows:
        budget -= 1
    assert hot_row_budget(spec, 1, budget) == rows
    return budget


def tiered(spec: TableSpec, directory: Path, rows: int = HOT) -> TieredTable:
    directory.mkdir(parents=True, exist_ok=True)
    return TieredTable(spec, budget_for(spec, rows), directory)


def pages(table: TieredTable | RowTable, since: int | None = None, limit: int = 300
          ) -> list[RowBlock]:
    out, start = [], 0
    while True:
        block, start = table.export(start, limit, since)
        out.append(block)
        if start == 0:
            return out


def rows_of(blocks: list[RowBlock]) -> Rows:
    out: Rows = {}
    for block in blocks:
        for k, i in enumerate(block.ids.tolist()):
            assert i not in out, f"id {i} exported twice"
            out[i] = (block.rows[k], block.last[k], *(s[k] for _, s in sorted(block.slots.items())))
    return out


def assert_same(got: Rows, want: Rows) -> None:
    assert got.keys() == want.keys()
    for i, values in want.items():
        assert all(torch.equal(a, b) for a, b in zip(got[i], values, strict=True)), i


def skewed_ids(gen: torch.Generator, n: int, space: int) -> torch.Tensor:
    """Ids over [0, space), the low ones far more often (a few hot rows, a long tail)."""
    return (torch.rand(n, generator=gen) ** 3 * space).to(torch.int64)


# ---------------------------------------------------------------------- one shard
@pytest.mark.parametrize("size", [None, 6000], ids=["dynamic", "fixed"])
@pytest.mark.parametrize("optimizer", ["sgd", "adagrad"])
@pytest.mark.parametrize("options", [{}, {"admit_after": 2}, {"evict_after_steps": 6}],
                         ids=["plain", "admission", "eviction"])
def test_rows_equal_an_in_ram_tables_after_the_same_steps(tmp_path: Path, optimizer: str,
                                                          options: dict[str, Any],
                                                          size: int | None) -> None:
    spec = make_spec(optimizer, dim=8, num_embeddings=size, **options)
    ram, disk = RowTable(spec), tiered(spec, tmp_path)
    gen = torch.Generator().manual_seed(0)
    every = torch.arange(6000)
    most_on_disk = 0
    for step in range(1, 41):
        ids = skewed_ids(gen, 512, 6000)
        grads = torch.randn(len(ids), 8, generator=gen)
        # A pull of the batch's rows first (rows read from disk are kept for the update).
        assert torch.equal(disk.read(ids), ram.read(ids)), step
        assert ram.apply(ids, grads, t=step, now=step) == disk.apply(ids, grads, t=step,
                                                                      now=step)
        tiers = disk.tier_stats()
        assert tiers["hot_rows"] <= HOT
        most_on_disk = max(most_on_disk, tiers["disk_rows"])
        assert disk.stats().rows == ram.stats().rows
        if step % 10 == 0:
            assert torch.equal(disk.read(every), ram.read(every)), step
    assert most_on_disk > HOT // 2, "many rows went to disk"
    assert_same(rows_of(pages(disk)), rows_of(pages(ram)))


def test_rows_move_to_disk_and_come_back_when_updated_not_when_read(tmp_path: Path) -> None:
    spec = make_spec()
    ram, disk = RowTable(spec), tiered(spec, tmp_path)
    first, second = torch.arange(HOT), torch.arange(HOT, 2 * HOT)
    for step, ids in ((1, first), (2, second)):
        for table in (ram, disk):
            table.apply(ids, torch.ones(len(ids), 4), t=step, now=step)
    # The first rows were updated least recently: they made room for the second.
    assert not bool(disk.hot.present(first).any())
    assert disk.tier_stats()["disk_rows"] == HOT
    assert torch.equal(disk.read(first[:5]), ram.read(first[:5]))
    assert not bool(disk.hot.present(first[:5]).any()), "a read leaves rows on disk"
    some = first[:5]
    for table in (ram, disk):
        table.apply(some, torch.full((5, 4), 0.5), t=3, now=3)
    assert bool(disk.hot.present(some).all()), "an update brings rows back"
    assert not disk.cold.get(some.numpy())[0].any(), "each row lives in one tier only"
    assert torch.equal(disk.read(torch.arange(2 * HOT)), ram.read(torch.arange(2 * HOT)))
    assert disk.stats().rows == 2 * HOT


@pytest.mark.parametrize("protect", [0, 40, 300], ids=["plain", "few", "all"])
def test_the_rows_to_move_first_are_the_segmented_lrus(protect: int) -> None:
    """`RowTable.oldest` against the rule written out: of the live rows outside `keep`,
    those updated least recently, but the `protect` most recently updated of the rows
    updated twice since they came (version >= 2) after every other."""
    spec = make_spec()
    table = RowTable(spec)
    gen = torch.Generator().manual_seed(3)
    ids = torch.randperm(1000, generator=gen)[:400]
    for step, chunk in enumerate(torch.split(ids, 40), start=1):  # distinct last updates
        table.apply(chunk, torch.ones(len(chunk), 4), t=step, now=step)
    for step, chunk in enumerate(torch.split(ids[::3], 7), start=20):  # twice, some
        table.apply(chunk, torch.ones(len(chunk), 4), t=step, now=step)
    table.remove(ids[5:9])  # free row indices among the live ones
    keep = ids[100:120]
    # The rule, by id: (protected?, last update), each table row once.
    skipped = set(ids[5:9].tolist()) | set(keep.tolist())
    rows = {i: int(table.index.get(np.array([i]))[0]) for i in ids.tolist() if i not in skipped}
    live = [(i, int(table.last[r]), int(table.version[r])) for i, r in rows.items()]
    twice = sorted((r for r in live if r[2] >= 2), key=lambda r: -r[1])[:protect]
    protected = {r[0] for r in twice}
    rank = {r[0]: (r[0] in protected, r[1]) for r in live}
    ordered = sorted(rank.values())
    for count in (1, 25, 150, len(live) - 1, len(live), len(live) + 5):
        got = table.owner[table.oldest(count, keep, protect)].tolist()
        assert len(set(got)) == len(got) == min(count, len(live)), count
        # Ties in the last update may go either way: every row ranked before the
        # count-th is there, and none ranked after it.
        boundary = ordered[min(count, len(live)) - 1]
        assert all(i in rank and rank[i] <= boundary for i in got), count
        assert {i for i, key in rank.items() if key < boundary} <= set(got), count


def test_only_a_batch_of_rows_going_to_disk_gives_the_heap_back(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Reads of disk rows and updates that bring rows back to RAM free blocks the next
    call takes again: trimming after them only made the next calls fault their pages
    back in. A batch of rows going to disk trims once."""
    from pstrain_runtime.sparse import tiered as tiered_module

    trims: list[int] = []
    monkeypatch.setattr(tiered_module, "release_free_memory", lambda: trims.append(1))
    spec = make_spec()
    disk = tiered(spec, tmp_path)
    first, second = torch.arange(HOT), torch.arange(HOT, HOT + HOT // 2)
    disk.apply(first, torch.ones(HOT, 4), t=1, now=1)
    disk.apply(second, torch.ones(len(second), 4), t=2, now=2)  # first rows to disk
    assert len(trims) == 1 and disk.tier_stats()["disk_rows"] > HOT // 2
    on_disk = first[~disk.hot.present(first)]
    back = on_disk[:HOT // 32]  # within the room the batch left (1/16 of the rows)
    disk.read(first)  # every row on disk read
    disk.apply(back, torch.ones(len(back), 4), t=3, now=3)  # brought back to RAM
    assert bool(disk.hot.present(back).all()) and len(trims) == 1
    disk.apply(torch.arange(2 * HOT, 3 * HOT), torch.ones(HOT, 4), t=4, now=4)
    assert len(trims) == 2, "another batch went to disk and trimmed"
    disk.close()


def test_the_ram_tier_stays_within_its_budget_under_a_burst_of_new_ids(tmp_path: Path
                                                                       ) -> None:
    spec = make_spec("adagrad")
    disk = tiered(spec, tmp_path)
    capacity = disk.hot.capacity
    for step in range(1, 21):
        ids = torch.arange(700) + 700 * step  # every id new
        disk.apply(ids, torch.ones(700, 4), t=step, now=step)
        assert disk.tier_stats()["hot_rows"] <= HOT, step
    assert disk.hot.capacity == capacity, "the RAM rows never grew past what was reserved"
    assert disk.stats().rows == 20 * 700
    assert disk.tier_stats()["disk_rows"] >= 20 * 700 - HOT


def test_rows_go_to_disk_a_few_thousand_at_a_time_and_equal_one_move(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch of rows to move goes in parts of `MOVE_ROWS` (each part's copies held
    for a moment, not the whole batch's); the rows are those of moving them at once."""
    spec = make_spec("adagrad", dim=8, num_embeddings=6000)
    whole, parts = tiered(spec, tmp_path / "whole"), tiered(spec, tmp_path / "parts")
    sizes: list[int] = []
    gen = torch.Generator().manual_seed(1)
    for step in range(1, 31):
        ids = skewed_ids(gen, 512, 6000)
        grads = torch.randn(len(ids), 8, generator=gen)
        whole.apply(ids, grads, t=step, now=step)
        with monkeypatch.context() as patch:
            patch.setattr(tiered_module, "MOVE_ROWS", 5)
            moved = parts._to_disk
            patch.setattr(parts, "_to_disk", lambda block, new: (
                sizes.append(int(block.ids.numel())), moved(block, new))[1])
            parts.apply(ids, grads, t=step, now=step)
        rows = ("hot_rows", "disk_rows")  # (the files' bytes depend on the writes)
        assert [parts.tier_stats()[k] for k in rows] == [whole.tier_stats()[k] for k in rows]
    assert sizes and max(sizes) <= 5 and sum(sizes) > 100
    assert_same(rows_of(pages(parts)), rows_of(pages(whole)))


@pytest.mark.parametrize("size", [None, 5000], ids=["dynamic", "fixed"])
def test_exports_page_both_tiers_and_a_delta_skips_unchanged_disk_rows(
        tmp_path: Path, size: int | None) -> None:
    spec = make_spec("adagrad", num_embeddings=size)
    ram, disk = RowTable(spec), tiered(spec, tmp_path / "a")
    for step in range(1, 6):
        ids = torch.arange(800) + 800 * (step - 1)
        for table in (ram, disk):
            table.apply(ids, torch.full((800, 4), float(step)), t=step, now=step)
    assert disk.tier_stats()["disk_rows"] > 2000
    assert_same(rows_of(pages(disk)), rows_of(pages(ram)))
    # A delta from clock 6: one row on disk and one in RAM changed since.
    changed = torch.tensor([5, 3900])
    for table in (ram, disk):
        table.apply(changed, torch.ones(2, 4), t=6, now=6)
    assert set(rows_of(pages(disk, since=6))) == {5, 3900}
    # Row 5 came back to RAM (a fixed-size table leaves its record on disk, dead):
    # every row once, as the in-RAM table's.
    assert_same(rows_of(pages(disk)), rows_of(pages(ram)))
    # Rows on disk all older than `since`: the disk is not read at all.
    disk.cold.page = None  # type: ignore[assignment]
    assert set(rows_of(pages(disk, since=7))) == set()

    # A restore: as many rows in RAM as the budget holds, the rest on disk, exactly.
    fresh = tiered(spec, tmp_path / "b")
    for block in pages(ram):
        fresh.load(block)
    assert fresh.tier_stats()["hot_rows"] == HOT
    assert fresh.stats().rows == ram.stats().rows
    assert_same(rows_of(pages(fresh)), rows_of(pages(ram)))
    with pytest.raises(ValueError, match="already present"):
        fresh.load(pages(ram)[-1])


def test_the_ids_an_export_gave_are_known_across_merges(monkeypatch: pytest.MonkeyPatch
                                                       ) -> None:
    from pstrain_runtime.sparse.tiered import GivenIds

    monkeypatch.setattr(GivenIds, "MERGE", 5)
    given = GivenIds()
    given.add(torch.tensor([9, 3, 7]))
    given.add(torch.tensor([1, 12, 4, 3]))  # past MERGE: into the sorted run
    given.add(torch.tensor([20]))
    assert given.run.tolist() == [1, 3, 4, 7, 9, 12] and given.recent_count == 1
    got = given.among(torch.tensor([3, 5, 20, 12, 0, 21]))
    assert got.tolist() == [True, False, True, True, False, False]
    given.add(torch.tensor([5, 0, 2, 8, 30]))
    assert given.among(torch.tensor([5, 20, 6])).tolist() == [True, True, False]


def test_an_export_page_fits_the_working_memory(tmp_path: Path) -> None:
    """Pages of a disk tier's export hold at most `page_rows` rows (the chief asks for
    65,536), and every row comes once."""
    spec = make_spec("adagrad")
    disk = tiered(spec, tmp_path)
    disk.apply(torch.arange(3000), torch.ones(3000, 4), t=1, now=1)
    assert disk.tier_stats()["disk_rows"] > 1000 and disk.page_rows < 1000
    blocks = pages(disk, limit=65536)
    assert max(b.ids.numel() for b in blocks) == disk.page_rows
    assert sorted(rows_of(blocks)) == list(range(3000))


def _delta_steps(tables: list[Any], gen: torch.Generator, first: int, count: int) -> int:
    """`count` steps of skewed ids on each of `tables` (rows go to disk and come back);
    the next step. Step 1 first puts 3,000 rows there, most of them going to disk."""
    for step in range(first, first + count):
        ids = (torch.arange(3000) if step == 1
               else torch.unique(skewed_ids(gen, 400, 4000)))
        for table in tables:
            table.apply(ids, torch.full((ids.numel(), 4), step / 10), t=step, now=step)
    return first + count


def mark(tables: Any, since: int | None, step: int) -> bool:
    """A checkpoint export begins on each of `tables` at clock `step` (a delta since
    `since`; None: a full one); whether each recorded every id it dropped since."""
    return all([table.track_removals(since, step) for table in tables])


def after_a_full_mark(spec: TableSpec, directory: Path, seed: int, steps: int
                      ) -> tuple[RowTable, TieredTable, torch.Generator, int]:
    """An in-RAM table and a disk tier after the same `steps` of `_delta_steps`, a full
    export begun on both: (ram, disk, the ids' generator, the clock)."""
    ram, disk = RowTable(spec), tiered(spec, directory)
    gen = torch.Generator().manual_seed(seed)
    step = _delta_steps([ram, disk], gen, 1, steps)
    mark([ram, disk], None, step)
    return ram, disk, gen, step


class ColdReads:
    """Counts the ids a disk tier's store is asked for (reads before updates aside),
    and fails a test that scans it while `scans` is False (sweeps scan it: evictions)."""

    def __init__(self, table: TieredTable, monkeypatch: pytest.MonkeyPatch) -> None:
        self.ids, self.scans, self.scanned = 0, True, 0
        get, page = table.cold.get, table.cold.page

        def counted_get(ids: Any, remember: bool = False) -> Any:
            self.ids += 0 if remember else len(ids)
            return get(ids, remember)

        def counted_page(*args: Any) -> Any:
            assert self.scans, "the disk was scanned"
            self.scanned += 1
            return page(*args)

        monkeypatch.setattr(table.cold, "get", counted_get)
        monkeypatch.setattr(table.cold, "page", counted_page)


@pytest.mark.parametrize("size", [None, 6000], ids=["dynamic", "fixed"])
def test_a_delta_reads_from_disk_only_the_rows_that_reached_it_since(
        tmp_path: Path, size: int | None, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = make_spec("adagrad", num_embeddings=size, evict_after_steps=12)
    ram, disk, gen, step = after_a_full_mark(spec, tmp_path, 5, 6)
    assert_same(rows_of(pages(disk)), rows_of(pages(ram)))
    reads = ColdReads(disk, monkeypatch)
    for _ in range(4):  # deltas, as a chain's links: each since the one before
        since, on_disk = step, disk.tier_stats()["disk_rows"]
        step = _delta_steps([ram, disk], gen, step, 4)
        assert mark([ram, disk], since, step)
        arrived = disk._arrived(since)
        assert arrived is not None and 0 < arrived.numel() < on_disk
        reads.ids, reads.scans = 0, False
        # The rows changed since, as the in-RAM table's delta (rows evicted on the way:
        # the sweeps ran at step 13), read from disk only where they reached it since.
        assert_same(rows_of(pages(disk, since=since)), rows_of(pages(ram, since=since)))
        assert reads.ids == arrived.numel()
        reads.scans = True


def test_a_record_of_arrivals_too_long_reads_the_whole_disk_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ram, disk, gen, step = after_a_full_mark(make_spec("adagrad"), tmp_path, 6, 5)
    assert_same(rows_of(pages(disk)), rows_of(pages(ram)))
    reads = ColdReads(disk, monkeypatch)
    # More rows reach disk than the RAM tier holds: the record is given up.
    since = step
    for _ in range(3):
        new = torch.arange(HOT) + 100_000 + HOT * step
        for table in (ram, disk):
            table.apply(new, torch.ones(HOT, 4), t=step, now=step)
        step += 1
    assert disk.arrivals is not None and disk.arrivals.overflowed
    mark([ram, disk], since, step)
    assert_same(rows_of(pages(disk, since=since)), rows_of(pages(ram, since=since)))
    assert reads.scanned  # read the whole disk
    # A new record began with that export: the next delta reads what arrived since.
    since = step
    step = _delta_steps([ram, disk], gen, step, 3)
    mark([ram, disk], since, step)
    assert disk._arrived(since) is not None
    reads.scans = False
    assert_same(rows_of(pages(disk, since=since)), rows_of(pages(ram, since=since)))


def test_a_delta_since_before_the_last_export_reads_the_whole_disk(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The record of arrivals forgets what came before the last export's mark: a delta
    since an earlier clock (not what a chain asks, but allowed) reads the whole disk
    and gives what the in-RAM table gives, not only what the record still holds."""
    ram, disk, gen, step = after_a_full_mark(make_spec("adagrad"), tmp_path, 8, 5)
    pages(disk)
    early = step
    step = _delta_steps([ram, disk], gen, step, 3)
    mark([ram, disk], early, step)
    pages(disk, since=early)  # this export's end forgets the arrivals before `step`
    step = _delta_steps([ram, disk], gen, step, 3)
    mark([ram, disk], early, step)
    assert disk._arrived(early) is None
    reads = ColdReads(disk, monkeypatch)
    assert_same(rows_of(pages(disk, since=early)), rows_of(pages(ram, since=early)))
    assert reads.scanned


@pytest.mark.parametrize("size", [None, 1 << 20], ids=["dynamic", "fixed"])
def test_an_export_while_rows_move_gives_each_row_once(tmp_path: Path,
                                                       size: int | None) -> None:
    """Async mode: updates go on between the pages of a checkpoint's export. Rows move
    to disk meanwhile; each id is given once, and every row not updated during the
    export is given with its values at the start."""
    spec = make_spec(num_embeddings=size)
    disk = tiered(spec, tmp_path)
    for step in range(1, 4):
        disk.apply(torch.arange(HOT) + HOT * step, torch.ones(HOT, 4), t=step, now=step)
    before = rows_of(pages(disk))
    given = export_while_rows_move(disk, None, 200, 4)
    assert_same({i: v for i, v in given.items() if i in before}, before)


def export_with(disk: TieredTable, since: int | None, limit: int,
                between: Callable[[int, int], None]) -> Rows:
    """An export's rows, `between(page, next start)` called between its pages; raises
    on an id given twice."""
    got, start, page = [], 0, 0
    while True:
        block, start = disk.export(start, limit, since)
        got.append(block)
        if start == 0:
            return rows_of(got)
        between(page, start)
        page += 1


def export_while_rows_move(disk: TieredTable, since: int | None, limit: int, step: int
                           ) -> Rows:
    """An export's rows, with 300 new rows applied between its pages (they push old
    ones to disk); raises on an id given twice."""
    def new_rows(page: int, _start: int) -> None:
        disk.apply(torch.arange(300) + 10_000 * (step + page), torch.ones(300, 4),
                   t=step + page, now=step + page)

    return export_with(disk, since, limit, new_rows)


def on_disk(disk: TieredTable, ids: Any) -> torch.Tensor:
    """Those of `ids` whose rows are on disk, sorted."""
    ids = torch.as_tensor(sorted(ids), dtype=torch.int64)
    return ids[~disk.hot.present(ids)]


def bring_back(disk: TieredTable, ids: torch.Tensor, step: int, when: str,
               back_to_disk: bool) -> Callable[[int, int], None]:
    """Between two pages of an export (`when`: in its RAM pass, or its disk pass), once:
    update the rows of `ids` (on disk: they come back to RAM); `back_to_disk`: then
    push them out again with new rows, before the next page."""
    done: list[bool] = []

    def between(_page: int, start: int) -> None:
        if done or (start < 0) != (when == "disk-pass"):
            return
        done.append(True)
        disk.apply(ids, torch.ones(ids.numel(), 4), t=step, now=step)
        assert bool(disk.hot.present(ids).all())
        if back_to_disk:
            new = torch.arange(2 * HOT) + 50_000
            disk.apply(new, torch.ones(2 * HOT, 4), t=step + 1, now=step + 1)
            assert not bool(disk.hot.present(ids).any())

    return between


@pytest.mark.parametrize("back_to_disk", [False, True], ids=["stay", "back-to-disk"])
@pytest.mark.parametrize("when", ["ram-pass", "disk-pass"])
@pytest.mark.parametrize("size", [None, 60_000], ids=["dynamic", "fixed"])
def test_a_full_export_gives_the_rows_that_leave_the_disk_during_it(
        tmp_path: Path, size: int | None, when: str, back_to_disk: bool) -> None:
    """Rows on disk updated while a full export runs come back to RAM, into places its
    RAM pass may have passed, and leave the disk before its disk pass reads them; the
    export still gives every row once (they were lost from it before): the rows not
    updated with their values at the start, the updated ones with theirs before or
    after the update, also when they went back to disk before the next page."""
    disk = tiered(make_spec(num_embeddings=size), tmp_path)
    for step in range(1, 4):
        disk.apply(torch.arange(HOT) + HOT * step, torch.ones(HOT, 4), t=step, now=step)
    before = rows_of(pages(disk))
    updated = on_disk(disk, before)[-300:]  # the ids a disk pass reaches last
    given = export_with(disk, None, 200, bring_back(disk, updated, 9, when, back_to_disk))
    assert set(before) <= set(given)  # (and maybe rows made during the export)
    moved = set(updated.tolist())
    assert_same({i: v for i, v in given.items() if i in before and i not in moved},
                {i: v for i, v in before.items() if i not in moved})
    now = rows_of(pages(disk))
    for i in moved:
        assert any(all(torch.equal(a, b) for a, b in zip(given[i], want, strict=True))
                   for want in (before[i], now[i])), i


@pytest.mark.parametrize("when", ["ram-pass", "disk-pass"])
def test_a_delta_gives_the_changed_rows_that_leave_the_disk_during_it(
        tmp_path: Path, when: str) -> None:
    """As above for a delta: rows changed since `since` and on disk, updated during the
    export, are given too."""
    ram, disk, gen, step = after_a_full_mark(make_spec("adagrad"), tmp_path, 7, 5)
    pages(disk)
    since = step
    step = _delta_steps([ram, disk], gen, step, 4)
    mark([ram, disk], since, step)
    want = rows_of(pages(ram, since=since))
    changed_on_disk = on_disk(disk, want)
    assert changed_on_disk.numel()
    given = export_with(disk, since, 100, bring_back(disk, changed_on_disk, step, when,
                                                     back_to_disk=False))
    assert set(want) <= set(given)


def test_a_delta_while_rows_move_gives_each_changed_row_once(tmp_path: Path) -> None:
    """As above, for a delta read through the record of rows reaching disk: rows move
    to disk between its pages; each id is given once, and every row changed since
    `since` and not updated during the export is given with its values at the start."""
    ram, disk, gen, step = after_a_full_mark(make_spec("adagrad"), tmp_path, 7, 5)
    pages(disk)
    since = step
    step = _delta_steps([ram, disk], gen, step, 4)
    mark([ram, disk], since, step)
    assert disk._arrived(since).numel()  # some changed rows are on disk
    want = rows_of(pages(ram, since=since))
    given = export_while_rows_move(disk, since, 100, step)
    assert set(want) <= set(given)
    assert_same({i: v for i, v in given.items() if i in want}, want)


@pytest.mark.parametrize("num_ids", [None, 100], ids=["dynamic", "fixed"])
def test_the_disk_store_gives_what_was_written_last(tmp_path: Path,
                                                    num_ids: int | None) -> None:
    """Records kept from reads (for the update that follows) never hide a later write
    or delete; a fixed-size table's id bitmap never hides a row."""
    from pstrain_runtime.sparse.cold import ColdStore

    store = ColdStore(tmp_path / "db", 2, MIN_MEMORY, num_ids)
    ids = np.array([3, 7, 50])
    store.put(ids, np.ones((3, 2), np.float32), np.array([1, 2, 3]))
    store.count = 3
    found, values, last = store.get(np.array([7, 8, 3, 7]), remember=True)
    assert found.tolist() == [True, False, True, True] and last.tolist() == [2, 1, 2]
    store.put(np.array([7]), np.full((1, 2), 5.0, np.float32), np.array([9]))
    store.delete(np.array([3]))
    found, values, last = store.get(np.array([3, 7, 50]))
    assert found.tolist() == [False, True, True]
    assert values.tolist() == [[5.0, 5.0], [1.0, 1.0]] and last.tolist() == [9, 3]
    store.close()
    assert not (tmp_path / "db").exists()


@pytest.mark.parametrize("num_ids", [None, 100], ids=["dynamic", "fixed"])
def test_a_delete_is_a_tombstone_or_with_an_id_bitmap_a_dead_record(
        tmp_path: Path, num_ids: int | None) -> None:
    """Without a bitmap a delete removes the record; with one (a fixed-size table) the
    record stays on disk, dead: never read, skipped by pages, replaced by a put."""
    from pstrain_runtime.sparse.cold import ColdStore, _keys

    store = ColdStore(tmp_path / "db", 2, MIN_MEMORY, num_ids)
    store.put(np.array([3, 7, 50]), np.ones((3, 2), np.float32), np.array([1, 2, 3]))
    store.count = 3
    store.delete(np.array([7]))
    store.count = 2
    record = store.db.get(_keys(np.array([7]))[0])
    assert (record is None) == (num_ids is None)
    found, _, _ = store.get(np.array([3, 7, 50]))
    assert found.tolist() == [True, False, True]
    ids, _, last, after = store.page(0, 10)
    assert ids.tolist() == [3, 50] and last.tolist() == [1, 3] and after is None
    ids, _, _, after = store.page(0, 2)  # a dead record counts toward the limit
    assert (ids.tolist(), after) == (([3, 50], None) if num_ids is None else ([3], 50))
    store.put(np.array([7]), np.full((1, 2), 4.0, np.float32), np.array([9]))
    found, values, last = store.get(np.array([7]))
    assert found.tolist() == [True] and values.tolist() == [[4.0, 4.0]] and last.tolist() == [9]
    assert store.last_id() == 50
    store.close()


@pytest.mark.parametrize("num_ids", [None, 100], ids=["dynamic", "fixed"])
def test_a_sweep_reads_only_the_keys_older_than_its_bound(
        tmp_path: Path, num_ids: int | None, monkeypatch: pytest.MonkeyPatch) -> None:
    """With `by_last`, `pop_stale` names the rows last updated before its bound from
    their keys by last update (never a page of the records), and drops the keys that
    rows which left the disk or were written again left behind."""
    from pstrain_runtime.sparse.cold import ColdStore

    store = ColdStore(tmp_path / "db", 2, MIN_MEMORY, num_ids, by_last=True)
    monkeypatch.setattr(store, "page", None)  # never a read of every record
    store.put(np.arange(10), np.ones((10, 2), np.float32), np.arange(10) - 3)  # last -3..6
    store.count = 10
    store.delete(np.array([2, 8]))  # back to RAM: their keys stay behind
    store.put(np.array([3]), np.ones((1, 2), np.float32), np.array([20]))  # written again
    store.count = 8
    assert store.least_last() == -3
    assert store.pop_stale(2).tolist() == [0, 1, 4]  # last -3, -2, 1; not 2 (gone), 3 (20)
    assert store.least_last() == 2  # every key before the bound went
    assert store.pop_stale(2).tolist() == []
    store.delete(np.array([0, 1, 4]))
    store.count = 5
    assert store.pop_stale(21).tolist() == [3, 5, 6, 7, 9]
    assert store.least_last() == math.inf
    store.close()


def test_the_disk_store_gives_back_a_batch_of_many_rows_exactly(tmp_path: Path) -> None:
    """A write of more rows than `PUT_CHUNK` (built a chunk at a time), and their ids
    as keys (8 big-endian bytes, zero bytes included) through a delete."""
    from pstrain_runtime.sparse.cold import PUT_CHUNK, ColdStore

    store = ColdStore(tmp_path / "db", 3, MIN_MEMORY, None)
    n = 2 * PUT_CHUNK + 5
    ids = np.concatenate([[0, 256, 1 << 40], np.arange(1000, 1000 + n - 3) * 7919])
    values = np.random.default_rng(0).standard_normal((n, 3)).astype(np.float32)
    store.put(ids, values, np.arange(n))
    store.count = n
    order = np.random.default_rng(1).permutation(n)
    found, got, last = store.get(ids[order])
    assert found.all() and np.array_equal(got, values[order])
    assert np.array_equal(last, order)
    store.delete(ids[:2])
    found, _, _ = store.get(ids[:4])
    assert found.tolist() == [False, False, True, True]
    store.close()


def test_reads_leave_data_blocks_out_of_the_block_cache(tmp_path: Path) -> None:
    """The cache keeps the index and filter blocks every lookup needs: random reads of
    rows would fill it with data blocks that are seldom read again."""
    from pstrain_runtime.sparse.cold import ColdStore

    store = ColdStore(tmp_path / "db", 64, MIN_MEMORY, None)  # a cache of 512 KiB
    n = 20_000  # 5.3 MB of rows: 10 times the cache
    ids = np.arange(n) * 3
    store.put(ids, np.ones((n, 64), np.float32), np.arange(n))
    store.count = n
    store.db.flush()  # the rows in a table file, read through the cache
    found, _, _ = store.get(np.random.default_rng(0).permutation(ids))
    assert found.all()
    cached = store.db.property_int_value("rocksdb.block-cache-usage")
    assert cached < 128 << 10, f"{cached} bytes cached after reading every row"
    store.close()


def test_the_disk_store_compacts_in_the_universal_style(tmp_path: Path) -> None:
    """Evictions write random ids: leveled compaction rewrote the whole table every few
    flushes (see `cold`'s module doc); index blocks restart every 16 keys (see
    `INDEX_RESTART`). RocksDB records the options it opened with."""
    from pstrain_runtime.sparse.cold import ColdStore

    store = ColdStore(tmp_path / "db", 2, MIN_MEMORY, None)
    try:
        options = sorted((tmp_path / "db").glob("OPTIONS-*"))[-1].read_text()
        assert "compaction_style=kCompactionStyleUniversal" in options
        assert "max_size_amplification_percent=100;" in options
        assert "level0_file_num_compaction_trigger=8" in options
        assert "index_block_restart_interval=16" in options
    finally:
        store.close()


# ---------------------------------------------------------------------- servers
class Servers:
    """Two parameter servers with a disk tier for their tables, driven by hand as sync
    mode drives them; `save` writes a checkpoint's rows through the chief's session."""

    def __init__(self, spec: TableSpec, directory: Path) -> None:
        self.spec = spec
        self.stores = [ParameterStore(i) for i in range(2)]
        client = SparseClient([LocalTransport(s) for s in self.stores], "ns")
        directory.mkdir(parents=True, exist_ok=True)
        storage = StorageSettings(budget_for(spec), str(directory))
        self.session = SparseSession([], {spec.name: spec}, client, storage)
        self.session.install(None, None)

    def table(self, ps: int) -> TieredTable:
        return self.stores[ps].namespace("ns").sparse.tables[self.spec.name]

    def step(self, ids: torch.Tensor) -> None:
        ids = torch.unique(ids)
        for ps, pos in enumerate(split_by_owner(ids, 2)):
            ns = self.stores[ps].namespace("ns")
            self.table(ps).apply(ids[pos], torch.linspace(-1, 1, len(pos) * 4).reshape(-1, 4),
                                 t=ns.global_step + 1, now=ns.global_step + 1)
        for store in self.stores:
            store.namespace("ns").global_step += 1

    def save(self, store: CheckpointStore, step: int) -> None:
        write = self.session.begin_save(store.directory, step, frozen=True)
        manifest = self.session.finish_save(write)
        store.save(Checkpoint(global_step=step, fingerprint="f", optimizer="sgd", params={},
                              sparse=manifest))
        self.session.commit(write, manifest)

    def rows(self) -> Rows:
        out: Rows = {}
        for ps in range(2):
            out.update(rows_of(pages(self.table(ps))))
        return out


@pytest.mark.parametrize("size", [None, 30_000], ids=["dynamic", "fixed"])
def test_a_restore_equals_the_live_tables_also_after_a_crash_mid_write(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, size: int | None) -> None:
    spec = make_spec("adagrad", num_embeddings=size, evict_after_steps=8)
    live = Servers(spec, tmp_path / "rows")
    store = CheckpointStore(tmp_path / "ckpt", keep=5)
    gen = torch.Generator().manual_seed(3)
    saved: dict[int, Rows] = {}
    for step in range(1, 31):
        live.step(skewed_ids(gen, 1000, 30_000))
        if step in (10, 20):  # a full write, then a delta
            live.save(store, step)
            saved[step] = live.rows()
    stats = live.session.stats()["t"]  # over both servers: rows in both tiers, RAM bytes
    assert stats["disk_rows"] > 2 * HOT and stats["hot_rows"] <= 2 * HOT
    assert stats["rows"] == stats["hot_rows"] + stats["disk_rows"]
    chain = load_checkpoint(store.path_for(20)).sparse["chain"]
    assert [link["full"] for link in chain] == [True, False]
    # The checkpoint of step 30 crashes after its first file: it has no .pt file.
    real = saving.write_rows

    def crash(path: Path, *args: Any) -> Any:
        if path.name.endswith("ps1.rows"):
            raise OSError("the server died")
        return real(path, *args)

    monkeypatch.setattr(saving, "write_rows", crash)
    with pytest.raises(OSError):
        live.save(store, 30)
    assert store.steps() == [10, 20]
    for step in (10, 20):
        fresh = Servers(spec, tmp_path / f"fresh{step}")
        fresh.session.install(load_checkpoint(store.path_for(step)).sparse, store.directory)
        assert_same(fresh.rows(), saved[step])
        assert all(fresh.table(ps).tier_stats()["hot_rows"] <= HOT for ps in range(2))


def test_an_unusable_directory_is_one_line_naming_the_field(tmp_path: Path) -> None:
    client = SparseClient([LocalTransport(ParameterStore(0))], "ns")
    spec = make_spec()
    cases = {str(tmp_path / "missing"): "does not exist",
             "/sys/kernel" if os.geteuid() == 0 else str(tmp_path / "ro"): "is not writable"}
    if os.geteuid() != 0:
        (tmp_path / "ro").mkdir(mode=0o500)
    for directory, rule in cases.items():
        with pytest.raises(PSError) as caught:
            client.configure([spec], reset=True,
                             storage=StorageSettings(budget_for(spec), directory))
        text = str(caught.value)
        assert "\n" not in text
        assert f"spec.training.sparseStorage.directory {directory!r} {rule}" in text
    with pytest.raises(PSError, match=r"sparseStorage.directory is unset"):
        client.configure([spec], reset=True, storage=StorageSettings(budget_for(spec)))
    with pytest.raises(PSError, match=r"sparseStorage.serverMemory leaves 1000000 bytes"):
        client.configure([spec], reset=True,
                         storage=StorageSettings(1_000_000, str(tmp_path)))
    # The chief: a configuration error (the job fails at once; a restart would not help).
    session = SparseSession([], {"t": spec}, client,
                            StorageSettings(budget_for(spec), str(tmp_path / "missing")))
    with pytest.raises(ConfigurationError, match=r"sparseStorage.directory .* does not exist"):
        session.install(None, None)


def test_a_server_empties_its_folder_of_a_previous_runs_rows(tmp_path: Path) -> None:
    stale = tmp_path / "pstrain-ps7" / "rows-t-old"
    stale.mkdir(parents=True)
    (stale / "000001.sst").write_bytes(b"x")
    other = tmp_path / "keep.txt"
    other.write_text("not ours")
    assert shard_directory(str(tmp_path), 7) == tmp_path / "pstrain-ps7"
    assert not stale.exists() and other.exists()


def test_the_local_runner_checks_the_directory_and_makes_a_temporary_one() -> None:
    from pstrain_api.model import TrainingJob
    from pstrain_runtime.local.runner import with_rows_directory

    def job(storage: dict[str, Any]) -> TrainingJob:
        return TrainingJob.model_validate({
            "apiVersion": "pstrain.io/v1alpha1", "kind": "TrainingJob",
            "metadata": {"name": "j"},
            "spec": {"replicas": {"ps": {"replicas": 1}, "worker": {"replicas": 1}},
                     "training": {"sparseStorage": storage}}})

    with pytest.raises(ConfigurationError, match=r"^spec.training.sparseStorage.directory "
                       r"'/nonexistent/rows' does not exist"):
        with_rows_directory(job({"serverMemory": "64Mi", "directory": "/nonexistent/rows"}))
    made, temp = with_rows_directory(job({"serverMemory": 64}))
    try:
        assert temp is not None and Path(temp).is_dir()
        assert made.spec.training.sparse_storage.directory == temp
    finally:
        os.rmdir(temp)  # type: ignore[arg-type]
    assert with_rows_directory(job({}))[1] is None


# ---------------------------------------------------------------------- end to end
def run_ctr(tmp_path: Path, name: str, storage: dict[str, Any] | None) -> dict[str, Any]:
    manifest = yaml.safe_load((ROOT / "examples" / "ctr.yaml").read_text())
    training = manifest["spec"]["training"]
    # Sync mode: both runs apply the same updates, so the tables hold the same rows
    # (up to the order of float sums) and the AUCs agree closely.
    training.update(args={"rows": 20_000, "embedding_dim": 8, "eval_size": 4096},
                    steps=60, evalIntervalSteps=60, mode="sync")
    if storage is not None:
        training["sparseStorage"] = storage
    manifest["metadata"]["name"] = name
    job = tmp_path / f"{name}.yaml"
    job.write_text(yaml.safe_dump(manifest))
    run = subprocess.run([sys.executable, "-m", "pstrain_api.cli", "run", str(job), "--json"],
                         capture_output=True, text=True, timeout=180, cwd=ROOT,
                         env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_pstrain_run_of_the_ctr_example_with_most_rows_on_disk(tmp_path: Path) -> None:
    """26 x 20 000 ids of dim 8 (Adagrad) on 2 servers, each with 6 MiB for rows: about
    15 000 rows in memory per server, the rest of the rows trained on disk."""
    on_disk = run_ctr(tmp_path, "ctr-disk", {"serverMemory": "6Mi"})
    in_ram = run_ctr(tmp_path, "ctr-ram", None)
    print(f"\nctr on disk: auc {on_disk['auc']:.4f}, {on_disk['sparse_disk_rows']} of "
          f"{on_disk['sparse_rows']} rows on disk, {on_disk['samples_per_sec']} samples/s; "
          f"in memory: auc {in_ram['auc']:.4f}, {in_ram['samples_per_sec']} samples/s")
    assert on_disk["phase"] == "Succeeded"
    assert on_disk["sparse_disk_rows"] > on_disk["sparse_rows"] / 2, on_disk
    assert "sparse_disk_rows" not in in_ram
    assert on_disk["sparse_rows"] == in_ram["sparse_rows"]
    assert abs(on_disk["auc"] - in_ram["auc"]) < 0.002, (on_disk["auc"], in_ram["auc"])
    assert not list(Path(tempfile.gettempdir()).glob("pstrain-ctr-disk-rows-*")), \
        "the run removes its rows folder"


@pytest.mark.parametrize("since", [None, 6], ids=["full", "delta"])
def test_a_disk_tier_server_writes_its_own_checkpoint_shard_as_the_chief_would(
        tmp_path: Path, since: int | None) -> None:
    """`shard_writes.save_shard` over both tiers, a page at a time within the working
    memory: the file holds every row (or every row changed since) exactly once, those
    of the in-RAM table after the same updates."""
    from pstrain_runtime.sparse import shard_writes
    from pstrain_runtime.sparse.files import read_rows

    spec = make_spec("adagrad")
    ram, disk = RowTable(spec), tiered(spec, tmp_path / "tier")
    for step in range(1, 7):
        ids = torch.arange(700) * 3 + 700 * (step - 1) if step < 6 else torch.tensor([5, 3900])
        for table in (ram, disk):
            table.apply(ids, torch.full((len(ids), 4), float(step)), t=step, now=step)
    assert disk.tier_stats()["disk_rows"] > 2000
    link = tmp_path / "ckpt" / "ckpt-000000000006.sparse"
    link.mkdir(parents=True)
    (link / shard_writes.PROBE).write_text("ab" * 16)
    header = {"dir": link.name, "token": "ab" * 16, "index": 0, "what": "rows",
              **({"since": since} if since is not None else {})}
    reply = shard_writes.save_shard(disk, 0, tmp_path / "ckpt", header)
    assert reply["shared"] and "error" not in reply
    got = rows_of(list(read_rows(link / "table0-ps0.rows", spec, ("sum",),
                                 {"bytes": reply["bytes"], "crc32c": reply["crc32c"]})))
    want = rows_of(pages(ram, since=since))
    assert reply["rows"] == len(want) and (since is None or set(want) == {5, 3900})
    assert_same(got, want)
