"""A step's sparse push riding on its dense push_pull (async mode): one call per server
per step instead of two (`SparseSession.riders`, `ShardedClient.push_pull`).

The call (data plane op `PushPullSparse`; the in-process transport too; gRPC has none,
so a worker over gRPC makes the two calls, with the same rule):

    request: the dense PushPullSmall message (one frame: `wire.encode_batch` of the
             push's stream), then the sparse push's frames (`protocol`: its JSON
             header, then ids and gradient rows per table)
    reply:   the dense reply message (the PULL stream, as PushPullSmall answers), then
             the sparse push's reply frames; or, when the server refused the sparse
             push, one JSON frame {"error": {"code", "message"}}: the dense part stands
             (the worker reads its parameters first, then raises the refusal)

The rule is the one of a sparse push made after the push_pull: the server applies the
sparse rows only when it applied the dense push (after the dense push's wait for the
staleness bound), else answers {"applied": false}. It is decided per server: a server
that applied its dense shard applies its rows, whatever the other servers answered.
Who may push is checked for both parts: the sparse header must name the worker the
dense header names (`claims`). The sparse push is read and checked (`service.check_push`,
with the caller's role) before the dense push is applied, so a malformed one (bad ids,
non-finite rows, an unknown table) is refused with nothing applied; what can only be
refused when the rows are applied (another generation, a worker removed meanwhile) is
answered after the dense part.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from ..proto import ps_pb2 as pb
from ..ps.store import ParameterStore, PSError
from ..ps.waits import Gone
from ..transport import claims
from . import service
from .protocol import Frame, header_of

CALL = "PushPullSparse"


def serve(store: ParameterStore, frames: Sequence[Frame], role: str | None = None,
          gone: Gone | None = None) -> list[bytes | memoryview]:
    """Answer one riding call (see the module doc) from a caller holding `role`'s key
    (None: no authentication). PSError for a refused dense push or a malformed call;
    the sparse push is read and checked before the dense push is applied, so a bad one
    changes nothing."""
    if len(frames) < 2:
        raise PSError("INVALID_ARGUMENT", f"{CALL}: the request holds {len(frames)} frames; "
                      "it needs the dense message and the sparse push's header")
    rider = list(frames[1:])
    reason = claims.problem(role, "Sparse", rider[0])
    if reason is not None:
        raise PSError("PERMISSION_DENIED", reason)
    push = service.check_push(store, rider, role)
    answer: list[bytes | memoryview] = []

    def after_push(reply: pb.PushReply) -> None:
        if not reply.applied:
            answer.append(_json({"applied": False, "note": "the dense push was not applied"
                                 + (f": {reply.note}" if reply.note else ""),
                                 "global_step": int(reply.info.global_step)}))
            return
        try:
            answer.extend(service.apply_push(store, push))
        except PSError as exc:  # e.g. another generation (ABORTED): the dense part stands
            answer.append(_json({"error": {"code": exc.code, "message": exc.message}}))

    dense = store.push_pull_small(bytes(frames[0]), gone=gone, after_push=after_push)
    return [dense, *answer]


def _json(value: dict[str, Any]) -> bytes:
    return json.dumps(value, separators=(",", ":")).encode()


def split_reply(frames: Sequence[Frame], address: str) -> tuple[Frame, list[Frame]]:
    """A riding call's reply: (the dense reply message, the sparse reply's frames)."""
    if len(frames) < 2:
        raise PSError("INTERNAL", f"{address}: {CALL} answered {len(frames)} frames; "
                      "expected the dense reply and the sparse one")
    return frames[0], list(frames[1:])


def reply_of(frames: Sequence[Frame]) -> dict[str, Any]:
    """The sparse push's reply header; the server's refusal raised as PSError."""
    header = header_of(frames)
    error = header.get("error")
    if isinstance(error, dict):
        raise PSError(str(error.get("code", "INTERNAL")), str(error.get("message", "")))
    return header
