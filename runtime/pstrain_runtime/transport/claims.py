"""Which worker a call acts for, and whether its caller may act for it.

Who calls is the identity its credentials prove (`auth`), on gRPC and on the data
plane alike:

- `chief`: any call (the chief-only ones are `auth.may_call`'s), for any worker;
- `worker-<i>`, worker i's own key: worker calls, each for worker i only: a push's
  stream header (Push, PushPull, PushPullSmall, PushPullSparse), a Pull's, an Info's
  and a sparse push's `worker` must be i (PushPullSparse's riding sparse push too:
  `sparse.riding` asks `problem` for it);
- `worker`, the job's shared worker key (the parameter servers hold it to derive the
  workers' own keys; the operator reads status with it): status only, that is Info,
  GetJobStatus, RequestCheckpoint and sparse `stats`; it acts for no worker.

`problem` answers for one request from its first frame (or its decoded message), before
the store sees it; `bind_handler` puts that check in front of a gRPC handler, and the
data plane asks `problem` itself. A request too malformed to name a worker passes: the
store refuses it with the very parser used here.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from typing import Any

import grpc
from pstrain_api import security

from ..proto import ps_pb2 as pb
from ..ps.store import PSError
from ..sparse import protocol as sparse_protocol
from . import auth, wire

STREAM_HEADER_CALLS = frozenset({"Push", "PushPull", "PushPullSmall", "PushPullSparse"})
BATCHED_CALLS = frozenset({"PushPullSmall", "PushPullSparse"})  # the header in a batch
NAMED_WORKER_CALLS = STREAM_HEADER_CALLS | {"Pull", "Info", "Sparse"}
SHARED_KEY_CALLS = frozenset({"Info", "GetJobStatus", "RequestCheckpoint"})
SHARED_KEY_SPARSE_OPS = frozenset({"stats"})


def _sparse_header(first: Any) -> dict[str, Any]:
    try:
        header = sparse_protocol.header_of([first]) if first is not None else {}
    except PSError:
        return {}
    return header if isinstance(header, dict) else {}


def named_worker(call: str, first: Any) -> int | None:
    """The worker index a request names: `first` is its first frame (bytes), or the
    decoded message of a unary gRPC call. None when it names none or cannot be read."""
    if first is None:
        return None
    try:
        if call in ("Pull", "Info"):
            if isinstance(first, (bytes, bytearray, memoryview)):
                message = pb.PullRequest if call == "Pull" else pb.NamespaceRequest
                first = message.FromString(bytes(first))
            # Info of no namespace (how a client learns the data port) acts for nobody
            return None if call == "Info" and not first.namespace else int(first.worker)
        if call == "Sparse":
            header = _sparse_header(first)  # the service reads `worker` with `field`
            return (sparse_protocol.field(header, "worker", int, "push")
                    if header.get("op") == "push" else None)
        if call in STREAM_HEADER_CALLS:
            frame = wire.decode_batch(first)[0] if call in BATCHED_CALLS else first
            header = wire.decode_frame(frame)
            return int(header.worker) if isinstance(header, pb.StreamHeader) else None
    except Exception:  # noqa: BLE001 - protobuf's DecodeError, WireError, IndexError
        return None
    return None


def problem(identity: str | None, call: str, first: Any) -> str | None:
    """Why `identity` may not make `call` with this request (first frame or message),
    or None when it may. `identity` None: authentication is off."""
    if identity is None or identity == security.KEY_CHIEF:
        return None
    op = _sparse_header(first).get("op") if call == "Sparse" else None
    if call == "Sparse" and not isinstance(op, str):
        return None  # malformed: the sparse service refuses it
    what = f"sparse {op}" if call == "Sparse" else call
    if identity == security.KEY_WORKER:
        if call in SHARED_KEY_CALLS or op in SHARED_KEY_SPARSE_OPS or (
                f"Sparse.{op}" in auth.CHIEF_ONLY):  # refused as the chief's, later
            return None
        return (f"{what} needs a worker's own credentials; the job's shared worker key "
                "reads status only")
    own = security.own_worker_index(identity)
    if own is None:
        return f"{what}: the credentials name no known identity"
    if call not in NAMED_WORKER_CALLS:
        return None
    named = named_worker(call, first)
    if named is None or named == own:
        return None
    return f"{what}: these are worker {own}'s credentials; they cannot act for worker {named}"


def checked_frames(identity: str | None, call: str,
                   frames: Iterator[Any]) -> Iterator[Any]:
    """`frames` as they were, once the first one has passed `problem` (PSError
    PERMISSION_DENIED otherwise, with that frame read)."""
    if identity is None or identity == security.KEY_CHIEF:
        return frames
    first = next(frames, None)
    reason = problem(identity, call, first)
    if reason is not None:
        raise PSError("PERMISSION_DENIED", reason)
    return frames if first is None else itertools.chain((first,), frames)


def bind_handler(handler: grpc.RpcMethodHandler, identity: str,
                 call: str) -> grpc.RpcMethodHandler:
    """`handler` with `problem` checked before its behaviour runs: a refused request
    is answered PERMISSION_DENIED and never reaches the store."""
    if identity == security.KEY_CHIEF:
        return handler
    kinds = ("stream_stream", "stream_unary", "unary_stream", "unary_unary")
    kind = next(k for k in kinds if getattr(handler, k) is not None)
    behaviour: Callable[[Any, grpc.ServicerContext], Any] = getattr(handler, kind)

    if handler.request_streaming:
        def checked(requests: Iterator[Any], context: grpc.ServicerContext) -> Any:
            try:
                rest = checked_frames(identity, call, requests)
            except PSError as exc:
                context.abort(grpc.StatusCode.PERMISSION_DENIED, exc.message)
            return behaviour(rest, context)
    else:
        def checked(request: Any, context: grpc.ServicerContext) -> Any:
            reason = problem(identity, call, request)
            if reason is not None:
                context.abort(grpc.StatusCode.PERMISSION_DENIED, reason)
            return behaviour(request, context)

    return handler._replace(**{kind: checked})
