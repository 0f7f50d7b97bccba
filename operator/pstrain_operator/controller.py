"""The executor: parse -> observe -> decide -> apply -> one status patch.

Imports neither kopf nor the kubernetes client; both come in through seams (`Kube`,
an event sink, a progress fetcher, a clock), so the whole loop is tested with fakes.
Reconciles of one job are serialised by a per-job lock, because pod events and job
events reach the operator on different workers; with leader election only one
operator process acts, so a process-local lock is enough. The lock coordinates work
only: what exists is always read from the API server.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from pydantic import ValidationError

from pstrain_api import constants as c
from pstrain_api.cluster import Task, kubernetes_cluster_spec
from pstrain_api.model import TrainingJobStatus
from pstrain_api.validate import check_manifest

from .build import job_selector
from .kube import Kube
from .metrics import Metrics
from .progress import (
    FETCH_TIMEOUT_S,
    FetchStatus,
    checkpoint_from_status,
    progress_from_status,
)
from .reconcile import (
    REQUEUE_RUNNING_S,
    CreatePod,
    CreateService,
    DeleteJob,
    DeletePod,
    Event,
    Observed,
    Plan,
    decide,
    decide_invalid,
    observe_pod,
    status_to_api,
)
from .settings import PodSettings

log = logging.getLogger(__name__)

EventSink = Callable[[Mapping[str, Any], Event], None]
LOCK_TIMEOUT_S = 60.0


class Busy(RuntimeError):
    """Another reconcile of the same job held its lock too long; try again shortly."""


def parse_status(raw: Any) -> TrainingJobStatus:
    """The stored status, keeping what parses: an unreadable status starts afresh
    rather than wedging the job (a real server prunes unknown fields anyway)."""
    if not isinstance(raw, Mapping):
        return TrainingJobStatus()
    known = {f.alias or n for n, f in TrainingJobStatus.model_fields.items()}
    try:
        return TrainingJobStatus.model_validate({k: v for k, v in raw.items() if k in known})
    except ValidationError:
        log.warning("the stored status does not parse; rebuilding it")
        return TrainingJobStatus()


@dataclass
class Reconciler:
    kube: Kube
    pod_settings: PodSettings
    emit: EventSink
    fetch_status: FetchStatus
    metrics: Metrics = field(default_factory=Metrics)
    clock: Callable[[], datetime] = field(default=lambda: datetime.now(UTC))
    progress_interval: float = REQUEUE_RUNNING_S
    _locks: dict[str, threading.Lock] = field(default_factory=dict, init=False)
    _guard: threading.Lock = field(default_factory=threading.Lock, init=False)

    def _lock_for(self, key: str) -> threading.Lock:
        with self._guard:
            return self._locks.setdefault(key, threading.Lock())

    def forget(self, namespace: str, name: str) -> None:
        """The job was deleted: drop its metrics entry and lock."""
        key = f"{namespace}/{name}"
        self.metrics.job_phase(key, None)
        with self._guard:
            self._locks.pop(key, None)

    def reconcile(self, namespace: str, name: str) -> float | None:
        """One pass over job `namespace/name`; returns seconds until the next look, or
        None when only a new event should wake it."""
        lock = self._lock_for(f"{namespace}/{name}")
        if not lock.acquire(timeout=LOCK_TIMEOUT_S):
            raise Busy(f"another reconcile of {namespace}/{name} is still running")
        started = time.perf_counter()
        try:
            delay = self._reconcile(namespace, name)
        except Exception:
            self.metrics.reconciles.labels("error").inc()
            self.metrics.errors.inc()
            raise
        else:
            self.metrics.reconciles.labels("ok").inc()
            return delay
        finally:
            self.metrics.latency.observe(time.perf_counter() - started)
            lock.release()

    def _reconcile(self, namespace: str, name: str) -> float | None:
        body = self.kube.get_job(namespace, name)
        if body is None or (body.get("metadata") or {}).get("deletionTimestamp"):
            return None
        old_status = parse_status(body.get("status"))
        plan = self.plan(body, old_status)
        self.apply(body, plan)
        new = plan.status_patch
        if new != status_to_api(old_status):
            self.kube.patch_job_status(namespace, name, new)
        self.metrics.job_phase(f"{namespace}/{name}", plan.status.phase)
        return plan.requeue_after

    def plan(self, body: Mapping[str, Any], old_status: TrainingJobStatus) -> Plan:
        """Parse and observe, then decide."""
        now = self.clock()
        manifest = {k: v for k, v in body.items() if k != "status"}
        job, problems = check_manifest(manifest, source="")
        meta = body.get("metadata") or {}
        if job is None:
            return decide_invalid(old_status, [p.message for p in problems],
                                  meta.get("generation"), now)
        job = job.model_copy(update={"status": old_status})
        pods = [observe_pod(p) for p in self.kube.list_pods(job.namespace, job_selector(job.name))]
        observed_pods = tuple(p for p in pods if p is not None)
        service = self.kube.service_exists(job.namespace, job.name)
        progress = checkpoint = None
        if old_status.phase == "Running":
            address = str(kubernetes_cluster_spec(job).addresses[Task(c.ROLE_PS, 0)])
            try:
                reply = self.fetch_status(address, FETCH_TIMEOUT_S)
            except Exception as exc:  # a status probe must never break reconciling
                log.info("progress of %s from %s unavailable: %s", job.name, address, exc)
                reply = None
            log.debug("job status of %s from %s: %s", job.name, address, reply)
            progress = progress_from_status(reply, now)
            checkpoint = checkpoint_from_status(reply)
        return decide(Observed(job, observed_pods, service, now, progress, checkpoint),
                      self.pod_settings, self.progress_interval)

    def apply(self, body: Mapping[str, Any], plan: Plan) -> None:
        """Carry out the plan's actions in order, then post its events."""
        meta = body.get("metadata") or {}
        namespace, name = meta.get("namespace", "default"), meta.get("name", "")
        for action in plan.actions:
            if isinstance(action, CreateService):
                self.kube.create(action.manifest)
            elif isinstance(action, CreatePod):
                if self.kube.create(action.manifest):
                    self.metrics.pods_created.labels(action.role).inc()
            elif isinstance(action, DeletePod):
                log.info("deleting pod %s/%s: %s", namespace, action.name, action.why)
                self.kube.delete_pod(namespace, action.name, action.uid)
            elif isinstance(action, DeleteJob):
                log.info("deleting job %s/%s: %s", namespace, name, action.why)
                self.kube.delete_job(namespace, name)
        for event in plan.events:
            log.info("%s/%s %s: %s", namespace, name, event.reason, event.message)
            self.emit(body, event)
