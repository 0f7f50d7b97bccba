"""The sparse calls on the wire: one request, one reply, each a list of frames.

Frame 0 is a small JSON header (the op and its arguments); the frames after it are
raw little-endian tensor bytes (ids as int64, rows as float32, versions as int32),
never pickled. The same frames go over the TCP data plane (op `OP_SPARSE`), gRPC
(method `Sparse`) and the in-process transport.

A push's `generation` is the one named by its server's reply to the worker's last
pull (0 or absent: unknown, not checked), so that a server initialised since refuses
it (ABORTED), as it refuses a dense push of another generation.

A row's version is the number of updates applied to it since the server created,
loaded or upserted it (`table.RowTable`; 0 for an id without a row, and for a row in
a disk tier). A pull or push with `versions: true` gets them back (a worker's row
cache bounds with them the updates its copies miss, `cache.RowCache`); without it (or
false) the frames are as they always were.

    pull:      {op, namespace, tables: [{name, count}], versions?}  + ids per table
       reply:  {global_step, generation}                  + rows per table
               (versions: + then the rows' versions, int32, per table; read before
               the rows, so a version never counts an update its row lacks)
    push:      {op, namespace, worker, step, part, generation, tables: [{name, count}],
                versions?}                                + (ids, grad rows) per table
       reply:  {applied, note, global_step}
               (versions: also `generation`, + the pushed ids' versions after the
               update, int32, one frame per table in the order of the ids pushed;
               the versions as they stand when the push was not applied or is queued
               for its step, sync mode)
    configure: {op, namespace, reset, num_ps, tables: [TableSpec json]}
    export:    {op, namespace, table, start, limit, since?}  (rows updated at >= since)
       reply:  {next, count}                              + ids, rows, slots..., last
    export:    {op, namespace, table, what: "mark", since}   (a checkpoint export starts)
       reply:  {watermark, generation, complete, rows}
    export:    {op, namespace, table, what: "removed", since, start, limit}
       reply:  {next, count}                              + ids dropped at >= since
    import:    {op, namespace, table, count, mode?}       + ids, rows, slots..., last
               (mode insert, the default, or upsert; mode remove: + ids only)
    stats:     {op, namespace}  reply: {tables: {name: {rows, bytes}}}
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from ..ps.store import PSError

# A frame received: bytes, a view, or (the data plane's sparse calls) a uint8 array of
# its own, which `tensor_of` reads without a copy.
Frame = bytes | bytearray | memoryview | np.ndarray
Encoded = list[bytes | memoryview]  # the frames `encode` gives
_NUMPY = {torch.int64: np.int64, torch.int32: np.int32, torch.float32: np.float32}


def encode(header: dict[str, Any], tensors: Sequence[torch.Tensor] = ()) -> Encoded:
    """The frames of a call: the header's JSON, then each tensor's bytes as a view of
    its memory, not a copy (the views keep the tensors alive): the tensors must not
    change until the frames are sent."""
    frames: Encoded = [json.dumps(header, separators=(",", ":")).encode()]
    frames.extend(memoryview(t.detach().contiguous().reshape(-1).numpy()).cast("B")
                  for t in tensors)
    return frames


def header_of(frames: Sequence[Frame]) -> dict[str, Any]:
    if not frames:
        raise PSError("INVALID_ARGUMENT", "sparse call: the request holds no frame")
    try:
        header = json.loads(bytes(frames[0]))
    except ValueError as exc:
        raise PSError("INVALID_ARGUMENT", f"sparse call: the header is not JSON: {exc}") from exc
    if not isinstance(header, dict):
        raise PSError("INVALID_ARGUMENT", "sparse call: the header must be a JSON object")
    return header


def tensor_of(frame: Frame, dtype: torch.dtype, width: int, what: str) -> torch.Tensor:
    """A frame's bytes as a tensor of `dtype`, [n] (width 0) or [n, width]."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    size = len(frame)
    row = itemsize * max(width, 1)
    if size % row:
        shape = "values" if width == 0 else f"rows of {width} values"
        raise PSError("INVALID_ARGUMENT", f"sparse call: {what} has {size} bytes, not a "
                      f"whole number of {shape}")
    if isinstance(frame, np.ndarray):  # received into a buffer of its own: no copy
        array = frame.view(_NUMPY[dtype])
    else:  # a copy: `frame` may be read-only or a view of a buffer used again
        array = np.frombuffer(bytearray(frame), dtype=_NUMPY[dtype])
    tensor = torch.from_numpy(array)
    return tensor.reshape(-1, width) if width else tensor


def field(header: dict[str, Any], name: str, kind: type, call: str) -> Any:
    value = header.get(name)
    if not isinstance(value, kind) or isinstance(value, bool) and kind is int:
        raise PSError("INVALID_ARGUMENT", f"sparse {call}: field {name!r} is {value!r}; it "
                      f"must be a {kind.__name__}")
    return value
