"""Pipelining (async mode only): step k's push_pull runs in the background while step
k+1 computes, and writes the parameters it pulls into a receive buffer that becomes the
model's when it lands. Gradients are computed on parameters one push older than
without pipelining: async training tolerates that staleness.

Two send buffers alternate, since the other one may be in flight; on CPU they are the
parameters' `.grad`, so backward writes them directly, and landing swaps the receive
buffer with the mirror (no copy).
"""

from __future__ import annotations

import concurrent.futures as cf

import torch
from pstrain_api.model import Training

from ..proto import ps_pb2 as pb
from ..ps.store import PSError
from .context import WorkerContext


def may_pipeline(training: Training, asked: bool | None, *, overlap: bool, num_ps: int,
                 sparse: bool) -> bool:
    """Whether a trainer pipelines: asked for (`asked`, else `training.pipeline`), in
    async mode, and neither with overlapped pushes over several servers nor with sparse
    tables (a step's rows must reach the servers before its dense push)."""
    want = training.pipeline if asked is None else asked
    return bool(want) and training.mode == "async" and not (
        overlap and num_ps > 1) and not sparse


class Pipeline:
    def __init__(self, ctx: WorkerContext) -> None:
        self.ctx = ctx
        self._inflight: cf.Future[list[pb.PushReply]] | None = None
        self._recv: dict[str, torch.Tensor] = {}
        self._send: list[dict[str, torch.Tensor]] = []
        self._send_slot = 0
        self._pipe: cf.ThreadPoolExecutor | None = None

    def _buffers(self) -> None:
        """The receive and send buffers and the background thread, made on first use."""
        if self._pipe is not None:
            return
        pinned = self.ctx.device.type != "cpu"
        mirror = self.ctx.local.mirror
        def like() -> dict[str, torch.Tensor]:
            return {n: torch.zeros(t.shape, dtype=t.dtype, pin_memory=pinned)
                    for n, t in mirror.items()}
        self._recv = like()
        self._send = [like(), like()]
        self._pipe = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="pipeline")

    def grads(self) -> dict[str, torch.Tensor]:
        """This step's gradient buffers (two alternate: the other one may be in flight);
        on CPU they become the parameters' .grad, so backward writes them directly.
        Taken before the gradients are zeroed: the last ones may be in flight."""
        self._buffers()
        grads = self._send[self._send_slot]
        self._send_slot ^= 1
        if self.ctx.device.type == "cpu":
            for name, p in self.ctx.local.params.items():
                p.grad = grads[name]
        return grads

    def backward_and_push(self, loss: torch.Tensor, grads: dict[str, torch.Tensor],
                          steps: list[int]) -> tuple[float, list[pb.PushReply] | None]:
        """Backward into this step's gradient buffers, then land the previous step's
        push_pull (its parameters become the model's) and start this step's in the
        background. Returns the previous push's replies (None on a pipeline's first
        step)."""
        device = self.ctx.device
        loss.backward()
        if device.type != "cpu":
            for name, p in self.ctx.local.params.items():
                grads[name].copy_(p.grad if p.grad is not None else torch.zeros_like(p))
            torch.cuda.synchronize(device)
        value = float(loss.detach())
        replies = self.land()
        self._inflight = self._pipe.submit(  # type: ignore[union-attr] - made with the grads
            self.ctx.client.push_pull, grads, self._recv, self.ctx.role.worker, steps)
        return value, replies

    def land(self) -> list[pb.PushReply] | None:
        """Wait for the push_pull in flight; make the parameters it brought the model's
        (swap buffers, no copy on CPU). Its PSError is raised here."""
        future, self._inflight = self._inflight, None
        if future is None:
            return None
        replies = future.result()
        local = self.ctx.local
        self._recv, local.mirror = local.mirror, self._recv
        if self.ctx.device.type == "cpu":
            for name, p in local.params.items():
                p.data = local.mirror[name]
        local.fresh = True
        return replies

    def drain(self) -> None:
        """Let the push_pull in flight end and forget it (before a pull, a recovery or
        the end of the loop); its failure does not matter any more."""
        future, self._inflight = self._inflight, None
        if future is not None:
            try:
                future.result()
            except PSError:
                pass

    def close(self) -> None:
        if self._pipe is not None:
            self._pipe.shutdown(wait=False, cancel_futures=True)
