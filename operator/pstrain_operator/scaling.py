"""Elastic workers in the operator: a change of `spec.replicas.worker.replicas` (by
`kubectl scale`, `patch` or `apply`) adds or removes worker pods only; the parameter
servers and the chief are never touched for it and the job never restarts.

Pure: observed pods and the job in, pod deletions, events and the status block out.
The rules shared with the local runner and the parameter servers (which indices go,
bounds) are `pstrain_api.membership`; this module only maps them onto pods.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pstrain_api import constants as c
from pstrain_api.membership import REASON_SCALED_DOWN, REASON_SCALED_UP, plan_scale
from pstrain_api.model import TrainingJob, TrainingJobStatus, WorkerMembership

from .conditions import Event
from .observe import ObservedPod

ELASTIC_FIELDS = ("replicas", "minReplicas", "maxReplicas")  # of spec.replicas.worker


def worker_selector(job: TrainingJob) -> str:
    """The label selector of the job's worker pods (the scale subresource's)."""
    return f"{c.LABEL_JOB}={job.name},{c.LABEL_ROLE}={c.ROLE_WORKER}"


def _rigid(applied: Mapping[str, Any]) -> dict[str, Any]:
    """An applied spec without the fields a live scale may change."""
    out = json.loads(json.dumps(applied))
    worker = out.get("replicas", {}).get("worker", {})
    for key in ELASTIC_FIELDS:
        worker.pop(key, None)
    return out


def is_scale_only(applied: str, current: Mapping[str, Any]) -> bool:
    """Whether a pod's applied spec (its annotation, JSON) differs from `current` only in
    the worker count or its bounds: such a pod is not stale, the change is a scale."""
    try:
        old = json.loads(applied)
    except ValueError:
        return False
    return isinstance(old, dict) and _rigid(old) == _rigid(current)


def worker_pods(pods: Sequence[ObservedPod]) -> list[ObservedPod]:
    return [p for p in pods if p.role == c.ROLE_WORKER and not p.deleting]


def membership(job: TrainingJob, pods: Sequence[ObservedPod]) -> WorkerMembership:
    """status.workers: desired from the spec, live = worker pods not finished."""
    return WorkerMembership(desired=job.spec.replicas.worker.replicas,
                            live=sum(1 for p in worker_pods(pods) if p.active),
                            selector=worker_selector(job))


@dataclass(frozen=True)
class Scale:
    """What a scale does now: the worker pods it removes (name, uid, why) and its event."""

    remove: tuple[tuple[str, str, str], ...] = ()
    events: tuple[Event, ...] = ()


def decide_scale(job: TrainingJob, old: TrainingJobStatus,
                 pods: Sequence[ObservedPod]) -> Scale:
    """Worker pods beyond the desired count go (highest index first, never worker 0);
    missing ones are created by the ordinary "create what is missing" step. One event
    records each change of the desired count (status.workers.desired holds the last one
    seen), with its reason."""
    desired = job.spec.replicas.worker.replicas
    live = {p.index: p for p in worker_pods(pods)}
    plan = plan_scale(live, desired)
    before = old.workers.desired if old.workers is not None else None
    if before is None or before == desired:
        return Scale()  # no scale: stray pods are the ordinary step's (UnexpectedPod)
    reason = REASON_SCALED_UP if desired > before else REASON_SCALED_DOWN
    event = Event("Normal", reason,
                  f"spec.replicas.worker.replicas changed from {before} to {desired}; "
                  + (plan.message(len(live), desired) if not plan.is_noop
                     else "the worker pods already match"))
    remove = tuple((live[i].name, live[i].uid,
                    f"scale-down to {desired} workers (spec.replicas.worker.replicas)")
                   for i in plan.remove)
    return Scale(remove, (event,))


def trainer_indices(job: TrainingJob, pods: Sequence[ObservedPod]) -> list[int]:
    """The parameter servers' worker set: trainer indices of the chief and of the Ready
    worker pods within the desired count (a separate chief is trainer 0 and worker pod k
    is trainer k + 1; without one, worker pod k is trainer k). Pods not Ready yet are left
    out so that no step waits for a pod that is still starting."""
    desired = job.spec.replicas.worker.replicas
    offset = 1 if job.has_separate_chief else 0
    ready = {p.index + offset for p in worker_pods(pods) if p.ready and p.index < desired}
    return sorted(ready | {0})
