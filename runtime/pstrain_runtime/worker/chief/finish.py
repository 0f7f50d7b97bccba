"""The chief's end of the job, once every server has reached the target: the final
pull, evaluation and checkpoint, the last status report and the `done` event (the
job's final summary: step, loss, accuracy, samples/s, wall time, lost steps), then
Finish, which tells every worker the job is done. After `Trainer.run` the chief asks the
servers to shut down (`shutdown_servers`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ...ps.store import PSError
from ..context import TrainResult, WorkerContext
from .progress import report_status

if TYPE_CHECKING:
    from .duties import ChiefDuties


def finish(chief: ChiefDuties, result: TrainResult) -> TrainResult:
    """Complete `result` with the final step, metrics and rate; a server that fails on
    the way raises PSError (the chief recovers it and trains on)."""
    ctx = chief.ctx
    gstep = ctx.retry(lambda: ctx.client.pull(ctx.local.mirror, worker=0))
    ctx.local.copy_in()
    result.global_step = gstep
    result.metrics = chief.evaluation.evaluate()
    result.samples_per_sec = chief.progress.final_rate(gstep, result)
    ctx.emit("eval", step=gstep, **result.metrics)
    chief.schedule.save_final(gstep)
    tables = chief.tables.progress_fields()
    report_status(ctx, loss=result.loss, samples_per_sec=result.samples_per_sec,
                  metrics=result.metrics, tables=tables)
    ctx.emit("done", step=gstep, loss=result.loss,
             accuracy=result.metrics.get("accuracy"),
             samples_per_sec=round(result.samples_per_sec, 1),
             wall_seconds=round(result.wall_seconds, 3), lost_steps=chief.restore.lost_steps,
             **tables)
    ctx.retry(ctx.client.finish)
    return result


def shutdown_servers(ctx: WorkerContext, grace: float) -> None:
    """Ask every server to stop (they wait up to `grace` seconds for workers to learn
    the job is done)."""
    try:
        ctx.client.shutdown(grace)
    except PSError as exc:
        print(f"pstrain: shutdown request failed: {exc}", flush=True)
