"""Table tests of the suspended step (`steps/suspended.py`): suspend and resume."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from pstrain_api.model import CheckpointStatus
from pstrain_operator.conditions import Event
from pstrain_operator.plan import RequestCheckpoint
from pstrain_operator.steps.suspended import decide_suspended, resume

from .op_builders import T0, make_job as J
from .step_builders import begin, delete, running


@dataclass
class Case:
    id: str
    job: Any
    pods: list[Any] = field(default_factory=list)
    checkpoint: CheckpointStatus | None = None
    # expected
    phase: str = "Suspended"
    actions: list[Any] = field(default_factory=list)
    events: list[str] = field(default_factory=list)
    requeue: float | None = 5.0
    lost_steps: int = 0


SUSPEND = {"suspend": True}
CASES = [
    Case("running job without checkpoints: every pod deleted, the steps lost",
         J().policy(**SUSPEND).status(phase="Running", progress={"globalStep": 7}),
         running(J()), actions=delete("ps-0", "worker-0", "worker-1"),
         events=["JobSuspended"], lost_steps=7),
    Case("already suspended, pods gone: nothing more, no requeue",
         J().policy(**SUSPEND).status(phase="Suspended"), requeue=None),
    Case("with checkpoints: ask the chief first, delete nothing yet",
         J().checkpoint().policy(**SUSPEND).status(phase="Running", progress={"globalStep": 7}),
         running(J()), phase="Running",
         actions=[RequestCheckpoint("j-ps-0.j.ns.svc:2222")],
         events=["CheckpointRequested"], requeue=2.0),
    Case("with checkpoints: the one at the last step is there, suspend",
         J().checkpoint().policy(**SUSPEND).status(phase="Running", progress={"globalStep": 7}),
         running(J()), checkpoint=CheckpointStatus(step=7, path="/ckpt/7"),
         actions=delete("ps-0", "worker-0", "worker-1"), events=["JobSuspended"]),
]


@pytest.mark.parametrize("case", CASES, ids=[c_.id for c_ in CASES])
def test_decide_suspended(case: Case) -> None:
    plan = decide_suspended(begin(case.job, case.pods, checkpoint=case.checkpoint))
    assert plan.status.phase == case.phase
    assert list(plan.actions) == case.actions
    assert [e.reason for e in plan.events] == case.events
    assert plan.requeue_after == case.requeue
    assert plan.status.lost_steps == case.lost_steps


RESUME = [
    ("not suspended before: unchanged", J().status(phase="Running"), None),
    ("resumed without checkpoints: from step 0",
     J().status(phase="Suspended", startTime="2026-01-01T11:00:00Z"),
     Event("Normal", "JobResumed", "resumed: recreating pods; training restarts from step 0 "
           "(spec.training.checkpoint.directory is not set)")),
]


@pytest.mark.parametrize(("job", "event"), [r[1:] for r in RESUME], ids=[r[0] for r in RESUME])
def test_resume(job: Any, event: Event | None) -> None:
    p = begin(job, now=T0)
    out = resume(p)
    if event is None:
        assert out == p
        return
    assert list(out.events) == [event]
    assert (out.st.start_time, out.st.progress, out.st.resumed_from_step) == (None, None, 0)
    suspended = {x.type: x for x in out.st.conditions}["Suspended"]
    assert (suspended.status, suspended.reason) == ("False", "JobResumed")
