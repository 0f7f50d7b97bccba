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

Storage is a row block [capacity, dim] per tensor (rows and each optimizer slot),
grown by half when full (or reserved up front for the expected shard of a fixed-size
table), 16 bytes of bookkeeping per row (its id, its last update),
plus an open-addressing hash map from id to row index held in numpy arrays (16 bytes
per entry at a load of 0.25 to 0.5: 32 to 64 bytes per row), so lookups and inserts of
a batch's ids are vectorised.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np
import torch

from . import ids as idrule
from .rowopt import apply_rows, coalesce
from .spec import ROW_SLOTS, TableSpec

EMPTY = -1
MIN_CAPACITY = 1024
MAX_LOAD = 0.5


class IdIndex:
    """An int64 -> int64 hash map over numpy arrays, vectorised (linear probing)."""

    def __init__(self, capacity: int = MIN_CAPACITY) -> None:
        capacity = 1 << max(int(capacity - 1).bit_length(), 4)
        self.keys = np.full(capacity, EMPTY, dtype=np.int64)
        self.vals = np.zeros(capacity, dtype=np.int64)
        self.size = 0

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.vals.nbytes

    def _home(self, keys: np.ndarray) -> np.ndarray:
        mask = np.uint64(len(self.keys) - 1)
        return (idrule.index_hash(keys.view(np.uint64)) & mask).astype(np.int64)

    def find(self, keys: np.ndarray) -> np.ndarray:
        """The position of each key in the map, or -1."""
        out = np.full(len(keys), -1, dtype=np.int64)
        if self.size == 0 or len(keys) == 0:
            return out
        mask = len(self.keys) - 1
        pending = np.arange(len(keys))
        pos = self._home(keys)
        while len(pending):
            found = self.keys[pos]
            hit = found == keys[pending]
            out[pending[hit]] = pos[hit]
            go_on = ~hit & (found != EMPTY)
            pending, pos = pending[go_on], (pos[go_on] + 1) & mask
        return out

    def get(self, keys: np.ndarray, default: int = -1) -> np.ndarray:
        pos = self.find(keys)
        out = np.full(len(keys), default, dtype=np.int64)
        there = pos >= 0
        out[there] = self.vals[pos[there]]
        return out

    def put(self, keys: np.ndarray, vals: np.ndarray) -> None:
        """Set keys (unique) to vals, inserting the absent ones."""
        pos = self.find(keys)
        there = pos >= 0
        self.vals[pos[there]] = vals[there]
        self.add(keys[~there], vals[~there])

    def add(self, new_keys: np.ndarray, new_vals: np.ndarray) -> None:
        """Insert keys that are unique and absent (the caller knows)."""
        if len(new_keys) == 0:
            return
        if (self.size + len(new_keys)) > MAX_LOAD * len(self.keys):
            live = self.keys != EMPTY
            self._rebuild(np.concatenate([self.keys[live], new_keys]),
                          np.concatenate([self.vals[live], new_vals]))
            return
        self._insert(new_keys, new_vals)

    def _insert(self, keys: np.ndarray, vals: np.ndarray) -> None:
        mask = len(self.keys) - 1
        pending = np.arange(len(keys))
        pos = self._home(keys)
        while len(pending):
            free = np.flatnonzero(self.keys[pos] == EMPTY)
            # Several keys may want the same free place: the first of each wins.
            _, first = np.unique(pos[free], return_index=True)
            winners = free[first]
            self.keys[pos[winners]] = keys[pending[winners]]
            self.vals[pos[winners]] = vals[pending[winners]]
            rest = np.ones(len(pending), dtype=bool)
            rest[winners] = False
            # Every other key now sees its place taken: probe the next one.
            pending, pos = pending[rest], (pos[rest] + 1) & mask
        self.size += len(keys)

    def _rebuild(self, keys: np.ndarray, vals: np.ndarray) -> None:
        # A power of two above len / MAX_LOAD: the load is 0.25..0.5 after a rebuild.
        fresh = IdIndex(max(MIN_CAPACITY, int(len(keys) / MAX_LOAD) + 1))
        fresh._insert(keys, vals)
        self.keys, self.vals, self.size = fresh.keys, fresh.vals, fresh.size

    def items(self) -> tuple[np.ndarray, np.ndarray]:
        live = self.keys != EMPTY
        return self.keys[live], self.vals[live]

    def keep(self, mask_fn) -> None:  # type: ignore[no-untyped-def]
        """Drop every entry whose (key, val) mask_fn marks False."""
        keys, vals = self.items()
        keep = mask_fn(keys, vals)
        self._rebuild(keys[keep], vals[keep])


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


class RowTable:
    """One shard of one table; `spec.optimizer` must be set (the row optimizer)."""

    def __init__(self, spec: TableSpec, reserve: int = 0) -> None:
        """`reserve`: rows to allocate up front (the expected shard of a fixed-size
        table; allocated, not touched, so it saves growing without costing memory)."""
        if spec.optimizer is None:
            raise ValueError(f"sparse table {spec.name!r} has no optimizer")
        self.spec = spec
        self.dim = spec.embedding_dim
        self.slot_names = ROW_SLOTS[spec.optimizer.name]
        self.stream = idrule.stream_of(spec.seed, spec.name)
        self.lock = threading.Lock()
        self.index = IdIndex()
        self.seen = IdIndex() if spec.admit_after > 1 else None  # id -> updates counted
        self.capacity = 0
        self.rows = torch.empty((0, self.dim))
        self.slots = {name: torch.empty((0, self.dim)) for name in self.slot_names}
        self.last = torch.empty(0, dtype=torch.int64)
        self.owner = torch.empty(0, dtype=torch.int64)  # id held by each row, -1 free
        self.used = 0  # rows ever handed out (high-water mark)
        self.free: list[int] = []
        self.last_sweep = 0
        if reserve:
            self._grow(reserve)

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

        def grown(old: torch.Tensor) -> torch.Tensor:
            new = torch.empty((capacity, *old.shape[1:]), dtype=old.dtype)
            new[:self.used] = old[:self.used]
            return new

        self.rows = grown(self.rows)
        self.slots = {name: grown(t) for name, t in self.slots.items()}
        self.last = grown(self.last)
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

    def _create(self, ids: torch.Tensor, now: int) -> torch.Tensor:
        """Rows for `ids` (unique, absent), set to their initial values."""
        where = self._take_rows(int(ids.numel()))
        self.rows.index_copy_(0, where, idrule.initial_rows(ids, self.dim, self.spec.init_std,
                                                            self.stream))
        fill = self.spec.optimizer.initial_accumulator_value  # type: ignore[union-attr]
        for name, tensor in self.slots.items():
            tensor.index_fill_(0, where, fill if name == "sum" else 0.0)
        self.last.index_fill_(0, where, now)
        self.owner.index_copy_(0, where, ids)
        self.index.add(ids.numpy(), where.numpy())
        return where

    def _where(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(self.index.get(ids.numpy()))

    # ------------------------------------------------------------------ reads
    def read(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows of `ids` (any order, repeats allowed), float32 [n, dim]."""
        ids = ids.reshape(-1).to(torch.int64).contiguous()
        with self.lock:
            where = self._where(ids)
            out = torch.empty((ids.numel(), self.dim), dtype=torch.float32)
            there = where >= 0
            if bool(there.all()):
                return torch.index_select(self.rows, 0, where, out=out)
            present = torch.nonzero(there).reshape(-1)
            out.index_copy_(0, present, self.rows.index_select(0, where[present]))
        absent = ~there
        out[absent] = idrule.initial_rows(ids[absent], self.dim, self.spec.init_std,
                                          self.stream)
        return out

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
                where[absent] = self._create(ids[absent], now)
            if where.numel():
                # Gather the rows and their state, update them, scatter them back.
                rows = self.rows.index_select(0, where)
                slots = {name: t_.index_select(0, where) for name, t_ in self.slots.items()}
                apply_rows(self.spec.optimizer, rows, grads, slots, t)  # type: ignore[arg-type]
                self.rows.index_copy_(0, where, rows)
                for name, value in slots.items():
                    self.slots[name].index_copy_(0, where, value)
                self.last.index_fill_(0, where, now)
            self._maybe_sweep(now)
            return int(where.numel())

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
        if len(self.seen.keys) and self.seen.size > 4 * max(1, self.index.size):  # type: ignore[union-attr]
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
        self.owner[gone] = EMPTY
        self.free.extend(gone.tolist())
        alive = torch.nonzero(self.owner[:self.used] >= 0).reshape(-1)
        self.index = IdIndex()
        if alive.numel():
            self.index.put(self.owner[alive].numpy(), alive.numpy())

    # ------------------------------------------------------------------ whole table
    def stats(self) -> TableStats:
        with self.lock:
            # Rows past `used` were never written (see `_grow`): they hold no memory.
            per_row = (self.dim * 4 * (1 + len(self.slots))
                       + self.last.element_size() + self.owner.element_size())
            held = self.used * per_row + self.index.nbytes
            if self.seen is not None:
                held += self.seen.nbytes
            return TableStats(rows=self.index.size, bytes=int(held))

    def export(self, start: int, limit: int) -> tuple[RowBlock, int]:
        """The live rows among row indices [start, start + limit) and the next start
        (0 once the end is reached): a page of the shard, for streaming it out."""
        with self.lock:
            end = min(self.used, start + limit)
            span = torch.arange(start, max(start, end), dtype=torch.int64)
            live = span[self.owner[span] >= 0] if span.numel() else span
            block = RowBlock(ids=self.owner[live].clone(), rows=self.rows[live].clone(),
                             slots={n: t[live].clone() for n, t in self.slots.items()},
                             last=self.last[live].clone())
            return block, (end if end < self.used else 0)

    def load(self, block: RowBlock) -> None:
        """Install exported rows (ids unique and not yet present)."""
        with self.lock:
            ids = block.ids.to(torch.int64)
            if self._where(ids).ge(0).any():
                raise ValueError(f"sparse table {self.spec.name!r}: rows being restored "
                                 "are already present")
            where = self._take_rows(int(ids.numel()))
            self.rows[where] = block.rows
            for name in self.slot_names:
                self.slots[name][where] = block.slots[name]
            self.last[where] = block.last
            self.owner[where] = ids
            self.index.put(ids.numpy(), where.numpy())
