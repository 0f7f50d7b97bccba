"""Pulls: the dense shard streamed back to a worker (its parameters, or for a
checkpoint also their optimizer slots, slot steps and data positions), read under the
namespace's lock. A pull that asks for slots at a step whose snapshot is kept
(`Namespace.keep_snapshot`) gets that snapshot; a consistent or slot pull of the live
shard gets a copy, so that later steps cannot tear it while it is being sent."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

from ..proto import ps_pb2 as pb
from ..transport import wire
from .errors import PSError
from .shard import SLOT_SEPARATOR
from .waits import Gone, Wait

if TYPE_CHECKING:
    from .namespace import Namespace


def check_pull_names(ns: Namespace, request: pb.PullRequest, ps_index: int) -> list[str]:
    names = list(request.names) or sorted(ns.params)
    for name in names:
        if name not in ns.params:
            raise PSError("NOT_FOUND",
                          f"pull: tensor {name!r} is not on parameter server "
                          f"{ps_index} in namespace {ns.name!r}")
    return names


def pull_frames(ns: Namespace, request: pb.PullRequest, ps_index: int, wait: Wait,
                timeout: float | None, chunk_bytes: int,
                push_reply: pb.PushReply | None, gone: Gone | None) -> Iterator[bytes]:
    """Validate now (raises PSError), then return the frame iterator of the shard, or
    of the snapshot kept at `request.at_step` when slots are asked for and it is kept."""
    names = check_pull_names(ns, request, ps_index)
    with ns.cond:
        if request.min_step > ns.global_step:
            wait(ns, lambda: ns.global_step >= request.min_step, timeout, gone)
        snap = ns.snapshot
        if not (request.include_slots and request.at_step and snap is not None
                and snap.step == request.at_step):
            snap = None  # the live shard
        params, states = (snap.params, snap.states) if snap else (ns.params, ns.states)
        header = pb.StreamHeader(kind=pb.STREAM_KIND_PULL, namespace=ns.name,
                                 global_step=snap.step if snap else ns.global_step,
                                 ps_index=ps_index, fingerprint=ns.fingerprint,
                                 optimizer=ns.optimizer_pb, mode=ns.mode,
                                 num_workers=ns.num_workers, generation=ns.generation)
        tensors: list[torch.Tensor] = []
        for name in names:
            tensors.append(params[name])
            header.tensors.append(ns.metas[name])
            if request.include_slots:
                header.slot_steps.append(states[name].step)
                for slot, value in sorted(states[name].slots.items()):
                    tensors.append(value)
                    header.tensors.append(
                        wire.meta_of(f"{name}{SLOT_SEPARATOR}{slot}", value))
        if request.include_slots:
            header.positions.extend(snap.positions if snap else (
                ns.position_of(w) for w in range(ns.num_workers)))
        if (request.consistent or request.include_slots) and snap is None:
            tensors = [t.clone() for t in tensors]  # a snapshot is never written again
        info = ns.info(request.worker)
    header.step = info.global_step
    if push_reply is not None:
        header.push_reply.CopyFrom(push_reply)
    return wire.StreamWriter(chunk_bytes).frames(header, tensors)
