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
from pstrain_api import security
from pstrain_api.cluster import kubernetes_cluster_spec
from pstrain_api.model import TrainingJob, TrainingJobStatus
from pstrain_api.readiness import runs_pstrain_runtime
from pstrain_api.validate import check_for_kubernetes, check_manifest

from .build import job_selector
from .kube import Kube, KubeError
from .metrics import Metrics
from .progress import (
    FETCH_TIMEOUT_S,
    AskCheckpoint,
    FetchStatus,
    SetWorkersCall,
    checkpoint_from_status,
    chief_summary,
    progress_from_status,
    progress_interval_for,
)
from .scaling import server_workers
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
    RequestCheckpoint,
    SetWorkers,
    decide,
    decide_invalid,
    ps0_address,
    status_to_api,
    unapplied,
)
from .observe import observe_pod
from .refusals import cleared, record_refusal, wait_left
from .security import (
    check_tls_secret,
    ensure_auth_secret,
    ensure_network_policy,
    ensure_own_key_secret,
    network_policy_name,
    probe_security,
    stored_worker_keys,
)
from .settings import PodSettings

log = logging.getLogger(__name__)

EventSink = Callable[[Mapping[str, Any], Event], None]
MAX_RERUNS = 10
COALESCED_REQUEUE_S = 2.0
# A namespace that refused a create because it is being deleted is left alone this long
# (then tried once more): no retries, events or status writes into a dying namespace.
TERMINATING_NAMESPACE_S = 60.0


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
    ask_checkpoint: AskCheckpoint = field(default=lambda address, timeout, security: None)
    set_workers: SetWorkersCall = field(
        default=lambda address, timeout, namespace, workers, security: None)
    metrics: Metrics = field(default_factory=Metrics)
    clock: Callable[[], datetime] = field(default=lambda: datetime.now(UTC))
    progress_interval: float = REQUEUE_RUNNING_S
    monotonic: Callable[[], float] = time.monotonic
    network_policy: bool = False  # a NetworkPolicy per job (the chart turns it on)
    operator_namespace: str = ""  # admitted to PS 0's gRPC port by that policy
    _jobs: dict[str, _JobState] = field(default_factory=dict, init=False)
    # When progress was last asked for, per job: only to rate-limit the probe (a PS that
    # cannot be reached costs up to the fetch timeout), never to decide anything.
    _asked: dict[str, float] = field(default_factory=dict, init=False)
    # Namespaces seen being deleted, with when (monotonic): rate-limits work only.
    _terminating: dict[str, float] = field(default_factory=dict, init=False)
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
        with self._guard:
            seen = self._terminating.get(namespace)
        if seen is not None and self.monotonic() - seen < TERMINATING_NAMESPACE_S:
            return None
        body = self.kube.get_job(namespace, name)
        if body is None or (body.get("metadata") or {}).get("deletionTimestamp"):
            return None
        old_status = parse_status(body.get("status"))
        plan = self.plan(body, old_status)
        try:
            plan = self.apply(body, plan)
        except NamespaceTerminating:
            log.info("namespace %s is being deleted; leaving job %s alone", namespace, name)
            with self._guard:
                self._terminating[namespace] = self.monotonic()
            return None
        new = plan.status_patch
        if new != status_to_api(old_status):
            self.kube.patch_job_status(namespace, name, new)
        self.metrics.job_phase(f"{namespace}/{name}", plan.status.phase)
        return plan.requeue_after

    def plan(self, body: Mapping[str, Any], old_status: TrainingJobStatus) -> Plan:
        """Parse and observe, then decide."""
        now = self.clock()
        manifest = {k: v for k, v in body.items() if k != "status"}
        job, problems = check_for_kubernetes(manifest, source="")
        meta = body.get("metadata") or {}
        if job is None:
            return decide_invalid(old_status, [p.message for p in problems],
                                  meta.get("generation"), now)
        job = job.model_copy(update={"status": old_status})
        running = old_status.phase not in c.TERMINAL_PHASES
        keys, refused = self._prepare(job, old_status, now) if running else (None, None)
        pods = [observe_pod(p) for p in self.kube.list_pods(job.namespace, job_selector(job.name))]
        observed_pods = tuple(p for p in pods if p is not None)
        service = self.kube.service_exists(job.namespace, job.name)
        cluster = kubernetes_cluster_spec(job)
        chief = next((p for p in observed_pods if p.name == cluster.replica_name(cluster.chief)),
                     None)
        chief_failed = chief is not None and chief.phase == "Failed"
        chief_succeeded = chief is not None and chief.phase == "Succeeded"
        has_status = runs_pstrain_runtime(job.spec.replicas.ps)  # else no status service
        # The final read once the chief succeeded, before the clean-up deletes the
        # parameter servers: the chief's own summary (its termination message) first.
        reply = (chief_summary(chief.message)
                 if chief is not None and chief_succeeded
                 and old_status.phase not in c.TERMINAL_PHASES else None)
        # Progress while running; at once while a checkpoint is awaited (suspend, a
        # deadline, the final one after the chief succeeded).
        awaited = old_status.checkpoint_request is not None or chief_succeeded
        if (reply is None and has_status and old_status.phase == "Running"
                and not chief_failed
                and (awaited or self._may_ask(f"{job.namespace}/{job.name}", old_status))):
            reply = self._fetch_status(job, keys)
        progress = progress_from_status(reply, now)
        checkpoint = checkpoint_from_status(reply)
        plan = decide(Observed(job, observed_pods, service, now, progress, checkpoint,
                               server_workers(reply)),
                      self.pod_settings, self.progress_interval)
        if refused is not None:
            plan = self._without_pods(plan, *refused)
        if plan.status.phase == "Running" and has_status and plan.requeue_after is not None:
            soon = progress_interval_for(plan.status, self.progress_interval)
            plan = replace(plan, requeue_after=min(plan.requeue_after, soon))
        return plan

    def _prepare(self, job: TrainingJob, old_status: TrainingJobStatus, now: datetime,
                 ) -> tuple[Any, tuple[str, KubeError] | None]:
        """What exists before any pod, in order: the credentials Secret, which the pods
        mount (created if absent, never rewritten; its worker key lets the progress
        probe in: the one step that returns something), the TLS Secret the job names
        (read: complete?), then the job's NetworkPolicy when the operator makes one per
        job. Returns the keys, and the object refused with its refusal, if any. After a
        refusal, that object and what comes after it are not tried again until its
        back-off has passed."""
        steps: list[tuple[str, Callable[[], Any]]] = []
        if job.spec.security.authentication:
            steps.append((f"Secret/{security.secret_name(job.name)}",
                          lambda: ensure_auth_secret(self.kube, job)))
        if job.spec.security.tls is not None:
            steps.append((f"Secret/{job.spec.security.tls.secret_name}",
                          lambda: check_tls_secret(self.kube, job)))
        if self.network_policy:
            steps.append((f"NetworkPolicy/{network_policy_name(job.name)}",
                          lambda: ensure_network_policy(self.kube, job,
                                                        self.operator_namespace)))
        refusal = old_status.create_refusal
        waiting = (refusal.object if refusal is not None
                   and wait_left(old_status, job.metadata.generation, now) > 0 else None)
        names = [obj for obj, _ in steps]
        keys = None
        for obj, step in steps[:names.index(waiting) if waiting in names else None]:
            try:
                got = step()
            except KubeError as exc:
                if exc.namespace_terminating:
                    raise
                return keys, (obj, exc)
            keys = keys if got is None else got
        return keys, None

    def _without_pods(self, plan: Plan, obj: str, exc: KubeError) -> Plan:
        """The plan without its creates (pods, the Service), the refusal of `obj` (made
        before them) in the status with back-off, as for a create the API server
        refused."""
        skipped = {a.name for a in plan.actions if isinstance(a, CreatePod | CreateService)}
        return self._refused(plan, skipped, obj, exc)

    def _refused(self, plan: Plan, skipped: set[str], obj: str, exc: KubeError) -> Plan:
        """The plan as carried out without the creates of `skipped`, with the refusal of
        `obj` in the status, its event, and the back-off before the next attempt."""
        plan = unapplied(plan, skipped)
        status, event, delay = record_refusal(plan.status, obj, exc.status or None,
                                              exc.api_message, self.clock())
        return replace(plan, status=status, requeue_after=delay,
                       events=plan.events + ((event,) if event else ()))

    def _fetch_status(self, job: TrainingJob, keys: Any) -> Mapping[str, Any] | None:
        address = ps0_address(job)
        try:
            reply = self.fetch_status(address, FETCH_TIMEOUT_S,
                                      probe_security(self.kube, job, keys))
        except Exception as exc:  # a status probe must never break reconciling
            log.info("progress of %s from %s unavailable: %s", job.name, address, exc)
            return None
        log.debug("job status of %s from %s: %s", job.name, address, reply)
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

    def apply(self, body: Mapping[str, Any], plan: Plan) -> Plan:
        """Carry out the plan's actions in order, then post its events; returns the plan
        as carried out. A refused create is expected (an invalid template, a missing
        ServiceAccount, a quota): the creates after it are skipped, and the refusal goes
        in the status with back-off (`refusals`), never as an exception."""
        meta = body.get("metadata") or {}
        namespace, name = meta.get("namespace", "default"), meta.get("name", "")
        refused: tuple[str, KubeError] | None = None
        skipped: set[str] = set()
        for action in plan.actions:
            if isinstance(action, CreateService | CreateObject | CreatePod):
                if refused is not None:
                    skipped.add(action.name)
                    continue
                try:
                    if isinstance(action, CreatePod):
                        ensure_own_key_secret(self.kube, action.manifest)
                    created = self.kube.create(action.manifest)
                except KubeError as exc:
                    if exc.namespace_terminating:
                        raise NamespaceTerminating(namespace) from exc
                    kind = action.manifest.get("kind", "Pod")
                    log.warning("%s/%s: the API server refused to create %s %s (%s): %s",
                                namespace, name, kind, action.name, exc.status,
                                exc.api_message)
                    refused = (f"{kind}/{action.name}", exc)
                    skipped.add(action.name)
                    continue
                if created and isinstance(action, CreatePod):
                    self.metrics.pods_created.labels(action.role).inc()
            elif isinstance(action, DeletePod):
                log.info("deleting pod %s/%s: %s", namespace, action.name, action.why)
                self.kube.delete_pod(namespace, action.name, action.uid)
            elif isinstance(action, DeleteJob):
                log.info("deleting job %s/%s: %s", namespace, name, action.why)
                self.kube.delete_job(namespace, name)
            elif isinstance(action, RequestCheckpoint):
                plan = self._ask_checkpoint(body, plan, action)
            elif isinstance(action, SetWorkers):
                plan = self._set_workers(body, plan, action)
        if refused is not None:
            plan = self._refused(plan, skipped, *refused)
        elif any(isinstance(a, CreateService | CreatePod) for a in plan.actions):
            plan = replace(plan, status=cleared(plan.status, self.clock()))
        for event in plan.events:
            log.info("%s/%s %s: %s", namespace, name, event.reason, event.message)
            self.emit(body, event)
        return plan


    def _ask_checkpoint(self, body: Mapping[str, Any], plan: Plan,
                        action: RequestCheckpoint) -> Plan:
        """RequestCheckpoint on PS 0. The step it was asked at (PS 0's, fresher than the
        operator's last reading) becomes the step awaited; an unreachable PS 0 leaves the
        request to run out its bound."""
        meta = body.get("metadata") or {}
        try:
            job, _ = check_manifest({k: v for k, v in body.items() if k != "status"},
                                    source="")
            security = None if job is None else probe_security(
                self.kube, job, stored_worker_keys(self.kube, job))
            step = self.ask_checkpoint(action.address, FETCH_TIMEOUT_S, security)
        except Exception as exc:  # a control call must never break reconciling
            log.info("checkpoint request to %s failed: %s", action.address, exc)
            step = None
        log.info("%s/%s: asked %s for a checkpoint (%s): %s", meta.get("namespace"),
                 meta.get("name"), action.address, action.why,
                 f"at step {step}" if step is not None else "unreachable")
        req = plan.status.checkpoint_request
        if step is None or req is None or step <= req.step:
            return plan
        return replace(plan, status=plan.status.model_copy(update={
            "checkpoint_request": req.model_copy(update={"step": step})}))

    def _set_workers(self, body: Mapping[str, Any], plan: Plan, action: SetWorkers) -> Plan:
        """SetWorkers on every parameter server, with the chief's key. When any call
        fails, status.workers.members goes back to what it was, so the next reconcile
        sends the set again (the call is idempotent)."""
        meta = body.get("metadata") or {}
        namespace = f"{meta.get('namespace') or 'default'}/{meta.get('name')}"
        try:
            job, _ = check_manifest({k: v for k, v in body.items() if k != "status"},
                                    source="")
            security = None if job is None else probe_security(
                self.kube, job, stored_worker_keys(self.kube, job, "chief"))
            steps = [self.set_workers(address, FETCH_TIMEOUT_S, namespace,
                                      list(action.workers), security)
                     for address in action.addresses]
        except Exception as exc:  # a control call must never break reconciling
            log.info("SetWorkers for %s failed: %s", namespace, exc)
            steps = [None]
        log.info("%s: worker set %s on %d parameter servers: %s", namespace,
                 list(action.workers), len(action.addresses),
                 "set" if None not in steps else "not set everywhere; retried")
        if None not in steps:
            return plan
        before = (body.get("status") or {}).get("workers") or {}
        workers = plan.status.workers
        if workers is None:
            return plan
        return replace(plan, status=plan.status.model_copy(update={
            "workers": workers.model_copy(update={"members": before.get("members")})}))


class NamespaceTerminating(Exception):
    """A create was refused because the job's namespace is being deleted."""
