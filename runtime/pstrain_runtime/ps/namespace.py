"""One namespace's state (one per job or model, like TensorFlow's containers): the
record the parameter server's concerns share. Each field is written by the module named
beside it, always under `cond`; this module only answers what the state says (`info`,
`position_of`) and keeps checkpoint snapshots.

Namespaces live in `pstrain_runtime.ps.store.ParameterStore`."""

from __future__ import annotations

import threading
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch
from pstrain_api.membership import WorkerSet

from ..optim import OptimizerConfig, OptimizerState
from ..proto import ps_pb2 as pb
from .grads import ScratchPool
from .job_board import JobReport
from .snapshots import StepSnapshot, snapshot_if_due

if TYPE_CHECKING:
    from .sync_barrier import Bucket


class Namespace:
    def __init__(self, name: str) -> None:
        self.name = name
        self.cond = threading.Condition()
        # the dense shard (`shard`)
        self.initialized = False
        self.params: dict[str, torch.Tensor] = {}
        self.states: dict[str, OptimizerState] = {}
        self.config = OptimizerConfig()
        self.mode = "async"
        self.staleness: int | None = None
        self.fingerprint = b""
        self.global_step = 0
        self.target_steps = 0  # 0: unbounded
        self.checkpoint_every = 0  # keep a snapshot at each multiple (0: none)
        self.snapshot: StepSnapshot | None = None
        self.epoch = 0  # bumped by every init: blocked waits end when it changes
        self.shapes: dict[str, tuple[int, ...]] = {}  # of params, for push checks
        self.metas: dict[str, pb.TensorMeta] = {}  # of params, for pull headers
        self.optimizer_pb = pb.OptimizerSpec()  # of config, for pull headers
        self.scratch = ScratchPool()  # gradient buffers (`grads`)
        self.skipped_nonfinite = 0  # pushes refused for NaN/inf (`grads`)
        # who may push (`membership`)
        self.members = WorkerSet.initial(1)
        self.generation = 0  # random and new at every init; pulls carry it
        self.worker_pushes: dict[int, int] = {}
        # async: per worker, the batches it had drawn when its last applied push was made
        # (the push's step + 1); from a checkpoint's INIT until then (`async_steps`)
        self.positions: dict[int, int] = {}
        self.buckets: dict[int, Bucket] = {}  # sync: per step (`sync_barrier`)
        # the job board (`job_board`)
        self.done = False
        self.told_done: set[int] = set()
        self.checkpoint_wanted = -1  # RequestCheckpoint: a checkpoint at/after this step
        self.report = JobReport()
        self.sparse: Any = None  # sparse.service.NamespaceTables, made by the chief's configure

    def keep_snapshot(self) -> None:
        """After a step: copy the shard if the step is a checkpoint step (lock held)."""
        snap = snapshot_if_due(self.global_step, self.checkpoint_every, self.params,
                               self.states)
        if snap is not None:  # with where each worker's data stood at that step
            self.snapshot = replace(snap, positions=tuple(
                self.position_of(w) for w in range(self.num_workers)))

    @property
    def num_workers(self) -> int:
        """The size of per-worker tables: one more than the highest live worker."""
        return self.members.span

    def position_of(self, worker: int) -> int:
        """Where `worker`'s data resumes: in sync mode every worker draws one batch per
        global step, so the step itself; in async mode what its pushes said."""
        return self.global_step if self.mode == "sync" else self.positions.get(worker, 0)

    def info(self, worker: int | None = None) -> pb.StepInfo:
        if self.done and worker is not None:
            self.told_done.add(worker)
        return pb.StepInfo(global_step=self.global_step, done=self.done,
                           initialized=self.initialized,
                           skipped_nonfinite=self.skipped_nonfinite,
                           checkpoint_requested=self.checkpoint_wanted >= 0,
                           position=self.position_of(worker) if worker is not None else 0,
                           member=worker is not None and worker in self.members)

    def not_applied(self, worker: int, note: str) -> pb.PushReply:
        """The reply to `worker`'s push that was dropped whole, saying why."""
        return pb.PushReply(info=self.info(worker), applied=False, note=note)

    def at_target(self, worker: int) -> pb.PushReply:
        return self.not_applied(worker, f"the target of {self.target_steps} steps is reached")
