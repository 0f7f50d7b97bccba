"""The deadline step: `spec.runPolicy.activeDeadlineSeconds`, counted from the job's
start (or its last resume). Past it the job fails; a running one asks for a checkpoint
first (bounded). Before it, a pass looks again no later than the deadline."""

from __future__ import annotations

from .. import checkpointing
from ..plan import Plan
from .checkpoint_wait import wait_for_checkpoint
from .constants import R_DEADLINE
from .finished import finish
from .state import Pass


def enforce(p: Pass) -> Plan | None:
    """The plan that ends (or, for a checkpoint, holds) a job past its deadline; None
    while it is not past."""
    deadline = p.policy.active_deadline_seconds
    start = p.st.start_time
    if deadline is None or start is None or (p.now - start).total_seconds() < deadline:
        return None
    if p.old.phase == "Running":
        gate = checkpointing.gate(p.job, p.st, p.obs.checkpoint, p.now, "deadline")
        p = p.then(st=gate.status, events=gate.events)
        if not gate.ready:
            return wait_for_checkpoint(p, gate)
    message = f"the job ran longer than activeDeadlineSeconds ({deadline} s)"
    return finish(p, "Failed", R_DEADLINE, message)


def within_deadline(p: Pass, requeue: float) -> float:
    """`requeue`, or sooner: when the deadline comes (at least half a second away)."""
    deadline = p.policy.active_deadline_seconds
    if deadline is None or p.st.start_time is None:
        return requeue
    left = deadline - (p.now - p.st.start_time).total_seconds()
    return max(0.5, min(requeue, left))
