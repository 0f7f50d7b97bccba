"""The suspended step: while `spec.runPolicy.suspend` is true the job has no pods and
stays; a running job checkpoints first (bounded, `checkpointing.gate`). On resume the
pods come back in order, progress is read afresh and activeDeadlineSeconds counts from
the resume. What a suspension loses is said in words by `suspend`."""

from __future__ import annotations

from pstrain_api import constants as c

from .. import checkpointing, suspend
from ..conditions import Event, set_condition
from ..plan import Action, DeletePod, Plan
from .checkpoint_wait import wait_for_checkpoint
from .constants import R_RESUMED, R_SUSPENDED, REQUEUE_CLEANUP_S
from .state import Pass


def is_suspended(p: Pass) -> bool:
    return p.policy.suspend


def decide_suspended(p: Pass) -> Plan:
    """Suspended: no pods, the job stays. A running job checkpoints first (bounded)."""
    st = p.st.model_copy()
    if p.obs.progress is not None:  # the freshest step: what a suspension loses counts
        st.progress = p.progress
    live = p.live
    if p.old.phase == "Running" and live:
        gate = checkpointing.gate(p.job, st, p.obs.checkpoint, p.now, "suspend")
        p = p.then(st=gate.status, events=gate.events)
        if not gate.ready:
            return wait_for_checkpoint(p, gate)
        st = gate.status.model_copy()
    actions: list[Action] = [DeletePod(q.name, q.uid, "the job is suspended") for q in live]
    events = []
    if p.old.phase != "Suspended":
        message, lost = suspend.suspended(p.job, st)
        events.append(Event("Normal", R_SUSPENDED, message))
        st.lost_steps += lost
    st.phase = "Suspended"
    st.create_refusal = None  # the user stepped in: retry afresh on resume
    st.conditions = set_condition(st.conditions, c.COND_SUSPENDED, "True", R_SUSPENDED,
                                  "The job is suspended (spec.runPolicy.suspend).", p.now)
    st.conditions = set_condition(st.conditions, c.COND_RUNNING, "False", R_SUSPENDED,
                                  "The job is suspended.", p.now)
    return p.then(st=st, actions=actions, events=events).plan(
        REQUEUE_CLEANUP_S if live else None)


def resume(p: Pass) -> Pass:
    """A job suspended until now: say from which step it continues, read progress
    afresh, and count activeDeadlineSeconds from now. Any other job: unchanged."""
    if p.old.phase != "Suspended":
        return p
    st = p.st.model_copy()
    message, st.resumed_from_step = suspend.resumed(p.job, st)
    st.progress = None  # read afresh once running again
    st.conditions = set_condition(st.conditions, c.COND_SUSPENDED, "False", R_RESUMED,
                                  "The job was resumed.", p.now)
    st.start_time = None  # activeDeadlineSeconds counts from the resume
    return p.then(st=st, events=[Event("Normal", R_RESUMED, message)],
                  progress=p.progress if p.obs.progress is not None else None)
