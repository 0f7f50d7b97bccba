"""`Trainer`: one trainer process of a job (a worker; worker 0 is the chief), built from
its parts and run as a short script: join, resume the data, train to the target, end.

The parts, one module each: the shared state (`context`), the model's parameters and
their CPU mirrors (`parameters`), the sparse tables (`sparse_binding`), one step
(`step`, `pipeline`), the data (`data`), the step loop (`loop`), joining and leaving
(`membership`) and the chief's duties (`chief/`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from pstrain_api import events
from pstrain_api.model import Training

from ..checkpoint import CheckpointStore, model_fingerprint
from ..optim import OptimizerConfig, OptimizerState
from ..ps.store import PSError
from ..sparse.session import SparseSession
from ..task import Task, load_task
from .chief.duties import ChiefDuties
from .chief.finish import shutdown_servers
from .client import ShardedClient, Transport
from .context import (EmitFn, TrainResult, WorkerContext, WorkerRole, pick_device,
                      wire_torch_dtype)
from .data import DataCursor
from .loop import StepLoop
from .membership import Membership
from .parameters import LocalParameters
from .pipeline import may_pipeline
from .placement import build_placement, param_specs
from .sparse_binding import SparseBinding, storage_settings
from .step import Step


class Trainer:
    """One trainer of a job. Its callers read the parts' state through the properties
    below `close` (`mirror`, `client`, `sparse`, `last_checkpoint`, ...); `client` may be
    wrapped before `run`, and every part sees the wrapper."""

    def __init__(self, training: Training, role: WorkerRole, transports: Sequence[Transport],
                 *, emit: EmitFn = events.emit, device: torch.device | None = None,
                 connect_timeout: float = 120.0, init_timeout: float = 600.0,
                 overlap: bool = False, pipeline: bool | None = None,
                 progress_interval: float = 1.0, shutdown_grace: float = 30.0,
                 task: Task | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        device = device or pick_device()
        task = task or load_task(training.entrypoint, training.args)
        model = task.model.to(device)
        local = LocalParameters(model, device)
        optimizer = OptimizerConfig.from_model(training.optimizer)
        # Sparse tables (rows on the servers): pushed beside the dense gradients.
        cache = training.sparse_cache  # async only: a sync step reads exact parameters
        self.tables = SparseBinding.attach(
            model, transports, role.namespace, optimizer, training.seed,
            (cache.rows, cache.staleness_steps) if training.mode == "async" else None,
            storage_settings(training.sparse_storage))
        fingerprint = self.tables.fingerprint(model_fingerprint(local.mirror))
        placement = build_placement(
            param_specs({n: tuple(t.shape) for n, t in local.mirror.items()}), len(transports))
        client = ShardedClient(transports, placement, role.namespace,
                               wire_dtype=wire_torch_dtype(training.wire_dtype))
        self.ctx = WorkerContext(
            training=training, role=role, task=task, model=model, local=local,
            optimizer=optimizer, fingerprint=fingerprint, placement=placement,
            client=client, emit=emit, clock=clock, connect_timeout=connect_timeout,
            init_timeout=init_timeout)
        self.shutdown_grace = shutdown_grace
        self.step = Step(self.ctx, self.tables, overlap=overlap and not self.tables.bound,
                         pipeline=may_pipeline(training, pipeline, overlap=overlap,
                                               num_ps=len(transports),
                                               sparse=self.tables.bound))
        self.data = DataCursor(self.ctx)
        self.membership = Membership(self.ctx)
        self.chief = ChiefDuties(self.ctx, self.tables, progress_interval)
        self.loop = StepLoop(self.ctx, self.step, self.data, self.membership,
                             self.chief if role.is_chief else None)

    def run(self) -> TrainResult:
        """Train this worker's part of the job; the chief also ends the job."""
        started = self.ctx.clock()
        self._join(started)
        self.data.resume()
        result = TrainResult()
        self.model.train()
        while True:  # the chief comes back here when finishing needed a recovery
            finished_by_peer = self.loop.run(result)
            self._loop_ended(result, started)
            if not self.role.is_chief:
                self.membership.leave(finished_by_peer)
                return result
            try:
                return self.chief.finish(result)
            except PSError as exc:  # a server failed while finishing: recover, then go on
                self.loop.handle(exc)

    def _join(self, started: float) -> None:
        """The chief initialises, restores or joins the servers; a worker waits for
        them and for its admission to the worker set."""
        if self.role.is_chief:
            self.chief.start(started)
        else:
            self.membership.join()

    def _loop_ended(self, result: TrainResult, started: float) -> None:
        """The step loop reached the target: no push stays in flight; what it did."""
        self.step.drain()
        result.global_step = self.ctx.last_step
        result.wall_seconds = self.ctx.clock() - started
        result.lost_steps = self.chief.restore.lost_steps

    def shutdown_servers(self) -> None:
        """Ask every server to stop (they wait up to the grace for workers to learn the
        job is done); the chief calls it after `run`."""
        shutdown_servers(self.ctx, self.shutdown_grace)

    def close(self) -> None:
        self.step.drain()
        self.tables.close()
        self.step.close()
        self.client.close()

    # --------------------------------------------- the parts' state, as callers read it
    @property
    def training(self) -> Training:
        return self.ctx.training

    @property
    def role(self) -> WorkerRole:
        return self.ctx.role

    @property
    def model(self) -> torch.nn.Module:
        return self.ctx.model

    @property
    def device(self) -> torch.device:
        return self.ctx.device

    @property
    def client(self) -> ShardedClient:
        return self.ctx.client

    @client.setter
    def client(self, client: ShardedClient) -> None:
        """Wrap the client (`metrics.MeteredClient`): every part reads it from here."""
        self.ctx.client = client

    @property
    def mirror(self) -> dict[str, torch.Tensor]:
        """The CPU copy of the parameters, as the last pull (or push) brought them."""
        return self.ctx.local.mirror

    @property
    def optimizer(self) -> OptimizerConfig:
        return self.ctx.optimizer

    @property
    def fingerprint(self) -> str:
        return self.ctx.fingerprint

    @property
    def sparse(self) -> SparseSession | None:
        return self.tables.session

    @property
    def pipeline(self) -> bool:
        return self.step.pipeline is not None

    @property
    def last_step(self) -> int:
        return self.ctx.last_step

    @property
    def position(self) -> int:
        """Batches drawn from this worker's data since the job began."""
        return self.data.position

    @property
    def ckpt_store(self) -> CheckpointStore | None:
        return self.chief.schedule.store

    @ckpt_store.setter
    def ckpt_store(self, store: CheckpointStore | None) -> None:
        """Where the chief's checkpoints go (tests put a failing store here)."""
        self.chief.schedule.store = store

    @property
    def last_checkpoint(self) -> tuple[int, str, float] | None:
        """(step, path, time written) of the chief's last checkpoint, for its summary."""
        return self.chief.schedule.last_written

    def _install(self, params: Mapping[str, torch.Tensor],
                 states: Mapping[str, OptimizerState] | None, global_step: int,
                 only: Sequence[int] | None = None, **kwargs: Any) -> None:
        """Init the servers as the chief does (tests set up servers with it)."""
        self.chief.restore.install(params, states, global_step, only, **kwargs)


__all__ = ["Trainer"]
