"""Checkpoint before disruption: suspend, an exceeded deadline and a pod eviction the
operator sees coming ask the chief for a checkpoint first (RequestCheckpoint on PS 0),
and success waits for the final one before the parameter servers are stopped.

Pure. The request lives in `status.checkpointRequest` (the step asked for, why, when),
so the wait survives operator restarts. A request is answered by a checkpoint at or
after its step, as PS 0 reports it (`status.lastCheckpoint`). The wait is bounded by
`WAIT_S`: handlers never sleep; the job is looked at again every `POLL_S` meanwhile.
Without `spec.training.checkpoint.directory` nothing is asked and nothing waits.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from pstrain_api.model import CheckpointRequest, CheckpointStatus, TrainingJob, TrainingJobStatus

from .conditions import Event

WAIT_S = 30.0
POLL_S = 2.0
R_REQUESTED = "CheckpointRequested"
R_CONFIRMED = "CheckpointConfirmed"
R_NOT_CONFIRMED = "CheckpointNotConfirmed"


@dataclass(frozen=True)
class Gate:
    """May the disruption go ahead (`ready`); must RequestCheckpoint be sent now (`ask`)."""

    ready: bool
    ask: bool
    status: TrainingJobStatus
    events: tuple[Event, ...] = ()
    requeue: float | None = None


def _latest(st: TrainingJobStatus) -> str:
    ckpt = st.last_checkpoint
    return f"the last checkpoint is at step {ckpt.step}" if ckpt else "there is no checkpoint"


def settle(st: TrainingJobStatus, now: datetime) -> tuple[TrainingJobStatus, tuple[Event, ...]]:
    """End a pending request once a checkpoint answers it, or once `WAIT_S` passed."""
    req = st.checkpoint_request
    if req is None:
        return st, ()
    have = st.last_checkpoint.step if st.last_checkpoint else None
    if have is not None and have >= req.step:
        return st.model_copy(update={"checkpoint_request": None}), (Event(
            "Normal", R_CONFIRMED,
            f"checkpoint at step {have} written ({req.reason}: asked for step "
            f"{req.step} or later)"),)
    waited = (now - req.requested_at).total_seconds() if req.requested_at else WAIT_S
    if waited >= WAIT_S:
        return st.model_copy(update={"checkpoint_request": None}), (Event(
            "Warning", R_NOT_CONFIRMED,
            f"no checkpoint at step {req.step} or later within {WAIT_S:g}s ({req.reason}); "
            f"going on: {_latest(st)}"),)
    return st, ()


def gate(job: TrainingJob, st: TrainingJobStatus, fresh: CheckpointStatus | None,
         now: datetime, reason: str, *, ask: bool = True, step: int | None = None) -> Gate:
    """Before a disruption for `reason`: wait for a checkpoint at or after `step` (the
    last global step seen, by default). `ask`: send RequestCheckpoint (False at success:
    the chief writes its final checkpoint by itself)."""
    if fresh is not None:
        st = st.model_copy(update={"last_checkpoint": fresh})
    if not job.spec.training.checkpoint.directory:
        return Gate(True, False, st)
    if st.checkpoint_request is None:
        want = step if step is not None else (st.progress.global_step if st.progress else 0)
        have = st.last_checkpoint.step if st.last_checkpoint else None
        if have is not None and have >= want:
            return Gate(True, False, st)
        st = st.model_copy(update={"checkpoint_request": CheckpointRequest(
            step=want, reason=reason, requested_at=now)})
        what = "asked the chief for a checkpoint" if ask else "waiting for the final checkpoint"
        return Gate(False, ask, st, (Event(
            "Normal", R_REQUESTED,
            f"{reason}: {what} at step {want} or later before going on (up to "
            f"{WAIT_S:g}s)"),), POLL_S)
    settled, events = settle(st, now)
    if settled.checkpoint_request is None:
        return Gate(True, False, settled, events)
    req = st.checkpoint_request
    left = WAIT_S - ((now - req.requested_at).total_seconds() if req.requested_at else 0)
    return Gate(False, False, st, (), max(0.5, min(POLL_S, left)))
