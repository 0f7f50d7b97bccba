"""The worker's step loop: pull all shards (concurrently) into the model, run forward and
backward on its own batch, push every shard's gradients (`step`), until every server's
step reaches `training.steps` (they differ after a server restarted without a
checkpoint), or a server says the job is done. The chief's duties run after each step
it pushed (`chief.duties`).

A refused or failed call (`handle`): a gradient with NaN/inf ends training
(`TrainingDiverged`); a busy server is retried after a short backoff; a push computed
on a server's previous state (ABORTED) is dropped and the step is recomputed on freshly
pulled parameters; a server that is unreachable or lost its state is recovered by the
chief (`chief.restore`) and waited for by the other workers (`membership`), as is a
worker's absence from the worker set. A server that is unreachable is retried with
backoff for `connect_timeout` seconds first (`WorkerContext.retry`). A refusal of this
job's credentials is fatal for a worker; the chief recovers from it as from a server
that is unreachable (a replaced server's name may lead elsewhere for a moment), for
`connect_timeout` seconds without an applied step at most (`RefusalBound`).
"""

from __future__ import annotations

import time

from ..ps.store import PSError
from .chief.duties import ChiefDuties
from .client import AUTH_REFUSED_CODES, RefusalBound
from .context import TrainingDiverged, TrainResult, WorkerContext
from .data import DataCursor
from .membership import Membership, admitted, not_a_member
from .step import Step

BUSY_BACKOFF_S = 0.2  # before retrying a call a busy server refused


class StepLoop:
    def __init__(self, ctx: WorkerContext, step: Step, data: DataCursor,
                 membership: Membership, chief: ChiefDuties | None) -> None:
        self.ctx = ctx
        self.step = step
        self.data = data
        self.membership = membership
        self.chief = chief  # None: this worker is not the chief
        self.steps: list[int] | None = None  # each server's step this worker pushes for
        self.refusals = RefusalBound(ctx.connect_timeout, ctx.clock)

    def run(self, result: TrainResult) -> bool:
        """Train until every server reaches the target; True when a server said the job
        is done (finished by the chief) before this worker saw the target."""
        ctx, local = self.ctx, self.ctx.local
        local.fresh = False
        while True:
            gstep = self._pull()
            if gstep is None:
                continue
            ctx.last_step = max(ctx.last_step, gstep) if self.chief is not None else gstep
            if min(ctx.client.last_pull_steps) >= ctx.training.steps:
                return False
            steps = self._steps_to_push()
            local.copy_in()
            batch = self.data.next_batch()
            try:
                loss, replies = self.step.backward_and_push(batch, steps)
            except PSError as exc:
                self._recover_from(exc)
                continue
            self._count(result, len(batch[1]), loss)
            if replies is None:  # pipelining's first step: its push is in flight
                local.fresh = True
                continue
            self.refusals.reset()  # the servers answered a push: they accept the keys
            gstep = ctx.last_step = replies[0].info.global_step
            if any(r.info.done for r in replies):
                return True
            if self.chief is None and not_a_member(replies):
                # Elastic workers: removed by a scale-down (the push was dropped
                # whole), or a server re-initialised with an older set: wait.
                local.fresh = False
                self.step.drain()
                self.membership.wait_initialised()
                continue
            # Every server must reach the target: one that lags (restarted without
            # a checkpoint) still needs this worker's gradients for its last steps.
            reached = min(r.info.global_step for r in replies) >= ctx.training.steps
            if self.chief is not None:
                failed = self.chief.after_step(gstep, replies, result)
                if failed is not None:  # a server failed under the checkpoint: recover
                    self._recover_from(failed)
                    continue
            if reached:
                return False

    def _pull(self) -> int | None:
        """Server 0's global step after the parameters are in the mirror (already there
        when the last push brought them back); None when the pull failed and was
        handled."""
        ctx, local = self.ctx, self.ctx.local
        if local.fresh:  # the last push brought the parameters back
            local.fresh = False
            return ctx.client.last_pull_steps[0]
        self.step.drain()
        try:
            return ctx.client.pull(local.mirror, worker=ctx.role.worker)
        except PSError as exc:
            self.handle(exc)
            return None

    def _steps_to_push(self) -> list[int]:
        """The step each server's push is for."""
        ctx = self.ctx
        if ctx.training.mode == "sync":
            # Each server counts its own steps; they agree except after a server
            # restarted without a checkpoint, so a worker follows each one.
            bound = ctx.training.staleness_bound or 0
            pulled = ctx.client.last_pull_steps
            if self.steps is None or len(self.steps) != len(pulled):
                self.steps = list(pulled)
            self.steps = [mine if g <= mine <= g + bound else g
                          for mine, g in zip(self.steps, pulled, strict=True)]
        else:
            # async: a push's step is the index of its batch in this worker's
            # data; server 0 keeps it, and so every checkpoint has it.
            self.steps = [self.data.position] * ctx.placement.num_ps
        return self.steps

    def _count(self, result: TrainResult, samples: int, loss: float) -> None:
        result.local_steps += 1
        result.samples += samples
        self.steps = [x + 1 for x in self.steps or ()]
        if self.chief is not None:
            self.chief.progress.record(loss)
        result.loss = loss

    def _recover_from(self, exc: PSError) -> None:
        """A push (or a checkpoint) failed: forget the parameters it may have brought
        and any push in flight (a recovery may reinstall them), then `handle`."""
        self.ctx.local.fresh = False
        self.step.drain()
        self.handle(exc)

    def handle(self, exc: PSError) -> None:
        """React to a refused or failed call; return to retry the step, or raise."""
        if exc.code == "INVALID_ARGUMENT" and "NaN or inf" in exc.message:
            raise TrainingDiverged(f"training diverged: {exc.message}") from exc
        if exc.code == "RESOURCE_EXHAUSTED":  # the server is busy: back off, retry
            time.sleep(BUSY_BACKOFF_S)
            return
        if exc.code == "ABORTED":  # a push computed on a server's previous state: the
            return                 # loop pulls the current parameters and goes on
        if (exc.code == "INVALID_ARGUMENT" and self.chief is None
                and not admitted(self.ctx.infos())):
            self.membership.wait_initialised()  # elastic: not in the worker set
            return
        if exc.code in AUTH_REFUSED_CODES and self.chief is not None:
            self.refusals.allow(exc)  # raises once they have lasted past the bound
            self.chief.restore.recover()
            return
        if exc.code in ("UNAVAILABLE", "FAILED_PRECONDITION", "DEADLINE_EXCEEDED",
                        "CANCELLED"):
            if self.chief is not None:
                self.chief.restore.recover()
            else:
                self.membership.wait_initialised()
            return
        raise exc

