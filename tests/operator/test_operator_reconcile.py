"""Table tests of the pure reconcile decision: observed job + pods -> actions + status."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import pytest

from pstrain_api import constants as c
from pstrain_api.model import Progress, TrainingJobStatus
from pstrain_operator.reconcile import (
    CreatePod,
    CreateService,
    DeleteJob,
    DeletePod,
    Observed,
    SetWorkers,
    ObservedPod,
    decide,
    decide_invalid,
    status_to_api,
)
from pstrain_operator.observe import observe_pod
from pstrain_operator.settings import PodSettings

from .op_builders import T0, at, make_job, pod, progress_status

SETTINGS = PodSettings()
SVC = CreateService({}, "j")


def create(*names: str) -> list[CreatePod]:
    return [CreatePod(f"j-{n}", n.rsplit("-", 1)[0], {}) for n in names]


def delete(*names: str) -> list[DeletePod]:
    return [DeletePod(f"j-{n}", f"u-{n}") for n in names]


@dataclass
class Case:
    id: str
    job: Any
    pods: list[Any] = field(default_factory=list)
    service: bool = True
    now: datetime = T0
    progress: Progress | None = None
    # expected
    actions: list[Any] = field(default_factory=list)
    phase: str = "Starting"
    events: list[str] = field(default_factory=list)
    status: dict[str, Any] = field(default_factory=dict)
    requeue: float | None = 5.0


def running(j: Any, ps: int = 1, workers: int = 2, ready: bool = True) -> list[ObservedPod]:
    job = j.build()
    return ([pod(job, "ps", i, ready=ready) for i in range(ps)]
            + [pod(job, "worker", i, ready=True) for i in range(workers)])


J = make_job  # short alias for the table

CASES = [
    Case("new job: service and PS, no workers",
         J(), service=False,
         actions=[SVC, *create("ps-0")],
         events=["CreatedService", "CreatedPS", "WaitingForPS"],
         status={"startTime": T0.isoformat().replace("+00:00", "Z"), "psReady": "0/1",
                 "workersReady": "0/2"}),
    Case("two PS, one missing: create it, still no workers",
         J().ps(2).status(phase="Starting"), pods=[pod(J().ps(2).build(), "ps", 0, ready=True)],
         actions=create("ps-1"), events=["CreatedPS"]),
    Case("PS not Ready: wait, nothing to do",
         J().status(phase="Starting"), pods=running(J(), workers=0, ready=False),
         actions=[], events=[]),
    Case("PS Ready: non-chief workers, then the chief (worker 0) last",
         J().status(phase="Starting"), pods=running(J(), workers=0),
         actions=create("worker-1", "worker-0"), phase="Running",
         events=["StartedWorkers", "StartedChief"], requeue=10.0),
    Case("separate chief created after all workers",
         J().chief().status(phase="Starting"), pods=running(J().chief(), workers=0),
         actions=create("worker-0", "worker-1", "chief-0"), phase="Running",
         events=["StartedWorkers", "StartedChief"], requeue=10.0),
    Case("all up: Running, progress recorded",
         J().status(phase="Running"), pods=running(J()),
         progress=Progress(global_step=42, loss=0.5, updated_at=T0),
         actions=[], phase="Running", requeue=10.0,
         status={"progress": progress_status(globalStep=42, loss=0.5,
                                             updatedAt="2026-01-01T12:00:00Z",
                                             advancedAt="2026-01-01T12:00:00Z"),
                 "psReady": "1/1", "workersReady": "2/2"}),
    Case("chief succeeded: Succeeded, PS deleted, running workers deleted",
         J().status(phase="Running"),
         pods=[*running(J(), workers=0), pod(J().build(), "worker", 0, phase="Succeeded"),
               pod(J().build(), "worker", 1, ready=True)],
         actions=delete("ps-0", "worker-1"), phase="Succeeded",
         events=["ChiefSucceeded", "CleanedUpPods"], requeue=5.0,
         status={"completionTime": "2026-01-01T12:00:00Z"}),
    Case("PS exited 0 before the chief is seen done: still Running, look again soon",
         J().status(phase="Running"),
         pods=[pod(J().build(), "ps", 0, phase="Succeeded"),
               pod(J().build(), "worker", 0, ready=True),
               pod(J().build(), "worker", 1, ready=True)],
         actions=[], phase="Running", events=[], requeue=5.0),
    Case("PS exited 0 just before the chief's success can be seen: still Running",
         J().status(phase="Running"), now=at(29),
         pods=[pod(J().build(), "ps", 0, phase="Succeeded", exit_code=0, finished_at=T0),
               pod(J().build(), "worker", 0, ready=True),
               pod(J().build(), "worker", 1, ready=True)],
         actions=[], phase="Running", events=[], requeue=5.0),
    Case("OnFailure: PS exited 0 while the chief trains: a failure of the PS, restarted",
         J().status(phase="Running"), now=at(30),
         pods=[pod(J().build(), "ps", 0, phase="Succeeded", exit_code=0, finished_at=T0,
                   reason="Completed"),
               pod(J().build(), "worker", 0, ready=True),
               pod(J().build(), "worker", 1, ready=True)],
         actions=delete("ps-0"), phase="Starting",
         events=["RestartingReplica", "WaitingForPS"], status={"restarts": 1}),
    Case("Never: PS exited 0 while the chief trains fails the job, naming the PS exit",
         J().policy(restartPolicy="Never").status(phase="Running"), now=at(30),
         pods=[pod(J().build(), "ps", 0, phase="Succeeded", exit_code=0, finished_at=T0,
                   reason="Completed"),
               pod(J().build(), "worker", 0, ready=True),
               pod(J().build(), "worker", 1, ready=True)],
         actions=delete("worker-0", "worker-1"), phase="Failed",
         events=["ParameterServerExited", "CleanedUpPods"],
         status={"failure": {"role": "ps", "pod": "j-ps-0", "exitCode": 0,
                             "reason": "Completed",
                             "message": "parameter server j-ps-0 exited with code 0 before "
                                        "the chief finished; a parameter server must serve "
                                        "until the job ends. j-ps-0 failed (exit code 0) "
                                        "and restartPolicy is Never."}}),
    Case("cleanPodPolicy None still deletes PS: they never linger",
         J().policy(cleanPodPolicy="None").status(phase="Running"),
         pods=[*running(J(), workers=0), pod(J().build(), "worker", 0, phase="Succeeded"),
               pod(J().build(), "worker", 1, ready=True)],
         actions=delete("ps-0"), phase="Succeeded",
         events=["ChiefSucceeded", "CleanedUpPods"], requeue=5.0),
    Case("cleanPodPolicy All deletes finished pods too",
         J().policy(cleanPodPolicy="All").status(phase="Running"),
         pods=[pod(J().build(), "ps", 0, phase="Succeeded"),
               pod(J().build(), "worker", 0, phase="Succeeded")],
         actions=delete("ps-0", "worker-0"), phase="Succeeded",
         events=["ChiefSucceeded", "CleanedUpPods"], requeue=5.0),
    Case("OnFailure: failed worker is deleted for restart and counted",
         J().status(phase="Running"),
         pods=[*running(J(), workers=1),
               pod(J().build(), "worker", 1, phase="Failed", exit_code=1, reason="Error")],
         actions=delete("worker-1"), phase="Running", events=["RestartingReplica"],
         requeue=10.0, status={"restarts": 1}),
    Case("failed chief restarting: phase back to Starting",
         J().status(phase="Running"),
         pods=[*running(J(), workers=0), pod(J().build(), "worker", 1, ready=True),
               pod(J().build(), "worker", 0, phase="Failed", exit_code=137,
                   reason="OOMKilled")],
         actions=delete("worker-0"), events=["RestartingReplica"], status={"restarts": 1}),
    Case("Never: a failed worker fails the job with its root cause",
         J().policy(restartPolicy="Never").status(phase="Running"),
         pods=[*running(J(), workers=1),
               pod(J().build(), "worker", 1, phase="Failed", exit_code=3, reason="Error")],
         actions=delete("ps-0", "worker-0"), phase="Failed",
         events=["RestartPolicyNever", "CleanedUpPods"], requeue=5.0,
         status={"failure": {"role": "worker", "pod": "j-worker-1", "exitCode": 3,
                             "reason": "Error",
                             "message": "j-worker-1 failed (exit code 3) and restartPolicy "
                                        "is Never."}}),
    Case("ExitCode: retryable 137 is restarted",
         J().policy(restartPolicy="ExitCode").status(phase="Running"),
         pods=[*running(J(), workers=1),
               pod(J().build(), "worker", 1, phase="Failed", exit_code=137,
                   reason="OOMKilled")],
         actions=delete("worker-1"), phase="Running", events=["RestartingReplica"],
         requeue=10.0, status={"restarts": 1}),
    Case("ExitCode: permanent exit code 1 fails the job",
         J().policy(restartPolicy="ExitCode").status(phase="Running"),
         pods=[*running(J(), workers=1),
               pod(J().build(), "worker", 1, phase="Failed", exit_code=1, reason="Error")],
         actions=delete("ps-0", "worker-0"), phase="Failed",
         events=["PermanentExitCode", "CleanedUpPods"], requeue=5.0),
    Case("backoffLimit exhausted: Failed naming the pod",
         J().policy(backoffLimit=2).status(phase="Running", restarts=2),
         pods=[*running(J(), workers=1),
               pod(J().build(), "worker", 1, phase="Failed", reason="Evicted")],
         actions=delete("ps-0", "worker-0"), phase="Failed",
         events=["BackoffLimitExceeded", "CleanedUpPods"], requeue=5.0,
         status={"failure": {"role": "worker", "pod": "j-worker-1", "exitCode": None,
                             "reason": "Evicted",
                             "message": "j-worker-1 failed (Evicted) after 2 restarts; "
                                        "backoffLimit is 2."}}),
    Case("a pod being deleted is neither counted again nor recreated",
         J().status(phase="Running", restarts=1),
         pods=[*running(J(), workers=1),
               pod(J().build(), "worker", 1, phase="Failed", exit_code=1, deleting=True)],
         actions=[], phase="Running", requeue=10.0, status={"restarts": 1}),
    Case("deleted pod is gone: recreated",
         J().status(phase="Running", restarts=1), pods=running(J(), workers=1),
         actions=create("worker-1"), phase="Running", events=["StartedWorkers"],
         requeue=10.0),
    Case("activeDeadlineSeconds passed: Failed, pods deleted",
         J().policy(activeDeadlineSeconds=60).status(phase="Running",
                                                      startTime="2026-01-01T12:00:00Z"),
         pods=running(J()), now=at(61),
         actions=delete("ps-0", "worker-0", "worker-1"), phase="Failed",
         events=["DeadlineExceeded", "CleanedUpPods"], requeue=5.0),
    Case("activeDeadlineSeconds not yet: requeue no later than the deadline",
         J().policy(activeDeadlineSeconds=60).status(phase="Running",
                                                      startTime="2026-01-01T12:00:00Z"),
         pods=running(J()), now=at(50), phase="Running", requeue=10.0),
    Case("suspend: all pods deleted, job kept, Suspended",
         J().policy(suspend=True).status(phase="Running"), pods=running(J()),
         actions=delete("ps-0", "worker-0", "worker-1"), phase="Suspended",
         events=["JobSuspended"]),
    Case("suspended and no pods: nothing to do",
         J().policy(suspend=True).status(phase="Suspended"), pods=[],
         actions=[], phase="Suspended", requeue=None),
    Case("resume: PS recreated, start time reset",
         J().status(phase="Suspended", startTime="2025-12-31T00:00:00Z"), pods=[],
         actions=create("ps-0"), events=["JobResumed", "CreatedPS", "WaitingForPS"],
         status={"startTime": "2026-01-01T12:00:00Z"}),
    Case("PS count changed under running pods: refused, nothing half-applied",
         J().ps(2).status(phase="Running"),
         pods=[pod(J().build(), "ps", 0, ready=True),
               pod(J().build(), "worker", 0, ready=True),
               pod(J().build(), "worker", 1, ready=True)],
         actions=[], phase="Running", events=["SpecChangeNotApplicable"], requeue=10.0,
         status={"psReady": "1/1"}),
    # Elastic workers: pods built for 2 workers, the spec now asks for another count.
    Case("scale 2 -> 4: two worker pods added, PS and chief untouched, no restart",
         J().workers(4).status(phase="Running", workers={"desired": 2, "live": 2}),
         pods=running(J()), actions=create("worker-2", "worker-3"), phase="Running",
         events=["WorkersScaledUp", "StartedWorkers"], requeue=10.0,
         status={"workers": {"desired": 4, "live": 4, "members": None,
                             "selector": "pstrain.io/job-name=j,"
                                         "pstrain.io/replica-role=worker"},
                 "workersReady": "2/4"}),
    Case("scale 4 -> 1: workers 3, 2, 1 removed, worker 0 (the chief) kept",
         J().workers(1).status(phase="Running", workers={"desired": 4, "live": 4}),
         pods=running(J().workers(4), workers=4),
         actions=delete("worker-3", "worker-2", "worker-1")
         + [SetWorkers(("j-ps-0.j.ns.svc:2222",), (0,))],  # the servers learn it
         phase="Running", events=["WorkersScaledDown"], requeue=10.0,
         status={"workers": {"desired": 1, "live": 1, "members": [0],
                             "selector": "pstrain.io/job-name=j,"
                                         "pstrain.io/replica-role=worker"}}),
    Case("scaled up, newcomer Ready: the servers get the set with it",
         J().workers(3).status(phase="Running", workers={"desired": 3, "live": 3}),
         pods=running(J()) + [pod(J().workers(3).build(), "worker", 2, ready=True)],
         actions=[SetWorkers(("j-ps-0.j.ns.svc:2222",), (0, 1, 2))], phase="Running",
         requeue=10.0, status={"workers": {"desired": 3, "live": 3, "members": [0, 1, 2],
                                           "selector": "pstrain.io/job-name=j,"
                                                       "pstrain.io/replica-role=worker"}}),
    Case("scale 4 -> 1 of a job whose servers run a program of their own (TF_CONFIG): "
         "pods only, no SetWorkers",
         J().template("ps", command=["python", "ps.py"]).workers(1).status(
             phase="Running", workers={"desired": 4, "live": 4}),
         pods=running(J().template("ps", command=["python", "ps.py"]).workers(4),
                      workers=4),
         actions=delete("worker-3", "worker-2", "worker-1"),
         phase="Running", events=["WorkersScaledDown"], requeue=10.0),
    Case("scaled up, newcomer not Ready yet: no step waits for it",
         J().workers(3).status(phase="Running", workers={"desired": 3, "live": 3}),
         pods=running(J()) + [pod(J().workers(3).build(), "worker", 2, ready=False)],
         phase="Running", requeue=10.0),
    Case("the set was sent already: not again",
         J().workers(3).status(phase="Running", workers={"desired": 3, "live": 3,
                                                         "members": [0, 1, 2]}),
         pods=running(J()) + [pod(J().workers(3).build(), "worker", 2, ready=True)],
         phase="Running", requeue=10.0),
    Case("scale seen and sent before: no second event, no second call",
         J().workers(4).status(phase="Running", workers={"desired": 4, "live": 4,
                                                         "members": [0, 1, 2, 3]}),
         pods=running(J()) + running(J().workers(4), ps=0, workers=4)[2:],
         phase="Running", requeue=10.0),
    Case("terminal: TTL not yet passed, requeue for the rest",
         J().policy(ttlSecondsAfterFinished=100).status(
             phase="Succeeded", completionTime="2026-01-01T12:00:00Z"),
         now=at(40), actions=[], phase="Succeeded", requeue=60.0),
    Case("terminal: TTL passed, job deleted",
         J().policy(ttlSecondsAfterFinished=100).status(
             phase="Failed", completionTime="2026-01-01T12:00:00Z"),
         now=at(100), actions=[DeleteJob()], phase="Failed", events=["TTLExpired"],
         requeue=None),
    Case("terminal and clean: nothing more, no requeue",
         J().status(phase="Succeeded", completionTime="2026-01-01T12:00:00Z"),
         pods=[pod(J().build(), "worker", 0, phase="Succeeded")],
         actions=[], phase="Succeeded", requeue=None),
    Case("GPU job: pods keep being created (GPU limits are in the pod)",
         J().gpus(2).status(phase="Starting"), pods=running(J().gpus(2), workers=0),
         actions=create("worker-1", "worker-0"), phase="Running",
         events=["StartedWorkers", "StartedChief"], requeue=10.0),
    Case("pods of an earlier job of the same name are not ours: not restarted, wait",
         J().status(phase="Starting"),
         pods=[pod(J().build(), "ps", 0, phase="Failed", exit_code=1, owner_uid="old")],
         actions=[], events=[]),
    Case("a pod of no replica (index beyond the spec) is deleted",
         J().workers(1).status(phase="Running"),
         pods=[*running(J().workers(1), workers=1), pod(J().workers(1).build(), "worker", 5)],
         actions=delete("worker-5"), phase="Running", events=["UnexpectedPod"], requeue=10.0),
]


@pytest.mark.parametrize("case", CASES, ids=[c_.id for c_ in CASES])
def test_decide(case: Case) -> None:
    job = case.job.build()
    plan = decide(Observed(job, tuple(case.pods), case.service, case.now, case.progress),
                  SETTINGS)
    assert list(plan.actions) == case.actions
    assert plan.status.phase == case.phase
    assert [e.reason for e in plan.events] == case.events
    assert plan.requeue_after == case.requeue
    wire = plan.status_patch
    for key, value in case.status.items():
        assert wire[key] == value, key


def test_decide_is_idempotent_for_repeated_events() -> None:
    """The same observation twice gives the same plan: events repeat harmlessly."""
    job = make_job().status(phase="Starting").build()
    obs = Observed(job, tuple(running(make_job(), workers=0)), True, T0)
    assert decide(obs, SETTINGS) == decide(obs, SETTINGS)


def test_created_pods_are_full_manifests_in_start_order() -> None:
    job = make_job().chief().status(phase="Starting").build()
    plan = decide(Observed(job, tuple(running(make_job().chief(), workers=0)), True, T0),
                  SETTINGS)
    made = [a.manifest for a in plan.actions if isinstance(a, CreatePod)]
    assert [m["metadata"]["name"] for m in made] == ["j-worker-0", "j-worker-1", "j-chief-0"]
    assert made[-1]["metadata"]["labels"][c.LABEL_IS_CHIEF] == "true"


def test_conditions_keep_transition_time_while_status_unchanged() -> None:
    first = decide(Observed(make_job().build(), (), False, T0), SETTINGS).status
    job = make_job().build().model_copy(update={"status": first})
    again = decide(Observed(job, (pod(job, "ps", 0),), True, at(30)), SETTINGS).status
    running_cond = {x.type: x for x in again.conditions}[c.COND_RUNNING]
    assert running_cond.status == "False"
    assert running_cond.last_transition_time == T0


def test_refused_spec_change_keeps_building_from_the_applied_spec() -> None:
    """While a PS-count change is refused, a lost worker is recreated from the OLD spec."""
    old = make_job().build()
    new_body = make_job().ps(2).status(phase="Running")
    from pstrain_operator.build import applied_spec
    import json
    applied = json.dumps(applied_spec(old))
    pods = (pod(old, "ps", 0, ready=True, applied_spec=applied),
            pod(old, "worker", 0, ready=True, applied_spec=applied))
    plan = decide(Observed(new_body.build(), pods, True, T0), SETTINGS)
    made = [a for a in plan.actions if isinstance(a, CreatePod)]
    assert [a.name for a in made] == ["j-worker-1"]
    cluster = json.loads(next(e["value"] for e in made[0].manifest["spec"]["containers"][0]["env"]
                              if e["name"] == c.ENV_CLUSTER))
    assert len(cluster["cluster"]["ps"]) == 1
    cond = {x.type: x for x in plan.status.conditions}[c.COND_SPEC_REJECTED]
    assert cond.status == "True" and "spec.replicas" in cond.message


def test_invalid_spec_gives_condition_and_one_event() -> None:
    plan = decide_invalid(TrainingJobStatus(), ["spec.x is bad."], 3, T0)
    assert plan.actions == () and plan.requeue_after is None
    assert [e.reason for e in plan.events] == ["InvalidSpec"]
    cond = plan.status.conditions[0]
    assert (cond.type, cond.status, cond.reason) == (c.COND_CREATED, "False", "InvalidSpec")
    again = decide_invalid(plan.status, ["spec.x is bad."], 3, at(5))
    assert again.events == () and again.status == plan.status


def test_status_patch_nulls_unset_fields_but_not_inside_lists() -> None:
    plan = decide(Observed(make_job().build(), (), False, T0), SETTINGS)
    wire = status_to_api(plan.status)
    assert wire["failure"] is None and wire["completionTime"] is None
    assert all(None not in cond.values() for cond in wire["conditions"])


OBSERVE_CASES = [
    ("running and ready",
     {"status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}},
     dict(phase="Running", ready=True)),
    ("OOMKilled main container",
     {"status": {"phase": "Failed", "containerStatuses": [
         {"name": "side", "state": {"terminated": {"exitCode": 0}}},
         {"name": "pstrain", "state": {"terminated": {"exitCode": 137,
                                                       "reason": "OOMKilled"}}}]}},
     dict(phase="Failed", exit_code=137, reason="OOMKilled")),
    ("completed main container: exit code and finish time",
     {"status": {"phase": "Succeeded", "containerStatuses": [
         {"name": "pstrain", "state": {"terminated": {
             "exitCode": 0, "reason": "Completed", "finishedAt": "2026-01-01T12:00:00Z"}}}]}},
     dict(phase="Succeeded", exit_code=0, reason="Completed", finished_at=T0)),
    ("evicted: pod-level reason wins",
     {"status": {"phase": "Failed", "reason": "Evicted", "message": "node low on memory"}},
     dict(phase="Failed", reason="Evicted", message="node low on memory")),
    ("failed without detail is an Error",
     {"status": {"phase": "Failed"}}, dict(phase="Failed", reason="Error")),
    ("being deleted",
     {"metadata": {"deletionTimestamp": "2026-01-01T00:00:00Z"}, "status": {"phase": "Running"}},
     dict(deleting=True, phase="Running")),
]


@pytest.mark.parametrize("raw,expected", [c_[1:] for c_ in OBSERVE_CASES],
                         ids=[c_[0] for c_ in OBSERVE_CASES])
def test_observe_pod(raw: dict[str, Any], expected: dict[str, Any]) -> None:
    meta = {"name": "j-worker-1", "uid": "u1", "labels": {
        c.LABEL_ROLE: "worker", c.LABEL_INDEX: "1"}, **raw.get("metadata", {})}
    got = observe_pod({"metadata": meta, "status": raw.get("status", {})})
    want = ObservedPod(name="j-worker-1", role="worker", index=1, uid="u1",
                       **{"phase": "Pending", **expected})
    assert got == want


def test_observe_pod_ignores_foreign_pods() -> None:
    assert observe_pod({"metadata": {"name": "x", "labels": {}}}) is None


CONFIG_LINE = ("pstrain replica: worker 1: configuration error: spec.training.entrypoint "
               "'m:f': module 'm' cannot be imported: ModuleNotFoundError: No module named 'm'")


def test_a_configuration_error_fails_the_job_at_once_with_its_line_as_the_reason() -> None:
    """Item 16/25: the pod's termination message is the cause, in the status and the
    event, and no restart is spent on it."""
    job = make_job().status(phase="Running").build()
    failed = pod(job, "worker", 1, phase="Failed", exit_code=c.EXIT_CONFIGURATION_ERROR,
                 reason="Error", message=CONFIG_LINE + "\n")
    plan = decide(Observed(job, (*running(make_job(), workers=1), failed), True, T0), SETTINGS)
    assert plan.status.phase == "Failed"
    assert plan.status.restarts == 0
    assert plan.status.failure is not None and plan.status.failure.message == CONFIG_LINE + "\n"
    failed_cond = next(x for x in plan.status.conditions if x.type == c.COND_FAILED)
    assert failed_cond.reason == "ConfigurationError"
    assert CONFIG_LINE in failed_cond.message
    event = next(e for e in plan.events if e.reason == "ConfigurationError")
    assert CONFIG_LINE in event.message


def test_restarting_event_says_the_cause_once_and_quotes_the_last_output() -> None:
    """Item 11/25: the termination message reaches an event before the pod is deleted;
    the cause is no longer said twice."""
    job = make_job().status(phase="Running").build()
    failed = pod(job, "worker", 1, phase="Failed", exit_code=137, reason="OOMKilled",
                 message="allocating 4 GiB for the embedding table\n")
    plan = decide(Observed(job, (*running(make_job(), workers=1), failed), True, T0), SETTINGS)
    assert list(plan.actions) == delete("worker-1")
    [event] = [e for e in plan.events if e.reason == "RestartingReplica"]
    assert event.message == ("restarting pod j-worker-1: it failed (OOMKilled, exit code "
                             "137); restart 1 of 3; its last output: allocating 4 GiB for "
                             "the embedding table")


def test_a_spec_valid_again_leaves_no_stale_invalid_spec_condition() -> None:
    """A running job whose spec was invalid for a while (an API server without the CRD's
    CEL rules lets a scale beyond maxReplicas through) and is valid again: Created is
    True again, with no InvalidSpec left, and the job goes on."""
    j = make_job()
    first = decide(Observed(j.build(), tuple(running(j)), True, T0), SETTINGS)
    assert first.status.phase == "Running"
    invalid = decide_invalid(first.status, ["spec.replicas.worker.replicas is 5."], 2, at(1))
    assert {x.type: x.reason for x in invalid.status.conditions}[c.COND_CREATED] == "InvalidSpec"
    job = j.build().model_copy(update={"status": invalid.status})
    again = decide(Observed(job, tuple(running(j)), True, at(2)), SETTINGS)
    created = {x.type: x for x in again.status.conditions}[c.COND_CREATED]
    assert (created.status, created.reason) == ("True", "SpecValid")
    assert again.status.phase == "Running" and again.actions == ()
    # A job that was invalid from the start (no pods yet) gets Created from its first pods.
    fresh = decide_invalid(TrainingJobStatus(), ["spec.x is bad."], 1, T0)
    job = j.build().model_copy(update={"status": fresh.status})
    made = decide(Observed(job, (), False, at(1)), SETTINGS)
    created = {x.type: x for x in made.status.conditions}[c.COND_CREATED]
    assert (created.status, created.reason) == ("True", "PodsCreated")
    assert [x.type for x in made.status.conditions].count(c.COND_CREATED) == 1
