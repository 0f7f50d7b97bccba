"""The executor (parse -> observe -> decide -> apply -> one status patch) against an
in-memory API server, through a job's whole life and an operator restart."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

import pytest

from pstrain_operator.controller import Reconciler, parse_status
from pstrain_operator.metrics import Metrics
from pstrain_operator.progress import ProbeSecurity, progress_from_status
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
        self.security: list[ProbeSecurity | None] = []

    def __call__(self, address: str, timeout: float,
                 security: ProbeSecurity | None) -> dict[str, Any] | None:
        self.asked.append(address)
        self.security.append(security)
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


ROWS = "spec.training.sparseStorage.directory"


@pytest.mark.parametrize(("directory", "mounts", "says"), [
    (None, None, f"{ROWS} is missing; with serverMemory set"),
    ("/rows", [{"name": "ckpt", "mountPath": "/ckpt"}],
     f"{ROWS} is '/rows'; it must be at or under the mountPath of a volumeMounts entry"),
], ids=["no-directory", "not-a-mount"])
def test_a_disk_tier_without_a_mounted_directory_is_refused_before_any_pod(
        directory: str | None, mounts: list[dict[str, str]] | None, says: str) -> None:
    """sparseStorage.serverMemory on Kubernetes needs `directory` on a volume of the
    parameter servers' main container: refused up front (no Secret, Service or pod),
    the status names the field, the value and the rule; the spec is left as it was,
    and once fixed (a new generation) the job starts."""
    kube, events = FakeKube(), Recorder()
    storage = {"serverMemory": "1Gi", **({"directory": directory} if directory else {})}
    builder = make_job()
    builder.data["spec"]["training"]["sparseStorage"] = storage
    if mounts is not None:
        builder.template("ps", volumeMounts=mounts,
                         volumes=[{"name": m["name"], "emptyDir": {}} for m in mounts])
    kube.add_job(builder.body())
    op = make_reconciler(kube, events, FakeStatus())
    assert op.reconcile("ns", "j") is None
    assert (kube.pods, kube.services, kube.secrets) == ({}, {}, {})
    stored = kube.jobs[("ns", "j")]
    assert {k: v for k, v in stored.items() if k != "status"} == builder.body()
    (cond,) = stored["status"]["conditions"]
    assert (cond["type"], cond["status"], cond["reason"]) == ("Created", "False", "InvalidSpec")
    assert says in cond["message"] and "spec.replicas.ps.template" in cond["message"]
    assert "\n" not in cond["message"]
    assert events.reasons() == ["InvalidSpec"]
    op.reconcile("ns", "j")  # said once
    assert events.reasons() == [] and kube.pods == {}

    builder.data["spec"]["training"]["sparseStorage"]["directory"] = "/var/rows/ps"
    builder.data["metadata"]["generation"] = 2
    builder.template("ps", volumeMounts=[{"name": "rows", "mountPath": "/var/rows"}],
                     volumes=[{"name": "rows", "emptyDir": {"sizeLimit": "1Gi"}}])
    kube.jobs[("ns", "j")] = {**builder.body(), "status": stored["status"]}
    op.reconcile("ns", "j")
    assert kube.pod_names() == ["j-ps-0"]
    reasons = {cond["reason"] for cond in kube.jobs[("ns", "j")]["status"]["conditions"]}
    assert "InvalidSpec" not in reasons


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
    got = progress_from_status({"global_step": 7, "eval_accuracy": None, "auc": 0.85,
                                "logloss": 0.47}, now)
    assert got is not None
    assert (got.eval_accuracy, got.auc, got.logloss) == (None, 0.85, 0.47)
    assert (got.sparse_rows, got.sparse_bytes) == (None, None)
    got = progress_from_status({"global_step": 7, "sparse_rows": 1500,
                                "sparse_bytes": 3 * 2**20}, now)
    assert got is not None and (got.sparse_rows, got.sparse_bytes) == (1500, 3 * 2**20)
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


class Clock:
    """A settable wall clock for the reconciler."""

    def __init__(self, seconds: float = 0.0) -> None:
        self.seconds = seconds

    def __call__(self) -> datetime:
        return at(self.seconds)


INVALID = ('Pod "j-worker-1" is invalid: spec.containers[0].volumeMounts[0].name: '
           'Not found: "data"')


def refusing(kube: FakeKube, message: str = INVALID, code: int = 422,
             kinds: tuple[str, ...] = ("worker",)) -> list[str]:
    """Make `kube` refuse creating pods of the given roles; returns the attempts."""
    from pstrain_operator.kube import KubeError

    original = FakeKube.create.__get__(kube)
    attempts: list[str] = []

    def create(manifest: Mapping[str, Any]) -> bool:
        role = manifest["metadata"].get("labels", {}).get("pstrain.io/replica-role")
        if manifest["kind"] == "Pod" and role in kinds:
            attempts.append(manifest["metadata"]["name"])
            raise KubeError(code, f"POST pods returned {code}: {message}", message)
        return original(manifest)

    kube.create = create  # type: ignore[method-assign]
    return attempts


def started(body: dict[str, Any] | None = None
            ) -> tuple[FakeKube, Recorder, FakeStatus, Clock, Reconciler]:
    """A job (the default one unless given) with its reconciler on a settable clock."""
    kube, events, status, clock = FakeKube(), Recorder(), FakeStatus(), Clock()
    kube.add_job(body or make_job().body())
    op = make_reconciler(kube, events, status)
    op.clock = clock
    return kube, events, status, clock, op


def bring_up(op: Reconciler, kube: FakeKube) -> None:
    """Reconcile while playing a node that makes every pod Running and Ready: PS first,
    then the workers, as the operator creates them."""
    for _ in range(3):
        op.reconcile("ns", "j")
        for name in kube.pod_names():
            kube.set_pod("ns", name, "Running", ready=True)


def conditions(kube: FakeKube) -> dict[str, dict[str, Any]]:
    return {cond["type"]: cond for cond in kube.jobs[("ns", "j")]["status"]["conditions"]}


def test_a_refused_pod_backs_off_reports_once_and_fails_the_job_in_bounded_time() -> None:
    kube, events, _, clock, op = started()
    op.reconcile("ns", "j")
    kube.set_pod("ns", "j-ps-0", "Running", ready=True)
    events.reasons()
    attempts = refusing(kube)

    clock.seconds = 1
    assert op.reconcile("ns", "j") == 5.0  # the first retry waits 5 s
    st = kube.jobs[("ns", "j")]["status"]
    assert (st["phase"], st["psReady"]) == ("Starting", "1/1")  # not WaitingForPS (0/1)
    assert conditions(kube)["CreateRejected"]["status"] == "True"
    assert INVALID in conditions(kube)["CreateRejected"]["message"]
    assert conditions(kube)["Running"]["reason"] == "CreateRejected"
    assert st["createRefusal"]["attempts"] == 1 and st["createRefusal"]["code"] == 422
    assert events.reasons() == ["CreateRejected"]  # and no "started workers"
    assert attempts == ["j-worker-1"]  # the creates after a refused one wait too

    # Pod and job events wake the job meanwhile: no attempt, no event, no status write.
    patches = kube.status_patches
    for t in (2, 3, 5.5):
        clock.seconds = t
        assert 0 < op.reconcile("ns", "j") <= 5.0
    assert attempts == ["j-worker-1"] and events.reasons() == []
    assert kube.status_patches == patches

    # Retries double their wait; the same refusal is not reported again.
    waits: list[float] = []
    while len(waits) < 7:  # follow the requeues the handler would honour
        tried = len(attempts)
        delay = op.reconcile("ns", "j")
        assert delay is not None
        if len(attempts) > tried:
            waits.append(delay)
        clock.seconds += delay
    assert waits == [10.0, 20.0, 40.0, 80.0, 160.0, 160.0, 160.0]
    assert events.reasons() == []
    assert len(attempts) == 8 and clock.seconds == 1 + 5 + sum(waits)

    # A different refusal is reported once.
    refusing(kube, message="pods \"j-worker-1\" is forbidden: exceeded quota", code=403)
    clock.seconds += 160
    op.reconcile("ns", "j")
    assert events.reasons() == ["CreateRejected"]
    assert "exceeded quota" in conditions(kube)["CreateRejected"]["message"]

    # Refused for longer than the bound (600 s): the job fails with that reason.
    assert kube.jobs[("ns", "j")]["status"]["phase"] == "Starting"
    assert op.reconcile("ns", "j") is not None or True
    clock.seconds += 1
    op.reconcile("ns", "j")
    st = kube.jobs[("ns", "j")]["status"]
    assert st["phase"] == "Failed"
    assert conditions(kube)["Failed"]["reason"] == "CreateRejected"
    assert "exceeded quota" in conditions(kube)["Failed"]["message"]
    assert (st["failure"]["pod"], st["failure"]["role"]) == ("j-worker-1", "worker")
    assert "j-ps-0" not in kube.pod_names()  # cleaned up


def test_a_refused_parameter_server_still_gets_a_status_and_clears_once_created() -> None:
    kube, events, _, clock, op = started()
    attempts = refusing(kube, kinds=("ps",))
    assert op.reconcile("ns", "j") == 5.0
    st = kube.jobs[("ns", "j")]["status"]
    assert (st["phase"], st["psReady"]) == ("Starting", "0/1")
    assert st["replicaStatuses"]["ps"]["active"] == 0  # the refused pod is not counted
    assert conditions(kube)["CreateRejected"]["status"] == "True"
    assert events.reasons() == ["CreatedService", "WaitingForPS", "CreateRejected"]
    assert attempts == ["j-ps-0"]

    # The cause is fixed (say the ServiceAccount now exists): the next try creates it.
    kube.create = FakeKube.create.__get__(kube)  # type: ignore[method-assign]
    clock.seconds = 5
    op.reconcile("ns", "j")
    assert kube.pod_names() == ["j-ps-0"]
    cond = conditions(kube)["CreateRejected"]
    assert (cond["status"], cond["reason"]) == ("False", "Created")
    assert "createRefusal" not in kube.jobs[("ns", "j")]["status"]
    assert events.reasons() == ["CreatedPS"]


def test_a_spec_edit_retries_a_refused_create_at_once() -> None:
    kube, events, _, clock, op = started()
    attempts = refusing(kube, kinds=("ps",))
    op.reconcile("ns", "j")
    clock.seconds = 1
    op.reconcile("ns", "j")
    assert attempts == ["j-ps-0"]
    kube.jobs[("ns", "j")]["metadata"]["generation"] = 2
    op.reconcile("ns", "j")
    assert attempts == ["j-ps-0", "j-ps-0"]


def test_a_terminating_namespace_is_left_alone() -> None:
    kube, events = FakeKube(), Recorder()
    kube.add_job(make_job().body())
    attempts = refusing(kube, code=403, kinds=("ps",), message=(
        'pods "j-ps-0" is forbidden: unable to create new content in namespace ns '
        "because it is being terminated"))
    op = make_reconciler(kube, events, FakeStatus())
    op.monotonic = lambda: 50.0  # type: ignore[method-assign]
    assert op.reconcile("ns", "j") is None
    assert kube.status_patches == 0 and events.reasons() == []
    kube.calls.clear()
    assert op.reconcile("ns", "j") is None  # within a minute: not even a read
    assert kube.calls == [] and attempts == ["j-ps-0"]
    op.monotonic = lambda: 111.0  # type: ignore[method-assign]
    op.reconcile("ns", "j")  # a minute later: one more try, still quiet
    assert attempts == ["j-ps-0", "j-ps-0"] and events.reasons() == []


@pytest.mark.parametrize("body, message, causes, terminating", [
    (b'{"kind":"Status","message":"pods \\"x\\" is forbidden: unable to create new '
     b'content in namespace ns because it is being terminated","reason":"Forbidden",'
     b'"details":{"causes":[{"type":"NamespaceTerminating","message":"x"}]}}',
     'pods "x" is forbidden: unable to create new content in namespace ns because it '
     "is being terminated", ("NamespaceTerminating",), True),
    (b'{"kind":"Status","message":"Pod \\"x\\" is invalid: a b","reason":"Invalid",'
     b'"details":{"causes":[{"reason":"FieldValueInvalid","field":"metadata.labels"}]}}',
     'Pod "x" is invalid: a b', (), False),
    (b"<html>bad gateway</html>", "<html>bad gateway</html>", (), False),
], ids=["namespace-terminating", "invalid", "not-json"])
def test_api_error_status_is_read_for_its_message_and_causes(
        body: bytes, message: str, causes: tuple[str, ...], terminating: bool) -> None:
    from pstrain_operator.kube import KubeError, _api_status

    data = _api_status(body)
    assert data == {"message": message, "causes": causes}
    assert KubeError(403, "x", data["message"], data["causes"]).namespace_terminating \
        is terminating


def test_suspend_asks_for_a_checkpoint_waits_for_it_and_resumes_from_it() -> None:
    body = make_job().body()
    body["spec"]["training"]["checkpoint"] = {"directory": "/ckpt"}
    kube, events, status, clock, op = started(body)
    asked: list[str] = []

    def ask(address: str, timeout: float, security: ProbeSecurity | None) -> int:
        asked.append(address)
        assert security is not None and "worker" in security.keys  # it proves the key
        return 130  # PS 0's step when asked: fresher than the operator's reading

    op.ask_checkpoint = ask
    bring_up(op, kube)
    status.reply = {"global_step": 120, "checkpoint_step": 100,
                    "checkpoint_path": "/ckpt/100.pt"}
    op.reconcile("ns", "j")
    assert kube.jobs[("ns", "j")]["status"]["phase"] == "Running"
    events.reasons()

    kube.jobs[("ns", "j")]["spec"]["runPolicy"]["suspend"] = True
    assert op.reconcile("ns", "j") == 2.0
    assert asked == ["j-ps-0.j.ns.svc:2222"]
    st = kube.jobs[("ns", "j")]["status"]
    assert st["checkpointRequest"]["step"] == 130 and st["phase"] == "Running"
    assert len(kube.pod_names()) == 3  # nothing deleted before the checkpoint
    assert events.reasons() == ["CheckpointRequested"]

    clock.seconds = 3
    status.reply = {"global_step": 131, "checkpoint_step": 131,
                    "checkpoint_path": "/ckpt/131.pt"}
    op.reconcile("ns", "j")
    st = kube.jobs[("ns", "j")]["status"]
    assert st["phase"] == "Suspended" and st["lastCheckpoint"]["step"] == 131
    assert "checkpointRequest" not in st and kube.pod_names() == []
    assert events.reasons() == ["CheckpointConfirmed", "JobSuspended"]
    assert len(asked) == 1

    kube.jobs[("ns", "j")]["spec"]["runPolicy"]["suspend"] = False
    op.reconcile("ns", "j")
    st = kube.jobs[("ns", "j")]["status"]
    assert st["resumedFromStep"] == 131
    resumed = [e for e in events.events if e.reason == "JobResumed"]
    assert "continues from the checkpoint at step 131" in resumed[0].message


def test_a_refused_replacement_while_running_is_reported_and_running_again_once_created(
) -> None:
    kube, events, _, clock, op = started()
    bring_up(op, kube)
    assert conditions(kube)["Running"]["status"] == "True"

    attempts = refusing(kube)
    kube.set_pod("ns", "j-worker-1", "Failed", exit_code=137, reason="OOMKilled")
    op.reconcile("ns", "j")  # deleted for its restart
    op.reconcile("ns", "j")  # its replacement is refused
    assert attempts == ["j-worker-1"]
    st = kube.jobs[("ns", "j")]["status"]
    assert st["replicaStatuses"]["worker"]["active"] == 1
    assert conditions(kube)["Running"]["reason"] == "CreateRejected"

    kube.create = FakeKube.create.__get__(kube)  # type: ignore[method-assign]
    clock.seconds = 5
    op.reconcile("ns", "j")
    assert "j-worker-1" in kube.pod_names()
    op.reconcile("ns", "j")
    running = conditions(kube)["Running"]
    assert (running["status"], running["reason"]) == ("True", "AllReplicasStarted")


def test_a_stalled_job_restarts_its_trainers_then_fails_with_reason_stalled() -> None:
    kube, events, status, clock, op = started(
        make_job().policy(stallTimeoutSeconds=60, backoffLimit=1).body())
    bring_up(op, kube)
    status.reply = {"global_step": 7}
    op.reconcile("ns", "j")
    assert kube.jobs[("ns", "j")]["status"]["phase"] == "Running"
    events.reasons()

    clock.seconds = 59
    op.reconcile("ns", "j")
    assert kube.pod_names() == ["j-ps-0", "j-worker-0", "j-worker-1"]
    clock.seconds = 61  # the step stayed at 7: the workers and the chief are restarted
    op.reconcile("ns", "j")
    assert kube.pod_names() == ["j-ps-0"]
    st = kube.jobs[("ns", "j")]["status"]
    assert (st["restarts"], st["disruptions"]) == (1, 0)
    said = events.reasons()
    assert said[0] == "RestartingStalled", said
    bring_up(op, kube)
    assert kube.jobs[("ns", "j")]["status"]["phase"] == "Running"

    clock.seconds = 61 + 61  # stalled again, backoffLimit (1) used up: Failed, Stalled
    op.reconcile("ns", "j")
    st = kube.jobs[("ns", "j")]["status"]
    assert st["phase"] == "Failed"
    assert conditions(kube)["Failed"]["reason"] == "Stalled"
    assert kube.pod_names() == []


def test_kubectl_scale_adds_a_worker_and_tells_every_parameter_server() -> None:
    """2 -> 3 workers while running: one pod created, PS and chief untouched, an event,
    and SetWorkers on the servers once the newcomer is Ready; a failed call is retried."""
    kube, events, _, _, op = started(make_job().ps(2).body())
    bring_up(op, kube)
    before = {name: kube.pods[("ns", name)]["metadata"].get("uid") for name in kube.pod_names()}
    calls: list[tuple[str, list[int]]] = []
    answers = iter([None, 7, 7, 7])  # the first call fails: the set is sent again

    def setter(address: str, timeout: float, namespace: str, workers: list[int],
               security: Any) -> int | None:
        assert namespace == "ns/j"
        calls.append((address, workers))
        return next(answers)

    op.set_workers = setter
    events.reasons()
    kube.jobs[("ns", "j")]["spec"]["replicas"]["worker"]["replicas"] = 3
    op.reconcile("ns", "j")
    assert "j-worker-2" in kube.pod_names()
    assert all(kube.pods[("ns", n)]["metadata"].get("uid") == uid for n, uid in before.items())
    assert "WorkersScaledUp" in events.reasons()
    assert calls == []  # the newcomer is not Ready yet: no step may wait for it
    kube.set_pod("ns", "j-worker-2", "Running", ready=True)
    op.reconcile("ns", "j")
    assert calls == [("j-ps-0.j.ns.svc:2222", [0, 1, 2]), ("j-ps-1.j.ns.svc:2222", [0, 1, 2])]
    assert kube.jobs[("ns", "j")]["status"]["workers"].get("members") is None  # PS 0 refused
    op.reconcile("ns", "j")
    assert len(calls) == 4
    assert kube.jobs[("ns", "j")]["status"]["workers"]["members"] == [0, 1, 2]
    op.reconcile("ns", "j")
    assert len(calls) == 4  # sent: not again
