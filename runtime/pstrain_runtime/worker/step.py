"""One step's compute and push: forward and backward on a batch, then the gradients to
every shard (concurrently). In sync mode that is a push (the step completes when every
worker's gradients are in); in async mode a push_pull, one round trip per server that
also reads the parameters back for the next step. With `overlap` (several servers), a
shard's push starts during backward as soon as all of its gradients are complete; with
pipelining (`pipeline`), the push runs while the next step computes.

A sparse model's rows go beside the dense gradients: in sync mode before the dense push
completes the step, in async mode in the same call as the dense push_pull where they
can (`sparse.riding`: a server applies them once it applied the dense push, which
waited for the staleness bound), else after it, once every server applied the dense
push.
"""

from __future__ import annotations

import concurrent.futures as cf

import torch

from ..proto import ps_pb2 as pb
from .context import WorkerContext
from .pipeline import Pipeline
from .sparse_binding import SparseBinding

Replies = list[pb.PushReply]


class Step:
    def __init__(self, ctx: WorkerContext, tables: SparseBinding, *, overlap: bool,
                 pipeline: bool) -> None:
        self.ctx = ctx
        self.tables = tables
        self.overlap = overlap
        self.pipeline = Pipeline(ctx) if pipeline else None

    def backward_and_push(self, batch: tuple[torch.Tensor, torch.Tensor],
                          steps: list[int]) -> tuple[float, Replies | None]:
        """The step's loss and the push's replies (None: a pipeline's first step, whose
        push is in flight). A refused or failed push raises PSError."""
        ctx, local = self.ctx, self.ctx.local
        x, y = (t.to(ctx.device, non_blocking=True) for t in batch)
        if self.pipeline is not None:
            grads = self.pipeline.grads()  # before zeroing: the last ones may be in flight
        local.zero_grads()
        self.tables.begin_step()
        loss = ctx.task.loss(ctx.model(x), y)
        if self.pipeline is not None:
            return self.pipeline.backward_and_push(loss, grads, steps)
        if not self.overlap or ctx.placement.num_ps == 1:
            loss.backward()
            replies = self._push(steps)
            return float(loss.detach()), replies
        return self._overlapped(loss, steps)

    def _push(self, steps: list[int]) -> Replies:
        ctx, local = self.ctx, self.ctx.local
        grads = {n: local.grad_cpu(n) for n in local.params}
        if ctx.training.mode == "sync":
            self.tables.push(ctx.role.worker, steps)  # before the dense push ends the step
            return ctx.client.push(grads, ctx.role.worker, steps)
        # async: one round trip per server: push, and read the parameters back into
        # the mirror for the next step (backward is over, nothing reads them now). The
        # sparse rows ride on it (`sparse.riding`: a server applies them only when it
        # applied the dense push, which waited for the staleness bound).
        riders = self.tables.riders(ctx.role.worker, steps)
        replies = ctx.client.push_pull(grads, local.mirror, ctx.role.worker, steps,
                                       riders=riders)
        local.fresh = True
        if riders is not None:
            self.tables.rode(ctx.client.rider_replies)
        elif self.tables.bound and all(r.applied for r in replies):
            # after the dense push: it waited for the staleness bound
            self.tables.push(ctx.role.worker, steps)
        return replies

    def _overlapped(self, loss: torch.Tensor, steps: list[int]) -> tuple[float, Replies]:
        """Push a shard as soon as backward has produced all its gradients."""
        ctx, local, client = self.ctx, self.ctx.local, self.ctx.client
        waiting = {ps: {p.param for p in client.shards[ps]}
                   for ps in range(ctx.placement.num_ps)}
        grads: dict[str, torch.Tensor] = {}
        futures: dict[int, cf.Future[pb.PushReply]] = {}

        def ready(name: str) -> None:
            grads[name] = local.grad_cpu(name)
            for ps, names in waiting.items():
                names.discard(name)
                if not names and ps not in futures:
                    futures[ps] = client.pool.submit(
                        client.push_one, ps, grads, ctx.role.worker, steps[ps])

        handles = [p.register_post_accumulate_grad_hook(lambda _p, n=n: ready(n))
                   for n, p in local.params.items()]
        try:
            loss.backward()
        finally:
            for h in handles:
                h.remove()
        for name in local.params:
            if name not in grads:
                ready(name)
        replies = [futures[ps].result() for ps in range(ctx.placement.num_ps)]
        return float(loss.detach()), replies

    def drain(self) -> None:
        """Forget a pipelined push in flight (see `Pipeline.drain`)."""
        if self.pipeline is not None:
            self.pipeline.drain()

    def close(self) -> None:
        """Stop the pipeline's thread (after `drain`)."""
        if self.pipeline is not None:
            self.pipeline.close()
