"""Table tests of the decisions beside `decide`: what suspend and resume do to training
(lost steps), pods deleted or evicted from outside, and the stall watchdog."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any

import pytest

from pstrain_api.model import CheckpointStatus, Progress
from pstrain_operator.reconcile import (
    DeletePod,
    Observed,
    ObservedPod,
    RequestCheckpoint,
    decide,
)
from pstrain_operator.observe import observe_pod
from pstrain_operator.settings import PodSettings

from .op_builders import T0, at, make_job, pod, progress_status

SETTINGS = PodSettings()
J = make_job




def up(j: Any, **worker0: Any) -> list[ObservedPod]:
    job = j.build()
    return [pod(job, "ps", 0, ready=True), pod(job, "worker", 0, ready=True, **worker0),
            pod(job, "worker", 1, ready=True)]


def iso(t: datetime) -> str:
    return t.isoformat().replace("+00:00", "Z")


PROGRESS_120 = {"globalStep": 120, "advancedAt": iso(T0)}


@dataclass
class Case:
    id: str
    job: Any
    pods: list[Any] = field(default_factory=list)
    now: datetime = T0
    progress: Progress | None = None
    checkpoint: CheckpointStatus | None = None  # as PS 0 reports it now
    # expected
    asked: bool = False  # RequestCheckpoint sent
    deleted: list[str] = field(default_factory=list)
    phase: str = "Running"
    events: list[str] = field(default_factory=list)
    says: list[str] = field(default_factory=list)  # in the events' messages
    status: dict[str, Any] = field(default_factory=dict)


CASES = [
    # --- suspend and resume say what really happens (issue 15, item 23)
    Case("suspend without a checkpoint directory: restarts from 0, steps lost",
         J().policy(suspend=True).status(phase="Running", progress=PROGRESS_120),
         pods=up(J()), deleted=["j-ps-0", "j-worker-0", "j-worker-1"], phase="Suspended",
         events=["JobSuspended"],
         says=["checkpoint.directory is not set", "restarts from step 0",
               "120 steps done so far are lost"],
         status={"lostSteps": 120}),
    # --- checkpoint before disruption (issue 11, item 9)
    Case("suspend with checkpoints: ask the chief first, keep the pods meanwhile",
         J().checkpoint(intervalSteps=50).policy(suspend=True).status(
             phase="Running", progress=PROGRESS_120,
             lastCheckpoint={"step": 100, "path": "/ckpt/100.pt"}),
         pods=up(J().checkpoint(intervalSteps=50)), asked=True, events=["CheckpointRequested"],
         says=["suspend: asked the chief for a checkpoint at step 120 or later"],
         status={"checkpointRequest": {"step": 120, "reason": "suspend",
                                       "requestedAt": iso(T0)}}),
    Case("suspend: the requested checkpoint is written, then the pods go",
         J().checkpoint(intervalSteps=50).policy(suspend=True).status(
             phase="Running", progress=PROGRESS_120,
             checkpointRequest={"step": 120, "reason": "suspend", "requestedAt": iso(T0)}),
         pods=up(J().checkpoint(intervalSteps=50)), now=at(4),
         checkpoint=CheckpointStatus(step=121, path="/ckpt/121.pt"),
         deleted=["j-ps-0", "j-worker-0", "j-worker-1"], phase="Suspended",
         events=["CheckpointConfirmed", "JobSuspended"],
         says=["continues from the checkpoint at step 121"],
         status={"lostSteps": 0, "checkpointRequest": None,
                 "lastCheckpoint": {"step": 121, "path": "/ckpt/121.pt", "time": None}}),
    Case("suspend: waiting within the bound, nothing asked twice",
         J().checkpoint(intervalSteps=50).policy(suspend=True).status(
             phase="Running", progress=PROGRESS_120,
             checkpointRequest={"step": 120, "reason": "suspend", "requestedAt": iso(T0)}),
         pods=up(J().checkpoint(intervalSteps=50)), now=at(10)),
    Case("suspend: no checkpoint within the bound, go on from the last one",
         J().checkpoint(intervalSteps=50).policy(suspend=True).status(
             phase="Running", progress=PROGRESS_120, lostSteps=3,
             lastCheckpoint={"step": 100, "path": "/ckpt/100.pt"},
             checkpointRequest={"step": 120, "reason": "suspend", "requestedAt": iso(T0)}),
         pods=up(J().checkpoint(intervalSteps=50)), now=at(30),
         deleted=["j-ps-0", "j-worker-0", "j-worker-1"], phase="Suspended",
         events=["CheckpointNotConfirmed", "JobSuspended"],
         says=["no checkpoint at step 120 or later within 30s",
               "continues from the checkpoint at step 100 (20 steps after it are lost)"],
         status={"lostSteps": 23}),
    Case("suspend with a directory but no checkpoint ever: restarts from 0",
         J().checkpoint(intervalSteps=50).policy(suspend=True).status(
             phase="Running", progress=PROGRESS_120,
             checkpointRequest={"step": 120, "reason": "suspend", "requestedAt": iso(T0)}),
         pods=up(J().checkpoint(intervalSteps=50)), now=at(31), deleted=["j-ps-0", "j-worker-0", "j-worker-1"],
         phase="Suspended", events=["CheckpointNotConfirmed", "JobSuspended"],
         says=["no checkpoint was written yet", "restarts from step 0"],
         status={"lostSteps": 120}),
    Case("deadline: checkpoint first, then fail",
         J().checkpoint(intervalSteps=50).policy(activeDeadlineSeconds=60).status(
             phase="Running", progress=PROGRESS_120, startTime=iso(T0)),
         pods=up(J().checkpoint(intervalSteps=50)), now=at(60), asked=True, events=["CheckpointRequested"],
         says=["deadline: asked the chief for a checkpoint"]),
    Case("deadline: checkpoint written, the job fails DeadlineExceeded",
         J().checkpoint(intervalSteps=50).policy(activeDeadlineSeconds=60).status(
             phase="Running", progress=PROGRESS_120, startTime=iso(T0),
             checkpointRequest={"step": 120, "reason": "deadline", "requestedAt": iso(at(60))}),
         pods=up(J().checkpoint(intervalSteps=50)), now=at(62),
         checkpoint=CheckpointStatus(step=120, path="/ckpt/120.pt"),
         deleted=["j-ps-0", "j-worker-0", "j-worker-1"], phase="Failed",
         events=["CheckpointConfirmed", "DeadlineExceeded", "CleanedUpPods"]),
    Case("an eviction seen coming: ask for a checkpoint, hold nothing up",
         J().checkpoint(intervalSteps=50).status(phase="Running", progress=PROGRESS_120),
         pods=up(J().checkpoint(intervalSteps=50), disruption="PreemptionByScheduler"),
         asked=True, events=["CheckpointRequested"],
         says=["disruption of j-worker-0: asked the chief"],
         status={"countedDisruptions": ["asked:u-worker-0"]}),
    Case("the same announced disruption seen again: not asked twice",
         J().checkpoint(intervalSteps=50).status(phase="Running", progress=PROGRESS_120,
                               countedDisruptions=["asked:u-worker-0"]),
         pods=up(J().checkpoint(intervalSteps=50), disruption="PreemptionByScheduler")),
    Case("evicted and terminating at first sight: counted and asked at once",
         J().checkpoint(intervalSteps=50).status(phase="Running", progress=PROGRESS_120),
         pods=up(J().checkpoint(intervalSteps=50), disruption="EvictionByEvictionAPI", deleting=True),
         asked=True, phase="Starting", events=["PodDisrupted", "CheckpointRequested"],
         status={"countedDisruptions": ["u-worker-0"], "restarts": 1}),
    Case("the chief succeeded: the PS stay until the final checkpoint is confirmed",
         J().checkpoint(intervalSteps=50).status(phase="Running", progress=PROGRESS_120),
         pods=[pod(J().checkpoint(intervalSteps=50).build(), "worker", 0, phase="Succeeded"),
               *up(J().checkpoint(intervalSteps=50))[:1], *up(J().checkpoint(intervalSteps=50))[2:]],
         checkpoint=CheckpointStatus(step=5, path="/ckpt/5.pt"),
         events=["CheckpointRequested"], says=["success: waiting for the final checkpoint"]),
    Case("the chief succeeded and the final checkpoint is there: success, PS stopped",
         J().checkpoint(intervalSteps=50).status(phase="Running", progress=PROGRESS_120),
         pods=[pod(J().checkpoint(intervalSteps=50).build(), "worker", 0, phase="Succeeded"),
               *up(J().checkpoint(intervalSteps=50))[:1], *up(J().checkpoint(intervalSteps=50))[2:]],
         checkpoint=CheckpointStatus(step=10, path="/ckpt/10.pt"),
         deleted=["j-ps-0", "j-worker-1"], phase="Succeeded",
         events=["ChiefSucceeded", "CleanedUpPods"]),
    Case("still suspended: no new event, nothing counted twice",
         J().policy(suspend=True).status(phase="Suspended", progress=PROGRESS_120,
                                         lostSteps=120),
         phase="Suspended", status={"lostSteps": 120}),
    Case("resume without a checkpoint directory: from step 0",
         J().status(phase="Suspended", progress=PROGRESS_120), phase="Starting",
         events=["JobResumed", "CreatedPS", "WaitingForPS"],
         says=["training restarts from step 0"],
         status={"resumedFromStep": 0, "progress": None}),
    Case("resume with a checkpoint: the status says from which step",
         J().checkpoint(intervalSteps=50).status(phase="Suspended", progress=PROGRESS_120,
                               lastCheckpoint={"step": 100, "path": "/ckpt/100.pt"}),
         phase="Starting", events=["JobResumed", "CreatedPS", "WaitingForPS"],
         says=["continues from the checkpoint at step 100"],
         status={"resumedFromStep": 100}),

    # --- pods deleted or evicted from outside leave a trace (issue 15, item 24)
    Case("an evicted worker: event names the cause, the replacement is counted",
         J().status(phase="Running"),
         pods=up(J(), deleting=True, disruption="EvictionByEvictionAPI",
                 disruption_message="Eviction API: evicting"),
         events=["PodDisrupted"], phase="Starting",
         says=["j-worker-0 (worker) is going away: DisruptionTarget EvictionByEvictionAPI: "
               "Eviction API: evicting", "restart 1"],
         status={"restarts": 1, "disruptions": 1, "countedDisruptions": ["u-worker-0"]}),
    Case("a deleted PS (kubectl delete pod): named as a deletion, counted once",
         J().status(phase="Running"),
         pods=[replace(up(J())[0], deleting=True), *up(J())[1:]],
         events=["PodDisrupted", "WaitingForPS"], phase="Starting",
         says=["j-ps-0 (ps) is going away: deleted through the API"],
         status={"restarts": 1, "disruptions": 1,
                 "replicaStatuses": {"ps": {"active": 0, "ready": 0, "succeeded": 0,
                                            "failed": 0, "restarts": 1},
                                     "worker": {"active": 2, "ready": 2, "succeeded": 0,
                                                "failed": 0, "restarts": 0}}}),
    Case("the same terminating pod seen again: not counted twice",
         J().status(phase="Running", restarts=1, disruptions=1,
                    countedDisruptions=["u-worker-0"]),
         pods=up(J(), deleting=True, disruption="EvictionByEvictionAPI"),
         phase="Starting", status={"restarts": 1, "disruptions": 1}),
    Case("a failed pod the operator deleted for its restart: no disruption",
         J().status(phase="Running", restarts=1),
         pods=up(J(), deleting=True, phase="Failed", exit_code=1),
         phase="Starting", status={"restarts": 1, "disruptions": 0}),
    Case("disruptions do not use up backoffLimit: a failure is still restarted",
         J().policy(backoffLimit=1).status(phase="Running", restarts=1, disruptions=1),
         pods=up(J(), phase="Failed", exit_code=1), deleted=["j-worker-0"],
         phase="Starting", events=["RestartingReplica"], status={"restarts": 2}),

    # --- the stall watchdog (issue 11, item 8)
    Case("stalled past stallTimeoutSeconds: workers and chief restarted, PS kept",
         J().policy(stallTimeoutSeconds=60).status(phase="Running", progress=PROGRESS_120),
         pods=up(J()), now=at(61), progress=Progress(global_step=120),
         deleted=["j-worker-0", "j-worker-1"], phase="Starting",
         events=["RestartingStalled"],
         says=["the global step stayed at 120 for 61s (stallTimeoutSeconds is 60)",
               "restart 1 of 3"],
         status={"restarts": 1, "countedDisruptions": ["u-worker-0", "u-worker-1"]}),
    Case("a hung PS 0 that no longer answers is a stall too",
         J().policy(stallTimeoutSeconds=60).status(phase="Running", progress=PROGRESS_120),
         pods=up(J()), now=at(61), deleted=["j-worker-0", "j-worker-1"], phase="Starting",
         events=["RestartingStalled"]),
    Case("not yet stalled: nothing happens",
         J().policy(stallTimeoutSeconds=60).status(phase="Running", progress=PROGRESS_120),
         pods=up(J()), now=at(59), progress=Progress(global_step=120),
         status={"progress": progress_status(**PROGRESS_120)}),
    Case("the step advanced: the watchdog's clock restarts",
         J().policy(stallTimeoutSeconds=60).status(phase="Running", progress=PROGRESS_120),
         pods=up(J()), now=at(300), progress=Progress(global_step=121),
         status={"progress": progress_status(globalStep=121, advancedAt=iso(at(300)))}),
    Case("watchdog off by default",
         J().status(phase="Running", progress=PROGRESS_120),
         pods=up(J()), now=at(10**6), progress=Progress(global_step=120)),
    Case("stalled under restartPolicy Never: the job fails with reason Stalled",
         J().policy(stallTimeoutSeconds=60, restartPolicy="Never").status(
             phase="Running", progress=PROGRESS_120),
         pods=up(J()), now=at(61), deleted=["j-ps-0", "j-worker-0", "j-worker-1"],
         phase="Failed", events=["Stalled", "CleanedUpPods"], says=["restartPolicy is Never"]),
    Case("stalled with backoffLimit used up: the job fails with reason Stalled",
         J().policy(stallTimeoutSeconds=60, backoffLimit=1).status(
             phase="Running", progress=PROGRESS_120, restarts=1),
         pods=up(J()), now=at(61), deleted=["j-ps-0", "j-worker-0", "j-worker-1"],
         phase="Failed", events=["Stalled", "CleanedUpPods"], says=["backoffLimit is 1"]),
    Case("running again after a restart: the watchdog's clock starts afresh",
         J().policy(stallTimeoutSeconds=60).status(phase="Starting", progress=PROGRESS_120),
         pods=up(J()), now=at(600), progress=Progress(global_step=120),
         status={"progress": progress_status(**{**PROGRESS_120,
                                                "advancedAt": iso(at(600))})}),
]


@pytest.mark.parametrize("case", CASES, ids=[c_.id for c_ in CASES])
def test_decide(case: Case) -> None:
    plan = decide(Observed(case.job.build(), tuple(case.pods), True, case.now, case.progress,
                           case.checkpoint), SETTINGS)
    assert [a.name for a in plan.actions if isinstance(a, DeletePod)] == case.deleted
    assert any(isinstance(a, RequestCheckpoint) for a in plan.actions) == case.asked
    assert plan.status.phase == case.phase
    assert [e.reason for e in plan.events] == case.events
    text = " | ".join(e.message for e in plan.events)
    for words in case.says:
        assert words in text
    wire = plan.status_patch
    for key, value in case.status.items():
        assert wire[key] == value, key
    if "Stalled" in case.events:
        assert any(cond.type == "Failed" and cond.reason == "Stalled"
                   for cond in plan.status.conditions)


def test_observe_pod_reads_the_disruption_target_condition() -> None:
    raw = {"metadata": {"name": "j-worker-0", "uid": "u1", "deletionTimestamp": "2026-01-01T00:00:00Z",
                        "labels": {"pstrain.io/replica-role": "worker",
                                   "pstrain.io/replica-index": "0"}},
           "status": {"phase": "Running", "conditions": [
               {"type": "Ready", "status": "True"},
               {"type": "DisruptionTarget", "status": "True", "reason": "EvictionByEvictionAPI",
                "message": "Eviction API: evicting"}]}}
    seen = observe_pod(raw)
    assert seen is not None and seen.deleting
    assert (seen.disruption, seen.disruption_message) == ("EvictionByEvictionAPI",
                                                          "Eviction API: evicting")
    raw["status"]["conditions"][1]["status"] = "False"
    seen = observe_pod(raw)
    assert seen is not None and seen.disruption == ""


def test_success_does_not_wait_when_the_parameter_servers_already_stopped() -> None:
    job = J().checkpoint(intervalSteps=50).status(phase="Running", progress=PROGRESS_120).build()
    pods = (pod(job, "worker", 0, phase="Succeeded"), pod(job, "ps", 0, phase="Succeeded"),
            pod(job, "worker", 1, phase="Succeeded"))
    plan = decide(Observed(job, pods, True, T0), SETTINGS)
    assert plan.status.phase == "Succeeded"
    assert [e.reason for e in plan.events] == ["ChiefSucceeded"]


def test_suspend_counts_the_steps_done_after_the_checkpoint_it_waited_for() -> None:
    job = J().checkpoint(intervalSteps=50).policy(suspend=True).status(
        phase="Running", progress=PROGRESS_120,
        checkpointRequest={"step": 120, "reason": "suspend", "requestedAt": iso(T0)}).build()
    plan = decide(Observed(job, tuple(up(J().checkpoint(intervalSteps=50))), True, at(3),
                           Progress(global_step=127),
                           CheckpointStatus(step=121, path="/ckpt/121.pt")), SETTINGS)
    assert plan.status.phase == "Suspended" and plan.status.lost_steps == 6
    assert "(6 steps after it are lost)" in plan.events[-1].message
