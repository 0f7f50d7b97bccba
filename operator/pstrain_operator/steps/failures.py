"""The failures step: a failed replica is restarted within the run policy, or fails the
job with its root cause. Disruptions from outside are restarts too, but do not count
against backoffLimit. A parameter server that exited 0 while the chief has not
succeeded failed as well, once `PS_EXIT_GRACE_S` has passed (a PS exits 0 when the
chief, done, tells it to stop: just before the chief's own success is seen). Which
failure is restarted is `pstrain_api.policy`, the rule the local runner follows too.
"""

from __future__ import annotations

from datetime import datetime

from pstrain_api import constants as c
from pstrain_api.cluster import Task
from pstrain_api.model import FailureCause, RoleStatus
from pstrain_api.policy import RestartDecision, decide_ps_exit, decide_restart, shorten

from .. import disruption
from ..conditions import Event
from ..observe import ObservedPod
from ..plan import Action, DeletePod, Plan
from .constants import R_RESTARTING
from .finished import finish
from .state import Pass

# One that exited 0 this long ago while the chief has not succeeded failed.
PS_EXIT_GRACE_S = 30.0


def exited_early(p: ObservedPod, now: datetime) -> bool:
    """`p` exited 0 more than PS_EXIT_GRACE_S ago (an unknown finish time: not yet)."""
    return (p.phase == "Succeeded" and p.finished_at is not None
            and (now - p.finished_at).total_seconds() >= PS_EXIT_GRACE_S)


def how(p: ObservedPod) -> str:
    """How `p` ended, in words: its reason and exit code."""
    parts = [p.reason] if p.reason else []
    if p.exit_code is not None:
        parts.append(f"exit code {p.exit_code}")
    return ", ".join(parts) or "unknown cause"


def _decision(p: Pass, task: Task, pod: ObservedPod, used: int) -> RestartDecision | None:
    """What to do about `pod`, with `used` restarts spent; None when it did not fail."""
    if pod.phase == "Failed":
        # The pod's termination message (its last error line, or its log's tail) goes
        # into the status and the events now, before the pod is deleted or restarted.
        return decide_restart(p.policy, pod.name, pod.exit_code, used, pod.reason,
                              detail=pod.message)
    if task.role == c.ROLE_PS and not p.chief_done and exited_early(pod, p.now):
        return decide_ps_exit(p.policy, pod.name, used)
    return None


def restart_or_fail(p: Pass) -> tuple[Pass, Plan | None]:
    """The pass with the failed replicas deleted for a restart; or, with the plan that
    fails the job, at the first failure the run policy does not restart."""
    st = p.st.model_copy()
    actions: list[Action] = []
    events: list[Event] = []
    restarted: set[str] = set()
    for task in p.cluster.tasks():
        pod = p.by_name.get(p.cluster.replica_name(task))
        if pod is None or pod.deleting:
            continue
        used = st.restarts - st.disruptions
        decision = _decision(p, task, pod, used)
        if decision is None:
            continue
        if decision.action == "fail":
            cause = FailureCause(role=pod.role, pod=pod.name, exit_code=pod.exit_code,
                                 reason=pod.reason, message=pod.message or decision.message)
            so_far = p.then(st=st, actions=actions, events=events,
                            restarted=p.restarted | restarted)
            return so_far, finish(so_far, "Failed", decision.reason,
                                  f"pod {pod.name} ({pod.role}) failed ({how(pod)}): "
                                  f"{decision.message}", cause)
        actions.append(DeletePod(pod.name, pod.uid, decision.message))
        restarted.add(pod.name)
        st.counted_disruptions = disruption.remembered(st.counted_disruptions, [pod.uid])
        st.restarts += 1
        role = st.replica_statuses.get(pod.role, RoleStatus())
        st.replica_statuses = {**st.replica_statuses, pod.role: role.model_copy(
            update={"restarts": role.restarts + 1})}
        last = f"; its last output: {shorten(pod.message)}" if pod.message else ""
        events.append(Event("Warning", R_RESTARTING,
                            f"restarting pod {pod.name}: it failed ({how(pod)}); restart "
                            f"{used + 1} of {p.policy.backoff_limit}{last}"))
    return p.then(st=st, actions=actions, events=events,
                  restarted=p.restarted | restarted), None
