"""The executor: parse -> observe -> decide -> apply -> one status patch.

Imports neither kopf nor the kubernetes client; both come in through seams (`Kube`,
an event sink, a progress fetcher, a clock), so the whole loop is tested with fakes.
Reconciles of one job never run concurrently, because pod events and job events reach
the operator on different workers: a request that arrives while the job is being
reconciled marks it dirty and returns at once, and the running reconcile goes round
once more (a work queue that coalesces bursts of pod events, and never parks kopf's
worker threads on a lock). With leader election only one operator process acts, so
process-local bookkeeping is enough. It coordinates work only: what exists is always
read from the API server.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any

from pydantic import ValidationError

from pstrain_api import constants as c
from pstrain_api.cluster import ClusterSpec, Task, kubernetes_cluster_spec
from pstrain_api.model import TrainingJobStatus
from pstrain_api.readiness import runs_pstrain_runtime
from pstrain_api.validate import check_manifest

from .build import job_selector
from .kube import Kube, KubeError
from .metrics import Metrics
from .progress import (
    FETCH_TIMEOUT_S,
    FetchStatus,
    checkpoint_from_status,
    chief_summary,
    progress_from_status,
    progress_interval_for,
)
from .reconcile import (
    REQUEUE_RUNNING_S,
    CreateObject,
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
R_CREATE_REJECTED = "CreateRejected"
MAX_RERUNS = 10
COALESCED_REQUEUE_S = 2.0


@dataclass
class _JobState:
    """Work-queue bookkeeping of one job: is a reconcile running, and did a request
    arrive meanwhile (then the running one goes round once more)."""

    running: bool = False
    dirty: bool = False


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
    monotonic: Callable[[], float] = time.monotonic
    _jobs: dict[str, _JobState] = field(default_factory=dict, init=False)
    # When progress was last asked for, per job: only to rate-limit the probe (a PS that
    # cannot be reached costs up to the fetch timeout), never to decide anything.
    _asked: dict[str, float] = field(default_factory=dict, init=False)
    _guard: threading.Lock = field(default_factory=threading.Lock, init=False)

    def forget(self, namespace: str, name: str) -> None:
        """The job was deleted: drop its metrics entry and lock."""
        key = f"{namespace}/{name}"
        self.metrics.job_phase(key, None)
        with self._guard:
            state = self._jobs.get(key)
            if state is not None and not state.running:
                del self._jobs[key]
            self._asked.pop(key, None)

    def reconcile(self, namespace: str, name: str) -> float | None:
        """Reconcile job `namespace/name`; returns seconds until the next look, or None
        when only a new event should wake it. When another reconcile of the job is
        running, it is asked to go round again and this call returns at once with a
        short re-look delay."""
        key = f"{namespace}/{name}"
        with self._guard:
            state = self._jobs.setdefault(key, _JobState())
            if state.running:
                state.dirty = True
                return COALESCED_REQUEUE_S
            state.running = True
        try:
            for _ in range(MAX_RERUNS):
                with self._guard:
                    state.dirty = False
                delay = self._timed(namespace, name)
                with self._guard:
                    if not state.dirty:
                        return delay
            return COALESCED_REQUEUE_S  # still busy: the re-queue comes back soon
        finally:
            with self._guard:
                state.running = False

    def _timed(self, namespace: str, name: str) -> float | None:
        started = time.perf_counter()
        try:
            delay = self._reconcile(namespace, name)
        except Exception:
            self.metrics.reconciles.labels("error").inc()
            self.metrics.errors.inc()
            raise
        finally:
            self.metrics.latency.observe(time.perf_counter() - started)
        self.metrics.reconciles.labels("ok").inc()
        return delay

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
        cluster = kubernetes_cluster_spec(job)
        chief = next((p for p in observed_pods if p.name == cluster.replica_name(cluster.chief)),
                     None)
        chief_ended = chief is not None and chief.phase in ("Succeeded", "Failed")
        has_status = runs_pstrain_runtime(job.spec.replicas.ps)  # else no status service
        reply = None
        if (chief is not None and chief.phase == "Succeeded"
                and old_status.phase not in c.TERMINAL_PHASES):
            # The final read, before the clean-up deletes the parameter servers: the
            # chief's own summary, else PS 0 while it still answers.
            reply = chief_summary(chief.message)
            if reply is None and has_status:
                reply = self._fetch_status(job.name, cluster)
        elif (old_status.phase == "Running" and not chief_ended and has_status
                and self._may_ask(f"{job.namespace}/{job.name}", old_status)):
            reply = self._fetch_status(job.name, cluster)
        progress = progress_from_status(reply, now)
        checkpoint = checkpoint_from_status(reply)
        plan = decide(Observed(job, observed_pods, service, now, progress, checkpoint),
                      self.pod_settings, self.progress_interval)
        if plan.status.phase == "Running" and has_status and plan.requeue_after is not None:
            soon = progress_interval_for(plan.status, self.progress_interval)
            plan = replace(plan, requeue_after=min(plan.requeue_after, soon))
        return plan

    def _fetch_status(self, job_name: str, cluster: ClusterSpec) -> Mapping[str, Any] | None:
        address = str(cluster.addresses[Task(c.ROLE_PS, 0)])
        try:
            reply = self.fetch_status(address, FETCH_TIMEOUT_S)
        except Exception as exc:  # a status probe must never break reconciling
            log.info("progress of %s from %s unavailable: %s", job_name, address, exc)
            return None
        log.debug("job status of %s from %s: %s", job_name, address, reply)
        return reply

    def _may_ask(self, key: str, status: TrainingJobStatus) -> bool:
        """At most one progress probe per job per progress interval; more often while no
        step is known yet, so that a short job shows its step too."""
        now = self.monotonic()
        interval = progress_interval_for(status, self.progress_interval)
        with self._guard:
            if now - self._asked.get(key, -1e9) < interval * 0.9:
                return False
            self._asked[key] = now
            return True

    def apply(self, body: Mapping[str, Any], plan: Plan) -> None:
        """Carry out the plan's actions in order, then post its events."""
        meta = body.get("metadata") or {}
        namespace, name = meta.get("namespace", "default"), meta.get("name", "")
        for action in plan.actions:
            if isinstance(action, CreateService | CreateObject | CreatePod):
                try:
                    created = self.kube.create(action.manifest)
                except KubeError as exc:
                    # Quota, admission or an invalid template: say so on the job, then
                    # let the handler retry (the cause may be fixed meanwhile).
                    self.emit(body, Event("Warning", R_CREATE_REJECTED,
                                          f"creating {action.name} failed: {exc}"))
                    raise
                if created and isinstance(action, CreatePod):
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
