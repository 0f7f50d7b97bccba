"""The start-order decision: what is missing is created, in order. First the headless
Service and the parameter servers (with a gang's PodGroup); the non-chief workers only
once every parameter server is Ready (`may_start_workers`); the chief last. A gang job
starts every pod at once (the scheduler places them together; the runtime keeps the
order). Nothing is created while the pass holds. Pods are built by `build` and secured
by `security`."""

from __future__ import annotations

from dataclasses import dataclass

from pstrain_api import constants as c
from pstrain_api.cluster import ClusterSpec, Task
from pstrain_api.model import TrainingJob, TrainingJobStatus

from ..build import build_pod, build_service, owner_reference
from ..conditions import Event, set_condition
from ..gang import build_pod_group, gang_of
from ..plan import Action, CreateObject, CreatePod, CreateService
from ..security import secure_pod
from ..settings import PodSettings
from .constants import (R_CREATED_PS, R_CREATED_SERVICE, R_PODS_CREATED, R_STARTED_CHIEF,
                        R_STARTED_WORKERS)
from .state import Pass, names


@dataclass(frozen=True)
class PsReadiness:
    """The parameter servers as observed: how many are Ready of how many, and whether
    one exited 0 (the chief is done: its completion is about to be seen, so this is no
    reason to go back to Starting). A PS restarted this pass has not exited."""

    ready: int
    total: int
    finished: bool = False

    @property
    def all_ready(self) -> bool:
        return self.ready == self.total


def ps_readiness(p: Pass) -> PsReadiness:
    pods = [p.by_name.get(p.cluster.replica_name(t)) for t in p.cluster.ps_tasks()]
    return PsReadiness(
        ready=sum(1 for q in pods if q is not None and q.ready and not q.deleting),
        total=len(pods),
        finished=any(q is not None and q.phase == "Succeeded" and q.name not in p.restarted
                     for q in pods))


def may_start_workers(ps: PsReadiness, gang: bool) -> bool:
    """Workers and the chief start once every parameter server is Ready, or with them
    in a gang."""
    return ps.all_ready or gang


def build_replica(job: TrainingJob, cluster: ClusterSpec, task: Task,
                  settings: PodSettings) -> CreatePod:
    """The create of `task`'s pod: built, then secured."""
    manifest = secure_pod(build_pod(job, cluster, task, settings), job, cluster, task)
    return CreatePod(manifest["metadata"]["name"], task.role, manifest)


def create_missing(p: Pass, settings: PodSettings) -> Pass:
    """Create the Service, the parameter servers, then the workers and the chief, each
    when it is missing and its turn has come."""
    cluster = p.cluster

    def missing(tasks: list[Task]) -> list[CreatePod]:
        return [build_replica(p.job, cluster, t, settings) for t in tasks
                if not p.hold and cluster.replica_name(t) not in p.by_name]

    actions: list[Action] = []
    events: list[Event] = []
    if not p.obs.service_exists and not p.hold:
        service = build_service(p.job)
        name = service["metadata"]["name"]
        actions.append(CreateService(service, name))
        events.append(Event("Normal", R_CREATED_SERVICE, f"created headless Service {name}",
                            about=(name,)))
    new_ps = missing(cluster.ps_tasks())
    gang = gang_of(p.job) is not None  # every pod at once; the runtime keeps the order
    if new_ps:
        group = build_pod_group(p.job, owner_reference(p.job))
        if group is not None:
            actions.append(CreateObject(group["kind"], group))
        actions.extend(new_ps)
        events.append(Event("Normal", R_CREATED_PS, f"created parameter servers "
                            f"{names(new_ps)}", about=tuple(q.name for q in new_ps)))
    ps = ps_readiness(p)
    if may_start_workers(ps, gang):
        trainers = [t for t in cluster.tasks()
                    if t.role != c.ROLE_PS and not cluster.is_chief(t)]
        new_workers = missing(trainers)
        if new_workers:
            actions.extend(new_workers)
            why = ("gang start: created with the parameter servers" if gang else
                   f"all {ps.total} parameter servers are Ready")
            events.append(Event("Normal", R_STARTED_WORKERS,
                                f"{why}; started workers {names(new_workers)}",
                                about=tuple(q.name for q in new_workers)))
        for chief in missing([cluster.chief]):
            actions.append(chief)
            events.append(Event("Normal", R_STARTED_CHIEF, f"started the chief {chief.name}",
                                about=(chief.name,)))
    return p.then(st=_started(p, actions, bool(new_ps)), actions=actions, events=events)


def _started(p: Pass, actions: list[Action], new_ps: bool) -> TrainingJobStatus:
    """The status once pods are created: the start time (activeDeadlineSeconds counts
    from it) and the Created condition with the first parameter servers."""
    st = p.st.model_copy()
    if st.start_time is None and any(isinstance(a, CreatePod) for a in (*p.actions, *actions)):
        st.start_time = p.now
    if new_ps:
        st.conditions = set_condition(st.conditions, c.COND_CREATED, "True", R_PODS_CREATED,
                                      "The job's pods are being created.", p.now)
    return st
