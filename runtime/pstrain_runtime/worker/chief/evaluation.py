"""The chief's evaluation: `task.evaluate(model)` every `evalIntervalSteps` global steps
(when set) while training, and once at the end (`finish`); each one is an `eval` event
and a status report."""

from __future__ import annotations

from ..context import WorkerContext
from .progress import report_status


class Evaluation:
    def __init__(self, ctx: WorkerContext) -> None:
        self.ctx = ctx
        self.every = ctx.training.eval_interval_steps
        self.next_step: int | None = None

    def begin(self) -> None:
        """The first evaluation is at the next multiple of the interval."""
        every = self.every
        self.next_step = (self.ctx.last_step // every + 1) * every if every else None

    def after_step(self, gstep: int) -> None:
        every, due = self.every, self.next_step
        if every and due is not None and due <= gstep < self.ctx.training.steps:
            metrics = self.evaluate()
            self.ctx.emit("eval", step=gstep, **metrics)
            report_status(self.ctx, metrics=metrics)
            self.next_step = (gstep // every + 1) * every

    def evaluate(self) -> dict[str, float]:
        model = self.ctx.model
        model.eval()
        try:
            metrics = {k: float(v) for k, v in self.ctx.task.evaluate(model).items()}
        finally:
            model.train()
        return metrics
