"""Pods deleted or evicted from outside the operator (`kubectl delete pod`, a drain
through the Eviction API, preemption, the taint manager): name the cause in an event
and count the replacement.

Pure. A pod the operator did not delete is recognised while it terminates: it carries a
deletionTimestamp while the job is active, it is a replica of the spec, and it was
either still running (the operator deletes only failed replicas of an active job) or
carries a `DisruptionTarget` condition, whose reason names the cause
(EvictionByEvictionAPI, PreemptionByScheduler, DeletionByTaintManager, ...). Each pod is
counted once: its uid goes in `status.countedDisruptions` (the last `MEMORY` of them).
A DisruptionTarget also asks the chief for a checkpoint (`checkpointing`), once per pod.
A pod removed at once (`--grace-period=0 --force`), or while the operator was down, is
replaced without a trace: no terminating pod is ever seen.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from pstrain_api.model import RoleStatus, TrainingJobStatus

from .conditions import Event
from .observe import ACTIVE_PHASES, ObservedPod

R_POD_DISRUPTED = "PodDisrupted"
MEMORY = 32
ASKED = "asked:"  # marks the uid of a running pod whose announced disruption was answered


def cause(p: ObservedPod) -> str:
    """Why `p` is going away, as a user would say it."""
    if p.disruption:
        detail = f": {p.disruption_message}" if p.disruption_message else ""
        return f"DisruptionTarget {p.disruption}{detail}"
    return "deleted through the API (kubectl delete pod, or another client)"


def from_outside(pods: Iterable[ObservedPod], wanted: set[str], job_uid: str | None,
                 counted: Sequence[str]) -> list[ObservedPod]:
    """Terminating replicas of this job that someone else deleted, not yet counted."""
    return [p for p in pods
            if p.deleting and p.uid and p.uid not in counted and p.name in wanted
            and (not job_uid or not p.owner_uid or p.owner_uid == job_uid)
            and (p.disruption or p.phase in ACTIVE_PHASES)]


def announced(pods: Iterable[ObservedPod], wanted: set[str], job_uid: str | None,
              counted: Sequence[str]) -> list[ObservedPod]:
    """Replicas with a DisruptionTarget condition not seen before: each gets one
    checkpoint request (a terminating one is counted, a running one marked ASKED)."""
    return [p for p in pods
            if p.disruption and p.uid and p.name in wanted
            and (not job_uid or not p.owner_uid or p.owner_uid == job_uid)
            and p.uid not in counted and ASKED + p.uid not in counted]


def remembered(counted: Sequence[str], uids: Iterable[str]) -> list[str]:
    """`counted` with `uids` added, the oldest dropped beyond MEMORY."""
    out = list(counted) + [u for u in uids if u and u not in counted]
    return out[-MEMORY:]


def count(st: TrainingJobStatus, disrupted: Sequence[ObservedPod]) -> list[Event]:
    """Count each disrupted pod's replacement in `st` (restarts, per role, disruptions)
    and return one Warning event per pod naming the cause."""
    events = []
    for p in disrupted:
        st.restarts += 1
        st.disruptions += 1
        role = st.replica_statuses.get(p.role, RoleStatus())
        st.replica_statuses = {**st.replica_statuses,
                               p.role: role.model_copy(update={"restarts": role.restarts + 1})}
        events.append(Event("Warning", R_POD_DISRUPTED,
                            f"pod {p.name} ({p.role}) is going away: {cause(p)}; it will be "
                            f"replaced (restart {st.restarts}, not counted against "
                            "backoffLimit)"))
    st.counted_disruptions = remembered(st.counted_disruptions, (p.uid for p in disrupted))
    return events
