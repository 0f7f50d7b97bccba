"""What every part of a worker shares: its settings and role, the task and its model, the
sharded client, and the newest global step it has seen; and the small value types a
trainer returns (`WorkerRole`, `TrainResult`).

The client is read from here at each call, never kept by a part: whoever runs the
trainer may wrap it after the trainer is built (`metrics.MeteredClient`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from pstrain_api.model import Training
from pstrain_api.quote import one_line

from ..optim import OptimizerConfig
from ..proto import ps_pb2 as pb
from ..ps.store import PSError
from ..task import Task
from .client import ShardedClient, retry_recovering, retry_unavailable
from .parameters import LocalParameters
from .placement import Placement

EmitFn = Callable[..., None]


class TrainingDiverged(RuntimeError):
    """A parameter server rejected a gradient with NaN/inf values."""


@dataclass(frozen=True)
class WorkerRole:
    namespace: str
    worker: int  # 0 is the chief
    num_workers: int

    @property
    def is_chief(self) -> bool:
        return self.worker == 0


@dataclass
class TrainResult:
    global_step: int = 0
    local_steps: int = 0
    loss: float | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    samples_per_sec: float = 0.0
    wall_seconds: float = 0.0
    lost_steps: int = 0
    samples: int = 0  # examples in this worker's batches (their real lengths)

    def samples_per_step(self, workers_per_step: int) -> float:
        """Examples behind one global step: this worker's mean real batch length (a
        batch may be shorter than batchSize, e.g. a small data set's only batch) times
        the workers whose gradients one step applies."""
        return self.samples / max(self.local_steps, 1) * workers_per_step


def why(exc: BaseException) -> str:
    return one_line(f"{type(exc).__name__}: {exc}", 300)


def pick_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def wire_torch_dtype(name: str) -> torch.dtype:
    return {"float32": torch.float32, "bfloat16": torch.bfloat16,
            "float16": torch.float16}[name]


@dataclass
class WorkerContext:
    """One trainer's shared state. `last_step` is the newest global step seen (by a
    pull, a push's reply, a restore)."""

    training: Training
    role: WorkerRole
    task: Task
    model: nn.Module  # the task's, on `device`
    local: LocalParameters
    optimizer: OptimizerConfig
    fingerprint: str  # the model's (and its sparse tables'): checkpoints must match it
    placement: Placement
    client: ShardedClient
    emit: EmitFn
    clock: Callable[[], float] = time.monotonic
    connect_timeout: float = 120.0
    init_timeout: float = 600.0
    last_step: int = 0

    @property
    def device(self) -> torch.device:
        return self.local.device

    def retry(self, fn: Callable[[], Any], recovering: bool = False) -> Any:
        """`fn`, retried while the servers are unreachable, for `connect_timeout` s;
        `recovering` (the chief recovering a replaced server): also while a server
        refuses this job's credentials, within the same bound (`retry_recovering`)."""
        if recovering:
            return retry_recovering(fn, self.connect_timeout)
        return retry_unavailable(fn, self.connect_timeout)

    def infos(self, recovering: bool = False) -> list[pb.StepInfo]:
        """Every server's Info for this worker; waits (`retry`) until all answer."""
        def all_reachable() -> list[pb.StepInfo]:
            infos = self.client.info_all(self.role.worker)
            for item in infos:
                if isinstance(item, PSError):
                    raise item
            return infos  # type: ignore[return-value]

        return self.retry(all_reachable, recovering)  # type: ignore[no-any-return]
