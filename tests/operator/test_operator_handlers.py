"""The kopf glue: settings that keep kopf out of the status, and quiet re-queues."""

from __future__ import annotations

import logging

import pytest

import kopf

from pstrain_operator.handlers import REQUEUE_MARK, RequeueIsNotAnError, kopf_settings


def test_kopf_keeps_its_state_in_annotations_not_status() -> None:
    settings = kopf_settings(leader_election=False)
    assert isinstance(settings.persistence.progress_storage, kopf.AnnotationsProgressStorage)
    assert isinstance(settings.persistence.diffbase_storage, kopf.AnnotationsDiffBaseStorage)
    assert settings.persistence.progress_storage.prefix == "pstrain.io"
    assert settings.persistence.diffbase_storage.prefix == "pstrain.io"
    assert settings.peering.standalone and not settings.peering.mandatory
    assert settings.posting.level == logging.WARNING
    led = kopf_settings(leader_election=True)
    assert led.peering.mandatory and not led.peering.standalone


def _record(message: str, level: int = logging.ERROR) -> logging.LogRecord:
    return logging.LogRecord("pstrain-test-kopf", level, __file__, 1, message, None, None)


def test_planned_requeue_is_logged_at_debug_not_error() -> None:
    logging.getLogger("pstrain-test-kopf").setLevel(logging.INFO)
    flt = RequeueIsNotAnError()
    record = _record(f"Handler 'reconcile_job' failed temporarily: {REQUEUE_MARK} 5s")
    assert flt.filter(record) is False  # dropped: DEBUG is not enabled
    assert record.levelno == logging.DEBUG
    other = _record("Handler 'reconcile_job' failed temporarily: real trouble")
    assert flt.filter(other) is True and other.levelno == logging.ERROR


def test_an_api_refusal_on_a_watch_event_is_one_log_line_not_a_traceback(
        caplog: pytest.LogCaptureFixture) -> None:
    from pstrain_operator import handlers
    from pstrain_operator.kube import KubeError

    class Refusing:
        def reconcile(self, namespace: str, name: str) -> None:
            raise KubeError(403, "GET pods returned 403: forbidden", "pods is forbidden")

    old = handlers._reconciler
    handlers._reconciler = Refusing()  # type: ignore[assignment]
    try:
        with caplog.at_level(logging.WARNING, logger="pstrain_operator.handlers"):
            handlers.pod_event(labels={"pstrain.io/job-name": "j"}, namespace="ns")
            handlers.job_event(name="j", namespace="ns", type="MODIFIED")
    finally:
        handlers._reconciler = old
    assert [r.getMessage() for r in caplog.records] == [
        "reconciling ns/j: the API server refused a call (403): pods is forbidden; "
        "retrying later"] * 2
    assert all(r.exc_info is None for r in caplog.records)
