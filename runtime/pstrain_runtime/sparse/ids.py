"""Pure functions on int64 ids: which parameter server owns an id, and the
deterministic initial value of a row.

Both are functions of the id alone (plus the seed and table for initial values), so
every worker, every server and every restart of a server compute the same answer
without talking to anyone.

- Owner: `splitmix64(id) % num_ps`. A strong 64-bit mix makes the owner of
  consecutive or strided ids (the usual vocabulary layouts) independent of their
  order, so a skewed id distribution still spreads its distinct ids evenly; one single
  hot id stays on one server (its row is one row wherever it lives).
- Initial row: element j of row `id` is a normal variate drawn from
  `splitmix64(stream ^ id)` and j by Box-Muller, where `stream` digests (seed, table).
"""

from __future__ import annotations

import hashlib
import math

import numpy as np
import torch

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_INDEX_SALT = np.uint64(0x632BE59BD9B4E019)


def splitmix64(x: np.ndarray) -> np.ndarray:
    """The splitmix64 finaliser of every element of a uint64 array (wrapping)."""
    with np.errstate(over="ignore"):
        z = x + _GOLDEN  # then in place: two arrays however long `x` is
        shifted = z >> np.uint64(30)
        z ^= shifted
        z *= _M1
        z ^= np.right_shift(z, np.uint64(27), out=shifted)
        z *= _M2
        z ^= np.right_shift(z, np.uint64(31), out=shifted)
        return z


def as_uint64(ids: torch.Tensor | np.ndarray) -> np.ndarray:
    """int64 ids (>= 0) as a uint64 numpy array (no copy for a CPU tensor)."""
    array = ids.detach().cpu().numpy() if isinstance(ids, torch.Tensor) else ids
    return np.ascontiguousarray(array).view(np.uint64)


def owner_of(ids: torch.Tensor, num_ps: int) -> torch.Tensor:
    """The parameter server (0..num_ps-1) owning each id, as an int64 tensor."""
    if num_ps < 1:
        raise ValueError(f"num_ps is {num_ps}; it must be at least 1")
    if num_ps == 1:
        return torch.zeros(ids.shape, dtype=torch.int64)
    return torch.from_numpy(_owners(ids, num_ps).astype(np.int64))


def _owners(ids: torch.Tensor, num_ps: int) -> np.ndarray:
    """`owner_of` (num_ps >= 2) in the narrowest unsigned dtype that holds it."""
    narrow = np.uint8 if num_ps <= 1 << 8 else np.uint16 if num_ps <= 1 << 16 else np.uint64
    return (splitmix64(as_uint64(ids)) % np.uint64(num_ps)).astype(narrow)


def split_by_owner(ids: torch.Tensor, num_ps: int) -> list[torch.Tensor]:
    """For each server, the positions in `ids` of the ids it owns (in input order)."""
    if num_ps == 1:
        return [torch.arange(ids.numel())]
    owners = _owners(ids, num_ps)
    # A stable sort of 8- or 16-bit keys is numpy's radix sort: one pass (torch's
    # stable argsort of the int64 owners cost 2.5 times the whole split).
    order = torch.from_numpy(np.argsort(owners, kind="stable"))
    counts = np.bincount(owners, minlength=num_ps).tolist()
    return list(torch.split(order, counts))


def unique_inverse(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`torch.unique(ids, return_inverse=True)` of a 1-D int64 CPU tensor: the sorted
    distinct ids and where each of `ids` is among them. numpy's (vectorised quicksort
    of the argsort) takes about a third of torch's time, which sorts with a stable
    merge sort of (value, index) pairs; every step of a sparse layer runs one."""
    unique, inverse = np.unique(ids.numpy(), return_inverse=True)
    return torch.from_numpy(unique), torch.from_numpy(inverse.reshape(-1))


def in_sorted(ids: torch.Tensor, among: torch.Tensor) -> torch.Tensor:
    """Which of `ids` are in `among` (int64, sorted ascending): a binary search of
    each, not a pass over all of `among` per id (bool [n])."""
    if not among.numel():
        return torch.zeros(ids.shape, dtype=torch.bool)
    at = torch.searchsorted(among, ids).clamp_(max=among.numel() - 1)
    return among[at] == ids


def index_hash(keys: np.ndarray) -> np.ndarray:
    """A second, independent mix for a server's id->slot hash map (the owner rule's
    low bits are equal for every id one server holds)."""
    return splitmix64(keys ^ _INDEX_SALT)


def stream_of(seed: int, table: str) -> int:
    """A 64-bit stream number for the initial values of `table` under `seed`."""
    digest = hashlib.sha256(f"{seed}:{table}".encode()).digest()
    return int.from_bytes(digest[:8], "little")


def initial_rows(ids: torch.Tensor, dim: int, std: float,
                 stream: int | np.ndarray) -> torch.Tensor:
    """The initial float32 rows [len(ids), dim] of `ids`: N(0, std^2) elements that
    depend only on (stream, id, element). `stream` may also give each id its own (a
    uint64 array, one per id: the tables of a fused table)."""
    n = int(ids.numel())
    if n == 0 or dim == 0:
        return torch.zeros((n, dim), dtype=torch.float32)
    streams = stream if isinstance(stream, np.ndarray) else np.uint64(stream)
    base = splitmix64(as_uint64(ids.reshape(-1)) ^ streams)
    half = (dim + 1) // 2
    with np.errstate(over="ignore"):
        lanes = base[:, None] + np.arange(1, half + 1, dtype=np.uint64)[None, :] * _GOLDEN
    bits = splitmix64(lanes).view(np.int64)
    # Two 24-bit uniforms per 64-bit draw (exact in float32); u1 in (0, 1] keeps log
    # finite. The transcendental part runs in torch's vectorised float32 kernels.
    scale = 1.0 / float(1 << 24)
    u1 = torch.from_numpy(((bits >> 40) & 0xFFFFFF).astype(np.float32)).add_(1.0).mul_(scale)
    u2 = torch.from_numpy(((bits >> 8) & 0xFFFFFF).astype(np.float32)).mul_(scale)
    radius = u1.log_().mul_(-2.0).sqrt_().mul_(std)
    angle = u2.mul_(2.0 * math.pi)
    normals = torch.cat([torch.cos(angle).mul_(radius), torch.sin(angle).mul_(radius)], dim=1)
    return normals[:, :dim].contiguous() if dim % 2 else normals
