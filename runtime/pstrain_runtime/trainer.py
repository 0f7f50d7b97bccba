"""Where a trainer's names have always been imported from: `Trainer` and what its callers
use with it. The worker side itself lives in `worker/` (see its package docstring for
which module owns what)."""

from __future__ import annotations

from .checkpoint import CheckpointError
from .worker.context import (TrainingDiverged, TrainResult, WorkerRole, pick_device,
                             wire_torch_dtype)
from .worker.trainer import Trainer

__all__ = ["CheckpointError", "TrainResult", "Trainer", "TrainingDiverged", "WorkerRole",
           "pick_device", "wire_torch_dtype"]
