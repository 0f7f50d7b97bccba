"""The chief's duties beside training, gathered: initialising and restoring the servers
(`restore`), the checkpoint schedule (`checkpoint_schedule`), evaluation
(`evaluation`), progress and status (`progress`), and the end of the job (`finish`).
Every trainer builds them (cheap, no I/O); only the chief (worker 0) runs them."""

from __future__ import annotations

from ...proto import ps_pb2 as pb
from ...ps.store import PSError
from ..context import TrainResult, WorkerContext
from ..sparse_binding import SparseBinding
from .checkpoint_schedule import CheckpointSchedule
from .evaluation import Evaluation
from .finish import finish
from .progress import Progress
from .restore import ServerRestore


class ChiefDuties:
    def __init__(self, ctx: WorkerContext, tables: SparseBinding,
                 progress_interval: float) -> None:
        self.ctx = ctx
        self.tables = tables
        self.schedule = CheckpointSchedule(ctx, tables)
        self.restore = ServerRestore(ctx, tables, self.schedule)
        self.evaluation = Evaluation(ctx)
        self.progress = Progress(ctx, tables, progress_interval)

    def start(self, started: float) -> None:
        """Initialise, restore or join the servers; then count progress, checkpoints
        and evaluations from the step the chief starts at (`started`: the clock)."""
        self.restore.start()
        self.progress.begin(started)
        self.schedule.begin()
        self.evaluation.begin()

    def after_step(self, gstep: int, replies: list[pb.PushReply],
                   result: TrainResult) -> PSError | None:
        """After each applied step: a progress event, a checkpoint and an evaluation,
        each when due. A server that failed under the checkpoint: its error, for the
        loop to recover from (the evaluation waits for a later step)."""
        self.progress.after_step(gstep, result)
        try:
            self.schedule.after_step(gstep, replies)
        except PSError as exc:
            return exc
        self.evaluation.after_step(gstep)
        return None

    def finish(self, result: TrainResult) -> TrainResult:
        """The end of the job (`finish`)."""
        return finish(self, result)
