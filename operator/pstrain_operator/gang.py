"""Gang start (spec.runPolicy.gangScheduling): every pod of a job created at once as one
group that a batch scheduler admits all-or-nothing. Pure constructors, like build.py.

- Volcano: a `scheduling.volcano.sh/v1beta1` PodGroup named after the job, each pod
  annotated `scheduling.k8s.io/group-name`, schedulerName `volcano`;
- SchedulerPlugins (coscheduling): a `scheduling.x-k8s.io/v1alpha1` PodGroup, each pod
  labelled `scheduling.x-k8s.io/pod-group`, schedulerName `scheduler-plugins-scheduler`;
- Kueue (plain-pod integration): each pod labelled `kueue.x-k8s.io/pod-group-name` and
  `kueue.x-k8s.io/queue-name`, annotated `kueue.x-k8s.io/pod-group-total-count`; Kueue
  gates the pods until it admits the group. No PodGroup object.

In every mode the PodGroup asks for every replica (`minMember` = the job's pod count),
and the trainers get PSTRAIN_STARTUP_TIMEOUT: the runtime then waits at a barrier for
every parameter server's health check instead of the operator's ordered start.
"""

from __future__ import annotations

from typing import Any

from pstrain_api import constants as c
from pstrain_api.cluster import Task, task_count
from pstrain_api.model import GangScheduling, TrainingJob

VOLCANO_API = "scheduling.volcano.sh/v1beta1"
COSCHEDULING_API = "scheduling.x-k8s.io/v1alpha1"
VOLCANO_GROUP_ANNOTATION = "scheduling.k8s.io/group-name"
COSCHEDULING_GROUP_LABEL = "scheduling.x-k8s.io/pod-group"
KUEUE_GROUP_LABEL = "kueue.x-k8s.io/pod-group-name"
KUEUE_QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
KUEUE_TOTAL_ANNOTATION = "kueue.x-k8s.io/pod-group-total-count"
VOLCANO_QUEUE_ANNOTATION = "scheduling.volcano.sh/queue-name"
DEFAULT_SCHEDULERS = {"Volcano": "volcano", "SchedulerPlugins": "scheduler-plugins-scheduler"}


def gang_of(job: TrainingJob) -> GangScheduling | None:
    return job.spec.run_policy.gang_scheduling


def pod_group_name(job: TrainingJob) -> str:
    return job.name


def build_pod_group(job: TrainingJob, owner: dict[str, Any]) -> dict[str, Any] | None:
    """The PodGroup of a gang-started job (None for Kueue and for ordered start)."""
    gang = gang_of(job)
    if gang is None or gang.provider == "Kueue":
        return None
    spec: dict[str, Any] = {"minMember": task_count(job)}
    if gang.provider == "Volcano":
        api = VOLCANO_API
        if gang.queue:
            spec["queue"] = gang.queue
        if gang.priority_class_name:
            spec["priorityClassName"] = gang.priority_class_name
    else:
        api = COSCHEDULING_API
        spec["scheduleTimeoutSeconds"] = gang.startup_timeout_seconds
    return {
        "apiVersion": api,
        "kind": "PodGroup",
        "metadata": {
            "name": pod_group_name(job),
            "namespace": job.namespace,
            "labels": {c.LABEL_JOB: job.name, c.LABEL_MANAGED_BY: c.MANAGED_BY},
            "ownerReferences": [owner],
        },
        "spec": spec,
    }


def startup_env(job: TrainingJob, task: Task) -> dict[str, str]:
    """The barrier's timeout for the trainers of a gang-started job."""
    gang = gang_of(job)
    if gang is None or task.role == c.ROLE_PS:
        return {}
    return {c.ENV_STARTUP_TIMEOUT: str(gang.startup_timeout_seconds)}


def apply_to_pod(job: TrainingJob, pod: dict[str, Any]) -> dict[str, Any]:
    """`pod` with the gang's labels, annotations, schedulerName and priorityClassName
    (a template's own schedulerName and priorityClassName win)."""
    gang = gang_of(job)
    if gang is None:
        return pod
    meta, spec = pod["metadata"], pod["spec"]
    group = pod_group_name(job)
    if gang.provider == "Volcano":
        meta["annotations"][VOLCANO_GROUP_ANNOTATION] = group
        if gang.queue:
            meta["annotations"][VOLCANO_QUEUE_ANNOTATION] = gang.queue
    elif gang.provider == "SchedulerPlugins":
        meta["labels"][COSCHEDULING_GROUP_LABEL] = group
    else:
        meta["labels"][KUEUE_GROUP_LABEL] = group
        meta["annotations"][KUEUE_TOTAL_ANNOTATION] = str(task_count(job))
        if gang.queue:
            meta["labels"][KUEUE_QUEUE_LABEL] = gang.queue
    scheduler = gang.scheduler_name or DEFAULT_SCHEDULERS.get(gang.provider)
    if scheduler:
        spec.setdefault("schedulerName", scheduler)
    if gang.priority_class_name:
        spec.setdefault("priorityClassName", gang.priority_class_name)
    return pod
