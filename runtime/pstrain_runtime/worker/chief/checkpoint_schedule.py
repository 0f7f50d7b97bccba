"""The chief's checkpoint schedule, and what a checkpoint holds.

A checkpoint is due every `checkpoint.intervalSteps` global steps, or when one is asked
for before a disruption (RequestCheckpoint on parameter server 0: a suspend, a deadline,
an eviction), and at the end. It holds the servers' state at a multiple of the interval
(the copies they kept at that step, where they have them; in sync mode the servers'
state at the chief's step, which the tables' rows are too), each worker's data
position, and a sparse model's table rows (written beside the file).

A sparse model's rows are a chain of a full write and deltas (`sparse.chain`), written
off the training thread (`sparse.saving`): the chief pulls the dense state, starts the
rows, trains on, and writes the checkpoint file, which names them, only once they are
all on disk, at its first step after that (so it reports no checkpoint before its rows
are complete). One write is in flight at most: a checkpoint due meanwhile is postponed
until it ends (then taken at the latest multiple; in sync mode at the chief's step),
never waited for, so training does not stop for it (a slow volume stretches the
interval instead). An asked-for checkpoint and the final one are written at once and
waited for (after the one in flight), before the chief reports them.

Storage: the chief refuses an unusable checkpoint directory before it trains
(`checkpoint_dir.check_directory`, a configuration error; see `restore`). A checkpoint
write that fails mid-run is reported and training carries on (the next interval tries
again, with a full write of the rows). When the final checkpoint cannot be written, the
trained parameters go to a fallback directory (fresh and private:
`checkpoint_dir.private_directory`), which is reported, and then the chief fails with a
configuration error, so the job fails at once with that line instead of restarting the
chief.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import torch

from ...checkpoint import Checkpoint, CheckpointError, CheckpointStore
from ...checkpoint_dir import check_directory, fallback_bases, private_directory
from ...failure import ConfigurationError
from ...proto import ps_pb2 as pb
from ...ps.store import PSError
from ...sparse.saving import LinkWrite, SaveCancelled
from ..context import WorkerContext, why
from ..sparse_binding import SparseBinding
from .progress import report_status


class CheckpointSchedule:
    def __init__(self, ctx: WorkerContext, tables: SparseBinding) -> None:
        self.ctx = ctx
        self.tables = tables
        ckpt = ctx.training.checkpoint
        self.store = CheckpointStore(ckpt.directory, ckpt.keep) if ckpt.directory else None
        self.every = ckpt.interval_steps
        self.next_step = 0
        self.last_step: int | None = None  # of the last checkpoint written or restored
        self.last_written: tuple[int, str, float] | None = None  # step, path, time written
        self.failed: tuple[Checkpoint, BaseException] | None = None  # the last write
        # A checkpoint whose rows are being written: its file waits for them.
        self.pending: tuple[Checkpoint, LinkWrite] | None = None

    def begin(self) -> None:
        """The first checkpoint is due at the next multiple of the interval."""
        self.next_step = (self.ctx.last_step // self.every + 1) * self.every

    def after_step(self, gstep: int, replies: list[pb.PushReply]) -> None:
        """Write a checkpoint whose rows are on disk; start one when one is due by the
        interval (unless one is in flight) or was asked for. A server that fails under
        it raises PSError (the chief recovers it)."""
        self._collect(wait=False)
        asked = (replies[0].info.checkpoint_requested
                 and gstep > (self.last_step if self.last_step is not None else -1))
        if (self.store is None or not (gstep >= self.next_step or asked)
                or gstep >= self.ctx.training.steps):
            return
        if asked and self.pending is not None:
            # Finish the one in flight first; the next step's reply says whether the
            # request still stands (it ends when a checkpoint at or after it is reported).
            self._collect(wait=True)
            return
        if self.pending is not None:
            return  # postponed: the rows of the last one are still being written
        interval = gstep >= self.next_step
        at_step = (gstep // self.every * self.every
                   if interval and self.ctx.training.mode == "async" else 0)
        self.save(at_step=at_step, wait=asked)
        self.next_step = max(self.next_step, (gstep // self.every + 1) * self.every)

    def save_final(self, gstep: int) -> None:
        """The end of training: a checkpoint of `gstep` unless one was written already;
        when it cannot be written, the fallback (a configuration error)."""
        if self.store is None:
            return
        self._collect(wait=True)
        if self.last_step != gstep and self.save() is None:
            self._save_fallback()
        self.store.settle()  # retention's removals in flight, and what is left

    def save(self, at_step: int = 0, wait: bool = True) -> Path | None:
        """Write a checkpoint of the servers' state: the copies they kept at `at_step`
        (a multiple of the interval) where they have them, else their state now (`0`).
        With tables, their rows are started; `wait`: waited for, and the file written.
        The path written; None when not yet (in flight) or when the write failed (it is
        reported and training carries on: the next interval tries again)."""
        if self.store is None:
            return None
        ckpt = self._pull(at_step)
        # The servers may hold a later step than the chief has seen (other workers
        # pushed meanwhile): the next checkpoint is due after the one taken, never at
        # its step again (two links of one step would share, and overwrite, one
        # directory of rows).
        self.next_step = max(self.next_step, (ckpt.global_step // self.every + 1) * self.every)
        try:
            write = self.tables.begin_save(self.store.directory, ckpt.global_step,
                                           frozen=self.ctx.training.mode == "sync")
        except (OSError, RuntimeError) as exc:  # rows written at once (sync) that failed
            return self._failed(ckpt, exc)
        except PSError:
            self.tables.restart_chain()
            raise
        if write is None:  # no tables: the file is the whole checkpoint
            return self._commit(ckpt, None)
        self.pending = (ckpt, write)
        return self._collect(wait=True) if wait else None

    def abandon(self) -> None:
        """A restore begins: drop the checkpoint in flight (its rows stop being
        written); the next checkpoint writes every row."""
        self.pending = None
        self.tables.restart_chain()

    def _collect(self, wait: bool) -> Path | None:
        """The checkpoint in flight, once its rows are on disk (`wait`: wait for them):
        its file written and reported. None when there is none, it is not done, or it
        failed (reported). A server that failed under its rows: PSError, raised."""
        if self.pending is None or not (wait or self.pending[1].done()):
            return None
        ckpt, write = self.pending
        self.pending = None
        try:
            ckpt.sparse = self.tables.finish_save(write)
        except SaveCancelled:
            return None
        except PSError:
            self.tables.restart_chain()
            raise
        except (OSError, RuntimeError, CheckpointError) as exc:
            return self._failed(ckpt, exc)
        return self._commit(ckpt, write)

    def _commit(self, ckpt: Checkpoint, write: LinkWrite | None) -> Path | None:
        """Write the checkpoint file (its rows are on disk) and report it."""
        assert self.store is not None  # only called with a store
        try:
            # Old row directories are removed on a thread: the chief trains on.
            path = self.store.save(ckpt, background=True)
        except (OSError, RuntimeError) as exc:  # torch.save wraps some write errors
            return self._failed(ckpt, exc)
        if write is not None:
            self.tables.commit(write, ckpt.sparse)
        self.failed = None
        self.last_step = ckpt.global_step
        self.last_written = (ckpt.global_step, str(path), ckpt.wall_time)
        self.ctx.emit("checkpoint", step=ckpt.global_step, path=str(path))
        report_status(self.ctx, checkpoint=(ckpt.global_step, str(path), ckpt.wall_time))
        return path

    def _failed(self, ckpt: Checkpoint, exc: BaseException) -> None:
        self.failed = (ckpt, exc)
        self.tables.restart_chain()
        where = self.store.directory if self.store is not None else None
        print(f"pstrain: warning: the checkpoint of step {ckpt.global_step} could not be "
              f"written to {where} ({why(exc)}); training goes on and the next "
              "checkpoint tries again", flush=True)
        return None

    def _save_fallback(self) -> None:
        """The final checkpoint could not be written: save the trained parameters to a
        fallback directory, then fail (a configuration error: retrying cannot help)."""
        assert self.failed is not None  # set by the failed `save`
        ckpt, error = self.failed
        where = self.store.directory if self.store else None
        lost = (f"the final checkpoint (step {ckpt.global_step}) could not be written to "
                f"{where} ({why(error)})")
        problems = []
        for base in fallback_bases():
            directory = None
            try:  # a fresh private directory: never one another user could have made
                directory = private_directory(base, self.ctx.role.namespace)
                check_directory(directory, "the fallback directory")
                path = CheckpointStore(directory).save(ckpt)
            except (ConfigurationError, OSError, RuntimeError) as exc:
                problems.append(why(exc))
                if directory is not None:
                    shutil.rmtree(directory, ignore_errors=True)
                continue
            print(f"pstrain: the trained parameters of step {ckpt.global_step} were saved to "
                  f"{path}", flush=True)
            raise ConfigurationError(
                f"{lost}; the trained parameters were saved to {path} instead (point "
                "checkpoint.directory at its directory to continue from them)")
        raise ConfigurationError(f"{lost}, nor to any fallback directory: "
                                 + "; ".join(problems))

    def _pull(self, at_step: int = 0) -> Checkpoint:
        """The servers' state (at `at_step` where they kept it), reassembled whole."""
        ctx = self.ctx
        state = ctx.retry(lambda: ctx.client.pull_state(at_step))
        mirror = ctx.local.mirror
        params = ctx.client.assemble(state.params, mirror)
        slots: dict[str, dict[str, torch.Tensor]] = {}
        slot_steps: dict[str, int] = {}
        for name in mirror:
            pieces = ctx.placement.pieces_of(name)
            slot_steps[name] = state.slot_steps.get(pieces[0].key, 0)
            for slot in state.slots.get(pieces[0].key, {}):
                full = torch.empty_like(mirror[name], device="cpu")
                for piece in pieces:
                    view = full[piece.row_start:piece.row_end] if piece.partitioned else full
                    view.copy_(state.slots[piece.key][slot])
                slots.setdefault(name, {})[slot] = full
        return Checkpoint(global_step=state.global_step, fingerprint=ctx.fingerprint,
                          optimizer=ctx.optimizer.name, params=params, slots=slots,
                          slot_steps=slot_steps, wall_time=time.time(),
                          positions=state.positions)
