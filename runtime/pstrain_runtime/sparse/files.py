"""A table shard on disk: a stream of row blocks, written and read a page at a time
(never the whole shard in one buffer), atomically (temporary file, fsync, rename).

    file   = MAGIC, header line (JSON: table, dim, slots), block*, end
    block  = u64 count (> 0), ids int64[count], rows float32[count, dim],
             each slot float32[count, dim] (in header order), last int64[count]
    end    = u64 0

An ids file (`write_ids`: the ids a delta removes) is the same with MAGIC_IDS, a header
of the table alone, and blocks of ids only.

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
from .spec import TableSpec
from .table import RowBlock

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

    def read(self, size: int) -> bytes:
        return self._seen(self.fh.read(size))

    def readline(self) -> bytes:
        return self._seen(self.fh.readline())


def _write_file(path: Path, magic: bytes, header: dict[str, Any],
                parts: Iterable[Sequence[torch.Tensor]]) -> Written:
    """Write `magic`, `header` and one block per item of `parts` (tensors of equal
    first dimension, the first one's length the block's count) atomically."""
    def write(raw: Any) -> Written:
        fh, total = _Summing(raw), 0
        fh.write(magic)
        fh.write(json.dumps(header).encode() + b"\n")
        for tensors in parts:
            count = int(tensors[0].shape[0])
            if not count:
                continue
            fh.write(_COUNT.pack(count))
            for tensor in tensors:
                fh.write_tensor(tensor)
            total += count
        fh.write(_COUNT.pack(0))
        return Written(total, fh.size, fh.crc)

    return write_atomically(path, write, direct=DIRECT)


def write_rows(path: Path, spec: TableSpec, slots: Sequence[str],
               blocks: Iterable[RowBlock]) -> Written:
    """Write `blocks` to `path` atomically; the rows written and the file's check."""
    header = {"table": spec.name, "dim": spec.embedding_dim, "slots": list(slots)}
    return _write_file(path, MAGIC, header, (
        (block.ids, block.rows, *(block.slots[n] for n in slots), block.last)
        for block in blocks))


def write_ids(path: Path, spec: TableSpec, blocks: Iterable[torch.Tensor]) -> Written:
    """Write blocks of ids (int64) to `path` atomically; the ids written and the check."""
    return _write_file(path, MAGIC_IDS, {"table": spec.name}, ((ids,) for ids in blocks))


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

    header = {"table": spec.name, "dim": dim, "slots": list(slots)}
    return _read_file(path, MAGIC, header, check, block)


def read_ids(path: Path, spec: TableSpec,
             check: Mapping[str, Any] | None = None) -> Iterator[torch.Tensor]:
    """The blocks of ids of a file written by `write_ids`, checked as `read_rows`."""
    return _read_file(path, MAGIC_IDS, {"table": spec.name}, check,
                      lambda part: part(np.int64, 0))
