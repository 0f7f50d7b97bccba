"""Async mode's step rule: each push is applied as it arrives, one at a time under the
namespace's lock (no lock spans servers), and counts as one global step.

The staleness bound N lets a worker run at most N pushes ahead of the slowest live
worker: a push past it waits (bounded, `waits`) for the others. Removed workers are not
waited for, and a removed worker's own wait ends at once (its push is then dropped
whole, `membership.removed`). Pushes stop at the target step.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from ..proto import ps_pb2 as pb
from . import membership, shard
from .waits import Gone, Wait

if TYPE_CHECKING:
    from .namespace import Namespace


def within_bound(ns: Namespace, worker: int) -> bool:
    """`worker` is at most `ns.staleness` pushes ahead of the slowest live worker (a
    removed worker goes on: its push is dropped after the wait)."""
    if worker not in ns.members:
        return True
    mine = ns.worker_pushes.get(worker, 0)
    slowest = min(ns.worker_pushes.get(w, 0) for w in ns.members.live)
    return mine - slowest <= ns.staleness  # type: ignore[operator]


def push(ns: Namespace, header: pb.StreamHeader, grads: dict[str, torch.Tensor],
         wait: Wait, timeout: float | None, gone: Gone | None) -> pb.PushReply:
    worker = header.worker
    with ns.cond:
        # The target is checked before the staleness wait too: a worker that stopped
        # at the target never pushes again, so waiting for it would not end.
        if ns.target_steps and ns.global_step >= ns.target_steps:
            return ns.at_target(worker)
        if ns.staleness is not None:
            if not wait(ns, lambda: within_bound(ns, worker), timeout, gone):
                return ns.not_applied(worker, "not applied: the job is done or the wait "
                                      "for slower workers timed out")
        if ns.target_steps and ns.global_step >= ns.target_steps:
            return ns.at_target(worker)
        if worker not in ns.members:
            return membership.removed(ns, worker)
        started = time.perf_counter()
        shard.apply(ns, grads)
        spent = time.perf_counter() - started
        ns.global_step += 1
        ns.worker_pushes[worker] = ns.worker_pushes.get(worker, 0) + 1
        ns.positions[worker] = header.step + 1  # async: the step is the batch's index
        ns.keep_snapshot()
        ns.cond.notify_all()
        return pb.PushReply(info=ns.info(worker), applied=True, apply_seconds=spent)
