"""A table shard on disk: a stream of row blocks, written and read a page at a time
(never the whole shard in one buffer), atomically (temporary file, fsync, rename).

    file   = MAGIC, header line (JSON: table, dim, slots), block*, end
    block  = u64 count (> 0), ids int64[count], rows float32[count, dim],
             each slot float32[count, dim] (in header order), last int64[count]
    end    = u64 0

An ids file (`write_ids`: the ids a delta removes) is the same with MAGIC_IDS, a header
of the table alone, and blocks of ids only.

A table's own rows (`write_pages`: a server writing its shard) are gathered straight
into the file's write buffer where the file is a `DirectFile` (`Room`): one copy of each
row, not one into new tensors and one into the buffer (bench/RESULTS.md, session 31).

Writing a file returns its size and CRC-32C (`Written`), which the checkpoint records
beside its name; reading checks both (a file recorded with zlib's CRC-32, as written
before, is checked with that). CRC-32C (google-crc32c, the CPU's CRC instruction) takes
a third of zlib's CRC-32 time, which was the largest piece of the chief's work per
checkpoint. A file that is missing, of another size, not a rows file, truncated, or not
the bytes written is damaged (`CheckpointCorrupt`): a restart would read the same
bytes. An I/O error is a `CheckpointError` (it may pass).
"""

from __future__ import annotations

import json
import struct
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import google_crc32c
import numpy as np
import torch

from ..checkpoint import (CheckpointCorrupt, CheckpointError, CheckpointMismatch,
                          check_rows_size, write_atomically)
from ..direct_write import ROOM
from .spec import TableSpec
from .table import Room, RowBlock

# A table's pages, `export(start, room)` each: (a page, the next start, 0 at the end).
Pages = Callable[[int, Room | None], tuple[RowBlock, int]]

MAGIC = b"PSTRAIN-ROWS 1\n"
MAGIC_IDS = b"PSTRAIN-IDS 1\n"
_COUNT = struct.Struct("<Q")


# A checksum, by the name a check records it under: (crc so far, data) -> crc.
CHECKSUMS: dict[str, Callable[[int, Any], int]] = {
    "crc32c": google_crc32c.extend,  # data: bytes or a uint8 array (not a memoryview)
    "crc32": lambda crc, data: zlib.crc32(data, crc),  # files written before
}
CHECKSUM = "crc32c"  # what files are written with
DIRECT = True  # around the page cache where the file system allows (see direct_write)


@dataclass(frozen=True)
class Written:
    """What `write_rows` wrote: rows, and the file's size and checksum (its check)."""

    rows: int
    size: int
    crc: int

    def check(self) -> dict[str, int]:
        return {"bytes": self.size, CHECKSUM: self.crc}


class _Summing:
    """A file wrapper that counts and checksums (`algorithm`) every byte through it."""

    def __init__(self, fh: BinaryIO, algorithm: str = CHECKSUM) -> None:
        self.fh, self.size, self.crc = fh, 0, 0
        self._extend = CHECKSUMS[algorithm]

    def _seen(self, data: bytes | np.ndarray) -> bytes | np.ndarray:
        self.size += len(data)
        self.crc = self._extend(self.crc, data)
        return data

    def write(self, data: bytes | np.ndarray) -> None:
        self.fh.write(self._seen(data))

    def write_tensor(self, tensor: torch.Tensor) -> None:
        """A tensor's bytes, without copying them into a bytes object first."""
        self.write(tensor.contiguous().numpy().reshape(-1).view(np.uint8))

    def claim(self, size: int) -> np.ndarray:
        """The file's next `size` bytes, for the caller to fill (`DirectFile.claim`);
        counted and checksummed once filled (`filled`)."""
        return self.fh.claim(size)  # type: ignore[attr-defined]

    def ready(self, size: int) -> None:
        self.fh.ready(size)  # type: ignore[attr-defined]

    def filled(self, room: np.ndarray) -> None:
        self._seen(room)

    def read(self, size: int) -> bytes:
        return self._seen(self.fh.read(size))

    def readline(self) -> bytes:
        return self._seen(self.fh.readline())


def _write_block(fh: _Summing, tensors: Sequence[torch.Tensor]) -> int:
    """One block of `tensors` (of equal first dimension: the count); none if empty."""
    count = int(tensors[0].shape[0])
    if count:
        fh.write(_COUNT.pack(count))
        for tensor in tensors:
            fh.write_tensor(tensor)
    return count


def _write_file(path: Path, magic: bytes, header: dict[str, Any],
                body: Callable[[_Summing], int]) -> Written:
    """Write `magic`, `header`, the blocks `body(file)` writes (it returns their rows)
    and the end atomically."""
    def write(raw: Any) -> Written:
        fh = _Summing(raw)
        fh.write(magic)
        fh.write(json.dumps(header).encode() + b"\n")
        total = body(fh)
        fh.write(_COUNT.pack(0))
        return Written(total, fh.size, fh.crc)

    return write_atomically(path, write, direct=DIRECT)


def row_bytes(dim: int, slots: int) -> int:
    """A row's bytes in a rows file: id, row, each of `slots`, last update."""
    return 16 + 4 * dim * (1 + slots)


def _rows_header(spec: TableSpec, slots: Sequence[str]) -> dict[str, Any]:
    return {"table": spec.name, "dim": spec.embedding_dim, "slots": list(slots)}


def _parts(block: RowBlock, slots: Sequence[str]) -> tuple[torch.Tensor, ...]:
    return (block.ids, block.rows, *(block.slots[n] for n in slots), block.last)


def write_rows(path: Path, spec: TableSpec, slots: Sequence[str],
               blocks: Iterable[RowBlock]) -> Written:
    """Write `blocks` to `path` atomically; the rows written and the file's check."""
    def body(fh: _Summing) -> int:
        return sum(_write_block(fh, _parts(block, slots)) for block in blocks)

    return _write_file(path, MAGIC, _rows_header(spec, slots), body)


class _BlockRoom:
    """A `Room` for one block at a time in a file's write buffer: the block's count
    written, then views of the buffer where its ids, rows, slots and last updates go
    (unaligned where the file's bytes fall: torch gathers into them all the same)."""

    def __init__(self, fh: _Summing, dim: int, slots: Sequence[str]) -> None:
        self.fh, self.dim, self.slots = fh, dim, list(slots)
        self.row_bytes = row_bytes(dim, len(self.slots))
        self.most = (ROOM - _COUNT.size) // self.row_bytes
        self._given: tuple[RowBlock, np.ndarray] | None = None  # the last page's

    def block(self, count: int) -> RowBlock:
        if not 0 < count <= self.most:
            raise ValueError(f"room for 1 to {self.most} rows, not {count}")
        room = self.fh.claim(_COUNT.size + count * self.row_bytes)
        room[:_COUNT.size] = np.frombuffer(_COUNT.pack(count), dtype=np.uint8)
        at = _COUNT.size

        def part(dtype: np.dtype[Any], width: int) -> torch.Tensor:
            nonlocal at
            size = count * max(width, 1) * dtype.itemsize
            view = torch.from_numpy(room[at:at + size].view(dtype))
            at += size
            return view.reshape(count, width) if width else view

        i64, f32 = np.dtype(np.int64), np.dtype(np.float32)
        block = RowBlock(ids=part(i64, 0), rows=part(f32, self.dim),
                         slots={n: part(f32, self.dim) for n in self.slots},
                         last=part(i64, 0))
        self._given = block, room
        return block

    def ready(self) -> None:
        """Before a page: room for `most` rows without a write (the table gathers
        under its lock, which a disk write would hold for milliseconds)."""
        self.fh.ready(_COUNT.size + self.most * self.row_bytes)

    def take(self, block: RowBlock) -> bool:
        """Whether `block` (a page) is the one gathered here: then it is summed, as
        written; otherwise the page is the table's own tensors, to write."""
        given, self._given = self._given, None
        if given is None:
            return False
        if block is not given[0]:
            raise RuntimeError("a page gathered into the file's buffer and gave another")
        self.fh.filled(given[1])
        return True


def write_pages(path: Path, spec: TableSpec, slots: Sequence[str],
                export: Pages) -> Written:
    """Write a table's pages, `export(start, room)` from start 0 until the next start
    is 0 again, to `path` atomically; the rows written and the file's check. Where the
    file is a `DirectFile`, a table that gathers into `room` (`RowTable.export`'s
    `into`) gathers each page's rows straight into the write buffer."""
    def body(fh: _Summing) -> int:
        room = _BlockRoom(fh, spec.embedding_dim, slots) if hasattr(fh.fh, "claim") else None
        if room is not None and room.most < 1:  # a row larger than the buffer
            room = None
        start, total = 0, 0
        while True:
            if room is not None:
                room.ready()
            block, start = export(start, room)
            if room is not None and room.take(block):
                total += int(block.ids.numel())
            else:
                total += _write_block(fh, _parts(block, slots))
            if start == 0:
                return total

    return _write_file(path, MAGIC, _rows_header(spec, slots), body)


def write_ids(path: Path, spec: TableSpec, blocks: Iterable[torch.Tensor]) -> Written:
    """Write blocks of ids (int64) to `path` atomically; the ids written and the check."""
    def body(fh: _Summing) -> int:
        return sum(_write_block(fh, (ids,)) for ids in blocks)

    return _write_file(path, MAGIC_IDS, {"table": spec.name}, body)


def _read_exact(fh: _Summing, size: int, path: Path) -> bytes:
    data = fh.read(size)
    if len(data) != size:
        raise CheckpointCorrupt(f"sparse rows {path} are truncated")
    return data


def _read_file(path: Path, magic: bytes, header: dict[str, Any],
               check: Mapping[str, Any] | None,
               read_block: Callable[[Callable[[type, int], torch.Tensor]], Any]
               ) -> Iterator[Any]:
    """The blocks of a file of `_write_file`, each read by `read_block(part)`, where
    part(dtype, width) reads the block's next tensor; with `check`, the file's size
    first and its checksum at the end."""
    check_rows_size(path, check)
    try:
        raw = open(path, "rb")  # noqa: SIM115 - closed below, read lazily
    except FileNotFoundError:
        raise CheckpointCorrupt(f"sparse rows {path} are missing") from None
    except OSError as exc:
        raise CheckpointError(f"sparse rows {path} cannot be read: {exc}") from exc
    # The checksum the check records (a file of before CRC-32C: "crc32").
    algorithm = next((name for name in CHECKSUMS if name in (check or {})), CHECKSUM)
    with raw:
        fh = _Summing(raw, algorithm)
        if fh.read(len(magic)) != magic:
            kind = "rows" if magic == MAGIC else "ids"
            raise CheckpointCorrupt(f"{path} is not a pstrain sparse {kind} file")
        try:
            found = json.loads(fh.readline())
        except ValueError as exc:
            raise CheckpointCorrupt(f"{path} has a corrupt header: {exc}") from exc
        if found != header:
            raise CheckpointMismatch(f"{path} holds {found}; expected "
                                     + ", ".join(f"{k} {v!r}" for k, v in header.items()))
        while True:
            (count,) = _COUNT.unpack(_read_exact(fh, _COUNT.size, path))
            if count == 0:
                if check and fh.crc != check.get(algorithm):
                    raise CheckpointCorrupt(f"sparse rows {path} are not the bytes written "
                                            f"(their {algorithm.upper()} differs)")
                return

            def part(dtype: type, width: int, count: int = count) -> torch.Tensor:
                itemsize = np.dtype(dtype).itemsize
                data = bytearray(_read_exact(fh, count * max(width, 1) * itemsize, path))
                array = torch.from_numpy(np.frombuffer(data, dtype=dtype))
                return array.reshape(count, width) if width else array

            yield read_block(part)


def read_rows(path: Path, spec: TableSpec, slots: Sequence[str],
              check: Mapping[str, Any] | None = None) -> Iterator[RowBlock]:
    """The blocks of a file written by `write_rows`, one at a time; with `check` (what
    the checkpoint recorded), the file's size first and its checksum at the end."""
    dim = spec.embedding_dim

    def block(part: Callable[[type, int], torch.Tensor]) -> RowBlock:
        ids = part(np.int64, 0)
        rows = part(np.float32, dim)
        slot_values = {name: part(np.float32, dim) for name in slots}
        return RowBlock(ids=ids, rows=rows, slots=slot_values, last=part(np.int64, 0))

    return _read_file(path, MAGIC, _rows_header(spec, slots), check, block)


def read_ids(path: Path, spec: TableSpec,
             check: Mapping[str, Any] | None = None) -> Iterator[torch.Tensor]:
    """The blocks of ids of a file written by `write_ids`, checked as `read_rows`."""
    return _read_file(path, MAGIC_IDS, {"table": spec.name}, check,
                      lambda part: part(np.int64, 0))
