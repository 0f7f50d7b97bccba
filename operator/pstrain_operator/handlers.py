"""kopf registrations: the only module that imports kopf besides `main`.

Every handler does the same thing: hand the job's namespace/name to the Reconciler,
which reads the job and its pods afresh from the API server. Handlers return None
(kopf would store a return value under `status.<handler>`, which the strict status
schema prunes); the status is written once, by the Reconciler.

Triggers:
- `on.resume/create/update` of a TrainingJob: reconcile, and while the job needs
  watching, raise `kopf.TemporaryError(delay=...)` so kopf calls again after the delay
  (how "waiting for PS" and the periodic progress refresh are expressed). No timers or
  daemons: they would add a finalizer that blocks deleting jobs and namespaces while
  the operator is down.
- `on.event` of a TrainingJob: reconcile at once (suspend, spec edits) and forget
  deleted jobs.
- `on.event` of pods labelled managed-by pstrain: reconcile the owning job, so a PS
  turning Ready or a chief completing is acted on within moments.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import kopf

from pstrain_api import constants as c

from .controller import Reconciler
from .kube import KubeError
from .reconcile import Event

log = logging.getLogger(__name__)

REQUEUE_MARK = "pstrain-requeue:"
API_ERROR_RETRY_S = 5.0
# Sync handlers run in kopf's thread pool; reconciles block on API calls, so allow a few
# more threads than kopf's CPU-based default.
EXECUTOR_THREADS = 16

_reconciler: Reconciler | None = None


def install(reconciler: Reconciler) -> None:
    """Set the Reconciler the handlers use (called once by `main` before kopf runs)."""
    global _reconciler
    _reconciler = reconciler


def _get() -> Reconciler:
    if _reconciler is None:
        raise kopf.PermanentError("the operator was started without a Reconciler")
    return _reconciler


def post_event(body: Mapping[str, Any], event: Event) -> None:
    """Post a Kubernetes Event on the TrainingJob through kopf's event poster."""
    ref = {
        "apiVersion": body.get("apiVersion", c.API_VERSION),
        "kind": body.get("kind", c.KIND),
        "metadata": body.get("metadata") or {},
    }
    kopf.event(ref, type=event.type, reason=event.reason, message=event.message[:1000])


@kopf.on.resume(c.GROUP, c.VERSION, c.PLURAL)
@kopf.on.create(c.GROUP, c.VERSION, c.PLURAL)
@kopf.on.update(c.GROUP, c.VERSION, c.PLURAL)
def reconcile_job(name: str, namespace: str, **_: Any) -> None:
    try:
        delay = _get().reconcile(namespace, name)
    except KubeError as exc:
        raise kopf.TemporaryError(f"the API server refused a call: {exc}",
                                  delay=API_ERROR_RETRY_S) from exc
    if delay is not None:
        raise kopf.TemporaryError(f"{REQUEUE_MARK} look again in {delay:.1f}s", delay=delay)


def reconcile_quietly(namespace: str, name: str) -> None:
    """Reconcile on a watch event. An API refusal is expected (the periodic handler
    retries it): one line in the log, never a traceback."""
    try:
        _get().reconcile(namespace, name)
    except KubeError as exc:
        log.warning("reconciling %s/%s: the API server refused a call (%s): %s; retrying "
                    "later", namespace, name, exc.status, exc.api_message)


@kopf.on.event(c.GROUP, c.VERSION, c.PLURAL)
def job_event(name: str, namespace: str, type: str | None, **_: Any) -> None:
    if type == "DELETED":
        _get().forget(namespace, name)
        return
    reconcile_quietly(namespace, name)


@kopf.on.event("", "v1", "pods", labels={c.LABEL_MANAGED_BY: c.MANAGED_BY, c.LABEL_JOB: kopf.PRESENT})
def pod_event(labels: Mapping[str, str], namespace: str, **_: Any) -> None:
    reconcile_quietly(namespace, labels[c.LABEL_JOB])


class RequeueIsNotAnError(logging.Filter):
    """kopf logs every TemporaryError at ERROR level and posts it as an Event; a planned
    re-look is routine, so its record is lowered to DEBUG before any handler sees it."""

    def filter(self, record: logging.LogRecord) -> bool:
        if REQUEUE_MARK in record.getMessage():
            record.levelno, record.levelname = logging.DEBUG, "DEBUG"
            return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)
        return True


def kopf_settings(leader_election: bool) -> kopf.OperatorSettings:
    """kopf's settings: progress and diff-base in annotations (never `status.kopf`,
    which the strict status schema prunes), our own finalizer name, events posted only
    for warnings from kopf itself (our decisions are posted explicitly). With leader
    election the peering object must exist (kopf fails instead of silently running
    standalone). Peering name, scope and priority are passed to `kopf.run`."""
    settings = kopf.OperatorSettings()
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=c.GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=c.GROUP, key="last-handled-configuration"
    )
    settings.persistence.finalizer = f"{c.GROUP}/finalizer"
    settings.posting.level = logging.WARNING
    settings.peering.mandatory = leader_election
    settings.peering.standalone = not leader_election
    settings.watching.server_timeout = 300
    settings.execution.max_workers = EXECUTOR_THREADS
    return settings
