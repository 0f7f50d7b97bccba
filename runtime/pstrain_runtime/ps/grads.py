"""A push's gradients, before any step rule sees them: the header's tensors are checked
against the shard, the body is read into pooled scratch buffers, and NaN/inf refuses
the whole push. Nothing here changes parameters, optimizer state or the step.

Scratch buffers (`ScratchPool`, one per namespace) are reused across pushes so that a
steady state allocates nothing."""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..proto import ps_pb2 as pb
from ..transport import wire
from .errors import PSError, invalid
from .streams import read_body

if TYPE_CHECKING:
    from .namespace import Namespace

GRAD_DTYPES = frozenset({torch.float32, torch.bfloat16, torch.float16})


def is_all_finite(tensor: torch.Tensor) -> bool:
    """No NaN or inf in `tensor`. A finite sum proves it (NaN and inf propagate through
    a sum) at a fraction of the cost of `isfinite`, which only runs when the sum is not
    finite (NaN/inf present, or an overflow of large finite values)."""
    if math.isfinite(float(tensor.sum())):
        return True
    return bool(torch.isfinite(tensor).all())


def first_nonfinite(tensors: dict[str, torch.Tensor]) -> str | None:
    """The first of `tensors` (in order) holding NaN or inf, or None."""
    return next((key for key, tensor in tensors.items() if not is_all_finite(tensor)), None)


class RunningSum:
    """The sum of a tensor's elements, taken stretch by stretch as its bytes arrive
    (`wire.StreamReader.on_data`) while they are still in cache, so that the NaN/inf
    check of a large push costs no extra pass over memory."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.flat = tensor.reshape(-1)
        self.itemsize = tensor.element_size()
        self.summed = 0  # elements summed so far
        self.total = 0.0

    def __call__(self, start: int, end: int) -> None:
        upto = end // self.itemsize
        if upto > self.summed:
            self.total += float(self.flat[self.summed:upto].sum())
            self.summed = upto

    def all_finite(self) -> bool:
        """True proves every element finite; False (NaN/inf, or an overflow of large
        finite values) calls for the precise check."""
        return self.summed == self.flat.numel() and math.isfinite(self.total)


@dataclass(frozen=True)
class FlatGrads:
    """Gradients of several parameters as views of one 1-D buffer, in push order: the
    push is read into one target and checked for NaN/inf with one sum. Pooled whole
    (buffer and views) and used for async pushes only: a sync bucket adopts gradient
    tensors, which must not be views of a buffer that is reused."""

    keys: tuple[str, ...]
    flat: torch.Tensor
    views: dict[str, torch.Tensor]

    @classmethod
    def build(cls, keys: tuple[str, ...], shapes: list[tuple[int, ...]],
              dtype: torch.dtype) -> FlatGrads:
        sizes = [math.prod(shape) for shape in shapes]
        flat = torch.empty(sum(sizes), dtype=dtype)
        views = {key: part.view(shape) for key, part, shape
                 in zip(keys, flat.split(sizes), shapes, strict=True)}
        return cls(keys, flat, views)


class ScratchPool:
    """Free gradient buffers of one namespace, by parameter and dtype."""

    def __init__(self) -> None:
        self._single: dict[tuple[str, torch.dtype], list[torch.Tensor]] = {}
        self._flat: dict[tuple[tuple[str, ...], torch.dtype], list[FlatGrads]] = {}
        self._lock = threading.Lock()

    def take(self, key: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        with self._lock:
            free = self._single.get((key, dtype))
            if free:
                return free.pop()
        return torch.empty(shape, dtype=dtype)

    def give(self, key: str, tensor: torch.Tensor) -> None:
        with self._lock:
            self._single.setdefault((key, tensor.dtype), []).append(tensor)

    def take_flat(self, keys: tuple[str, ...], shapes: list[tuple[int, ...]],
                  dtype: torch.dtype) -> FlatGrads:
        """Scratch gradients for `keys`, all of `dtype`, end to end in one buffer."""
        with self._lock:
            free = self._flat.get((keys, dtype))
            if free:
                return free.pop()
        return FlatGrads.build(keys, shapes, dtype)

    def give_flat(self, grads: FlatGrads) -> None:
        with self._lock:
            self._flat.setdefault((grads.keys, grads.flat.dtype), []).append(grads)

    def clear(self) -> None:
        with self._lock:
            self._single.clear()
            self._flat.clear()


def take(ns: Namespace, key: str, dtype: torch.dtype) -> torch.Tensor:
    """A scratch buffer shaped like parameter `key`."""
    return ns.scratch.take(key, ns.shapes[key], dtype)


def check_metas(ns: Namespace, header: pb.StreamHeader,
                ps_index: int) -> dict[str, torch.dtype]:
    """The dtype of each pushed gradient, in push order, once every one is known to
    belong to the shard with the parameter's shape and a floating dtype."""
    checked: dict[str, torch.dtype] = {}
    for meta in header.tensors:
        key = meta.name
        if key not in ns.params:
            raise PSError("NOT_FOUND",
                          f"push: tensor {key!r} is not on parameter server "
                          f"{ps_index} in namespace {ns.name!r}")
        if key in checked:
            raise invalid(f"push: tensor {key!r} appears twice")
        try:
            dtype = wire.parse_dtype(meta.dtype)
        except wire.WireError as exc:
            raise invalid(f"push: gradient {key!r}: {exc}") from exc
        if dtype not in GRAD_DTYPES:
            raise invalid(f"push: gradient {key!r} has dtype {meta.dtype}; "
                          "gradients must be float32, bfloat16 or float16")
        if tuple(meta.shape) != ns.shapes[key]:
            raise invalid(f"push: gradient {key!r} has shape {list(meta.shape)}, "
                          f"the parameter has {list(ns.shapes[key])}")
        checked[key] = dtype
    return checked


@contextmanager
def received(ns: Namespace, header: pb.StreamHeader, messages: Iterator[bytes], mode: str,
             ps_index: int) -> Iterator[dict[str, torch.Tensor]]:
    """The push's gradients by parameter, read and free of NaN/inf, in scratch buffers
    that go back to the pool on exit. A step rule that keeps a gradient (a sync bucket
    adopting it) deletes it from the dict, so it is not given back."""
    checked = check_metas(ns, header, ps_index)
    flat: FlatGrads | None = None
    grads: dict[str, torch.Tensor] = {}
    try:
        dtypes = set(checked.values())
        if mode == "async" and len(checked) > 1 and len(dtypes) == 1:
            keys = tuple(checked)
            flat = ns.scratch.take_flat(keys, [ns.shapes[key] for key in keys], dtypes.pop())
            grads = dict(flat.views)
            targets = [wire.byte_view(flat.flat)]
        else:
            grads = {key: take(ns, key, dtype) for key, dtype in checked.items()}
            targets = [wire.byte_view(grad) for grad in grads.values()]
        # One tensor receives the whole push (the flat buffer, or a lone gradient):
        # sum it as it arrives.
        whole = flat.flat if flat is not None else (
            next(iter(grads.values())) if len(grads) == 1 else None)
        running = RunningSum(whole) if whole is not None else None
        read_body(header, messages, targets, running)
        if running is not None:
            bad = None if running.all_finite() else first_nonfinite(grads)
        else:
            bad = first_nonfinite(grads)
        if bad is not None:
            with ns.cond:
                ns.skipped_nonfinite += 1
                count = ns.skipped_nonfinite
            raise invalid(
                f"push: gradient {bad!r} contains NaN or inf; the push from worker "
                f"{header.worker} was rejected and not applied ({count} rejected so far)"
            )
        yield grads
    finally:
        if flat is not None:
            ns.scratch.give_flat(flat)
        else:
            for key, tensor in grads.items():
                ns.scratch.give(key, tensor)
