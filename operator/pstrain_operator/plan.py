"""What a reconcile pass reads and what it hands the executor.

`Observed` is everything one pass looks at; `Plan` is what it decided: the actions, the
new status and the events. The executor (`controller.py`) carries a plan out and writes
its status once; `unapplied` is the plan as carried out when some creates were refused.
Pure: no kopf, no kubernetes client.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any

from pstrain_api import constants as c
from pstrain_api.cluster import Task, kubernetes_cluster_spec
from pstrain_api.model import CheckpointStatus, Progress, TrainingJob, TrainingJobStatus

from . import scaling
from .conditions import Event
from .observe import ObservedPod


@dataclass(frozen=True)
class Observed:
    """Everything one reconcile looks at."""

    job: TrainingJob
    pods: tuple[ObservedPod, ...]
    service_exists: bool
    now: datetime
    progress: Progress | None = None
    checkpoint: CheckpointStatus | None = None
    server_workers: tuple[int, ...] | None = None  # PS 0's live worker set, when read


@dataclass(frozen=True)
class CreateService:
    manifest: dict[str, Any] = field(compare=False)
    name: str = ""


@dataclass(frozen=True)
class CreateObject:
    """Another child object, such as a gang's PodGroup."""

    kind: str
    manifest: dict[str, Any] = field(compare=False, repr=False)

    @property
    def name(self) -> str:
        return str(self.manifest["metadata"]["name"])


@dataclass(frozen=True)
class CreatePod:
    name: str
    role: str
    manifest: dict[str, Any] = field(compare=False, repr=False)


@dataclass(frozen=True)
class DeletePod:
    name: str
    uid: str
    why: str = field(compare=False, default="")


@dataclass(frozen=True)
class DeleteJob:
    why: str = field(compare=False, default="")


@dataclass(frozen=True)
class RequestCheckpoint:
    """Ask the chief, through PS 0 at `address`, for a checkpoint before a disruption."""

    address: str
    why: str = field(compare=False, default="")


def ps0_address(job: TrainingJob) -> str:
    """Where the operator reaches parameter server 0 (status, checkpoint requests)."""
    return str(kubernetes_cluster_spec(job).addresses[Task(c.ROLE_PS, 0)])


SetWorkers = scaling.SetWorkers
Action = (CreateService | CreateObject | CreatePod | DeletePod | DeleteJob
          | RequestCheckpoint | SetWorkers)


@dataclass(frozen=True)
class Plan:
    actions: tuple[Action, ...]
    status: TrainingJobStatus
    events: tuple[Event, ...] = ()
    requeue_after: float | None = None

    @property
    def status_patch(self) -> dict[str, Any]:
        """The status as a JSON merge patch body: every field, None where it is unset
        (a merge patch deletes keys set to null)."""
        return status_to_api(self.status)


def status_to_api(status: TrainingJobStatus) -> dict[str, Any]:
    """Unset fields of objects become null (a merge patch removes them); list items,
    which a merge patch replaces whole, carry no nulls."""
    return _drop_nulls_in_lists(status.model_dump(by_alias=True, mode="json"))


def _drop_nulls_in_lists(value: Any, in_list: bool = False) -> Any:
    if isinstance(value, dict):
        return {k: _drop_nulls_in_lists(v, in_list) for k, v in value.items()
                if not (in_list and v is None)}
    if isinstance(value, list):
        return [_drop_nulls_in_lists(v, True) for v in value]
    return value


def unapplied(plan: Plan, names: set[str]) -> Plan:
    """The plan as carried out when the creates of `names` did not happen (the API
    server refused one): they are not counted, no event reports them, and a job whose
    chief was not created is not Running."""
    if not names:
        return plan
    st = plan.status
    counts = dict(st.replica_statuses)
    chief_missing = False
    for a in plan.actions:
        if isinstance(a, CreatePod) and a.name in names:
            if a.role in counts:
                role = counts[a.role]
                counts[a.role] = role.model_copy(update={"active": max(0, role.active - 1)})
            labels = (a.manifest.get("metadata") or {}).get("labels") or {}
            chief_missing |= labels.get(c.LABEL_IS_CHIEF) == "true"
    update: dict[str, Any] = {"replica_statuses": counts}
    refused_workers = sum(1 for a in plan.actions if isinstance(a, CreatePod)
                          and a.name in names and a.role == c.ROLE_WORKER)
    if st.workers is not None and refused_workers:
        update["workers"] = st.workers.model_copy(
            update={"live": max(0, st.workers.live - refused_workers)})
    if chief_missing and st.phase == "Running":
        update["phase"] = "Starting"
    return replace(
        plan,
        actions=tuple(a for a in plan.actions
                      if not (isinstance(a, CreatePod | CreateService) and a.name in names)),
        status=st.model_copy(update=update),
        events=tuple(e for e in plan.events if not set(e.about) & names),
    )
