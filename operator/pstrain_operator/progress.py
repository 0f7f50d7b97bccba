"""Training progress: the seam to the runtime's status service on parameter server 0.

The runtime provides `pstrain_runtime.status_client.fetch_job_status(address, timeout)`
(torch-free). The operator image may lack the runtime entirely, so it is imported
lazily and a missing module means "no progress", never a crash. Tests pass a fake.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from pstrain_api.model import CheckpointStatus, Progress, TrainingJobStatus

log = logging.getLogger(__name__)



@dataclass(frozen=True)
class ProbeSecurity:
    """What the probe needs to be let in: the job's worker key (when its servers check
    credentials) and the CA of its TLS certificates (when they serve TLS)."""

    keys: Mapping[str, bytes] = field(default_factory=dict)
    ca: bytes | None = None


FetchStatus = Callable[[str, float, ProbeSecurity | None], Mapping[str, Any] | None]
# Ask PS 0 for a checkpoint; returns the step asked at, None when it cannot be reached.
AskCheckpoint = Callable[[str, float, ProbeSecurity | None], int | None]
# SetWorkers on one parameter server; returns the global step, None when refused/unreachable.
SetWorkersCall = Callable[[str, float, str, list[int], ProbeSecurity | None], int | None]
FETCH_TIMEOUT_S = 1.0
# While a running job has no step yet, progress is read this often (a short job would
# otherwise end before the first regular read and never show a step).
EARLY_PROGRESS_S = 2.0

# Significant digits of `status.progress.loss`: `kubectl get trainingjobs` prints the
# number whole in its Loss column (0.0006786651997649411 reads as 0.0006787).
LOSS_DIGITS = 4

# Keys the runtime may use for each Progress field, first match wins.
_KEYS = {
    "global_step": ("global_step", "globalStep", "step"),
    "loss": ("loss",),
    "samples_per_second": ("samples_per_second", "samplesPerSecond", "samples_per_sec"),
    "eval_accuracy": ("eval_accuracy", "evalAccuracy", "accuracy"),
    "auc": ("auc",),
    "logloss": ("logloss",),
    "sparse_rows": ("sparse_rows",),
    "sparse_bytes": ("sparse_bytes",),
}


def _no_status(address: str, timeout: float, security: ProbeSecurity | None) -> None:
    return None


def default_fetcher() -> FetchStatus:
    """The runtime's client when installed, else a fetcher that knows nothing."""
    try:
        from pstrain_runtime.status_client import fetch_job_status
    except ImportError:
        log.info("pstrain_runtime.status_client is not installed; progress is not reported")
        return _no_status

    def fetch(address: str, timeout: float,
              security: ProbeSecurity | None) -> Mapping[str, Any] | None:
        return fetch_job_status(address, timeout, **_secured(security))

    return fetch


def _no_checkpoint(address: str, timeout: float, security: ProbeSecurity | None) -> None:
    return None


def _secured(security: ProbeSecurity | None) -> dict[str, Any]:
    """The runtime client's keyword arguments for `security` (imports the runtime)."""
    from pstrain_runtime.transport.auth import Credentials
    from pstrain_runtime.transport.tls import TrustedCa

    security = security or ProbeSecurity()
    return {"credentials": Credentials(security.keys) if security.keys else None,
            "tls": TrustedCa(security.ca) if security.ca else None}


def default_worker_setter() -> SetWorkersCall:
    """The runtime's SetWorkers client when installed, else one that reaches no one (the
    operator then retries at its next reconcile)."""
    try:
        from pstrain_runtime.status_client import set_workers
    except ImportError:
        return lambda address, timeout, namespace, workers, security: None

    def call(address: str, timeout: float, namespace: str, workers: list[int],
             security: ProbeSecurity | None) -> int | None:
        return set_workers(address, timeout, namespace, workers, **_secured(security))

    return call


def default_asker() -> AskCheckpoint:
    """The runtime's RequestCheckpoint client when installed, else one that reaches no one
    (the operator then waits out its bound and goes on)."""
    try:
        from pstrain_runtime.status_client import request_checkpoint
    except ImportError:
        return _no_checkpoint

    def ask(address: str, timeout: float, security: ProbeSecurity | None) -> int | None:
        return request_checkpoint(address, timeout, **_secured(security))

    return ask


def rounded(value: float, digits: int = LOSS_DIGITS) -> float:
    """`value` to `digits` significant digits, still a number (the CRD's column and
    field stay `number`); nan and infinities pass through."""
    return float(f"{value:.{digits}g}")


def progress_from_status(data: Mapping[str, Any] | None, now: datetime) -> Progress | None:
    """The Progress in the runtime's status reply, or None when it carries none."""
    if not data:
        return None
    values: dict[str, Any] = {}
    for name, keys in _KEYS.items():
        for key in keys:
            if data.get(key) is not None:
                values[name] = data[key]
                break
    if "global_step" not in values:
        return None
    try:
        return Progress(
            global_step=max(0, int(values["global_step"])),
            loss=rounded(float(values["loss"])) if "loss" in values else None,
            samples_per_second=(float(values["samples_per_second"])
                                if "samples_per_second" in values else None),
            eval_accuracy=(float(values["eval_accuracy"])
                           if "eval_accuracy" in values else None),
            auc=float(values["auc"]) if "auc" in values else None,
            logloss=float(values["logloss"]) if "logloss" in values else None,
            sparse_rows=int(values["sparse_rows"]) if "sparse_rows" in values else None,
            sparse_bytes=int(values["sparse_bytes"]) if "sparse_bytes" in values else None,
            updated_at=now,
        )
    except (TypeError, ValueError):
        return None


def checkpoint_from_status(data: Mapping[str, Any] | None) -> CheckpointStatus | None:
    """The last checkpoint in the runtime's status reply, or None when there is none."""
    if not data or data.get("checkpoint_step") is None or not data.get("checkpoint_path"):
        return None
    try:
        when = data.get("checkpoint_time")
        return CheckpointStatus(
            step=max(0, int(data["checkpoint_step"])),
            path=str(data["checkpoint_path"]),
            time=datetime.fromtimestamp(float(when), UTC) if when else None,
        )
    except (TypeError, ValueError, OverflowError):
        return None


def progress_interval_for(status: TrainingJobStatus, interval: float) -> float:
    """How often to read a running job's progress: `interval`, or sooner while no step
    is known yet."""
    if status.progress is None or status.progress.global_step == 0:
        return min(interval, EARLY_PROGRESS_S)
    return interval


def chief_summary(message: str) -> dict[str, Any] | None:
    """The final summary the chief left as its termination message
    (pstrain_runtime.summary), or None when the message is not one."""
    try:
        data = json.loads(message)
    except ValueError:
        return None
    return data if isinstance(data, dict) and "global_step" in data else None
