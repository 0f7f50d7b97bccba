"""A table shard on disk: a stream of row blocks, written and read a page at a time
(never the whole shard in one buffer), atomically (temporary file, fsync, rename).

    file   = MAGIC, header line (JSON: table, dim, slots), block*, end
    block  = u64 count (> 0), ids int64[count], rows float32[count, dim],
             each slot float32[count, dim] (in header order), last int64[count]
    end    = u64 0
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import BinaryIO

import numpy as np
import torch

from ..checkpoint import CheckpointError, write_atomically
from .spec import TableSpec
from .table import RowBlock

MAGIC = b"PSTRAIN-ROWS 1\n"
_COUNT = struct.Struct("<Q")


def write_rows(path: Path, spec: TableSpec, slots: Sequence[str],
               blocks: Iterable[RowBlock]) -> int:
    """Write `blocks` to `path` atomically; the number of rows written."""
    def write(fh: BinaryIO) -> int:
        total = 0
        fh.write(MAGIC)
        fh.write(json.dumps({"table": spec.name, "dim": spec.embedding_dim,
                             "slots": list(slots)}).encode() + b"\n")
        for block in blocks:
            count = int(block.ids.numel())
            if not count:
                continue
            fh.write(_COUNT.pack(count))
            for tensor in (block.ids, block.rows, *(block.slots[n] for n in slots),
                           block.last):
                fh.write(tensor.contiguous().numpy().tobytes())
            total += count
        fh.write(_COUNT.pack(0))
        return total

    return write_atomically(path, write)


def _read_exact(fh, size: int, path: Path) -> bytes:  # type: ignore[no-untyped-def]
    data = fh.read(size)
    if len(data) != size:
        raise CheckpointError(f"sparse rows {path} are truncated")
    return data


def read_rows(path: Path, spec: TableSpec, slots: Sequence[str]) -> Iterator[RowBlock]:
    """The blocks of a file written by `write_rows`, one at a time."""
    dim = spec.embedding_dim
    try:
        fh = open(path, "rb")  # noqa: SIM115 - closed below, read lazily
    except OSError as exc:
        raise CheckpointError(f"sparse rows {path} cannot be read: {exc}") from exc
    with fh:
        if fh.read(len(MAGIC)) != MAGIC:
            raise CheckpointError(f"{path} is not a pstrain sparse rows file")
        try:
            header = json.loads(fh.readline())
        except ValueError as exc:
            raise CheckpointError(f"{path} has a corrupt header: {exc}") from exc
        if header != {"table": spec.name, "dim": dim, "slots": list(slots)}:
            raise CheckpointError(f"{path} holds {header}; expected table {spec.name!r} "
                                  f"with dim {dim} and slots {list(slots)}")
        while True:
            (count,) = _COUNT.unpack(_read_exact(fh, _COUNT.size, path))
            if count == 0:
                return

            def part(dtype: type, width: int) -> torch.Tensor:
                itemsize = np.dtype(dtype).itemsize
                data = bytearray(_read_exact(fh, count * max(width, 1) * itemsize, path))
                array = torch.from_numpy(np.frombuffer(data, dtype=dtype))
                return array.reshape(count, width) if width else array

            ids = part(np.int64, 0)
            rows = part(np.float32, dim)
            slot_values = {name: part(np.float32, dim) for name in slots}
            yield RowBlock(ids=ids, rows=rows, slots=slot_values, last=part(np.int64, 0))
