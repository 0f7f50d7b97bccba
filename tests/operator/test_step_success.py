"""Table tests of the success step (`steps/success.py`): the chief completed."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from pstrain_api.model import CheckpointStatus, Progress
from pstrain_operator.plan import RequestCheckpoint
from pstrain_operator.steps.success import on_chief_done

from .op_builders import T0, make_job as J, pod
from .step_builders import begin, delete

JOB = J().build()
CHIEF_DONE = [pod(JOB, "ps", 0, ready=True), pod(JOB, "worker", 0, phase="Succeeded"),
              pod(JOB, "worker", 1, ready=True)]
CKPT = {"checkpoint": {"directory": "/ckpt"}}


@dataclass
class Case:
    id: str
    job: Any
    pods: list[Any]
    progress: Progress | None = None
    checkpoint: CheckpointStatus | None = None
    # expected: None while the chief has not completed
    phase: str | None = "Succeeded"
    actions: list[Any] = field(default_factory=list)
    events: list[str] = field(default_factory=list)
    message: str = "the chief j-worker-0 completed"


def with_ckpt(j: Any) -> Any:
    j.data["spec"]["training"].update(CKPT)
    return j


CASES = [
    Case("the chief still trains: not yet",
         J().status(phase="Running"),
         [pod(JOB, "ps", 0, ready=True), pod(JOB, "worker", 0, ready=True)], phase=None),
    Case("the chief completed: Succeeded, PS and running workers cleaned up",
         J().status(phase="Running"), CHIEF_DONE,
         actions=delete("ps-0", "worker-1"), events=["ChiefSucceeded", "CleanedUpPods"]),
    Case("the step just read is named",
         J().status(phase="Running"), CHIEF_DONE,
         progress=Progress(global_step=10, updated_at=T0),
         actions=delete("ps-0", "worker-1"), events=["ChiefSucceeded", "CleanedUpPods"],
         message="the chief j-worker-0 completed at global step 10"),
    Case("with checkpoints: the PS wait for the final one (nothing is asked)",
         with_ckpt(J().status(phase="Running")), CHIEF_DONE, phase="Running",
         events=["CheckpointRequested"], message=""),
    Case("with checkpoints: the final one is there, Succeeded",
         with_ckpt(J().status(phase="Running")), CHIEF_DONE,
         checkpoint=CheckpointStatus(step=10, path="/ckpt/ckpt-10.pt"),
         actions=delete("ps-0", "worker-1"), events=["ChiefSucceeded", "CleanedUpPods"]),
]


@pytest.mark.parametrize("case", CASES, ids=[c_.id for c_ in CASES])
def test_on_chief_done(case: Case) -> None:
    plan = on_chief_done(begin(case.job, case.pods, progress=case.progress,
                               checkpoint=case.checkpoint))
    if case.phase is None:
        assert plan is None
        return
    assert plan is not None
    assert plan.status.phase == case.phase
    assert list(plan.actions) == case.actions
    assert [e.reason for e in plan.events] == case.events
    done = [x.message for x in plan.status.conditions if x.type == "Succeeded"]
    assert done == ([case.message] if case.message else [])
    assert not any(isinstance(a, RequestCheckpoint) for a in plan.actions)
