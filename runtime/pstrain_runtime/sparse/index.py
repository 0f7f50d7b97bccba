"""Id -> row maps of a table shard, behind one small interface (numpy int64 arrays in
and out): `find` (positions or -1), `get` (values or a default), `put` (set, inserting
the absent), `add` (insert keys known unique and absent), `items`, `keep`, `clear`,
`size` (entries) and `nbytes` (memory held).

- `DirectIndex`, for a table of a fixed size (ids in [0, num_embeddings)): one int32
  per id of the whole id space, value + 1 (0: absent). A lookup is one gather, and the
  array is allocated zeroed by the OS (calloc): pages no owned id falls in are never
  touched. With P servers each holds ~num_embeddings / P rows, so it costs 4 P bytes
  per row held: used up to `DIRECT_MAX_SERVERS` servers.
- `IdIndex`, for every other table (any int64 id): open addressing with linear probing
  over numpy arrays, vectorised over a batch's ids; 12 bytes per entry (an int64 key,
  an int32 value) at a load of 0.25 to 0.5 (24 to 48 bytes per row).
"""

from __future__ import annotations

import numpy as np

from . import ids as idrule
from .spec import TableSpec

DIRECT_MAX_SERVERS = 16  # 4 P bytes per row: up to 64, the hash map's worst case
DIRECT_MAX_IDS = (1 << 31) - 1  # values are int32 row indices + 1


EMPTY = -1
MIN_CAPACITY = 1024
MAX_LOAD = 0.5


class IdIndex:
    """An int64 -> int32 hash map over numpy arrays, vectorised (linear probing)."""

    def __init__(self, capacity: int = MIN_CAPACITY) -> None:
        capacity = 1 << max(int(capacity - 1).bit_length(), 4)
        self.keys = np.full(capacity, EMPTY, dtype=np.int64)
        self.vals = np.zeros(capacity, dtype=np.int32)  # row indices: below 2^31
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
            # Several keys may want the same free place: each writes its key there and
            # one write stays (the keys being unique, reading them back says which).
            at, mine = pos[free], keys[pending[free]]
            self.keys[at] = mine
            won = self.keys[at] == mine
            winners = free[won]
            self.vals[at[won]] = vals[pending[winners]]
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
        return self.keys[live], self.vals[live].astype(np.int64)

    def keep(self, mask_fn) -> None:  # type: ignore[no-untyped-def]
        """Drop every entry whose (key, val) mask_fn marks False."""
        keys, vals = self.items()
        keep = mask_fn(keys, vals)
        self._rebuild(keys[keep], vals[keep])

    def drop(self, keys: np.ndarray) -> None:
        """Remove `keys` (those absent are skipped). Linear probing has no cheap
        deletion: the map is built again without them."""
        pos = self.find(keys)
        pos = pos[pos >= 0]
        if len(pos):
            live = self.keys != EMPTY
            live[pos] = False
            self._rebuild(self.keys[live], self.vals[live])


class DirectIndex:
    """An id -> value map over ids in [0, size): an int32 array of value + 1."""

    def __init__(self, num_ids: int) -> None:
        self.num_ids = num_ids
        self.slots = np.zeros(num_ids, dtype=np.int32)  # calloc: untouched pages are free
        self.size = 0

    @property
    def nbytes(self) -> int:
        return self.slots.nbytes

    def find(self, keys: np.ndarray) -> np.ndarray:
        return np.where(self.slots[keys] > 0, keys, -1)

    def get(self, keys: np.ndarray, default: int = -1) -> np.ndarray:
        found = self.slots[keys].astype(np.int64)
        found -= 1
        if default != -1:
            found[found < 0] = default
        return found

    def put(self, keys: np.ndarray, vals: np.ndarray) -> None:
        self.size += int(np.count_nonzero(self.slots[keys] == 0))
        self.slots[keys] = vals + 1

    def add(self, keys: np.ndarray, vals: np.ndarray) -> None:
        self.slots[keys] = vals + 1
        self.size += len(keys)

    def items(self) -> tuple[np.ndarray, np.ndarray]:
        keys = np.flatnonzero(self.slots)
        return keys, self.slots[keys].astype(np.int64) - 1

    def keep(self, mask_fn) -> None:  # type: ignore[no-untyped-def]
        keys, vals = self.items()
        gone = keys[~mask_fn(keys, vals)]
        self.slots[gone] = 0
        self.size -= len(gone)

    def drop(self, keys: np.ndarray) -> None:
        """Remove `keys` (those absent are skipped): no scan of the id space."""
        keys = np.unique(keys)
        self.size -= int(np.count_nonzero(self.slots[keys]))
        self.slots[keys] = 0


def index_for(spec: TableSpec, num_ps: int) -> DirectIndex | IdIndex:
    """The map for a shard of `spec` on one of `num_ps` servers (see the module doc)."""
    n = spec.num_embeddings
    if n is not None and n <= DIRECT_MAX_IDS and num_ps <= DIRECT_MAX_SERVERS:
        return DirectIndex(n)
    return IdIndex()
