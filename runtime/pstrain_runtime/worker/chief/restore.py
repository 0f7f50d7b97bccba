"""The chief's initialisation of the parameter servers, and their recovery.

At its start the chief initialises the servers: from the latest intact checkpoint when
there is one, else with its own freshly built parameters; a chief that restarted while
the servers kept training joins them as they are.

A server that comes back empty (restarted) makes workers wait for it to be initialised;
the chief re-initialises it. With a checkpoint directory, the chief restores *every*
server from the latest checkpoint (a consistent state) and reports how many global steps
were lost. Without one, it installs its own latest pulled copy of the parameters on the
restarted servers only, with fresh optimizer state for that shard; the global step
continues from server 0 (or from the chief's last known step when server 0 itself
restarted), and `lost_steps` is 0 because no step count is undone, although the
optimizer state of that shard is lost.

Every Init gives a server a new generation, which pulls carry and pushes send back: a
gradient computed on parameters from before a restore (or a re-initialisation) is
refused (ABORTED), never applied, and the worker pulls again and recomputes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from ...checkpoint import Checkpoint
from ...checkpoint_dir import check_directory
from ...optim import SLOT_NAMES, OptimizerState
from ..context import WorkerContext
from ..membership import live_workers
from ..sparse_binding import SparseBinding
from .checkpoint_schedule import CheckpointSchedule


class ServerRestore:
    def __init__(self, ctx: WorkerContext, tables: SparseBinding,
                 schedule: CheckpointSchedule) -> None:
        self.ctx = ctx
        self.tables = tables
        self.schedule = schedule
        self.lost_steps = 0  # global steps undone by restores

    def start(self) -> None:
        """The chief joins the job: initialise or restore the servers, or join them."""
        ctx = self.ctx
        if self.schedule.store is not None:  # refuse an unusable directory before training
            check_directory(self.schedule.store.directory)
        infos = ctx.infos()
        if all(i.initialized for i in infos):
            # The chief restarted while the servers kept training: join them.
            ctx.last_step = infos[0].global_step
            return
        if any(i.initialized for i in infos):
            self.recover()
            return
        latest = self._latest_checkpoint()
        if latest is not None:
            self._restore_at_start(*latest)
            return
        self.install(ctx.local.mirror, None, 0)
        ctx.last_step = 0

    def _restore_at_start(self, ckpt: Checkpoint, path: Path, skipped: dict[str, str]) -> None:
        training = self.ctx.training
        self._restore_all(ckpt, path)
        self.ctx.last_step = ckpt.global_step
        past = ckpt.global_step > training.steps
        warning = (f"checkpoint {path} is at global step {ckpt.global_step}, past this "
                   f"job's target of {training.steps} steps (spec.training.steps): "
                   "nothing is left to train, so the job ends with that checkpoint's "
                   "parameters")
        if past:
            print(f"pstrain: warning: {warning}", flush=True)
        warnings = [w for w in (skipped.get("warning"), past and warning) if w]
        self.ctx.emit("restored", step=ckpt.global_step, path=str(path), lost_steps=0,
                      **({"warning": "; ".join(warnings)} if warnings else {}))

    def recover(self) -> None:
        """Some servers lost their state (restarted): re-initialise, see module doc.
        A replaced server's name may lead elsewhere for a moment, so a refusal of this
        job's credentials is waited out here like an unreachable server, within the
        same bound (`WorkerContext.retry`, recovering)."""
        ctx = self.ctx
        infos = ctx.infos(recovering=True)
        lost = [i for i, info in enumerate(infos) if not info.initialized]
        if not lost:
            return
        before = max(ctx.last_step, max(i.global_step for i in infos))
        latest = self._latest_checkpoint()
        if latest is not None:
            ckpt, path, skipped = latest
            self._restore_all(ckpt, path, recovering=True)
            lost_steps = max(0, before - ckpt.global_step)
            self.lost_steps += lost_steps
            ctx.last_step = ckpt.global_step
            self.schedule.begin()  # the next checkpoint: after the restored step
            ctx.emit("restored", step=ckpt.global_step, path=str(path),
                     lost_steps=lost_steps, servers=lost, **skipped)
            return
        step = infos[0].global_step if 0 not in lost else ctx.last_step
        self.install(ctx.local.mirror, None, step, only=lost, recovering=True)
        ctx.last_step = step
        self.schedule.begin()
        ctx.emit("restored", step=step, path=None, lost_steps=0, servers=lost,
                 note="no checkpoint directory: restarted servers got the chief's latest "
                 "pulled parameters and fresh optimizer state")

    def install(self, params: Mapping[str, torch.Tensor],
                states: Mapping[str, OptimizerState] | None, global_step: int,
                only: Sequence[int] | None = None, positions: Sequence[int] = (),
                sparse_rows: dict[str, Any] | None = None,
                num_workers: int | None = None, recovering: bool = False) -> None:
        """Init the servers (`only` those) with these parameters and optimizer states;
        a sparse model's tables (and their rows) first: Init lets the workers in.
        `recovering`: as `recover` retries (`WorkerContext.retry`)."""
        ctx, training, store = self.ctx, self.ctx.training, self.schedule.store
        directory = store.directory if store is not None else None
        # A checkpoint in flight read the servers being replaced: it is dropped, and
        # the next one writes every row (its chain would not match them).
        self.schedule.abandon()
        ctx.retry(lambda: self.tables.install(sparse_rows, directory, only), recovering)
        ctx.retry(lambda: ctx.client.init(
            params, ctx.optimizer, mode=training.mode,
            num_workers=num_workers or live_workers(ctx),
            staleness_bound=training.staleness_bound,
            fingerprint=ctx.fingerprint, global_step=global_step,
            target_steps=training.steps, states=states, only=only,
            positions=positions,
            checkpoint_every=(training.checkpoint.interval_steps
                              if store is not None else 0)), recovering)

    def _restore_all(self, ckpt: Checkpoint, path: Path, recovering: bool = False) -> None:
        ctx = self.ctx
        ckpt.check_matches(ctx.fingerprint, ctx.optimizer.name, str(path))
        ckpt.check_tensors(ctx.local.mirror, str(path), SLOT_NAMES[ctx.optimizer.name])
        states: dict[str, OptimizerState] = {}
        for piece in ctx.placement.pieces:
            slots = {}
            for slot, full in ckpt.slots.get(piece.param, {}).items():
                slots[slot] = full[piece.row_start:piece.row_end] if piece.partitioned else full
            states[piece.key] = OptimizerState(step=ckpt.slot_steps.get(piece.param, 0),
                                               slots=slots)
        # The checkpoint's positions are one per trainer of the worker set it was saved
        # with (elastic workers: not necessarily the set this chief started with).
        # A chief that has pulled knows the live set; a chief that has just started
        # takes the set the checkpoint was saved with.
        live = (ctx.client.last_pull_workers or len(ckpt.positions)
                or ctx.role.num_workers)
        positions = ckpt.positions
        if positions and len(positions) != live:
            print(f"pstrain: {path} holds the data positions of {len(positions)} workers and "
                  f"this job has {live}; every worker reads its data from the beginning",
                  flush=True)
            positions = []
        self.install(ckpt.params, states, ckpt.global_step, positions=positions,
                     sparse_rows=ckpt.sparse, num_workers=live, recovering=recovering)
        self.schedule.last_step = ckpt.global_step

    def _latest_checkpoint(self) -> tuple[Checkpoint, Path, dict[str, str]] | None:
        """The newest intact checkpoint, and the `warning` field for the restored event
        when newer ones were skipped as damaged (each named in the log as well). Every
        checkpoint damaged: NoUsableCheckpoint, a configuration error (no restart)."""
        store = self.schedule.store
        if store is None:
            return None
        found = store.latest()
        if found is None:
            return None
        ckpt, path, problems = found
        for problem in problems:
            print(f"pstrain: skipping checkpoint: {problem}", flush=True)
        if not problems:
            return ckpt, path, {}
        skipped = (f"{len(problems)} newer checkpoint{'s' if len(problems) > 1 else ''} "
                   f"skipped as damaged; restored the previous intact one, {path} (step "
                   f"{ckpt.global_step})")
        print(f"pstrain: {skipped}", flush=True)
        return ckpt, path, {"warning": skipped}
