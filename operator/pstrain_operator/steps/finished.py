"""The finished step: a job that has finished, and a job that finishes now.

A finished job (Succeeded or Failed) only cleans up its pods by its cleanPodPolicy and,
once ttlSecondsAfterFinished has passed, deletes itself. `finish` is how every other
step ends a job: the terminal phase, its condition and event, the completion time and
the clean-up, in one place.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from datetime import timedelta
from typing import Literal

from pstrain_api import constants as c
from pstrain_api.model import FailureCause, TrainingJob

from ..conditions import Event, set_condition
from ..observe import ObservedPod
from ..plan import Action, CreatePod, DeleteJob, DeletePod, Plan
from .constants import R_CLEANUP, R_TTL, REQUEUE_CLEANUP_S
from .state import Pass, names


def is_finished(p: Pass) -> bool:
    return p.old.phase in c.TERMINAL_PHASES


def cleanup_actions(job: TrainingJob, pods: Sequence[ObservedPod]) -> list[DeletePod]:
    """Pods to delete once the job has finished. Parameter servers never linger, whatever
    cleanPodPolicy says: without a chief they would wait forever."""
    policy = job.spec.run_policy.clean_pod_policy
    out = []
    for p in pods:
        if p.deleting:
            continue
        if policy == "All" or (p.active and (policy == "Running" or p.role == c.ROLE_PS)):
            out.append(DeletePod(p.name, p.uid, f"the job finished (cleanPodPolicy {policy})"))
    return out


def _cleanup_event(job: TrainingJob, cleanup: Sequence[DeletePod]) -> list[Event]:
    if not cleanup:
        return []
    return [Event("Normal", R_CLEANUP, f"deleted pods {names(cleanup)} "
                  f"(cleanPodPolicy {job.spec.run_policy.clean_pod_policy})")]


def decide_finished(p: Pass) -> Plan:
    """A finished job only cleans up and, after its TTL, deletes itself."""
    cleanup = cleanup_actions(p.job, p.live)
    actions: list[Action] = list(cleanup)
    events = _cleanup_event(p.job, cleanup)
    requeue = REQUEUE_CLEANUP_S if cleanup else None
    ttl = p.policy.ttl_seconds_after_finished
    done = p.st.completion_time
    if ttl is not None and done is not None:
        left = (done + timedelta(seconds=ttl) - p.now).total_seconds()
        if left <= 0:
            actions.append(DeleteJob(f"ttlSecondsAfterFinished ({ttl}) passed"))
            events.append(Event("Normal", R_TTL, f"deleting the job: it finished at "
                                f"{done.isoformat()} and ttlSecondsAfterFinished is {ttl}"))
            requeue = None
        else:
            requeue = min(requeue or left, left)
    return p.then(actions=actions, events=events).plan(requeue)


def finish(p: Pass, phase: Literal["Succeeded", "Failed"], reason: str, message: str,
           cause: FailureCause | None = None) -> Plan:
    """The job ends now: terminal phase, conditions, completion time, clean-up. The
    deletions decided so far stay; nothing is created any more."""
    st = p.st.model_copy()
    st.phase = phase
    st.completion_time = p.now
    st.failure = cause
    st.checkpoint_request = None
    kind = c.COND_SUCCEEDED if phase == "Succeeded" else c.COND_FAILED
    st.conditions = set_condition(st.conditions, kind, "True", reason, message, p.now)
    st.conditions = set_condition(st.conditions, c.COND_RUNNING, "False", reason,
                                  f"The job {phase.lower()}.", p.now)
    verb = "succeeded" if phase == "Succeeded" else "failed"
    ended = Event("Normal" if phase == "Succeeded" else "Warning", reason,
                  f"job {verb}: {message}")
    done = {a.name for a in p.actions if isinstance(a, DeletePod)}
    cleanup = cleanup_actions(p.job, [q for q in p.live if q.name not in done])
    ttl = p.policy.ttl_seconds_after_finished
    requeue: float | None = REQUEUE_CLEANUP_S if cleanup else None
    if ttl is not None:
        requeue = min(requeue or float(ttl), float(ttl)) if ttl > 0 else 0.5
    kept = tuple(a for a in p.actions if not isinstance(a, CreatePod))
    ending = replace(p, st=st, actions=kept)
    return ending.then(actions=cleanup,
                       events=[ended, *_cleanup_event(p.job, cleanup)]).plan(requeue)
