"""The chief's checkpoint schedule, and what a checkpoint holds.

A checkpoint is due every `checkpoint.intervalSteps` global steps, or when one is asked
for before a disruption (RequestCheckpoint on parameter server 0: a suspend, a deadline,
an eviction), and at the end. It holds the servers' state at a multiple of the interval
(the copies they kept at that step, where they have them), each worker's data position,
and a sparse model's table rows (written beside the file).

Storage: the chief refuses an unusable checkpoint directory before it trains
(`checkpoint_dir.check_directory`, a configuration error; see `restore`). A checkpoint
write that fails mid-run is reported and training carries on (the next interval tries
again). When the final checkpoint cannot be written, the trained parameters go to a
fallback directory (fresh and private: `checkpoint_dir.private_directory`), which is
reported, and then the chief fails with a configuration error, so the job fails at once
with that line instead of restarting the chief.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import torch

from ...checkpoint import Checkpoint, CheckpointStore
from ...checkpoint_dir import check_directory, fallback_bases, private_directory
from ...failure import ConfigurationError
from ...proto import ps_pb2 as pb
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

    def begin(self) -> None:
        """The first checkpoint is due at the next multiple of the interval."""
        self.next_step = (self.ctx.last_step // self.every + 1) * self.every

    def after_step(self, gstep: int, replies: list[pb.PushReply]) -> None:
        """Write a checkpoint when one is due by the interval or was asked for. A server
        that fails under it raises PSError (the chief recovers it)."""
        asked = (replies[0].info.checkpoint_requested
                 and gstep > (self.last_step if self.last_step is not None else -1))
        if (self.store is not None and (gstep >= self.next_step or asked)
                and gstep < self.ctx.training.steps):
            self.save(at_step=gstep // self.every * self.every)
            self.next_step = (gstep // self.every + 1) * self.every

    def save_final(self, gstep: int) -> None:
        """The end of training: a checkpoint of `gstep` unless one was written already;
        when it cannot be written, the fallback (a configuration error)."""
        if self.store is not None and self.last_step != gstep:
            if self.save() is None:
                self._save_fallback()

    def save(self, at_step: int = 0) -> Path | None:
        """Write a checkpoint of the servers' state: the copies they kept at `at_step`
        (a multiple of the interval) where they have them, else their state now. A write
        that fails is reported and training carries on (the next interval tries again):
        None."""
        if self.store is None:
            return None
        ckpt = self._pull(at_step)
        try:
            rows = self.tables.save(self.store.directory, ckpt.global_step)
            if rows is not None:  # each table's rows, streamed beside the file
                ckpt.sparse = rows
            path = self.store.save(ckpt)
        except (OSError, RuntimeError) as exc:  # torch.save wraps some write errors
            self.failed = (ckpt, exc)
            print(f"pstrain: warning: the checkpoint of step {ckpt.global_step} could not be "
                  f"written to {self.store.directory} ({why(exc)}); training goes on "
                  "and the next checkpoint tries again", flush=True)
            return None
        self.failed = None
        self.last_step = ckpt.global_step
        self.last_written = (ckpt.global_step, str(path), ckpt.wall_time)
        self.ctx.emit("checkpoint", step=ckpt.global_step, path=str(path))
        report_status(self.ctx, checkpoint=(ckpt.global_step, str(path), ckpt.wall_time))
        return path

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
