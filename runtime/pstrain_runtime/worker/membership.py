"""Joining and leaving: where a worker joins the job, waits to be admitted to its worker
set (elastic workers), and leaves at the end; and how many examples the applied steps
stand for when the worker set changes size.

The rules of membership itself (who is added or removed, when a sync step waits for
whom) are `pstrain_api.membership`; the parameter servers apply them (`set_workers`) and
answer every Info and push asked as a worker with `member`: whether that worker is in
the live set. From that a trainer knows:

- a newcomer (started by a scale-up) is not a member until the operator or the local
  runner calls SetWorkers: it waits to be admitted before it pushes;
- a worker that a scale-down removed has its push in flight dropped whole and waits
  the same way, until the operator or the runner stops it (it never decides by itself
  that it is gone: a parameter server re-initialised with an older set says the same
  until the set is sent again).

A worker other than the chief joins once the chief has initialised every server (the
chief joins by initialising or restoring them: `chief.restore`). A restarted worker
pulls the current state and continues; in sync mode it joins the step the servers are
collecting (a duplicate contribution is ignored). Past the last step it waits for the
chief's Finish, then says goodbye so that every server may stop.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..proto import ps_pb2 as pb

if TYPE_CHECKING:  # the rules above the classes stay torch-free
    from .context import WorkerContext


def admitted(infos: Sequence[pb.StepInfo]) -> bool:
    """Every server counts the asking worker among the live set."""
    return bool(infos) and all(i.member for i in infos)


def not_a_member(replies: Sequence[pb.PushReply]) -> bool:
    """A push was refused because its worker is not in the live set."""
    return any(not r.applied and r.HasField("info") and r.info.initialized
               and not r.info.member for r in replies)


@dataclass
class AppliedSamples:
    """Examples behind the global steps applied since counting began.

    A sync step applies one batch from each live worker, an async step one batch, and
    the live count may change while the job runs: each step is counted with the count
    seen when it was applied, so a rate over a scale is neither over nor under."""

    step: int  # the global step counted up to
    total: float = 0.0

    def advance(self, global_step: int, samples_per_step: float) -> None:
        if global_step > self.step:
            self.total += (global_step - self.step) * samples_per_step
        self.step = global_step  # a restore may take it back: count on from there


def live_workers(ctx: WorkerContext) -> int:
    """Trainers in the servers' worker set as the last pull saw it (elastic workers
    change it while the job runs), else as this trainer was started with."""
    return ctx.client.last_pull_workers or ctx.role.num_workers


def workers_per_step(ctx: WorkerContext) -> int:
    """Workers whose gradients one global step applies: all of them in sync mode, one
    push in async mode."""
    return live_workers(ctx) if ctx.training.mode == "sync" else 1


class Membership:
    """A worker's joining (and re-joining after a scale-down or a recovery) and
    leaving."""

    def __init__(self, ctx: WorkerContext) -> None:
        self.ctx = ctx

    def join(self) -> None:
        """A worker other than the chief joins the job."""
        self.wait_initialised()
        print(f"pstrain: worker {self.ctx.role.worker} joins at step {self.ctx.last_step}",
              flush=True)

    def wait_initialised(self) -> None:
        """A worker waits for the chief to initialise every server and to be in the
        live worker set of each (elastic workers: SetWorkers admits a newcomer; a worker
        a scale-down removed waits here until it is stopped)."""
        ctx = self.ctx
        deadline = ctx.clock() + ctx.init_timeout
        delay = 0.05
        waited = False  # for admission to the worker set
        while True:
            infos = ctx.infos()
            if all(i.initialized for i in infos) and (admitted(infos)
                                                      or any(i.done for i in infos)):
                ctx.last_step = max(ctx.last_step, infos[0].global_step)
                if waited:
                    print(f"pstrain: worker {ctx.role.worker} is in the worker set; "
                          f"training from step {ctx.last_step}", flush=True)
                return
            if all(i.initialized for i in infos) and not waited:
                waited = True
                print(f"pstrain: worker {ctx.role.worker} is not in the job's worker set; "
                      "waiting to be admitted (a scale-up) or stopped (a scale-down)",
                      flush=True)
            if ctx.clock() > deadline:
                raise self._timeout(infos)
            time.sleep(delay)  # backoff between polls of a remote flag
            delay = min(delay * 2, 1.0)

    def _timeout(self, infos: Sequence[pb.StepInfo]) -> TimeoutError:
        ctx = self.ctx
        uninitialised = [i for i, x in enumerate(infos) if not x.initialized]
        if not uninitialised:
            return TimeoutError(
                f"worker {ctx.role.worker} was not in the job's worker set within "
                f"{ctx.init_timeout:.0f} s; a worker started by a scale-up is "
                "admitted by the operator or `pstrain run`, one removed by a "
                "scale-down is stopped by them")
        return TimeoutError(
            f"parameter servers {uninitialised}"
            f" were not initialised within {ctx.init_timeout:.0f} s; the chief "
            "initialises them")

    def leave(self, finished_by_peer: bool) -> None:
        """A worker other than the chief past the last step: wait for the chief's Finish
        (unless a server already said the job is done), then say goodbye."""
        if not finished_by_peer:
            self._wait_done()
        self.ctx.client.info_all(self.ctx.role.worker)  # goodbye: every server may stop now

    def _wait_done(self) -> None:
        ctx = self.ctx
        deadline = ctx.clock() + max(ctx.connect_timeout, 600.0)
        while ctx.clock() < deadline:
            info = ctx.retry(lambda: ctx.client.info(0, ctx.role.worker))
            if info.done:
                return
            time.sleep(0.1)  # poll of a remote flag
        raise TimeoutError("the chief did not finish the job in time after the last step")
