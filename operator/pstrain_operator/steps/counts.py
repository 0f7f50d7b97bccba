"""The replica counts in the status (`replicaStatuses`, `psReady`, `workersReady`,
`workers`), as the pods will be once a plan is applied: so the next reconcile of an
unchanged world writes no new status."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from pstrain_api import constants as c
from pstrain_api.model import RoleStatus, TrainingJob, TrainingJobStatus

from .. import scaling
from ..observe import ObservedPod
from ..plan import Action, CreatePod, DeletePod


def count(job: TrainingJob, pods: Sequence[ObservedPod],
          old: Mapping[str, RoleStatus]) -> dict[str, RoleStatus]:
    """Pods per role and phase; the restarts carry over from `old`."""
    roles = [c.ROLE_PS, c.ROLE_WORKER] + ([c.ROLE_CHIEF] if job.has_separate_chief else [])
    out: dict[str, RoleStatus] = {}
    for role in roles:
        mine = [p for p in pods if p.role == role and not p.deleting]
        out[role] = RoleStatus(
            active=sum(1 for p in mine if p.active),
            ready=sum(1 for p in mine if p.ready),
            succeeded=sum(1 for p in mine if p.phase == "Succeeded"),
            failed=sum(1 for p in mine if p.phase == "Failed"),
            restarts=old[role].restarts if role in old else 0,
        )
    return out


def after(pods: Sequence[ObservedPod], actions: Sequence[Action]) -> list[ObservedPod]:
    """The pods as they will be once `actions` are applied."""
    gone = {a.name for a in actions if isinstance(a, DeletePod)}
    out = [p for p in pods if p.name not in gone]
    out += [ObservedPod(name=a.name, role=a.role, index=-1) for a in actions
            if isinstance(a, CreatePod)]
    return out


def with_counts(job: TrainingJob, st: TrainingJobStatus, pods: Sequence[ObservedPod],
                actions: Sequence[Action] = ()) -> TrainingJobStatus:
    """`st` with the counts of `pods` once `actions` are applied."""
    counts = count(job, after(pods, actions), st.replica_statuses)
    reps = job.spec.replicas
    workers_total = reps.worker.replicas + (1 if reps.chief else 0)
    workers_ready = counts[c.ROLE_WORKER].ready + (
        counts[c.ROLE_CHIEF].ready if c.ROLE_CHIEF in counts else 0
    )
    return st.model_copy(update={
        "workers": scaling.membership(job, after(pods, actions), st.workers),
        "replica_statuses": counts,
        "ps_ready": f"{counts[c.ROLE_PS].ready}/{reps.ps.replicas}",
        "workers_ready": f"{workers_ready}/{workers_total}",
    })
