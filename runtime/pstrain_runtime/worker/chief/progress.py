"""The chief's progress: `progress` events every `progress_interval` seconds (the first
step at once: training has begun), with the loss averaged over the steps since the last
one, the rate of examples behind the applied global steps and the staleness of the
chief's gradients, and the status it reports to parameter server 0, where the operator
reads it. Apart from those, `loss` events draw the loss curve (TensorBoard's
`train/loss`): every `curve_every(steps)` global steps, about CURVE_POINTS over a job,
each the chief's loss averaged since the previous point.

Staleness: how many global steps (other workers' updates) were applied between the pull
a gradient was computed on and that gradient's own update, averaged over the steps since
the last event (0 in sync mode without a staleness bound). A pipelined push is answered
one step later, so the pulled steps wait in a queue of two until their push's reply.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping
from typing import Any

from ...proto import ps_pb2 as pb
from ...ps.store import PSError
from ..context import TrainResult, WorkerContext
from ..membership import AppliedSamples, workers_per_step
from ..sparse_binding import SparseBinding


def report_status(ctx: WorkerContext, *, loss: float | None = None,
                  samples_per_sec: float = 0.0, metrics: Mapping[str, float] | None = None,
                  checkpoint: tuple[int, str, float] | None = None,
                  tables: Mapping[str, Any] | None = None) -> None:
    """Status for parameter server 0 (best effort: training goes on without it);
    `metrics` are an evaluation's (all of them, e.g. accuracy or auc and logloss)."""
    accuracy = metrics.get("accuracy") if metrics else None
    report = pb.StatusReport(
        loss=loss if loss is not None else math.nan, samples_per_sec=samples_per_sec,
        eval_accuracy=accuracy if accuracy is not None else math.nan,
        has_eval=bool(metrics), has_checkpoint=checkpoint is not None,
        target_steps=ctx.training.steps, eval_metrics=metrics or {})
    if checkpoint is not None:
        report.checkpoint_step, report.checkpoint_path, report.checkpoint_time = checkpoint
    if tables:
        report.sparse_rows, report.sparse_bytes = tables["sparse_rows"], tables["sparse_bytes"]
    try:
        ctx.client.report(report)
    except PSError as exc:
        print(f"pstrain: could not report status to parameter server 0: {exc}", flush=True)


CURVE_POINTS = 200  # points of a job's loss curve (`loss` events)


def curve_every(steps: int) -> int:
    """Global steps between two points of the loss curve of a job of `steps` steps."""
    return max(1, steps // CURVE_POINTS)


class Progress:
    def __init__(self, ctx: WorkerContext, tables: SparseBinding, interval: float) -> None:
        self.ctx = ctx
        self.tables = tables
        self.interval = interval
        self.curve: list[float] = []  # losses since the last point of the loss curve
        self.next_point = 0  # the global step of the next point
        self.started = 0.0
        self.applied = AppliedSamples(step=0)  # the rate's examples
        self.window: list[float] = []  # losses since the last progress event
        self.stale: list[int] = []  # staleness of the steps since the last event
        self.pulled: deque[int] = deque(maxlen=2)  # the steps pushes were computed on
        self.last_event = -math.inf

    def begin(self, started: float) -> None:
        """Count the rate from `started` (the clock) and the step the chief joined at."""
        self.started = started
        self.applied = AppliedSamples(step=self.ctx.last_step)
        self.window = []
        self.stale = []
        self.pulled.clear()
        self.last_event = -math.inf  # the first step is reported at once
        self.curve = []
        self.next_point = 0

    def record(self, loss: float) -> None:
        """A step's loss, right after its push (`ctx.last_step` is still the step its
        parameters were pulled at)."""
        self.window.append(loss)
        self.curve.append(loss)
        self.pulled.append(self.ctx.last_step)

    def after_step(self, gstep: int, result: TrainResult) -> None:
        ctx = self.ctx
        now = ctx.clock()
        elapsed = max(now - self.started, 1e-9)
        self.applied.advance(gstep, result.samples_per_step(workers_per_step(ctx)))
        rate = self.applied.total / elapsed
        if self.pulled:  # this push's update took the global step from gstep - 1 to gstep
            self.stale.append(max(gstep - 1 - self.pulled.popleft(), 0))
        if gstep >= self.next_point and self.curve:
            ctx.emit("loss", step=gstep, loss=round(sum(self.curve) / len(self.curve), 6))
            self.curve.clear()
            self.next_point = gstep + curve_every(ctx.training.steps)
        if now - self.last_event >= self.interval:
            avg = sum(self.window) / len(self.window)
            stale = round(sum(self.stale) / len(self.stale), 3) if self.stale else 0.0
            tables = self.tables.progress_fields()
            ctx.emit("progress", step=gstep, loss=round(avg, 6),
                     samples_per_sec=round(rate, 1), staleness=stale, **tables)
            report_status(ctx, loss=avg, samples_per_sec=rate, tables=tables)
            self.window.clear()
            self.stale.clear()
            self.last_event = now

    def final_rate(self, gstep: int, result: TrainResult) -> float:
        """Examples per second over the whole run, up to the final `gstep`."""
        self.applied.advance(gstep, result.samples_per_step(workers_per_step(self.ctx)))
        return self.applied.total / max(result.wall_seconds, 1e-9)
