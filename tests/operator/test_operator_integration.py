"""The real operator process (`pstrain operator`) against an HTTP Kubernetes API
(kmock's KubernetesEmulator): ordered start, success, restart without duplicates, and
every request covered by the RBAC table."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from pstrain_api import constants as c
from pstrain_operator.rbac import allows

from .conftest import NAMESPACE, OperatorProcess
from .emulator import EmulatorThread, HttpApi, pod_status, rbac_verb, wait_for
from .op_builders import make_job

pytestmark = pytest.mark.timeout(240)

NS = NAMESPACE


def pod_posts(emulator: EmulatorThread) -> list[str]:
    """Pod creations the operator attempted (successful or not)."""
    return [r.path for r in emulator.recorded()
            if r.method == "POST" and r.path.endswith("/pods") and not r.by_test]


def test_operator_runs_a_job_in_order_and_survives_a_restart(
    emulator: EmulatorThread, operator_process: OperatorProcess
) -> None:
    api = HttpApi(emulator.url)
    operator_process.start()
    api.create_job(make_job("mnist", NS).ps(2).workers(2).body())

    # 1-2. The Service and the PS pods appear; no workers while no PS is Ready.
    wait_for("the headless Service", lambda: api.service(NS, "mnist"))
    wait_for("both PS pods", lambda: {"mnist-ps-0", "mnist-ps-1"} <= set(api.pods(NS)))
    wait_for("phase Starting", lambda: (api.job(NS, "mnist") or {}).get("status", {})
             .get("phase") == "Starting")
    pods = api.pods(NS)
    assert sorted(pods) == ["mnist-ps-0", "mnist-ps-1"]
    ps0 = pods["mnist-ps-0"]
    assert ps0["spec"]["containers"][0]["readinessProbe"] == {
        "grpc": {"port": 2222}, "periodSeconds": 2, "failureThreshold": 3}
    assert ps0["metadata"]["ownerReferences"][0]["kind"] == c.KIND
    assert ps0["metadata"]["labels"][c.LABEL_ROLE] == "ps"

    # One PS Ready is not enough.
    api.set_pod_status(NS, "mnist-ps-0", pod_status("Running", ready=True))
    wait_for("psReady 1/2", lambda: api.job(NS, "mnist")["status"].get("psReady") == "1/2")
    assert sorted(api.pods(NS)) == ["mnist-ps-0", "mnist-ps-1"]

    # 3. Every PS Ready: the non-chief worker, then the chief (worker 0).
    api.set_pod_status(NS, "mnist-ps-1", pod_status("Running", ready=True))
    wait_for("workers", lambda: {"mnist-worker-0", "mnist-worker-1"} <= set(api.pods(NS)))
    assert len(pod_posts(emulator)) == 4
    wait_for("phase Running", lambda: api.job(NS, "mnist")["status"]["phase"] == "Running")

    # 5. Restart the operator mid-job: it picks the job up and creates nothing twice.
    operator_process.stop()
    before = len(pod_posts(emulator))
    operator_process.start()
    for name in ("mnist-worker-0", "mnist-worker-1"):
        api.set_pod_status(NS, name, pod_status("Running", ready=True))
    wait_for("workersReady 2/2 from the new operator",
             lambda: api.job(NS, "mnist")["status"].get("workersReady") == "2/2")
    assert len(pod_posts(emulator)) == before
    assert sorted(api.pods(NS)) == ["mnist-ps-0", "mnist-ps-1", "mnist-worker-0",
                                    "mnist-worker-1"]

    # 4. The chief completes: Succeeded, and the PS are shut down.
    api.set_pod_status(NS, "mnist-worker-1", pod_status("Succeeded", exit_code=0))
    api.set_pod_status(NS, "mnist-worker-0", pod_status("Succeeded", exit_code=0))
    wait_for("phase Succeeded", lambda: api.job(NS, "mnist")["status"]["phase"] == "Succeeded")
    wait_for("PS deleted", lambda: not any(n.startswith("mnist-ps") for n in api.pods(NS)))
    status = api.job(NS, "mnist")["status"]
    assert status["completionTime"] and status["startTime"]
    conds = {cond["type"]: cond for cond in status["conditions"]}
    assert conds["Succeeded"]["status"] == "True"
    assert conds["Succeeded"]["reason"] == "ChiefSucceeded"

    # Events name the decisions.
    reasons = wait_for("events", lambda: {e.get("reason") for e in api.events(NS)}
                       >= {"CreatedPS", "StartedWorkers", "ChiefSucceeded"} and
                       {e.get("reason") for e in api.events(NS)})
    assert "WaitingForPS" in reasons

    # Metrics are served.
    text = operator_process.metrics()
    assert "pstrain_operator_reconcile_total" in text
    assert 'pstrain_operator_jobs{phase="Succeeded"} 1.0' in text
    operator_process.stop()

    # Nothing was created twice, over both operator runs.
    assert len(pod_posts(emulator)) == 4

    # Every request either operator made is covered by the RBAC table.
    used = {v for r in emulator.recorded() if not r.by_test
            for v in [rbac_verb(r)] if v is not None}
    assert {("", "pods", "create"), ("pstrain.io", "trainingjobs/status", "patch"),
            ("", "events", "create"), ("", "pods", "delete")} <= used
    assert sorted(v for v in used if not allows(*v)) == []


def test_failure_names_the_root_cause_and_ttl_deletes_the_job(
    emulator: EmulatorThread, operator_process: OperatorProcess
) -> None:
    api = HttpApi(emulator.url)
    operator_process.start()
    api.create_job(make_job("bad", NS).workers(2)
                   .policy(restartPolicy="ExitCode", ttlSecondsAfterFinished=3).body())
    wait_for("PS pod", lambda: "bad-ps-0" in api.pods(NS))
    api.set_pod_status(NS, "bad-ps-0", pod_status("Running", ready=True))
    wait_for("workers", lambda: {"bad-worker-0", "bad-worker-1"} <= set(api.pods(NS)))

    # 137 is retryable under ExitCode: the pod is restarted (deleted, recreated), counted.
    api.set_pod_status(NS, "bad-worker-1", pod_status("Failed", exit_code=137,
                                                      reason="OOMKilled"))
    wait_for("one restart", lambda: api.job(NS, "bad")["status"].get("restarts") == 1)
    wait_for("worker-1 recreated", lambda: (api.pods(NS).get("bad-worker-1") or {})
             .get("status", {}).get("phase") == "Pending")

    # Exit code 2 is permanent: the job fails, naming the pod and the reason.
    api.set_pod_status(NS, "bad-worker-1", pod_status("Failed", exit_code=2))
    wait_for("Failed", lambda: api.job(NS, "bad")["status"]["phase"] == "Failed")
    status = api.job(NS, "bad")["status"]
    assert status["failure"] == {
        "role": "worker", "pod": "bad-worker-1", "exitCode": 2, "reason": "Error",
        "message": "bad-worker-1 failed with exit code 2, which restartPolicy ExitCode "
                   "treats as permanent (retryable: [130, 137, 143])."}
    conds = {cond["type"]: cond for cond in status["conditions"]}
    assert conds["Failed"]["reason"] == "PermanentExitCode"
    wait_for("running pods cleaned up", lambda: not any(
        p["status"]["phase"] in ("Pending", "Running") for p in api.pods(NS).values()))
    reasons = {e.get("reason") for e in api.events(NS)}
    assert {"RestartingReplica", "PermanentExitCode"} <= reasons

    # ttlSecondsAfterFinished: the job is deleted (its pods go with it by ownerReference
    # garbage collection, which the emulator does not do).
    wait_for("the job deleted after its TTL", lambda: api.job(NS, "bad") is None, timeout=30)
    operator_process.stop()
    used = {v for r in emulator.recorded() if not r.by_test
            for v in [rbac_verb(r)] if v is not None}
    assert ("pstrain.io", "trainingjobs", "delete") in used
    assert sorted(v for v in used if not allows(*v)) == []


def test_termination_messages_reach_events_and_status_and_config_errors_fail_at_once(
    emulator: EmulatorThread, operator_process: OperatorProcess
) -> None:
    api = HttpApi(emulator.url)
    operator_process.start()
    api.create_job(make_job("cfg", NS).workers(2).body())
    wait_for("PS pod", lambda: "cfg-ps-0" in api.pods(NS))
    api.set_pod_status(NS, "cfg-ps-0", pod_status("Running", ready=True))
    wait_for("workers", lambda: {"cfg-worker-0", "cfg-worker-1"} <= set(api.pods(NS)))

    # A restart: the pod's last words reach the event before the pod is deleted.
    api.set_pod_status(NS, "cfg-worker-1", pod_status(
        "Failed", exit_code=137, reason="OOMKilled", message="allocating the table\n"))
    wait_for("one restart", lambda: api.job(NS, "cfg")["status"].get("restarts") == 1)
    restarting = [e["message"] for e in api.events(NS) if e.get("reason") == "RestartingReplica"]
    assert restarting == ["restarting pod cfg-worker-1: it failed (OOMKilled, exit code "
                          "137); restart 1 of 3; its last output: allocating the table"]
    wait_for("worker-1 recreated", lambda: (api.pods(NS).get("cfg-worker-1") or {})
             .get("status", {}).get("phase") == "Pending")

    # A configuration error (exit 78): the job fails at once, with the replica's line.
    line = ("pstrain replica: worker 1: configuration error: spec.training.entrypoint "
            "'m:f': module 'm' cannot be imported: ModuleNotFoundError: No module named 'm'")
    api.set_pod_status(NS, "cfg-worker-1", pod_status(
        "Failed", exit_code=c.EXIT_CONFIGURATION_ERROR, message=line))
    wait_for("Failed", lambda: api.job(NS, "cfg")["status"]["phase"] == "Failed")
    status = api.job(NS, "cfg")["status"]
    assert status["restarts"] == 1
    assert status["failure"]["message"] == line
    conds = {cond["type"]: cond for cond in status["conditions"]}
    assert conds["Failed"]["reason"] == "ConfigurationError"
    assert line in conds["Failed"]["message"]
    assert any(e.get("reason") == "ConfigurationError" and line in e["message"]
               for e in api.events(NS))
    operator_process.stop()


def test_leader_election_only_one_operator_acts(
    emulator: EmulatorThread, operator_process: OperatorProcess, tmp_path: Path
) -> None:
    """With PSTRAIN_OPERATOR_LEADER_ELECTION=true, operators peer through the namespaced
    KopfPeering "pstrain" (cluster-wide operators use ClusterKopfPeering); the one with
    the highest priority acts, the others pause."""
    emulator.declare_peering(NS)
    operator_process.extra_env["PSTRAIN_OPERATOR_LEADER_ELECTION"] = "true"
    second = OperatorProcess(operator_process.kubeconfig, tmp_path / "second",
                             {"PSTRAIN_OPERATOR_LEADER_ELECTION": "true"})
    (tmp_path / "second").mkdir()
    operator_process.start()
    second.start()
    try:
        # kopf starts paused, resumes when no live peer has a higher priority, and pauses
        # again when one appears: the last of those messages tells whether it acts.
        def is_acting(op: OperatorProcess) -> bool:
            log = op.log_tail(5000)
            return log.rfind("Resuming operations after the pause") > log.rfind(
                "Pausing operations in favour of")

        def acting() -> list[OperatorProcess]:
            return [op for op in (operator_process, second) if is_acting(op)]

        def priority(op: OperatorProcess) -> int:
            found = re.search(r"peering priority (\d+)", op.log_tail(5000))
            assert found, op.log_tail()
            return int(found.group(1))

        leader = max((operator_process, second), key=priority)
        wait_for("the higher-priority operator alone to act", lambda: acting() == [leader],
                 timeout=60)
        api = HttpApi(emulator.url)
        api.create_job(make_job("le", NS).body())
        wait_for("PS pod", lambda: "le-ps-0" in api.pods(NS))
        wait_for("phase Starting", lambda: (api.job(NS, "le") or {}).get("status", {})
                 .get("phase") == "Starting")
        assert len(pod_posts(emulator)) == 1
        assert acting() == [leader]
        follower = second if leader is operator_process else operator_process
        assert "pstrain_operator.controller" not in follower.log_tail(5000)
    finally:
        second.stop()
    used = {v for r in emulator.recorded() if not r.by_test
            for v in [rbac_verb(r)] if v is not None}
    assert ("kopf.dev", "kopfpeerings", "patch") in used
    assert sorted(v for v in used if not allows(*v)) == []


def test_refused_spec_change_then_suspend_and_resume(
    emulator: EmulatorThread, operator_process: OperatorProcess
) -> None:
    api = HttpApi(emulator.url)
    path = f"/apis/{c.API_VERSION}/namespaces/{NS}/{c.PLURAL}/sr"

    def patch_spec(spec: dict[str, object]) -> None:
        api.request("PATCH", path, {"spec": spec}, "application/merge-patch+json")

    def condition(kind: str) -> dict[str, str]:
        conds = (api.job(NS, "sr") or {}).get("status", {}).get("conditions", [])
        return next((cond for cond in conds if cond["type"] == kind), {})

    operator_process.start()
    api.create_job(make_job("sr", NS).body())
    wait_for("PS pod", lambda: "sr-ps-0" in api.pods(NS))
    api.set_pod_status(NS, "sr-ps-0", pod_status("Running", ready=True))
    wait_for("workers", lambda: {"sr-worker-0", "sr-worker-1"} <= set(api.pods(NS)))

    # A different PS count cannot be applied live: refused, nothing applied.
    patch_spec({"replicas": {"ps": {"replicas": 2}}})
    rejected = wait_for("SpecChangeRejected", lambda: condition("SpecChangeRejected")
                        .get("status") == "True" and condition("SpecChangeRejected"))
    assert rejected["reason"] == "SpecChangeNotApplicable"
    assert "spec.replicas" in rejected["message"]
    assert "sr-ps-1" not in api.pods(NS)
    patch_spec({"replicas": {"ps": {"replicas": 1}}})
    wait_for("the refusal lifted", lambda: condition("SpecChangeRejected")
             .get("status") == "False")

    # Suspend: every pod goes, the job stays.
    patch_spec({"runPolicy": {"suspend": True}})
    wait_for("Suspended", lambda: api.job(NS, "sr")["status"]["phase"] == "Suspended")
    wait_for("no pods", lambda: not api.pods(NS))
    # Resume: started again in order, PS first.
    patch_spec({"runPolicy": {"suspend": False}})
    wait_for("PS recreated", lambda: "sr-ps-0" in api.pods(NS))
    wait_for("Starting", lambda: api.job(NS, "sr")["status"]["phase"] == "Starting")
    assert sorted(api.pods(NS)) == ["sr-ps-0"]
    reasons = {e.get("reason") for e in api.events(NS)}
    assert {"SpecChangeNotApplicable", "JobSuspended", "JobResumed"} <= reasons
    # No checkpoint directory: the events say that training restarts from step 0.
    said = {e.get("reason"): str(e.get("message")) for e in api.events(NS)}
    assert "restarts from step 0 on resume" in said["JobSuspended"]
    assert "training restarts from step 0" in said["JobResumed"]
    assert api.job(NS, "sr")["status"]["resumedFromStep"] == 0


INVALID = ('Pod "ev-worker-1" is invalid: spec.containers[0].volumeMounts[0].name: '
           'Not found: "data"')


def test_a_refused_pod_backs_off_and_an_evicted_pod_leaves_a_trace(
    emulator: EmulatorThread, operator_process: OperatorProcess
) -> None:
    api = HttpApi(emulator.url)

    def refuse_worker_1(method: str, path: str, body: object) -> tuple[int, str] | None:
        name = ((body or {}).get("metadata") or {}).get("name") if isinstance(body, dict) else ""
        return (422, INVALID) if method == "POST" and name == "ev-worker-1" else None

    def attempts() -> int:
        return sum(1 for r in emulator.recorded() if r.method == "POST" and not r.by_test
                   and r.path.endswith("/pods")) - 1  # less the PS

    def condition(kind: str) -> dict[str, str]:
        conds = (api.job(NS, "ev") or {}).get("status", {}).get("conditions", [])
        return next((cond for cond in conds if cond["type"] == kind), {})

    def events(reason: str) -> list[dict[str, object]]:
        return [e for e in api.events(NS) if e.get("reason") == reason]

    emulator.refuse(refuse_worker_1)
    operator_process.start()
    api.create_job(make_job("ev", NS).body())
    wait_for("PS pod", lambda: "ev-ps-0" in api.pods(NS))
    api.set_pod_status(NS, "ev-ps-0", pod_status("Running", ready=True))

    # Refused: a condition quoting the server, one event, an honest status, back-off.
    rejected = wait_for("CreateRejected", lambda: condition("CreateRejected")
                        .get("status") == "True" and condition("CreateRejected"))
    assert INVALID in rejected["message"]
    status = api.job(NS, "ev")["status"]
    assert (status["phase"], status["psReady"]) == ("Starting", "1/1")
    assert status["createRefusal"]["code"] == 422
    wait_for("the second attempt, 5 s later", lambda: attempts() >= 2, timeout=20)
    emulator.refuse(None)  # the cause is fixed: the next attempt (10 s later) goes through
    wait_for("both workers", lambda: {"ev-worker-0", "ev-worker-1"} <= set(api.pods(NS)),
             timeout=30)
    wait_for("the refusal lifted", lambda: condition("CreateRejected").get("status") == "False")
    assert attempts() == 4  # worker-1 three times (0 s, 5 s, 15 s), then worker-0
    assert len(events("CreateRejected")) == 1
    assert "Traceback" not in operator_process.log_tail(5000)

    # Evicted through the Eviction API: DisruptionTarget, then graceful deletion (a
    # finalizer stands in for the grace period). The cause is named, the replacement
    # counted.
    for name in ("ev-worker-0", "ev-worker-1"):
        api.set_pod_status(NS, name, pod_status("Running", ready=True))
    evicted = pod_status("Running", ready=True)
    evicted["conditions"].append({"type": "DisruptionTarget", "status": "True",
                                  "reason": "EvictionByEvictionAPI",
                                  "message": "Eviction API: evicting"})
    api.set_pod_status(NS, "ev-worker-1", evicted)
    old_uid = api.pods(NS)["ev-worker-1"]["metadata"]["uid"]
    pod_path = f"/api/v1/namespaces/{NS}/pods/ev-worker-1"
    api.request("PATCH", pod_path, {"metadata": {
        "finalizers": ["test/grace"], "deletionTimestamp": "2026-01-01T00:00:00Z"}},
        "application/merge-patch+json")
    disrupted = wait_for("PodDisrupted event", lambda: events("PodDisrupted"))
    assert "EvictionByEvictionAPI" in str(disrupted[0]["message"])
    wait_for("restart counted", lambda: api.job(NS, "ev")["status"].get("restarts") == 1)
    api.request("PATCH", pod_path, {"metadata": {"finalizers": []}},
                "application/merge-patch+json")
    wait_for("ev-worker-1 replaced", lambda: (api.pods(NS).get("ev-worker-1") or {})
             .get("metadata", {}).get("uid") not in (None, old_uid))
    status = api.job(NS, "ev")["status"]
    assert (status["restarts"], status["disruptions"]) == (1, 1)
    assert len(events("PodDisrupted")) == 1


def test_a_namespace_being_deleted_gets_no_retries_events_or_status(
    emulator: EmulatorThread, operator_process: OperatorProcess
) -> None:
    api = HttpApi(emulator.url)
    terminating = (403, 'pods "gone-ps-0" is forbidden: unable to create new content in '
                        f"namespace {NS} because it is being terminated")
    emulator.refuse(lambda method, path, body: terminating
                    if method == "POST" and path.endswith("/pods") else None)
    operator_process.start()
    api.create_job(make_job("gone", NS).body())
    wait_for("the first attempt", lambda: pod_posts(emulator))
    time.sleep(3)  # a quiet period is what is asserted: nothing may happen in it
    assert len(pod_posts(emulator)) == 1
    assert not [e for e in api.events(NS) if e.get("reason") == "CreateRejected"]
    assert "createRefusal" not in (api.job(NS, "gone") or {}).get("status", {})
    log = operator_process.log_tail(5000)
    assert "being deleted" in log and "Traceback" not in log
