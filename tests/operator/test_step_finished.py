"""Table tests of the finished step (`steps/finished.py`): a finished job cleans up and,
after its TTL, deletes itself; `finish` ends a job."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from pstrain_api.model import FailureCause
from pstrain_operator.conditions import Event
from pstrain_operator.plan import DeleteJob
from pstrain_operator.steps.finished import cleanup_actions, decide_finished, finish

from .op_builders import at, make_job as J, pod
from .step_builders import begin, create, delete, running

JOB = J().build()
DONE = "2026-01-01T12:00:00Z"


@dataclass
class Case:
    id: str
    job: Any
    pods: list[Any] = field(default_factory=list)
    now: Any = at(0)
    # expected
    actions: list[Any] = field(default_factory=list)
    events: list[str] = field(default_factory=list)
    requeue: float | None = None


CASES = [
    Case("clean and no TTL: nothing more, no requeue",
         J().status(phase="Succeeded", completionTime=DONE),
         [pod(JOB, "worker", 0, phase="Succeeded")]),
    Case("a PS left running is deleted whatever cleanPodPolicy says",
         J().policy(cleanPodPolicy="None").status(phase="Failed", completionTime=DONE),
         running(J(), workers=1), actions=delete("ps-0"), events=["CleanedUpPods"],
         requeue=5.0),
    Case("TTL not yet passed: look again when it does",
         J().policy(ttlSecondsAfterFinished=100).status(phase="Succeeded",
                                                         completionTime=DONE),
         now=at(40), requeue=60.0),
    Case("TTL passed: the job is deleted",
         J().policy(ttlSecondsAfterFinished=100).status(phase="Failed", completionTime=DONE),
         now=at(100), actions=[DeleteJob()], events=["TTLExpired"]),
]


@pytest.mark.parametrize("case", CASES, ids=[c_.id for c_ in CASES])
def test_decide_finished(case: Case) -> None:
    plan = decide_finished(begin(case.job, case.pods, now=case.now))
    assert list(plan.actions) == case.actions
    assert [e.reason for e in plan.events] == case.events
    assert plan.requeue_after == case.requeue
    assert plan.status.phase == case.job.build().status.phase


CLEANUP = [
    ("Running (the default): active pods go", "Running", delete("ps-0", "worker-1")),
    ("None: only the parameter servers go", "None", delete("ps-0")),
    ("All: finished pods go too", "All", delete("ps-0", "worker-0", "worker-1")),
]


@pytest.mark.parametrize(("policy", "expected"), [r[1:] for r in CLEANUP],
                         ids=[r[0] for r in CLEANUP])
def test_cleanup_actions(policy: str, expected: list[Any]) -> None:
    job = J().policy(cleanPodPolicy=policy).build()
    pods = [pod(job, "ps", 0), pod(job, "worker", 0, phase="Succeeded"),
            pod(job, "worker", 1), pod(job, "worker", 2, deleting=True)]
    assert cleanup_actions(job, pods) == expected


def test_finish_keeps_the_deletions_so_far_drops_the_creates_and_cleans_up() -> None:
    p = begin(J().policy(ttlSecondsAfterFinished=30).status(phase="Running"),
              running(J()), now=at(5))
    p = p.then(actions=[*delete("worker-1"), *create("worker-2")])
    cause = FailureCause(role="worker", pod="j-worker-1", reason="Error", message="boom")
    plan = finish(p, "Failed", "RestartPolicyNever", "it broke", cause)
    assert list(plan.actions) == delete("worker-1", "ps-0", "worker-0")
    assert list(plan.events) == [
        Event("Warning", "RestartPolicyNever", "job failed: it broke"),
        Event("Normal", "CleanedUpPods", "deleted pods j-ps-0, j-worker-0 "
              "(cleanPodPolicy Running)")]
    st = plan.status
    assert (st.phase, st.completion_time, st.failure) == ("Failed", at(5), cause)
    assert plan.requeue_after == 5.0
    assert {x.type: (x.status, x.reason) for x in st.conditions} == {
        "Failed": ("True", "RestartPolicyNever"), "Running": ("False", "RestartPolicyNever")}
