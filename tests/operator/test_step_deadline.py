"""Table tests of the deadline step (`steps/deadline.py`): activeDeadlineSeconds."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from pstrain_operator.steps.deadline import enforce, within_deadline

from .op_builders import at, make_job as J
from .step_builders import begin, delete, running

STARTED = "2026-01-01T12:00:00Z"


@dataclass
class Case:
    id: str
    job: Any
    now: Any
    # expected: None while the deadline has not passed
    phase: str | None = None
    actions: list[Any] = field(default_factory=list)
    events: list[str] = field(default_factory=list)
    requeue: float = 10.0  # what within_deadline makes of 10 s


CASES = [
    Case("no deadline", J().status(phase="Running", startTime=STARTED), at(9999)),
    Case("not started yet: no clock", J().policy(activeDeadlineSeconds=60), at(9999)),
    Case("before it: look again no later than it",
         J().policy(activeDeadlineSeconds=60).status(phase="Running", startTime=STARTED),
         at(55), requeue=5.0),
    Case("just before it: at least half a second",
         J().policy(activeDeadlineSeconds=60).status(phase="Running", startTime=STARTED),
         at(59.9), requeue=0.5),
    Case("passed: Failed, pods cleaned up",
         J().policy(activeDeadlineSeconds=60).status(phase="Running", startTime=STARTED),
         at(60), phase="Failed", actions=delete("ps-0", "worker-0", "worker-1"),
         events=["DeadlineExceeded", "CleanedUpPods"], requeue=0.5),
]


@pytest.mark.parametrize("case", CASES, ids=[c_.id for c_ in CASES])
def test_enforce(case: Case) -> None:
    p = begin(case.job, running(J()), now=case.now)
    plan = enforce(p)
    assert (plan.status.phase if plan else None) == case.phase
    assert (list(plan.actions) if plan else []) == case.actions
    assert ([e.reason for e in plan.events] if plan else []) == case.events
    assert within_deadline(p, 10.0) == case.requeue
