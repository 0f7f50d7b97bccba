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
from pstrain_api.membership import (REASON_SCALED_DOWN, REASON_SCALED_UP, plan_scale,
                                    trainer_index)
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


def membership(job: TrainingJob, pods: Sequence[ObservedPod],
               old: WorkerMembership | None = None) -> WorkerMembership:
    """status.workers: desired from the spec, live = worker pods not finished; the
    members last set on the parameter servers are kept."""
    return WorkerMembership(desired=job.spec.replicas.worker.replicas,
                            live=sum(1 for p in worker_pods(pods) if p.active),
                            selector=worker_selector(job),
                            members=old.members if old is not None else None)


@dataclass(frozen=True)
class SetWorkers:
    """Make `workers` (trainer indices) the worker set on every parameter server at
    `addresses` (the SetWorkers call, with the chief's key)."""

    addresses: tuple[str, ...]
    workers: tuple[int, ...]


def _initialised_trainers(job: TrainingJob, pods: Sequence[ObservedPod]) -> int | None:
    """How many trainers the chief initialised the servers for: the worker count (plus
    a separate chief) of the spec its pod was built from; None without a chief pod."""
    role, index = (c.ROLE_CHIEF, 0) if job.has_separate_chief else (c.ROLE_WORKER, 0)
    chief = next((p for p in pods if p.role == role and p.index == index and not p.deleting),
                 None)
    if chief is None:
        return None
    try:
        replicas = json.loads(chief.applied_spec)["replicas"]
        return int(replicas["worker"].get("replicas", 2)) + (1 if "chief" in replicas else 0)
    except (ValueError, KeyError, TypeError, AttributeError):
        return None


def decide_worker_set(job: TrainingJob, old: TrainingJobStatus,
                      pods: Sequence[ObservedPod], addresses: Sequence[str],
                      on_servers: Sequence[int] | None = None) -> SetWorkers | None:
    """The SetWorkers call a running job needs now, or None. The servers' set is: the
    trainers the chief initialised them for, less those a scale-down removed, plus the
    newcomers whose pods are Ready (so no step waits for a pod still starting, and a
    worker of the initial set is never dropped for a readiness blip). Sent when it
    differs from the last one sent (status.workers.members), or from Init's default,
    or from the set PS 0 reports (`on_servers`: a server the chief re-initialised, or
    a restarted chief's restore, installed an older set)."""
    initial = _initialised_trainers(job, pods)
    if initial is None:
        return None
    desired = job.spec.replicas.worker.replicas + (1 if job.has_separate_chief else 0)
    kept = set(range(min(initial, desired)))
    target = sorted(kept | {i for i in trainer_indices(job, pods) if i >= initial})
    last = old.workers.members if old.workers is not None else None
    if target == (last if last is not None else list(range(initial))) and (
            on_servers is None or list(on_servers) == target):
        return None
    return SetWorkers(tuple(addresses), tuple(target))


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


def server_workers(reply: Mapping[str, Any] | None) -> tuple[int, ...] | None:
    """The live worker set in PS 0's job status, when the reply has one."""
    workers = reply.get("workers") if reply is not None else None
    if not isinstance(workers, list) or not all(isinstance(w, int) for w in workers):
        return None
    return tuple(workers)


def trainer_indices(job: TrainingJob, pods: Sequence[ObservedPod]) -> list[int]:
    """The parameter servers' worker set: trainer indices of the chief and of the Ready
    worker pods within the desired count (a separate chief is trainer 0 and worker pod k
    is trainer k + 1; without one, worker pod k is trainer k). Pods not Ready yet are left
    out so that no step waits for a pod that is still starting."""
    desired = job.spec.replicas.worker.replicas
    ready = {trainer_index(p.index, job.has_separate_chief) for p in worker_pods(pods)
             if p.ready and p.index < desired}
    return sorted(ready | {0})
