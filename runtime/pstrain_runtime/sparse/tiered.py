"""A table shard larger than its share of the server's memory: the rows updated most
recently in RAM (a `RowTable`, the hot tier), the others on local disk (`cold.ColdStore`).

`spec.training.sparseStorage` sets each server's memory budget for sparse rows
(`serverMemory`) and where the rest go (`directory`); the chief sends both with the
tables in the sparse `configure` call, and a server splits its budget evenly over the
namespace's tables (`hot_row_budget` turns a table's share into rows).

Invariants (each id has its row in at most one tier):
- After every update the hot tier holds at most `hot_rows` rows (unless one update
  alone touches more ids). When an update would pass that, rows go to disk in one
  batch that leaves 1/16 of the budget free, so batches are few; the rows of the
  update itself stay. Which rows: those updated least recently (`RowTable.last`),
  but the rows updated at least twice since they came to RAM (up to 3/4 of the RAM
  rows, the most recent of them) only after all others (`RowTable.oldest`, a
  segmented LRU): with Zipf ids most ids of a batch are seen once and never again,
  and under plain LRU they pushed out rows that keep coming back (29 % fewer disk
  reads in the CTR bench).
- An update of a row on disk brings it back to RAM (it is the most recent row then).
  A read of a row on disk reads it from disk and leaves it there: reads come from
  every worker's pull of the ids it sees, and promoting on a read would make the next
  batch of updates push out rows that are updated.
- Values are exactly those of one `RowTable` after the same calls: admission counts
  only ids without a row in either tier; eviction (`evict_after_steps` K) sweeps the
  disk at the clocks the RAM table sweeps (every max(1, K // 4) steps), dropping the
  disk rows not updated for K steps, and records them for checkpoint deltas as the RAM
  table records its own.
- `export` pages the RAM rows (start >= 0, as `RowTable.export`), then the disk rows
  in id order (start < 0), each with the same `since` rule, each id once, and the
  disk pass only the rows on disk when it began. Training goes on between pages (async
  mode): a row that goes to disk during the RAM pass is read by the disk pass (or was
  given already); one that goes to disk during the disk pass was in RAM when it began,
  so the RAM pass gave it, or it was updated after the RAM pass passed it; a row that
  comes back to RAM was updated. An updated row is in the next delta (its update
  clock is past the export's watermark), as with `RowTable`. A delta skips the disk
  without reading it while no row on disk was updated at or after `since`.
- A delta reads from disk only the rows that reached it since (`arrivals`), not the
  whole disk: rows never change on disk (an update brings a row back to RAM), so a
  row there updated at or after `since` reached the disk after that update. Each batch
  of rows going to disk is recorded, by its newest update clock, from a checkpoint
  export's start on, and of it only the rows updated at or after the `since` of the
  export under way (the next delta's, once an export has read the disk: the batches
  older than that are forgotten then). A record that outgrows the RAM rows' count (8
  bytes an id, against 276 or more a RAM row) is given up, and the next delta reads
  the whole disk as a full export does.
- A row that comes back to RAM during an export (it was updated) may be one the export
  still owes: it left the disk before the disk pass read it, and the RAM pass may have
  passed its new place already. The export records the ids of those it may owe (on
  disk when it began or since, not given yet, for a delta updated at or after
  `since`; during the disk pass only those the pass has not reached) and gives them
  with its next page, from whichever tier holds them then (8 bytes an id until then;
  the page gives as many fewer rows of its own).
"""

from __future__ import annotations

import math
import os
import re
import shutil
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .. import allocator
from .cold import MAX_MEMORY, MIN_MEMORY, ColdStore, release_free_memory
from .ids import in_sorted
from .index import DIRECT_MAX_IDS, DIRECT_MAX_SERVERS
from .rowopt import coalesce
from .scatter import put_rows
from .spec import ROW_SLOTS, TableSpec
from .table import REMOVAL_LOG_MIN, RemovalLog, Room, RowBlock, RowTable, TableStats

FIELD = "spec.training.sparseStorage"
MIN_HOT_ROWS = 1024  # a table's share of the budget must hold this many rows at least
ROW_BOOKKEEPING = 20  # bytes per RAM row besides its values: id, last update, version
HASH_BYTES_PER_ROW = 48  # the hash map's worst case per row (`index.IdIndex`)
PROTECTED = 3  # quarters of the RAM rows that may be kept for being updated twice
MOVE_ROWS = 2048  # rows moved to disk at once (`_make_room`)
MIN_PAGE_ROWS = 256  # an export page's rows, at least (`export_page_rows`)
DISK_FIRST = -1  # export's start of the disk pass (then -(2 + next id))
_cleaned: set[Path] = set()  # server directories emptied by this process
_cleaned_lock = threading.Lock()


@dataclass(frozen=True)
class StorageSettings:
    """A server's memory budget for sparse rows, in bytes, and the directory for the
    rows beyond it (None: none given; the server refuses tables then)."""

    memory_bytes: int
    directory: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"memory_bytes": self.memory_bytes, "directory": self.directory}

    @classmethod
    def from_json(cls, data: Any) -> StorageSettings | None:
        if data is None:
            return None
        memory, directory = (data.get("memory_bytes"), data.get("directory")
                             ) if isinstance(data, dict) else (None, None)
        if not isinstance(memory, int) or isinstance(memory, bool) or memory < 1:
            raise ValueError(f"storage.memory_bytes is {memory!r}; it must be a positive "
                             "integer")
        if directory is not None and not isinstance(directory, str):
            raise ValueError(f"storage.directory is {directory!r}; it must be a string")
        return cls(memory, directory)


def cold_memory(budget: int) -> int:
    """The disk store's share of a table's budget: 1/8, within [MIN_MEMORY, MAX_MEMORY]."""
    return min(MAX_MEMORY, max(MIN_MEMORY, budget // 8))


def working_memory(budget: int) -> int:
    """The share of a table's budget left for what the calls hold: the update's kept
    gather blocks (`table.Scratch`, a 64th of the budget each) and the initial rows
    kept from reads (`fresh.RecentReads`), all the time; and for a moment, a pull's
    rows, the records read from disk, a move to disk's choice of rows (`RowTable.oldest`:
    arrays over every RAM row) and copies, freed heap not yet given back: 3/16.
    (At 1/8 a server's peak anonymous RSS reached 1.00-1.01x its budget in the CTR
    bench while it moved rows to disk: bench/RESULTS.md, session 16.)"""
    return budget * 3 // 16


def export_page_rows(spec: TableSpec, budget: int) -> int:
    """The most rows an export page of a table with `budget` bytes gives: a page and
    its copies (the gather, the rows kept of it, the records read from disk, the reply)
    hold a 16th of the working memory each at most. The chief's pages of 65,536 rows
    (~17 MB of a CTR table's rows each, copied 3-4 times) took the servers' peak
    anonymous RSS growth to 1.1-1.2x a budget of 64 MiB during checkpoints, 1.0x with
    these (a 32nd: the same; bench/RESULTS.md, session 18); the chief asks for the
    next page where one ends."""
    return max(MIN_PAGE_ROWS, working_memory(budget) // 16 // (spec.row_bytes() + 16))


def hot_row_budget(spec: TableSpec, num_ps: int, budget: int) -> int:
    """The rows a table's `budget` bytes hold in RAM on one of `num_ps` servers: after
    the disk store's memory, the working memory and, for a fixed-size table, its id maps (4 bytes per id of the
    table, twice with `admit_after` > 1, and a bit per id for the disk), each row costs its values and slots, 20 bytes
    of bookkeeping and, for a dynamic table, up to 48 bytes of hash map."""
    n = spec.num_embeddings
    direct = n is not None and n <= DIRECT_MAX_IDS and num_ps <= DIRECT_MAX_SERVERS
    fixed = cold_memory(budget) + working_memory(budget)
    per_row = spec.row_bytes() + ROW_BOOKKEEPING
    if n is not None:  # the disk's id bitmap (`ColdStore.bits`)
        fixed += (n + 7) // 8
    if direct:
        fixed += 4 * n * (2 if spec.admit_after > 1 else 1)  # type: ignore[operator]
    else:
        per_row += HASH_BYTES_PER_ROW
    rows = (budget - fixed) // per_row
    if rows < MIN_HOT_ROWS:
        need = (fixed - working_memory(budget) + MIN_HOT_ROWS * per_row) * 16 // 13
        raise ValueError(f"{FIELD}.serverMemory leaves {budget} bytes on a server for "
                         f"sparse table {spec.name!r}; it must leave about {need} or more "
                         f"({MIN_HOT_ROWS} rows of {per_row} bytes in RAM plus "
                         f"{fixed} bytes of id maps, disk store and working memory): raise "
                         "serverMemory")
    return int(rows)


def shard_directory(directory: str, ps_index: int) -> Path:
    """This server's folder in `directory` (`pstrain-ps<i>`), made if missing. The
    rows a previous run of this server left there are removed once per process (they
    died with it: rows come back from checkpoints). One line naming the field when
    `directory` does not exist or is not writable."""
    base = Path(directory)
    if not base.is_dir():
        raise ValueError(f"{FIELD}.directory {directory!r} does not exist or is not a "
                         "directory; mount a volume there in the parameter servers' pod "
                         "template (see docs/sparse.md)")
    root = base / f"pstrain-ps{ps_index}"
    try:
        root.mkdir(exist_ok=True)
        with _cleaned_lock:
            if root not in _cleaned:
                for old in root.glob("rows-*"):
                    shutil.rmtree(old, ignore_errors=True)
                _cleaned.add(root)
        fd, probe = tempfile.mkstemp(prefix=".probe-", dir=root)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise ValueError(f"{FIELD}.directory {directory!r} is not writable: "
                         f"{exc.strerror or exc}") from exc
    return root


class GivenIds:
    """The ids an export gave so far. A page asks which of its ids are among them: a
    sorted run, searched, and the pages added since it last took them in (at most
    `MERGE` ids), compared whole; every `MERGE` ids go into the run where they sort (a
    copy of it, no sort). A tensor of them all, joined and compared whole at every
    page, took a full export twice its time with pages of a few thousand rows."""

    MERGE = 8192

    def __init__(self) -> None:
        self.run = np.empty(0, dtype=np.int64)
        self.recent: list[torch.Tensor] = []
        self.recent_count = 0

    def add(self, ids: torch.Tensor) -> None:
        if not ids.numel():
            return
        self.recent.append(ids)
        self.recent_count += int(ids.numel())
        if self.recent_count > self.MERGE:
            new = np.unique(torch.cat(self.recent).numpy())
            self.run = np.insert(self.run, np.searchsorted(self.run, new), new)
            self.recent, self.recent_count = [], 0

    def among(self, ids: torch.Tensor) -> torch.Tensor:
        """Which of `ids` were given (bool)."""
        out = in_sorted(ids, torch.from_numpy(self.run))
        if self.recent:
            out |= torch.isin(ids, torch.cat(self.recent))
        return out


def _joined(blocks: list[RowBlock]) -> RowBlock:
    blocks = [b for b in blocks if b.ids.numel()] or blocks[:1]
    if len(blocks) == 1:
        return blocks[0]
    return RowBlock(ids=torch.cat([b.ids for b in blocks]),
                    rows=torch.cat([b.rows for b in blocks]),
                    slots={n: torch.cat([b.slots[n] for b in blocks]) for n in blocks[0].slots},
                    last=torch.cat([b.last for b in blocks]))


def _part(block: RowBlock, which: torch.Tensor) -> RowBlock:
    return RowBlock(ids=block.ids[which], rows=block.rows[which],
                    slots={n: t[which] for n, t in block.slots.items()},
                    last=block.last[which])


class TieredTable:
    """One shard of one table in RAM and on disk, with `RowTable`'s interface."""

    def __init__(self, spec: TableSpec, budget: int, directory: Path, num_ps: int = 1
                 ) -> None:
        """`budget`: this shard's bytes of memory; `directory`: this server's folder
        (`shard_directory`), where the shard's disk rows get a folder of their own."""
        self.spec = spec
        self.dim = spec.embedding_dim
        self.slot_names = ROW_SLOTS[spec.optimizer.name]  # type: ignore[union-attr]
        self.hot_rows = hot_row_budget(spec, num_ps, budget)
        self.page_rows = export_page_rows(spec, budget)
        # The update's kept gather blocks (`table.Scratch`: three for Adagrad) come
        # out of the working memory: a 64th of the budget each at most.
        self.hot = RowTable(spec, reserve=self.hot_rows + MIN_HOT_ROWS, num_ps=num_ps,
                            scratch_bytes=budget // 64)
        safe = re.sub(r"[^A-Za-z0-9_.-]", "_", spec.name)[:40]
        path = Path(tempfile.mkdtemp(prefix=f"rows-{safe}-", dir=directory))
        self.cold = ColdStore(path, self.dim * (1 + len(self.slot_names)),
                              cold_memory(budget), spec.num_embeddings,
                              by_last=spec.evict_after_steps is not None)
        allocator.tune("budget")  # freed blocks go back to the OS, not kept for reuse
        self.lock = threading.RLock()
        self.swept = 0  # the clock of the RAM table's last sweep (the same rule)
        self.disk_min_last = math.inf  # at most the least last update on disk
        self.disk_max_last = -1  # at least the greatest last update on disk
        self.removals: RemovalLog | None = None  # disk rows evicted, for deltas
        self.arrivals: RemovalLog | None = None  # ids that reached disk, for deltas
        self.watermark: int | None = None  # the clock the last export's mark gave
        self.floor = 0  # rows updated before it reaching disk: wanted by no delta
        self.candidates: torch.Tensor | None = None  # a delta's disk pass: ids to read
        self.given: GivenIds | None = None  # ids the export under way gave
        self.since: int | None = None  # the export under way's (None: a full one)
        self.owed: list[torch.Tensor] = []  # ids it may owe (back in RAM since a page)
        self.disk_at = 0  # the disk pass's next id (whole disk) or candidate index
        self.disk_pass = False  # an export is reading the disk
        self.disk_end: int | None = None  # the last id on disk as its pass began
        self.closed = False

    # ------------------------------------------------------------------ tiers
    def _to_disk(self, block: RowBlock, new: bool) -> None:
        if not block.ids.numel():
            return
        values = torch.cat([block.rows, *(block.slots[n] for n in self.slot_names)], 1)
        self.cold.put(block.ids.numpy(), values.numpy(), block.last.numpy())
        if new:
            self.cold.count += int(block.ids.numel())
        if self.arrivals is not None:  # those a delta may want (see the module doc)
            wanted = block.last >= self.floor
            if bool(wanted.any()):
                self.arrivals.add(int(block.last.max()), block.ids[wanted], self.hot_rows)
        if self.disk_pass and self.given is not None:
            # Rows reaching disk while an export reads it were in RAM when its disk
            # pass began: given by its RAM pass, or updated since (the next delta), or
            # owed (given with the next page, read from here).
            ids = block.ids
            if self.owed:
                ids = ids[~torch.isin(ids, torch.cat(self.owed))]
            self.given.add(ids)
        self.disk_min_last = min(self.disk_min_last, int(block.last.min()))
        self.disk_max_last = max(self.disk_max_last, int(block.last.max()))

    def _from_disk(self, ids: torch.Tensor, remember: bool = False
                   ) -> tuple[torch.Tensor, RowBlock]:
        """(which of `ids` are on disk, their rows); `remember`: see `ColdStore.get`."""
        found, values, last = self.cold.get(ids.numpy(), remember)
        there = torch.from_numpy(found)
        rows = torch.from_numpy(values)
        slots = {n: rows[:, (k + 1) * self.dim:(k + 2) * self.dim]
                 for k, n in enumerate(self.slot_names)}
        return there, RowBlock(ids=ids[there], rows=rows[:, :self.dim], slots=slots,
                               last=torch.from_numpy(last))

    def _make_room(self, incoming: int, keep: torch.Tensor | None) -> None:
        """Move rows to disk (`RowTable.oldest`: least recently updated first, rows
        updated twice in RAM last), so that `incoming` more rows fit in RAM (down to
        15/16 of the budget: one batch now and then)."""
        live = self.hot.stats().rows
        if live + incoming <= self.hot_rows:
            return
        count = live + incoming - self.hot_rows + self.hot_rows // 16
        going = self.hot.oldest(count, keep, self.hot_rows * PROTECTED // 4)
        # A few thousand rows at a time: each row passes through about 1.4 KB of
        # copies on its way (its block, the joined values, the records, the write
        # batch, the keys' and values' bytes objects): a batch of a sixteenth of the
        # budget at once held about a sixth of the budget for a moment.
        for part in torch.split(going, MOVE_ROWS):
            self._to_disk(self.hot.take(part), new=True)
        # The batch's copies (megabytes) left holes in the heap among blocks still in
        # use, which glibc keeps: give their pages back. Only here: a read or an update
        # frees blocks of the size it will take again (allocator role `budget`), and
        # trimming after them (every ~1,300 rows
        # they moved between the tiers) only made the next calls fault the pages back
        # in: 8 % of a call's CPU in `python -m bench.tier_calls disk`, the servers'
        # RSS the same without (bench/RESULTS.md, session 13).
        release_free_memory()

    def _check(self) -> None:
        if self.closed:
            raise RuntimeError(f"sparse table {self.spec.name!r} was closed (the tables "
                               "were defined again)")

    # ------------------------------------------------------------------ reads
    def read(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows of `ids` (any order, repeats allowed), float32 [n, dim]."""
        ids = ids.reshape(-1).to(torch.int64).contiguous()
        with self.lock:
            self._check()
            if self.cold.count == 0:
                return self.hot.read(ids)
            missing = torch.nonzero(~self.hot.present(ids)).reshape(-1)
            there, block = self._from_disk(ids[missing], remember=True)
            if not bool(there.any()):
                return self.hot.read(ids)
            out = torch.empty((ids.numel(), self.dim), dtype=torch.float32)
            on_disk = missing[there]
            rest = torch.ones(ids.numel(), dtype=torch.bool)
            rest[on_disk] = False
            rest_at = torch.nonzero(rest).reshape(-1)
            put_rows(out, rest_at, self.hot.read(ids.index_select(0, rest_at)))
            put_rows(out, on_disk, block.rows)
            return out

    # ------------------------------------------------------------------ updates
    def apply(self, ids: torch.Tensor, grads: torch.Tensor, t: int, now: int) -> int:
        """`RowTable.apply`: rows on disk come back to RAM first, room is made."""
        ids, grads = coalesce(ids.reshape(-1).to(torch.int64), grads)
        with self.lock:
            self._check()
            hot = self.hot.present(ids)
            others = ids[~hot]
            self._make_room(int(others.numel()), ids[hot])
            if self.cold.count and others.numel():
                there, block = self._from_disk(others)
                if bool(there.any()):
                    self._owe(block)
                    self.cold.delete(block.ids.numpy())
                    self.cold.count -= int(block.ids.numel())
                    self.hot.load(block)
            updated = self.hot.apply(ids, grads, t, now)
            after = self.spec.evict_after_steps
            if after is not None and now - self.swept >= max(1, after // 4):
                self.swept = now  # the RAM table swept now too
                self._sweep_disk(now, after)
            if self.hot.stats().rows > self.hot_rows:  # one update above the budget
                self._make_room(0, None)
            return updated

    def _sweep_disk(self, now: int, after: int) -> None:
        """Drop the disk rows not updated for `after` steps, as the RAM table's sweep
        drops its own (and records them as it does): those the store's keys by last
        update name (`ColdStore.pop_stale`), not a read of every row."""
        if not self.cold.count or now - self.disk_min_last < after:
            return
        dropped = self.cold.pop_stale(now - after + 1)
        self.cold.delete(dropped)
        self.cold.count -= len(dropped)
        self.disk_min_last = self.cold.least_last()
        if len(dropped) and self.removals is not None:
            self.removals.add(now, torch.from_numpy(dropped),
                              max(REMOVAL_LOG_MIN, 2 * (self.cold.count + len(dropped))))

    # ------------------------------------------------------------------ whole table
    def stats(self) -> TableStats:
        """Live rows of both tiers; the memory of the RAM rows and of the disk store's
        caches (`tier_stats`: the tiers apart)."""
        with self.lock:
            hot = self.hot.stats()
            return TableStats(rows=hot.rows + self.cold.count,
                              bytes=hot.bytes + self.cold.memory_bytes())

    def tier_stats(self) -> dict[str, int]:
        with self.lock:
            return {"hot_rows": self.hot.stats().rows, "disk_rows": self.cold.count,
                    "disk_bytes": self.cold.disk_bytes(), "hot_row_budget": self.hot_rows}

    def export(self, start: int, limit: int, since: int | None = None,
               into: Room | None = None) -> tuple[RowBlock, int]:
        """`RowTable.export` over both tiers: RAM rows for start >= 0, then disk rows
        (start < 0: -(2 + the next id)); the next start, 0 at the end. Each id once,
        and the disk pass gives only rows that were on disk when it began, the rows
        owed beside (see the module doc). At most `page_rows` of the `limit` rows a
        page (the working memory's share, `export_page_rows`), owed rows included
        (a page gives min(limit, `MIN_PAGE_ROWS`) rows of its own at least). `into`
        is not used: a page is joined from the tiers' rows (and the owed), never
        gathered in one go."""
        with self.lock:
            self._check()
            if start == 0 or self.given is None:
                self.given = GivenIds()
                self.disk_pass, self.since, self.owed = False, since, []
            owed = self._pay_owed()
            limit = min(limit, self.page_rows)
            limit = max(min(limit, MIN_PAGE_ROWS), limit - int(owed.ids.numel()))
            block, after = self._page(start, limit, since)
            if not after:
                self._end_disk_pass()
            return _joined([owed, block]), after

    def _page(self, start: int, limit: int, since: int | None) -> tuple[RowBlock, int]:
        """`export`'s own rows: a page of the RAM rows or of the disk's."""
        assert self.given is not None  # an export is under way
        if start >= 0:
            block, after = self.hot.export(start, limit, since)
            block = self._not_given(block)
            self.given.add(block.ids)
            return block, (after if after else DISK_FIRST)
        if since is not None and since > self.disk_max_last:
            return self._empty(), 0
        if start == DISK_FIRST or not self.disk_pass:
            self.disk_pass = True
            self.candidates = self._arrived(since)
            # A whole-disk pass: ids past the last one on disk now arrive during the
            # pass, skipped.
            self.disk_end = self.cold.last_id() if self.candidates is None else None
        at = 0 if start == DISK_FIRST else -start - 2
        if self.candidates is not None:  # a delta: the rows that reached disk since
            ids = self.candidates[at:at + limit]
            found, values, last = self.cold.get(ids.numpy())
            ids, after = ids[torch.from_numpy(found)].numpy(), at + limit
            if after >= self.candidates.numel():
                after = None
        elif self.disk_end is None:
            return self._empty(), 0
        else:  # the whole disk, in id order
            ids, values, last, after = self.cold.page(at, limit)
            if after is not None and after > self.disk_end:
                after = None
        block = self._not_given(self._disk_block(ids, values, last, since))
        if after is None:
            return block, 0
        self.disk_at = after
        return block, -(after + 2)

    def _owe(self, block: RowBlock) -> None:
        """Rows leaving the disk for RAM (`block`, as they were on disk) during an
        export: record those it may still owe (see the module doc)."""
        if self.given is None or not block.ids.numel():
            return
        owed = block.ids
        if self.since is not None:
            owed = owed[block.last >= self.since]
        if self.disk_pass:  # those the pass has not reached
            if self.candidates is not None:  # (sorted)
                owed = owed[in_sorted(owed, self.candidates[self.disk_at:])]
            else:
                owed = owed[owed >= self.disk_at]
        if owed.numel():
            self.owed.append(owed)

    def _pay_owed(self) -> RowBlock:
        """The rows the export owes (`_owe`) and has not given yet, from the tier that
        holds each now; given from then on."""
        if not self.owed or self.given is None:
            return self._empty()
        ids = torch.unique(torch.cat(self.owed))
        self.owed = []
        ids = ids[~self.given.among(ids)]
        ram = self.hot.present(ids)
        _, on_disk = self._from_disk(ids[~ram])
        owed = _joined([self.hot.block_of(ids[ram]), on_disk])
        self.given.add(owed.ids)
        return owed

    def _arrived(self, since: int | None) -> torch.Tensor | None:
        """The ids that reached disk at clock >= `since` (sorted, distinct), or None when
        the record does not hold them all (or for a full export): the pass reads the
        whole disk then."""
        log = self.arrivals
        if since is None or log is None or not log.covers(since):
            return None
        chunks = log.since(since)
        if not chunks:
            return torch.empty(0, dtype=torch.int64)
        return torch.unique(torch.cat(chunks))

    def _disk_block(self, ids: np.ndarray, values: np.ndarray, last: np.ndarray,
                    since: int | None) -> RowBlock:
        """Rows read from disk as a block; with `since`, those updated at or after it."""
        keep = (torch.ones(len(ids), dtype=torch.bool) if since is None
                else torch.from_numpy(last >= since))
        rows = torch.from_numpy(values)[keep]
        return RowBlock(ids=torch.from_numpy(ids)[keep], rows=rows[:, :self.dim],
                        slots={n: rows[:, (k + 1) * self.dim:(k + 2) * self.dim]
                               for k, n in enumerate(self.slot_names)},
                        last=torch.from_numpy(last)[keep])

    def _end_disk_pass(self) -> None:
        self.given, self.disk_pass, self.candidates = None, False, None
        self.owed, self.disk_at = [], 0
        if self.arrivals is not None and self.watermark is not None:
            # The next delta is of the rows updated since this export's mark.
            self.arrivals.trim(self.watermark)
            self.floor = self.watermark

    def _not_given(self, block: RowBlock) -> RowBlock:
        """`block` without the ids this export gave already."""
        if self.given is None or not block.ids.numel():
            return block
        return _part(block, ~self.given.among(block.ids))

    def _empty(self) -> RowBlock:
        empty = torch.empty((0, self.dim))
        return RowBlock(ids=torch.empty(0, dtype=torch.int64), rows=empty,
                        slots={n: empty for n in self.slot_names},
                        last=torch.empty(0, dtype=torch.int64))

    def _place(self, block: RowBlock) -> None:
        """New rows (absent from both tiers): in RAM while there is room, then on disk."""
        room = max(0, self.hot_rows - self.hot.stats().rows)
        order = torch.arange(block.ids.numel())
        self.hot.load(_part(block, order[:room]))
        self._to_disk(_part(block, order[room:]), new=True)

    def load(self, block: RowBlock) -> None:
        """Install exported rows (ids unique and in neither tier)."""
        with self.lock:
            self._check()
            ids = block.ids.to(torch.int64)
            there, _ = self._from_disk(ids)
            if bool(self.hot.present(ids).any()) or bool(there.any()):
                raise ValueError(f"sparse table {self.spec.name!r}: rows being restored "
                                 "are already present")
            self._place(block)

    def upsert(self, block: RowBlock) -> None:
        """`RowTable.upsert`: a row in RAM or on disk is replaced where it is."""
        with self.lock:
            self._check()
            ids = block.ids.to(torch.int64)
            hot = self.hot.present(ids)
            self.hot.upsert(_part(block, hot))
            rest = _part(block, ~hot)
            there, _ = self._from_disk(rest.ids)
            self._to_disk(_part(rest, there), new=False)
            self._place(_part(rest, ~there))

    def remove(self, ids: torch.Tensor) -> int:
        """`RowTable.remove` over both tiers."""
        with self.lock:
            self._check()
            ids = torch.unique(ids.reshape(-1).to(torch.int64))
            gone = self.hot.remove(ids)
            there, block = self._from_disk(ids)
            self.cold.delete(block.ids.numpy())
            self.cold.count -= int(block.ids.numel())
            return gone + int(block.ids.numel())

    def read_versioned(self, ids: torch.Tensor, versions: bool = True
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """`RowTable.read_versioned`: `read` and `versions` under one hold of the lock."""
        with self.lock:
            return self.read(ids), (self.versions(ids) if versions
                                    else torch.empty(0, dtype=torch.int32))

    def versions(self, ids: torch.Tensor) -> torch.Tensor:
        """`RowTable.versions`: the RAM rows' own, 0 for rows on disk (a row that
        comes back to RAM is loaded, so its count starts again at 0: a worker's cached
        copy of it is refreshed, see `cache`)."""
        with self.lock:
            self._check()
            return self.hot.versions(ids)

    def track_removals(self, since: int | None, watermark: int) -> bool:
        """`RowTable.track_removals`, for the RAM rows' evictions and the disk's."""
        complete = self.hot.track_removals(since, watermark)
        with self.lock:
            self.removals, disk_complete = RemovalLog.tracked(self.removals, since, watermark)
            # The ids reaching disk: a record that holds those since `since` serves
            # this export's delta and goes on; else a new one serves the next delta.
            covered = since is not None and RemovalLog.tracked(
                self.arrivals, since, watermark)[1]
            if covered:
                self.floor = since
            else:
                self.arrivals, self.floor = RemovalLog(watermark), watermark
            self.watermark = watermark
            return complete and disk_complete

    def removed_ids(self, since: int, start: int, limit: int) -> tuple[torch.Tensor, int]:
        """The RAM rows' removed ids (start >= 0), then the disk's (start < 0)."""
        if start >= 0:
            ids, after = self.hot.removed_ids(since, start, limit)
            return ids, (after if after else DISK_FIRST)
        with self.lock:
            if self.removals is None:
                return torch.empty(0, dtype=torch.int64), 0
            ids, after = self.removals.page(since, -start - 1, limit)
            return ids, (-(after + 1) if after else 0)

    def close(self) -> None:
        """Remove the disk rows (the table is being replaced or its server stops)."""
        with self.lock:
            if not self.closed:
                self.closed = True
                self.given = None
                self.cold.close()
