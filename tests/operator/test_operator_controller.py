"""The executor (parse -> observe -> decide -> apply -> one status patch) against an
in-memory API server, through a job's whole life and an operator restart."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

import pytest

from pstrain_operator.controller import Reconciler, parse_status
from pstrain_operator.metrics import Metrics
from pstrain_operator.progress import progress_from_status
from pstrain_operator.reconcile import Event
from pstrain_operator.settings import PodSettings

from .fake_kube import FakeKube
from .op_builders import T0, at, make_job


class Recorder:
    def __init__(self) -> None:
        self.events: list[Event] = []

    def __call__(self, body: Mapping[str, Any], event: Event) -> None:
        assert body["metadata"]["name"] == "j"
        self.events.append(event)

    def reasons(self) -> list[str]:
        out = [e.reason for e in self.events]
        self.events.clear()
        return out


class FakeStatus:
    def __init__(self) -> None:
        self.reply: dict[str, Any] | None = None
        self.asked: list[str] = []

    def __call__(self, address: str, timeout: float) -> dict[str, Any] | None:
        self.asked.append(address)
        return self.reply


def make_reconciler(kube: FakeKube, events: Recorder, status: FakeStatus,
                    now: datetime = T0) -> Reconciler:
    ticks = iter(range(0, 10**9, 100))  # every look is 100 s after the previous one
    return Reconciler(kube=kube, pod_settings=PodSettings(), emit=events,
                      fetch_status=status, metrics=Metrics(), clock=lambda: now,
                      monotonic=lambda: float(next(ticks)))


def test_whole_life_restart_and_success() -> None:
    kube, events, status = FakeKube(), Recorder(), FakeStatus()
    kube.add_job(make_job().body())
    op = make_reconciler(kube, events, status)

    assert op.reconcile("ns", "j") == 5.0
    assert kube.pod_names() == ["j-ps-0"] and ("ns", "j") in kube.services
    assert events.reasons() == ["CreatedService", "CreatedPS", "WaitingForPS"]
    assert kube.jobs[("ns", "j")]["status"]["phase"] == "Starting"

    # A repeated event changes nothing and writes no status.
    patches = kube.status_patches
    op.reconcile("ns", "j")
    assert kube.pod_names() == ["j-ps-0"] and kube.status_patches == patches
    assert events.reasons() == []

    kube.set_pod("ns", "j-ps-0", "Running", ready=True)
    assert op.reconcile("ns", "j") == 2.0  # Running, no step known yet: look again soon
    assert kube.pod_names() == ["j-ps-0", "j-worker-0", "j-worker-1"]
    created = [name for verb, name in kube.calls if verb == "create" and name.startswith("Pod")]
    assert created == ["Pod/j-ps-0", "Pod/j-worker-1", "Pod/j-worker-0"]  # chief last
    assert events.reasons() == ["StartedWorkers", "StartedChief"]

    # The operator restarts: a fresh Reconciler creates no duplicates.
    op = make_reconciler(kube, events, status)
    kube.calls.clear()
    op.reconcile("ns", "j")
    assert [v for v, _ in kube.calls if v == "create"] == []

    # Progress is read from PS 0 while Running.
    for name in ("j-worker-0", "j-worker-1"):
        kube.set_pod("ns", name, "Running", ready=True)
    status.reply = {"global_step": 7, "loss": 1.25, "checkpoint_step": 5,
                    "checkpoint_path": "/ckpt/5.pt", "checkpoint_time": 1.7e9}
    op.reconcile("ns", "j")
    st = kube.jobs[("ns", "j")]["status"]
    assert st["phase"] == "Running" and st["progress"]["globalStep"] == 7
    assert st["lastCheckpoint"] == {"step": 5, "path": "/ckpt/5.pt",
                                    "time": "2023-11-14T22:13:20Z"}
    assert status.asked[-1] == "j-ps-0.j.ns.svc:2222"

    # A worker is OOM-killed: restarted (deleted, then recreated), counted.
    kube.set_pod("ns", "j-worker-1", "Failed", exit_code=137, reason="OOMKilled")
    op.reconcile("ns", "j")
    assert "j-worker-1" not in kube.pod_names()
    assert kube.jobs[("ns", "j")]["status"]["restarts"] == 1
    assert events.reasons() == ["RestartingReplica"]
    op.reconcile("ns", "j")
    assert "j-worker-1" in kube.pod_names()
    assert kube.jobs[("ns", "j")]["status"]["replicaStatuses"]["worker"]["restarts"] == 1

    # The chief completes: Succeeded, PS deleted.
    kube.set_pod("ns", "j-worker-0", "Succeeded", exit_code=0)
    assert op.reconcile("ns", "j") == 5.0
    st = kube.jobs[("ns", "j")]["status"]
    assert st["phase"] == "Succeeded" and st["completionTime"]
    assert "j-ps-0" not in kube.pod_names()
    assert events.reasons() == ["StartedWorkers", "ChiefSucceeded", "CleanedUpPods"]
    assert op.reconcile("ns", "j") is None


def test_invalid_spec_no_pods_condition_and_event() -> None:
    kube, events = FakeKube(), Recorder()
    body = make_job().body()
    body["spec"]["replicas"]["ps"]["gpus"] = 1  # parameter servers may not have GPUs
    kube.add_job(body)
    op = make_reconciler(kube, events, FakeStatus())
    assert op.reconcile("ns", "j") is None
    assert kube.pods == {} and kube.services == {}
    cond = kube.jobs[("ns", "j")]["status"]["conditions"][0]
    assert (cond["type"], cond["reason"]) == ("Created", "InvalidSpec")
    assert "may not request GPUs" in cond["message"]
    assert events.reasons() == ["InvalidSpec"]


def test_ttl_deletes_the_job() -> None:
    kube, events = FakeKube(), Recorder()
    kube.add_job(make_job().policy(ttlSecondsAfterFinished=10)
                 .status(phase="Succeeded", completionTime="2026-01-01T12:00:00Z").body())
    assert make_reconciler(kube, events, FakeStatus(), at(5)).reconcile("ns", "j") == 5.0
    assert ("ns", "j") in kube.jobs
    make_reconciler(kube, events, FakeStatus(), at(11)).reconcile("ns", "j")
    assert ("ns", "j") not in kube.jobs


def test_missing_job_is_no_error() -> None:
    assert make_reconciler(FakeKube(), Recorder(), FakeStatus()).reconcile("ns", "x") is None


def test_metrics_count_reconciles_pods_and_phases() -> None:
    kube, events = FakeKube(), Recorder()
    kube.add_job(make_job().body())
    op = make_reconciler(kube, events, FakeStatus())
    op.reconcile("ns", "j")
    reg = op.metrics.registry
    assert reg.get_sample_value("pstrain_operator_reconcile_total", {"outcome": "ok"}) == 1
    assert reg.get_sample_value("pstrain_operator_pods_created_total", {"role": "ps"}) == 1
    assert reg.get_sample_value("pstrain_operator_jobs", {"phase": "Starting"}) == 1
    op.forget("ns", "j")
    assert reg.get_sample_value("pstrain_operator_jobs", {"phase": "Starting"}) == 0


def test_parse_status_drops_unknown_fields() -> None:
    st = parse_status({"phase": "Running", "kopf": {"progress": {}}, "restarts": 2})
    assert (st.phase, st.restarts) == ("Running", 2)
    assert parse_status({"phase": "Exploded"}).phase == "Pending"


def test_progress_from_status() -> None:
    now = datetime(2026, 1, 1, tzinfo=UTC)
    got = progress_from_status({"step": 5, "loss": "0.5", "accuracy": 0.9}, now)
    assert got is not None
    assert (got.global_step, got.loss, got.eval_accuracy, got.updated_at) == (5, 0.5, 0.9, now)
    assert progress_from_status({"loss": 1.0}, now) is None
    assert progress_from_status(None, now) is None
    assert progress_from_status({"global_step": "x"}, now) is None


def test_concurrent_requests_coalesce_into_one_more_pass() -> None:
    """A request that arrives while the job is being reconciled returns at once and the
    running reconcile goes round again, so no event is lost and no worker waits."""
    kube, events = FakeKube(), Recorder()
    kube.add_job(make_job().body())
    op = make_reconciler(kube, events, FakeStatus())
    nested: list[float | None] = []
    original = kube.list_pods

    def list_pods(namespace: str, selector: str) -> list[dict[str, Any]]:
        if not nested:  # another worker asks while this pass runs
            nested.append(op.reconcile("ns", "j"))
        return original(namespace, selector)

    kube.list_pods = list_pods  # type: ignore[method-assign]
    assert op.reconcile("ns", "j") == 5.0
    assert nested == [2.0]
    assert [verb for verb, _ in kube.calls].count("list") == 2
    assert kube.pod_names() == ["j-ps-0"]
    reg = op.metrics.registry
    assert reg.get_sample_value("pstrain_operator_reconcile_total", {"outcome": "ok"}) == 2


def test_progress_probe_is_rate_limited_per_job() -> None:
    kube, events, status = FakeKube(), Recorder(), FakeStatus()
    kube.add_job(make_job().status(phase="Running").body())
    op = Reconciler(kube=kube, pod_settings=PodSettings(), emit=events, fetch_status=status,
                    metrics=Metrics(), clock=lambda: T0, monotonic=lambda: 50.0)
    for _ in range(3):
        kube.jobs[("ns", "j")]["status"]["phase"] = "Running"  # as last written
        op.reconcile("ns", "j")
    assert status.asked == ["j-ps-0.j.ns.svc:2222"]  # once: the clock stood still
    op.monotonic = lambda: 50.0 + op.progress_interval
    kube.jobs[("ns", "j")]["status"]["phase"] = "Running"
    op.reconcile("ns", "j")
    assert len(status.asked) == 2


def test_a_rejected_create_is_reported_on_the_job_and_retried() -> None:
    from pstrain_operator.kube import KubeError

    kube, events = FakeKube(), Recorder()
    kube.add_job(make_job().body())
    original = kube.create

    def create(manifest: Mapping[str, Any]) -> bool:
        if manifest["kind"] == "Pod":
            raise KubeError(403, 'POST pods returned 403: exceeded quota: pods')
        return original(manifest)

    kube.create = create  # type: ignore[method-assign]
    op = make_reconciler(kube, events, FakeStatus())
    with pytest.raises(KubeError) as err:  # reaches the handler, which retries
        op.reconcile("ns", "j")
    assert err.value.status == 403
    rejected = [e for e in events.events if e.reason == "CreateRejected"]
    assert rejected[0].type == "Warning" and "exceeded quota" in rejected[0].message
    assert "j-ps-0" in rejected[0].message
    kube.create = original  # type: ignore[method-assign]
    op.reconcile("ns", "j")
    assert kube.pod_names() == ["j-ps-0"]
