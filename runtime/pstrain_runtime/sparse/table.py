"""A table shard: the rows one parameter server (or a local, in-process table) holds,
their optimizer state next to them, and the id -> row map.

Invariants:
- A row exists once its id has been admitted and updated. Reading an id without a
  row gives its deterministic initial value (`ids.initial_rows`), so creating rows
  lazily is invisible to readers, also after a restart or an eviction.
- With `admit_after` N > 1, an id's updates are counted; the first N-1 are dropped
  (the id reads as its initial value) and the N-th creates the row and applies.
- With `evict_after_steps` K, rows not updated for K steps are dropped by a sweep that
  runs every max(1, K // 4) steps; an evicted id reads as its initial value again
  and starts with fresh optimizer state.
- Every method takes the table's lock; `apply` validates nothing (the caller has).
- A row's version counts the updates applied to it (int32, wrapping at 2^31): 0 when
  the row is created, loaded or upserted (a restore, a row back from disk), +1 per
  `apply` that updates it. An id without a row has no version (`versions` says 0).
  Workers' row caches use it to bound the updates a kept copy misses (`cache`).

Storage is a row block [capacity, dim] per tensor (rows and each optimizer slot),
grown by half when full (or reserved up front for the expected shard of a fixed-size
table), 20 bytes of bookkeeping per row (its id, its last update, its update count),
plus the id -> row map (`index`: a direct array for a fixed-size table, 4 bytes per id
of the id space; else a hash map of 32 to 64 bytes per row), vectorised over a batch's
ids.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from ..optim import OptimizerConfig
from .fresh import RecentReads
from .index import EMPTY, MIN_CAPACITY, DirectIndex, index_for
from .prefault import Prefault
from .rowopt import apply_rows, coalesce
from .scatter import fill_rows, put_rows
from .spec import ROW_SLOTS, TableSpec

@dataclass(frozen=True)
class TableStats:
    rows: int  # live rows
    bytes: int  # memory held: row blocks, optimizer slots, bookkeeping, index


@dataclass
class RowBlock:
    """Rows exported from or imported into a table: ids, rows, slots, last update."""

    ids: torch.Tensor  # int64 [n]
    rows: torch.Tensor  # float32 [n, dim]
    slots: dict[str, torch.Tensor]  # float32 [n, dim] each
    last: torch.Tensor  # int64 [n]


class Room(Protocol):
    """Where an export gathers a page's rows instead of into new tensors (`export`'s
    `into`): room for `most` rows at most, a file's write buffer."""

    most: int

    def block(self, count: int) -> RowBlock:
        """Tensors for `count` rows (1 to `most`) to gather into."""
        ...


NEVER = 1 << 62  # `RowTable.oldest`'s score of the rows it must not pick
# Rows per page when a shard is streamed out: to the chief (`SparseClient.export`), or
# into a server's own checkpoint file (`shard_writes`).
EXPORT_ROWS = 65536
SCRATCH_BYTES = 4 << 20  # an update's gathers reuse blocks of at most this size each


class Scratch:
    """Blocks an update gathers its rows and optimizer state into, kept from one update
    to the next: fresh blocks of a few hundred KB per call come from new mappings
    (glibc maps blocks above its threshold apart, 128 KiB for a budgeted server), whose
    every page faults in again (about 600 faults per call of a disk-tier server).
    At most `limit` bytes per block; a larger update allocates as before."""

    def __init__(self, dim: int, count: int, limit: int = SCRATCH_BYTES) -> None:
        self.dim, self.count = dim, count
        self.max_rows = limit // max(1, 4 * dim)
        self.blocks: list[torch.Tensor] = []

    def take(self, n: int) -> list[torch.Tensor] | None:
        """`count` float32 [n, dim] blocks (contiguous, contents undefined), or None when
        n rows pass the limit. Valid until the next `take` (callers hold the table's lock)."""
        if n > self.max_rows:
            return None
        if not self.blocks or self.blocks[0].shape[0] < n:
            rows = min(self.max_rows, max(n, 2 * (self.blocks[0].shape[0] if self.blocks else 0)))
            self.blocks = [torch.empty((rows, self.dim)) for _ in range(self.count)]
        return [block[:n] for block in self.blocks]


def protect_in_place(score: torch.Tensor, last: torch.Tensor, twice: torch.Tensor,
                     protect: int) -> None:
    """Add to `score` (rows' last updates) what puts the `protect` most recently
    updated rows among `twice` (bool) after every other row: the span of `last`."""
    span = int(last.max() - last.min()) + 1
    if int(twice.sum()) <= protect:  # the usual case: each of them, no selection
        score.add_(twice, alpha=span)
        return
    chosen = np.flatnonzero(twice.numpy())
    values = last.numpy()[chosen]
    chosen = chosen[np.argpartition(values, len(values) - protect)[len(values) - protect:]]
    score[torch.from_numpy(chosen)] += span


class RowTable:
    """One shard of one table; `spec.optimizer` must be set (the row optimizer)."""

    def __init__(self, spec: TableSpec, reserve: int = 0, num_ps: int = 1,
                 scratch_bytes: int = SCRATCH_BYTES, prefault: bool = False) -> None:
        """`reserve`: rows to allocate up front (the expected shard of a fixed-size
        table; allocated, not touched, so it saves growing without costing memory).
        `prefault`: map the reserve's pages (and the id map's) in the background now,
        holding their memory from the start, so that new rows' first writes do not
        fault them in one by one during training (`prefault`).
        `num_ps`: how many servers share the table (it picks the id map, `index`).
        `scratch_bytes`: the most each of an update's kept gather blocks may hold
        (`Scratch`: rows, each slot, Adagrad's denominator)."""
        if spec.optimizer is None:
            raise ValueError(f"sparse table {spec.name!r} has no optimizer")
        self.spec = spec
        self.dim = spec.embedding_dim
        self.slot_names = ROW_SLOTS[spec.optimizer.name]
        self.initial = RecentReads(spec.initializer())  # initial rows, kept from reads
        self.lock = threading.Lock()
        self.index = index_for(spec, num_ps)
        # id -> updates counted
        self.seen = index_for(spec, num_ps) if spec.admit_after > 1 else None
        self.capacity = 0
        self.rows = torch.empty((0, self.dim))
        self.slots = {name: torch.empty((0, self.dim)) for name in self.slot_names}
        self.last = torch.empty(0, dtype=torch.int64)
        self.version = torch.empty(0, dtype=torch.int32)  # updates of each row
        self.owner = torch.empty(0, dtype=torch.int64)  # id held by each row, -1 free
        self.used = 0  # rows ever handed out (high-water mark)
        self.free: list[int] = []
        self.last_sweep = 0
        self.scratch = Scratch(self.dim, 2 + len(self.slot_names), scratch_bytes)
        self.prefault: Prefault | None = None
        self.prefault_rows = reserve if prefault else 0
        if reserve:
            self._grow(reserve)
            if prefault:
                blocks = [t[:reserve] for t in (self.rows, *self.slots.values(), self.last,
                                                self.version, self.owner)]
                if isinstance(self.index, DirectIndex):
                    blocks.append(torch.from_numpy(self.index.slots))
                self.prefault = Prefault(blocks, spec.name)

    # ------------------------------------------------------------------ storage
    def _grow(self, need: int) -> None:
        """Room for `need` rows. New blocks are allocated, not filled: the pages past
        the rows in use are never written, so the OS maps them only once rows arrive
        (a reserved, mostly untouched shard costs no resident memory)."""
        capacity = max(MIN_CAPACITY, self.capacity)
        while capacity < need:
            capacity = capacity * 3 // 2
        if capacity == self.capacity:
            return
        if self.prefault is not None:  # (it maps the blocks being replaced)
            self.prefault.stop()
            self.prefault = None

        def grown(old: torch.Tensor) -> torch.Tensor:
            new = torch.empty((capacity, *old.shape[1:]), dtype=old.dtype)
            new[:self.used] = old[:self.used]
            return new

        self.rows = grown(self.rows)
        self.slots = {name: grown(t) for name, t in self.slots.items()}
        self.last = grown(self.last)
        self.version = grown(self.version)
        self.owner = grown(self.owner)
        self.capacity = capacity

    def _take_rows(self, count: int) -> torch.Tensor:
        reuse = min(count, len(self.free))
        taken = self.free[len(self.free) - reuse:]
        del self.free[len(self.free) - reuse:]
        fresh = count - reuse
        if self.used + fresh > self.capacity:
            self._grow(self.used + fresh)
        taken_t = torch.tensor(taken, dtype=torch.int64)
        new_t = torch.arange(self.used, self.used + fresh, dtype=torch.int64)
        self.used += fresh
        return torch.cat([taken_t, new_t])

    def _create_updated(self, ids: torch.Tensor, grads: torch.Tensor, t: int, now: int
                        ) -> None:
        """Rows for `ids` (unique, absent): their initial values and fresh optimizer
        state with the update of `grads` applied, computed in a block and written once
        (what creating them, then gathering, updating and scattering them back gives:
        the same arithmetic on the same values, the version 1 of one update)."""
        opt: OptimizerConfig = self.spec.optimizer  # type: ignore[assignment]
        rows, slots, spare = self._work(int(ids.numel()))
        rows.copy_(self.initial.create(ids))  # (maybe a kept read's block: not written)
        for name, state in slots.items():
            state.fill_(opt.initial_accumulator_value if name == "sum" else 0.0)
        apply_rows(opt, rows, grads, slots, t, scratch=spare)
        where = self._take_rows(int(ids.numel()))
        self._put(where, rows, slots, now)
        fill_rows(self.version, where, 1)
        put_rows(self.owner, where, ids)
        self.index.add(ids.numpy(), where.numpy())

    def _work(self, n: int) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor | None]:
        """Blocks of `n` rows an update works in: its rows, each optimizer slot and
        Adagrad's spare (the kept ones when they fit, see `Scratch`)."""
        blocks = self.scratch.take(n)
        if blocks is None:
            return (torch.empty((n, self.dim)),
                    {name: torch.empty((n, self.dim)) for name in self.slot_names}, None)
        return blocks[0], {name: blocks[2 + k] for k, name in enumerate(self.slot_names)}, \
            blocks[1]

    def _put(self, where: torch.Tensor, rows: torch.Tensor, slots: dict[str, torch.Tensor],
             now: int) -> None:
        """Write updated rows and their state at `where`, updated at clock `now`."""
        put_rows(self.rows, where, rows)
        for name, state in slots.items():
            put_rows(self.slots[name], where, state)
        fill_rows(self.last, where, now)

    def _where(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(self.index.get(ids.numpy()))

    # ------------------------------------------------------------------ reads
    def read(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows of `ids` (any order, repeats allowed), float32 [n, dim]."""
        return self.read_versioned(ids, versions=False)[0]

    def read_versioned(self, ids: torch.Tensor, versions: bool = True
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """(`read`, `versions`) of `ids` from one lookup of their rows, both as of the
        same moment; with `versions` False, no versions (an empty tensor)."""
        ids = ids.reshape(-1).to(torch.int64).contiguous()
        with self.lock:
            where = self._where(ids)
            counts = self._versions_at(where) if versions else torch.empty(0, dtype=torch.int32)
            out = torch.empty((ids.numel(), self.dim), dtype=torch.float32)
            there = where >= 0
            if bool(there.all()):
                return torch.index_select(self.rows, 0, where, out=out), counts
            present = torch.nonzero(there).reshape(-1)
            put_rows(out, present, self.rows.index_select(0, where.index_select(0, present)))
        absent = torch.nonzero(~there).reshape(-1)
        put_rows(out, absent, self.initial.read(ids.index_select(0, absent)))
        return out, counts

    def versions(self, ids: torch.Tensor) -> torch.Tensor:
        """The rows' versions (see the module doc), int32 [n]; 0 for ids without a row."""
        with self.lock:
            return self._versions_at(self._where(ids.reshape(-1).to(torch.int64).contiguous()))

    def _versions_at(self, where: torch.Tensor) -> torch.Tensor:
        """The versions of the rows at `where` (-1: no row, version 0); lock held."""
        if not where.numel() or int(where.min()) >= 0:  # (the usual case: all held)
            return self.version.index_select(0, where)
        if not self.version.numel():
            return torch.zeros(where.numel(), dtype=torch.int32)
        held = self.version.index_select(0, where.clamp(min=0))
        return held.masked_fill_(where < 0, 0)

    # ------------------------------------------------------------------ updates
    def apply(self, ids: torch.Tensor, grads: torch.Tensor, t: int, now: int) -> int:
        """Apply gradient rows (repeats summed) at update step `t` (>= 1) and clock
        `now`; returns how many rows were updated."""
        ids, grads = coalesce(ids.reshape(-1).to(torch.int64), grads)
        with self.lock:
            where = self._where(ids)
            if self.seen is not None:
                ids, grads, where = self._admit(ids, grads, where)
            absent = where < 0
            if bool(absent.any()):
                new = torch.nonzero(absent).reshape(-1)
                self._create_updated(ids.index_select(0, new), grads.index_select(0, new),
                                     t, now)
                held = torch.nonzero(~absent).reshape(-1)
                self._update(where.index_select(0, held), grads.index_select(0, held), t,
                             now)
            else:
                self._update(where, grads, t, now)
            self._maybe_sweep(now)
            return int(where.numel())

    def _update(self, where: torch.Tensor, grads: torch.Tensor, t: int, now: int) -> None:
        """Update the rows at `where` (distinct): gather them and their state, update
        them, scatter them back."""
        if not where.numel():
            return
        rows, slots, spare = self._work(int(where.numel()))
        torch.index_select(self.rows, 0, where, out=rows)
        for name, state in slots.items():
            torch.index_select(self.slots[name], 0, where, out=state)
        apply_rows(self.spec.optimizer, rows, grads, slots, t,  # type: ignore[arg-type]
                   scratch=spare)
        self._put(where, rows, slots, now)
        version = self.version.numpy()
        version[where.numpy()] += 1  # (distinct: each row once)

    def _admit(self, ids: torch.Tensor, grads: torch.Tensor, where: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Count the updates of ids without a row; keep those with a row or admitted now."""
        absent = where < 0
        if not bool(absent.any()):
            return ids, grads, where
        waiting = ids[absent].numpy()
        counts = self.seen.get(waiting, 0) + 1  # type: ignore[union-attr]
        self.seen.put(waiting, counts)  # type: ignore[union-attr]
        admitted = torch.ones_like(absent)
        admitted[absent] = torch.from_numpy(counts >= self.spec.admit_after)
        if self.seen.size > 4 * max(1, self.index.size):  # type: ignore[union-attr]
            # Forget the counts of admitted ids (they have rows now).
            have = self.index
            self.seen.keep(lambda keys, _vals: have.find(keys) < 0)  # type: ignore[union-attr]
        return ids[admitted], grads[admitted], where[admitted]

    def _maybe_sweep(self, now: int) -> None:
        after = self.spec.evict_after_steps
        if after is None or now - self.last_sweep < max(1, after // 4):
            return
        self.last_sweep = now
        live = self.owner[:self.used] >= 0
        stale = live & (now - self.last[:self.used] >= after)
        if not bool(stale.any()):
            return
        gone = torch.nonzero(stale).reshape(-1)
        if self.removals is not None:  # a checkpoint chain needs the ids dropped
            self.removals.add(now, self.owner[gone],
                              max(REMOVAL_LOG_MIN, 2 * self.index.size))
        self.index.drop(self.owner[gone].numpy())
        self.owner[gone] = EMPTY
        self.free.extend(gone.tolist())

    # ------------------------------------------------------------------ whole table
    def close(self) -> None:
        """Stop mapping pages ahead (the table is being replaced or its server stops)."""
        if self.prefault is not None:
            self.prefault.stop()

    def stats(self) -> TableStats:
        with self.lock:
            # Rows past `used` were never written (see `_grow`): they hold no memory,
            # unless they are prefaulted.
            per_row = (self.dim * 4 * (1 + len(self.slots)) + self.last.element_size()
                       + self.version.element_size() + self.owner.element_size())
            mapped = self.used
            if self.prefault is not None and self.prefault.ok:
                mapped = max(mapped, int(self.prefault.fraction() * self.prefault_rows))
            held = mapped * per_row + self.index.nbytes
            if self.seen is not None:
                held += self.seen.nbytes
            return TableStats(rows=self.index.size, bytes=int(held))

    def export(self, start: int, limit: int, since: int | None = None,
               into: Room | None = None) -> tuple[RowBlock, int]:
        """The live rows among row indices [start, start + limit) and the next start
        (0 once the end is reached): a page of the shard, for streaming it out. With
        `since`, only the rows last updated at clock >= since (a checkpoint's delta).
        With `into`, the rows are gathered into its block, and a page ends early where
        it holds no more (the next start is then the first live row left out)."""
        with self.lock:
            end = min(self.used, start + limit)
            keep = self.owner[start:max(start, end)] >= 0
            if since is not None:
                keep &= self.last[start:max(start, end)] >= since
            live = torch.nonzero(keep).reshape(-1) + start
            if into is not None and live.numel() > into.most:
                end, live = int(live[into.most]), live[:into.most]
            return self._block(live, into), (end if end < self.used else 0)

    def _block(self, where: torch.Tensor, into: Room | None = None) -> RowBlock:
        """Copies of the rows at `where` (the block owns its tensors, or they are
        `into`'s: the lock can go)."""
        if into is None or not where.numel():
            return RowBlock(ids=self.owner.index_select(0, where),
                            rows=self.rows.index_select(0, where),
                            slots={n: t.index_select(0, where) for n, t in self.slots.items()},
                            last=self.last.index_select(0, where))
        block = into.block(int(where.numel()))
        for source, out in ((self.owner, block.ids), (self.rows, block.rows),
                            *((t, block.slots[n]) for n, t in self.slots.items()),
                            (self.last, block.last)):
            torch.index_select(source, 0, where, out=out)
        return block

    def load(self, block: RowBlock) -> None:
        """Install exported rows (ids unique and not yet present)."""
        with self.lock:
            ids = block.ids.to(torch.int64)
            if self._where(ids).ge(0).any():
                raise ValueError(f"sparse table {self.spec.name!r}: rows being restored "
                                 "are already present")
            where = self._take_rows(int(ids.numel()))
            self._install_rows(where, block)
            self.owner[where] = ids
            self.index.put(ids.numpy(), where.numpy())

    # ------------------------------------------------------------------ checkpoint chains
    # Ids dropped by sweeps since a checkpoint chain began (see `track_removals`); None
    # while no chain is being written. (A class default: set per table when tracked.)
    removals: RemovalLog | None = None

    def _install_rows(self, where: torch.Tensor, block: RowBlock) -> None:
        put_rows(self.rows, where, block.rows)
        for name in self.slot_names:
            put_rows(self.slots[name], where, block.slots[name])
        put_rows(self.last, where, block.last)
        fill_rows(self.version, where, 0)  # a row replaced: its count starts again

    def upsert(self, block: RowBlock) -> None:
        """Install a delta's rows (ids unique): an id present gets the block's row,
        slots and last update in place of its own; an absent one gets a row."""
        with self.lock:
            ids = block.ids.to(torch.int64)
            where = self._where(ids)
            absent = where < 0
            if bool(absent.any()):
                fresh = self._take_rows(int(absent.sum()))
                where[absent] = fresh
                self.owner[fresh] = ids[absent]
                self.index.add(ids[absent].numpy(), fresh.numpy())
            self._install_rows(where, block)

    def remove(self, ids: torch.Tensor) -> int:
        """Drop the rows of `ids` (a delta's removed ids; ids without a row are
        skipped): they read as their initial values again. Returns the rows dropped."""
        with self.lock:
            where = self._where(ids.reshape(-1).to(torch.int64))
            gone = torch.unique(where[where >= 0])  # an id may be named twice
            if not gone.numel():
                return 0
            self.index.drop(self.owner[gone].numpy())
            self.owner[gone] = EMPTY
            self.free.extend(gone.tolist())
            return int(gone.numel())

    def track_removals(self, since: int | None, watermark: int) -> bool:
        """A checkpoint export begins at clock `watermark`. A full one (`since` None)
        starts recording the ids sweeps drop from now on (older records go). A delta
        of the rows changed at clock >= `since` needs every id dropped at clock >=
        since: True when they are recorded (records older than `since` go, no later
        delta asks for them), False when not (the record began later, or was given up
        for its size): then the checkpoint must be a full one."""
        with self.lock:
            self.removals, complete = RemovalLog.tracked(self.removals, since, watermark)
            return complete

    def removed_ids(self, since: int, start: int, limit: int) -> tuple[torch.Tensor, int]:
        """A page of the ids dropped at clock >= `since` (see `track_removals`): at most
        `limit` from the `start`-th on, and the next start (0 once the end is reached)."""
        with self.lock:
            if self.removals is None:
                return torch.empty(0, dtype=torch.int64), 0
            return self.removals.page(since, start, limit)

    # ------------------------------------------------------------------ tiers
    # For a table with a disk tier (`tiered.TieredTable`), which holds this table as
    # its rows in RAM.
    def present(self, ids: torch.Tensor) -> torch.Tensor:
        """Which of `ids` have a row here (bool [n])."""
        with self.lock:
            return self._where(ids.reshape(-1).to(torch.int64).contiguous()) >= 0

    def oldest(self, count: int, keep: torch.Tensor | None = None, protect: int = 0
               ) -> torch.Tensor:
        """The `count` rows (indices; fewer if fewer are live) to move elsewhere first,
        not those of the ids in `keep`: a segmented LRU, the rows updated least recently
        but `protect` rows updated twice since they came here after all
        (`protect_in_place`)."""
        with self.lock:
            live = self.owner[:self.used] >= 0
            if keep is not None and keep.numel():
                held = self._where(keep.reshape(-1).to(torch.int64).contiguous())
                live[held[held >= 0]] = False
            if count >= int(live.sum()):
                return torch.nonzero(live).reshape(-1)
            # Over every row index at once (no gathers of the candidates): the rows
            # not to pick score NEVER, above any last update plus its span.
            last = self.last[:self.used]
            score = last.masked_fill(~live, NEVER)
            if protect:
                protect_in_place(score, last, live & (self.version[:self.used] >= 2),
                                 protect)
            # (numpy's vectorised partial sort: a fifth of torch.topk's time)
            return torch.from_numpy(np.argpartition(score.numpy(), count - 1)[:count])

    def block_of(self, ids: torch.Tensor) -> RowBlock:
        """Copies of the rows of `ids` (each with a row here), as an export gives them."""
        with self.lock:
            where = self._where(ids.reshape(-1).to(torch.int64).contiguous())
            if where.numel() and int(where.min()) < 0:
                raise KeyError(f"sparse table {self.spec.name!r}: no row for some ids")
            return self._block(where)

    def take(self, where: torch.Tensor) -> RowBlock:
        """Remove and return the rows at `where` (live row indices, from `oldest`).
        Unlike an eviction this records no removal: the rows live on elsewhere."""
        with self.lock:
            block = self._block(where)
            if where.numel():
                self.index.drop(block.ids.numpy())
                self.owner[where] = EMPTY
                self.free.extend(where.tolist())
            return block


REMOVAL_LOG_MIN = 1 << 20  # ids a removal record may always hold (8 MiB)


class RemovalLog:
    """Ids dropped by sweeps, each batch with its clock, recorded from clock `origin` on.
    A record that outgrows its cap (a table's live rows, twice; checkpoints that stopped
    being written) is given up (`overflowed`): the next checkpoint is a full one. (A
    disk tier also records the ids reaching its disk this way: `tiered`.)"""

    def __init__(self, origin: int) -> None:
        self.origin = origin
        self.chunks: list[tuple[int, torch.Tensor]] = []  # (clock, ids)
        self.count = 0
        self.overflowed = False

    def add(self, clock: int, ids: torch.Tensor, cap: int) -> None:
        if self.overflowed:
            return
        self.chunks.append((clock, ids))
        self.count += int(ids.numel())
        if self.count > cap:
            self.chunks, self.count, self.overflowed = [], 0, True

    @classmethod
    def tracked(cls, log: RemovalLog | None, since: int | None, watermark: int
                ) -> tuple[RemovalLog | None, bool]:
        """The record to keep when a checkpoint export begins at clock `watermark`, and
        whether it holds every id dropped at clock >= `since` (see
        `RowTable.track_removals`): a full export (`since` None) starts a new one."""
        if since is None:
            return cls(watermark), True
        if log is None or not log.covers(since):
            return log, False
        log.trim(since)
        return log, True

    def covers(self, since: int) -> bool:
        """Whether every id recorded at clock >= `since` is here."""
        return not self.overflowed and self.origin <= since

    def since(self, since: int) -> list[torch.Tensor]:
        """The batches of ids recorded at clock >= `since`."""
        return [ids for clock, ids in self.chunks if clock >= since]

    def trim(self, since: int) -> None:
        """Forget the ids dropped before clock `since` (the record covers no earlier
        clock then)."""
        kept = [(c, ids) for c, ids in self.chunks if c >= since]
        self.chunks, self.count = kept, sum(int(ids.numel()) for _, ids in kept)
        self.origin = max(self.origin, since)

    def page(self, since: int, start: int, limit: int) -> tuple[torch.Tensor, int]:
        parts, skip, taken = [], start, 0
        chunks = self.since(since)
        for ids in chunks:
            if skip >= ids.numel():
                skip -= int(ids.numel())
                continue
            part = ids[skip:skip + limit - taken]
            skip = 0
            parts.append(part)
            taken += int(part.numel())
            if taken >= limit:
                break
        total = sum(int(ids.numel()) for ids in chunks)
        out = torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)
        after = start + taken
        return out, (after if after < total else 0)
