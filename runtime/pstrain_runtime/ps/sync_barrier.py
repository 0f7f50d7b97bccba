"""The sync barrier: sync mode's step rule.

Each worker adds one gradient per step into the bucket of its step; a bucket is applied
(the mean of its gradients) when every worker the step waits for has contributed, in
step order, and a push returns once its step is applied. `staleness_bound` N lets a
worker push up to N steps ahead of the applied step. A newcomer is waited for from its
first push on (`membership.join`); a removed worker by no step after its removal.
Every wait ends (`waits`): a contribution whose step does not complete in time stays in
its bucket, and the worker's next push of that step is an ignored duplicate.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from ..proto import ps_pb2 as pb
from . import membership, shard
from .errors import invalid
from .grads import take
from .waits import Gone, Wait

if TYPE_CHECKING:
    from .namespace import Namespace


@dataclass
class Bucket:
    sums: dict[str, torch.Tensor] = field(default_factory=dict)
    contributors: set[int] = field(default_factory=set)


def add(ns: Namespace, bucket: Bucket, step: int, worker: int,
        grads: dict[str, torch.Tensor]) -> None:
    """Add `worker`'s gradients of `step` into its bucket (ns.cond held). A float32
    gradient that opens a sum becomes the sum (no copy): it is deleted from `grads`, so
    its buffer is owned by the bucket, and pooled again once the step is applied."""
    missing = set(ns.params) - set(grads)
    if missing:
        raise invalid(f"push: sync step {step} lacks gradients for "
                      f"{sorted(missing)[:3]}; send every tensor of the shard")
    adopted = []
    for key, grad in grads.items():
        acc = bucket.sums.get(key)
        if acc is not None:
            acc.add_(grad)
        elif grad.dtype == torch.float32:
            bucket.sums[key] = grad
            adopted.append(key)
        else:
            bucket.sums[key] = take(ns, key, torch.float32)
            bucket.sums[key].copy_(grad)
    for key in adopted:
        del grads[key]
    bucket.contributors.add(worker)
    membership.join(ns, worker, step)


def push(ns: Namespace, header: pb.StreamHeader, grads: dict[str, torch.Tensor],
         wait: Wait, timeout: float | None, gone: Gone | None) -> pb.PushReply:
    """A sync push: wait until its step is within the bound, add it, apply what is
    complete, then wait (bounded) until its step is applied."""
    worker, step = header.worker, header.step
    bound = ns.staleness or 0
    with ns.cond:
        if step < ns.global_step:
            return ns.not_applied(worker, f"step {step} was already applied; the global "
                                  f"step is {ns.global_step}")
        if ns.target_steps and step >= ns.target_steps:
            return ns.at_target(worker)
        if not wait(ns, lambda: step <= ns.global_step + bound, timeout, gone):
            return ns.not_applied(worker, f"step {step} is more than {bound} ahead")
        if worker not in ns.members:
            return membership.removed(ns, worker)
        bucket = ns.buckets.setdefault(step, Bucket())
        duplicate = worker in bucket.contributors
        if not duplicate:
            add(ns, bucket, step, worker, grads)
        spent = apply_ready_buckets(ns)
        complete = wait(ns, lambda: ns.global_step >= step + 1 - bound, timeout, gone)
        note = "duplicate contribution ignored" if duplicate else ""
        if not complete and not ns.done:
            # The contribution stays in its bucket; the worker pulls again and, if
            # the step is still open, pushes it again (a duplicate, ignored).
            note = (f"step {step} was not complete within the wait; the contribution "
                    "is kept")
        return pb.PushReply(info=ns.info(worker), applied=not duplicate, note=note,
                            apply_seconds=spent)


def apply_ready_buckets(ns: Namespace) -> float:
    """Apply every complete bucket in step order (ns.cond held); the seconds spent
    applying."""
    started = time.perf_counter()
    while True:
        bucket = ns.buckets.get(ns.global_step)
        if bucket is None or not ns.members.is_complete(ns.global_step,
                                                        bucket.contributors):
            return time.perf_counter() - started
        del ns.buckets[ns.global_step]
        totals = list(bucket.sums.values())
        if totals:
            torch._foreach_div_(totals, len(bucket.contributors))
        shard.apply(ns, bucket.sums)  # every sum is float32: applied as it is
        if ns.sparse is not None:  # the step's sparse rows, pushed before its bucket
            ns.sparse.apply_step(ns, ns.global_step, len(bucket.contributors))
        for key, total in bucket.sums.items():
            ns.scratch.give(key, total)
        ns.global_step += 1
        ns.keep_snapshot()
        ns.cond.notify_all()
