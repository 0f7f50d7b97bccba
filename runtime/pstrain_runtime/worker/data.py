"""Where this worker's data resumes, and its re-partition when the worker set changes.

Every worker counts the batches it draws (`position`). In async mode a push's step is
its batch's index, and server 0 keeps the last applied one per worker; in sync mode
every worker draws one batch per global step, so the step is the position. Checkpoints
save these positions and a restore installs them, so a worker that starts (first start,
restart, resume) opens its `batches` where it left off (`task.open_batches`). Workers
that keep running through a parameter server's recovery keep their iterators: the
batches of lost steps are not read again.

Elastic workers: when the worker set changes size, a worker reads its shard of the new
partition from its beginning (docs/runtime.md).
"""

from __future__ import annotations

from collections.abc import Iterator

from ..task import Batch, open_batches
from .context import WorkerContext


class DataCursor:
    def __init__(self, ctx: WorkerContext) -> None:
        self.ctx = ctx
        self.position = 0  # batches drawn from this worker's data since the job began
        self.opened_for = ctx.role.num_workers  # the worker count of the partition read
        self._batches: Iterator[Batch] | None = None

    def resume(self) -> None:
        """Open this worker's batches where server 0 says it left off (restored from a
        checkpoint, or kept from this worker's pushes before it restarted)."""
        ctx = self.ctx
        info = ctx.retry(lambda: ctx.client.info(0, ctx.role.worker))
        self.position = int(info.position)
        self.opened_for = ctx.role.num_workers
        self._open(start=self.position)

    def next_batch(self) -> Batch:
        """The next batch, from the new partition's beginning when the last pull saw the
        worker set at another size."""
        live = self.ctx.client.last_pull_workers
        if 0 < live != self.opened_for:
            self.opened_for = live
            self.position = 0
            self._open()
        assert self._batches is not None  # opened by `resume`
        try:
            batch = next(self._batches)
        except StopIteration:
            raise ValueError(
                f"{self.ctx.training.entrypoint}: batches() ran out after {self.position} "
                "batches; it must be endless or long enough for the job") from None
        self.position += 1
        return batch

    def _open(self, start: int = 0) -> None:
        training = self.ctx.training
        self._batches = open_batches(self.ctx.task, self.ctx.role.worker, self.opened_for,
                                     training.batch_size, training.seed, start=start)
