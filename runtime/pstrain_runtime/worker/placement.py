"""Which parameter server holds which parameter (or which rows of it).

Pure and deterministic: every worker computes the same placement from the same model
without talking to anyone. The input is a set of (name, shape, itemsize); the result
depends only on that set, never on dict or creation order.

Rules:
- A tensor larger than `partition_bytes` (default: a fair share, total bytes / number
  of parameter servers, but at least MIN_PARTITION_BYTES)
  is split along its first dimension into as many row ranges
  as it needs, at most one per parameter server; each range is a separate piece.
- Pieces are placed largest first (ties by name) on the least-loaded server (ties by
  index): greedy longest-processing-time balancing by bytes.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

PART_SEPARATOR = "/part"
MIN_PARTITION_BYTES = 1 << 20  # below this, splitting costs more messages than it saves


@dataclass(frozen=True)
class ParamSpec:
    name: str
    shape: tuple[int, ...]
    itemsize: int = 4

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize

    @property
    def row_bytes(self) -> int:
        rows = self.shape[0] if self.shape else 1
        return self.nbytes // rows if rows else 0


@dataclass(frozen=True, order=True)
class Piece:
    """A whole parameter, or rows [row_start, row_end) of it, on one parameter server."""

    param: str
    row_start: int
    row_end: int
    ps: int
    shape: tuple[int, ...]  # shape of the piece
    key: str  # the name the parameter server knows it by
    byte_offset: int  # where the piece starts inside the parameter's bytes
    nbytes: int
    partitioned: bool


@dataclass(frozen=True)
class Placement:
    num_ps: int
    pieces: tuple[Piece, ...]  # sorted by (ps, key)
    loads: tuple[int, ...] = field(default=())

    def shard(self, ps: int) -> list[Piece]:
        """The pieces of server `ps`, in a fixed order (by key)."""
        return [p for p in self.pieces if p.ps == ps]

    def pieces_of(self, param: str) -> list[Piece]:
        return sorted((p for p in self.pieces if p.param == param), key=lambda p: p.row_start)

    def as_table(self) -> dict[str, int | list[int]]:
        """param -> server index, or the server of each partition in row order."""
        whole: dict[str, int] = {}
        parts: dict[str, list[int]] = {}
        for piece in sorted(self.pieces, key=lambda p: (p.param, p.row_start)):
            if piece.partitioned:
                parts.setdefault(piece.param, []).append(piece.ps)
            else:
                whole[piece.param] = piece.ps
        return {**whole, **parts}


def param_specs(shapes: Mapping[str, Sequence[int]], itemsize: int = 4) -> list[ParamSpec]:
    return [ParamSpec(name, tuple(int(d) for d in shape), itemsize)
            for name, shape in shapes.items()]


def _row_ranges(rows: int, parts: int) -> list[tuple[int, int]]:
    base, extra = divmod(rows, parts)
    out = []
    start = 0
    for i in range(parts):
        end = start + base + (1 if i < extra else 0)
        out.append((start, end))
        start = end
    return out


def build_placement(
    params: Iterable[ParamSpec],
    num_ps: int,
    partition_bytes: int | None = None,
) -> Placement:
    """Place `params` on `num_ps` servers; see the module docstring for the rules."""
    if num_ps < 1:
        raise ValueError(f"num_ps is {num_ps}; it must be at least 1")
    specs = sorted(params, key=lambda s: s.name)
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        dupes = sorted({n for n in names if names.count(n) > 1})
        raise ValueError(f"parameter names must be unique; repeated: {dupes}")
    for spec in specs:
        if PART_SEPARATOR in spec.name:
            raise ValueError(
                f"parameter name {spec.name!r} contains {PART_SEPARATOR!r}, which "
                "pstrain reserves for partitions"
            )
    total = sum(s.nbytes for s in specs)
    limit = (partition_bytes if partition_bytes is not None
             else max(math.ceil(total / num_ps), MIN_PARTITION_BYTES))
    if limit < 1:
        limit = 1

    candidates: list[tuple[str, int, int, tuple[int, ...], int, bool, str]] = []
    for spec in specs:
        rows = spec.shape[0] if spec.shape else 1
        parts = 1
        if num_ps > 1 and spec.shape and rows > 1 and spec.nbytes > limit:
            parts = min(num_ps, rows, math.ceil(spec.nbytes / limit))
        if parts == 1:
            candidates.append((spec.name, 0, rows, spec.shape, spec.nbytes, False, spec.name))
            continue
        for i, (start, end) in enumerate(_row_ranges(rows, parts)):
            shape = (end - start, *spec.shape[1:])
            candidates.append((spec.name, start, end, shape, (end - start) * spec.row_bytes,
                               True, f"{spec.name}{PART_SEPARATOR}{i}"))

    loads = [0] * num_ps
    pieces: list[Piece] = []
    by_param: dict[str, ParamSpec] = {s.name: s for s in specs}
    for param, start, end, shape, size, partitioned, key in sorted(
        candidates, key=lambda c: (-c[4], c[6])
    ):
        ps = min(range(num_ps), key=lambda i: (loads[i], i))
        loads[ps] += size
        pieces.append(Piece(
            param=param, row_start=start, row_end=end, ps=ps, shape=shape, key=key,
            byte_offset=start * by_param[param].row_bytes, nbytes=size,
            partitioned=partitioned,
        ))
    pieces.sort(key=lambda p: (p.ps, p.key))
    return Placement(num_ps=num_ps, pieces=tuple(pieces), loads=tuple(loads))
