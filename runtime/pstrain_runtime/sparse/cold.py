"""A table shard's rows on local disk (the cold tier of `tiered.TieredTable`), in RocksDB
through `rocksdict` (the `disk` extra: `pip install 'pstrain[disk]'`).

Why RocksDB and not LMDB: the server's resident memory must stay under its budget.
LMDB reads through a memory map, so every page it touches counts in the process's RSS
(reclaimable by the kernel, but visible to the pod's memory accounting and to anyone
sizing the server); RocksDB reads into a block cache of a fixed size and writes through
memtables of a fixed size, so its memory is bounded by its options (`memory`), whatever
the size of the table on disk.

Layout: one RocksDB database per shard, in a directory of its own that `close` removes.
A key is the id as 8 big-endian bytes (so keys sort as ids do, ids being >= 0); a value
is the row's last update (int64, little-endian) then the row and its optimizer slots
(`width` float32 values). Nothing is written ahead (no WAL, no fsync): a server's disk
rows die with the server, whose rows come back from the checkpoint, as its RAM rows do.

For a fixed-size table the store keeps one bit per id (which ids it holds), and that
bit is the truth: a delete only clears bits, and leaves the records (dead) on disk,
never read again (a read asks RocksDB only for marked ids, a scan skips the others)
and replaced by the id's next put. Rows come back to RAM by the hundreds per call, and
deleting them wrote a tombstone each, which every flush, compaction and lookup then
carried: without them a disk-tier call took 6-10 % less CPU in `python -m
bench.tier_calls disk` (bench/RESULTS.md, session 16). The price is disk space: a
shard's files hold a record for every id that ever went to disk (its share of the
table's ids at most), not only the live ones. A table without a fixed size has no
bitmap and writes its deletes.

With `by_last` (a table whose rows are evicted after K steps), a second key space (a
column family) holds a key per row put, its last update then its id, so that a sweep
(`pop_stale`) reads only the keys older than its bound, not every record: 16 bytes a
key against a record's hundreds, and only the stale ones. A row that leaves the disk
(back to RAM, deleted, replaced) leaves its key behind: a sweep checks each key it
reads against the row's record (marked, and of that last update) and deletes the key
either way; keys left behind are swept within K steps of their row's last update.

Compaction is universal (tiered), not RocksDB's default leveled style: evictions write
batches of random ids, so each flush overlaps the whole key range, and leveled
compaction merged every few flushes into the one level that held the table, rewriting
all of it (8x the bytes written; its threads took 29 % of a disk-tier server's CPU in
the CTR bench). Universal merges runs of similar size, once 8 runs are there (at 4,
the default, it wrote 1.6x the bytes, for no faster reads: a lookup of an id not in a
run costs a check of that run's bloom filter); it costs disk space, not memory: the
files peaked at 2.1x the live rows' bytes in `python -m bench.tier_calls disk --steps
2000` (leveled: 2.1x), with a full merge whenever the newer runs outgrow the oldest.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import math
import shutil
from collections import deque
from itertools import islice
from pathlib import Path
from typing import Any

import numpy as np

KEY = np.dtype(">u8")
LAST_KEY = np.dtype([("last", ">u8"), ("id", ">u8")])  # a `by_last` key
_SIGN = np.uint64(1 << 63)  # flipped in a last update's key: int64 order as bytes
PUT_CHUNK = 1024  # rows whose values are bytes objects at once while a batch is built
KEEP_READS = 4  # reads whose records are kept: one pull per worker in flight (and slack)
MIN_MEMORY = 2 << 20  # RocksDB's own memory per shard, at least
MAX_MEMORY = 64 << 20  # and at most (block cache + two memtables)
INDEX_RESTART = 16  # index entries per restart point (RocksDB's default: 1)


def _engine() -> Any:
    try:
        import rocksdict
    except ImportError as exc:  # the extra is not installed
        raise ValueError("spec.training.sparseStorage needs the rocksdict package on the "
                         "parameter servers; install pstrain with the disk extra "
                         "(pip install 'pstrain[disk]'; the runtime image has it)") from exc
    return rocksdict


def _libc_trim() -> Any:
    """glibc's `malloc_trim`, or None elsewhere (musl, macOS)."""
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


_TRIM = _libc_trim()


def release_free_memory() -> None:
    """Give the pages the heap holds free back to the OS. Moving rows between the tiers
    frees many blocks of a few hundred KB (ids, records, torch's gathers) between
    blocks still in use; glibc returns only the free top of its heap by itself, so the
    holes would stay resident and the server's RSS would grow past its budget."""
    if _TRIM is not None:
        _TRIM(0)


def _keys(ids: np.ndarray) -> list[bytes]:
    """The keys of `ids` (a void view's `tolist` makes the bytes objects in C)."""
    return np.asarray(ids, dtype=np.int64).astype(KEY).view(np.dtype("V8")).tolist()


def _last_keys(last: np.ndarray, ids: np.ndarray) -> list[bytes]:
    keys = np.empty(len(ids), LAST_KEY)
    keys["last"] = np.asarray(last, dtype=np.int64).view(np.uint64) ^ _SIGN
    keys["id"] = ids
    return keys.view(np.dtype("V16")).tolist()


def _each(method: Any, *columns: list[bytes]) -> None:
    """`method(*row)` for each row of `columns`, looped in C (`map` drained by a
    zero-length deque): a batch of thousands of puts or deletes."""
    deque(map(method, *columns), maxlen=0)


class RecentRecords:
    """Records that reads fetched from disk, kept for the update that usually follows
    (a worker pulls its batch's rows, then pushes their gradients: the update would
    read them from disk again). At most `capacity` records of the last `KEEP_READS`
    reads; the oldest reads go first.
    The owner drops the ids it writes or deletes, so a record kept is the one on disk."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.blocks: deque[tuple[np.ndarray, np.ndarray, np.ndarray]] = deque()
        self.size = 0

    def add(self, ids: np.ndarray, records: np.ndarray) -> None:
        ids, first = np.unique(ids, return_index=True)
        if not 0 < len(ids) <= self.capacity:
            return
        self.blocks.append((ids, records[first], np.ones(len(ids), dtype=bool)))
        self.size += len(ids)
        while self.size > self.capacity or len(self.blocks) > KEEP_READS:
            self.size -= len(self.blocks.popleft()[0])

    def _where(self, block_ids: np.ndarray, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        pos = np.minimum(np.searchsorted(block_ids, ids), len(block_ids) - 1)
        return pos, block_ids[pos] == ids

    def find(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(which of `ids` are kept, their records, in the order of `ids`)."""
        hit = np.zeros(len(ids), dtype=bool)
        out = np.empty(len(ids), self.blocks[0][1].dtype) if self.blocks else None
        for block_ids, records, valid in reversed(self.blocks):
            pos, same = self._where(block_ids, ids)
            new = same & valid[pos] & ~hit
            out[new] = records[pos[new]]  # type: ignore[index]
            hit |= new
        return hit, (out[hit] if out is not None else np.empty(0))

    def drop(self, ids: np.ndarray) -> None:
        for block_ids, _, valid in self.blocks:
            pos, same = self._where(block_ids, ids)
            valid[pos[same]] = False


class ColdStore:
    """Rows by id on disk. `width`: float32 values per row (row + slots); `memory`:
    the memory of the store: RocksDB's block cache (a quarter: index and filter
    blocks), two memtables (an eighth each) and the records recent reads fetched
    (`RecentRecords`, a quarter); a quarter is left for what RocksDB holds beside them
    (iterators, compaction).
    Not thread-safe: the owning table holds its lock around every call."""

    def __init__(self, path: Path, width: int, memory: int, num_ids: int | None = None,
                 by_last: bool = False) -> None:
        """`num_ids`: a fixed-size table's id space; the store then keeps one bit per id
        in memory (which ids are on disk), so that a lookup of ids not on disk, most of
        a batch's, never reaches RocksDB. `by_last`: keep the rows' keys by last update
        too, for `pop_stale` (two memtables of a 32nd of `memory` each, out of the
        quarter left over)."""
        rd = _engine()
        self.path = path
        self.width = width
        self.bits = None if num_ids is None else np.zeros((num_ids + 7) // 8, np.uint8)
        self.record = np.dtype([("last", "<i8"), ("values", "<f4", (width,))])
        self.count = 0  # rows held (the owner keeps it exact: it knows what is new)
        memory = min(MAX_MEMORY, max(MIN_MEMORY, memory))
        opts = rd.Options(raw_mode=True)
        opts.create_if_missing(True)
        table = rd.BlockBasedOptions()
        self.recent = RecentRecords(memory // 4 // self.record.itemsize)
        table.set_block_cache(rd.Cache(memory // 4))
        # The cache holds the index and filter blocks, charged to it (bounded), not
        # data blocks: reads do not fill it (see `reads` below).
        table.set_cache_index_and_filter_blocks(True)
        # Index blocks delta-encode 16 keys per restart point instead of storing each
        # whole: a few times smaller, so the index blocks of a grown table (one per
        # file, a few hundred KB each with 1) fault in, copy and crowd the cache less;
        # a lookup scans up to 15 entries more. `python -m bench.tier_calls disk
        # --steps 4000`: CPU per call -10 % (median), faults 806-1,124 -> 598-686 per
        # call (bench/RESULTS.md, session 16; a two-level index gained less, a cache
        # twice the size nothing).
        table.set_index_block_restart_interval(INDEX_RESTART)
        table.set_bloom_filter(10, False)  # an id that is not on disk costs no read
        if num_ids is not None:
            # Every id asked for is on disk (the bitmap says so): no filters on the
            # last level, which holds most rows (they would only confirm a hit).
            opts.set_optimize_filters_for_hits(True)
        opts.set_block_based_table_factory(table)
        opts.set_write_buffer_size(memory // 8)
        opts.set_max_write_buffer_number(2)
        opts.set_compression_type(rd.DBCompressionType.none())  # float rows hardly shrink
        opts.set_compaction_style(rd.DBCompactionStyle.universal())  # see the module doc
        universal = rd.UniversalCompactOptions()
        universal.max_size_amplification_percent = 100  # all runs at most twice the last
        opts.set_universal_compaction_options(universal)
        opts.set_level_zero_file_num_compaction_trigger(8)  # runs before a merge
        opts.set_max_background_jobs(2)
        # Compaction's own buffers (outside the cache): small, they are transient RSS.
        opts.set_compaction_readahead_size(256 << 10)
        opts.set_writable_file_max_buffer_size(256 << 10)
        self.db = rd.Rdict(str(path), opts)
        # Ids are read at random: 1.5 % of the data blocks read were in the cache,
        # and putting them there pushed out the index and filter blocks every lookup
        # needs (40 % of those missed with 8 runs, each a read of a block of ~100 KB);
        # without: 6 % missed, a call 7 % faster in `python -m bench.tier_calls disk`.
        reads = rd.ReadOptions()
        reads.fill_cache(False)
        self.db.set_read_options(reads)
        writes = rd.WriteOptions()
        writes.disable_wal = True
        self.db.set_write_options(writes)
        self._rd = rd
        self.by_last: Any = None
        if by_last:
            keys = rd.Options(raw_mode=True)
            keys.set_write_buffer_size(memory // 32)
            keys.set_max_write_buffer_number(2)
            keys.set_compression_type(rd.DBCompressionType.none())
            self.by_last = self.db.create_column_family("by_last", keys)
            self._by_last_cf = self.db.get_column_family_handle("by_last")

    # ------------------------------------------------------------------ rows
    def get(self, ids: np.ndarray, remember: bool = False
            ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(found [n] bool, values [found, width] float32, last [found] int64) of
        `ids`: the rows of those found, in the order of `ids`. `remember`: keep the
        records read from disk for a `get` soon after (a read before an update)."""
        found = np.zeros(len(ids), dtype=bool)
        if len(ids) == 0 or self.count == 0:
            return found, np.empty((0, self.width), np.float32), np.empty(0, np.int64)
        out = np.empty(len(ids), self.record)
        kept, records = self.recent.find(ids)
        out[kept], found[kept] = records, True
        rest = ~kept if self.bits is None else ~kept & self._marked(ids)
        ask = np.flatnonzero(rest)
        if len(ask):
            got = self.db.get(_keys(ids[ask]))
            there = np.fromiter((v is not None for v in got), dtype=bool, count=len(got))
            fetched = np.frombuffer(b"".join(v for v in got if v is not None), self.record)
            out[ask[there]], found[ask[there]] = fetched, True
            if remember:
                self.recent.add(ids[ask[there]], fetched)
        out = out[found]
        return found, out["values"].copy(), out["last"].copy()

    def _marked(self, ids: np.ndarray) -> np.ndarray:
        return ((self.bits[ids >> 3] >> (ids & 7).astype(np.uint8)) & 1).astype(bool)  # type: ignore[index]

    def _mark(self, ids: np.ndarray, on: bool) -> None:
        if self.bits is None:
            return
        bits = np.left_shift(1, ids & 7).astype(np.uint8)
        if on:
            np.bitwise_or.at(self.bits, ids >> 3, bits)
        else:
            np.bitwise_and.at(self.bits, ids >> 3, ~bits)

    def put(self, ids: np.ndarray, values: np.ndarray, last: np.ndarray) -> None:
        """Write rows (ids unique); an id on disk gets the new row."""
        if len(ids) == 0:
            return
        records = np.empty(len(ids), self.record)
        records["last"] = last
        records["values"] = values
        batch = self._rd.WriteBatch(raw_mode=True)
        keys, raw = _keys(ids), records.view(np.dtype(f"V{self.record.itemsize}"))
        for start in range(0, len(ids), PUT_CHUNK):  # the values' bytes objects a chunk at a time
            end = start + PUT_CHUNK
            _each(batch.put, keys[start:end], raw[start:end].tolist())
        if self.by_last is not None:
            by_last = _last_keys(last, ids)
            _each(batch.put, by_last, [b""] * len(by_last), [self._by_last_cf] * len(by_last))
        self.db.write(batch)
        self._mark(ids, True)
        self.recent.drop(ids)

    def delete(self, ids: np.ndarray) -> None:
        """Forget rows (ids unique, on disk): with an id bitmap their bits only (the
        records stay, dead; see the module doc), else RocksDB deletes."""
        if len(ids) == 0:
            return
        self.recent.drop(ids)
        if self.bits is not None:
            self._mark(ids, False)
            return
        batch = self._rd.WriteBatch(raw_mode=True)
        _each(batch.delete, _keys(ids))
        self.db.write(batch)

    # ------------------------------------------------------------------ scans
    # (rocksdict's snapshots do not hold for iterators: scans read the store as it is.)
    def page(self, first: int, limit: int
             ) -> tuple[np.ndarray, np.ndarray, np.ndarray, int | None]:
        """Up to `limit` rows from id `first` on, in id order: (ids, values, last, the
        next id to read or None at the end). Dead records count toward `limit` and are
        left out (a page may hold fewer rows, even none, before the end)."""
        start = _keys(np.array([first]))[0]
        items = list(islice(self.db.items(from_key=start), limit + 1))
        after = None
        if len(items) > limit:
            after = int(np.frombuffer(items[-1][0], KEY)[0])
            items = items[:limit]
        ids = np.frombuffer(b"".join(k for k, _ in items), KEY).astype(np.int64)
        records = np.frombuffer(b"".join(v for _, v in items), self.record)
        if self.bits is not None and len(ids):
            live = self._marked(ids)
            ids, records = ids[live], records[live]
        return ids, records["values"].copy(), records["last"].copy(), after

    def pop_stale(self, before: int, page_keys: int = 8192) -> np.ndarray:
        """The ids of the rows last updated before clock `before` (`by_last`), their
        keys deleted (the caller drops the rows), with those of rows that left the disk
        (one range delete). A page of keys and the records read to check them are
        transient memory: 8,192 keys, ~2 MB of records for rows of 64 values (65,536
        raised a disk tier's peak anonymous RSS by ~55 MB in `bench.tier_calls`)."""
        bound = _last_keys(np.array([before]), np.array([0]))[0]
        found: list[np.ndarray] = []
        after = b""
        while True:
            keys = [k for k in islice(self.by_last.keys(from_key=after), page_keys)
                    if k < bound]
            if keys:
                entries = np.frombuffer(b"".join(keys), LAST_KEY)
                ids = entries["id"].astype(np.int64)
                last = (entries["last"] ^ _SIGN).view(np.int64)
                # A key is its row's while the row is on disk with that last update.
                there, _, now = self.get(ids)
                current = np.zeros(len(ids), bool)
                current[np.flatnonzero(there)[now == last[there]]] = True
                found.append(ids[current])
            if len(keys) < page_keys:
                break
            after = keys[-1] + b"\x00"  # the next key after it
        batch = self._rd.WriteBatch(raw_mode=True)
        batch.delete_range(b"", bound, self._by_last_cf)
        self.db.write(batch)
        return np.unique(np.concatenate(found)) if found else np.empty(0, np.int64)

    def least_last(self) -> float:
        """At most the least last update of a row on disk (`by_last`; inf: none)."""
        first = next(iter(self.by_last.keys()), None)
        if first is None:
            return math.inf
        return int((np.frombuffer(first, LAST_KEY)["last"][0] ^ _SIGN).view(np.int64))

    def last_id(self) -> int | None:
        """The greatest id with a record on disk, dead or not (None: none): a bound."""
        it = self.db.iter()
        try:
            it.seek_to_last()
            return int(np.frombuffer(it.key(), KEY)[0]) if it.valid() else None
        finally:
            del it

    # ------------------------------------------------------------------ the store
    def disk_bytes(self) -> int:
        """Bytes of the table files on disk, dead records included (rows still in a
        memtable are in memory: `memory_bytes`)."""
        files = self.db.property_int_value("rocksdb.total-sst-files-size") or 0
        return int(files)

    def memory_bytes(self) -> int:
        """The store's memory now: RocksDB's memtables and block cache content, the
        records kept from reads and the id bitmap."""
        tables = self.db.property_int_value("rocksdb.cur-size-all-mem-tables") or 0
        cache = self.db.property_int_value("rocksdb.block-cache-usage") or 0
        bits = 0 if self.bits is None else self.bits.nbytes
        return int(tables) + int(cache) + self.recent.size * self.record.itemsize + bits

    def close(self) -> None:
        """Close the database and remove its directory (its rows are gone)."""
        try:
            self.db.close()
        finally:
            shutil.rmtree(self.path, ignore_errors=True)
