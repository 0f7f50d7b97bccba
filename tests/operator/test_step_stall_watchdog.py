"""Table tests of the stall-watchdog step (`steps/stall_watchdog.py`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from pstrain_operator.conditions import Event
from pstrain_operator.steps.stall_watchdog import watch

from .op_builders import T0, at, make_job as J
from .step_builders import begin, delete, running

STALLED_SINCE_T0 = {"globalStep": 5, "advancedAt": "2026-01-01T12:00:00Z"}


@dataclass
class Case:
    id: str
    job: Any
    now: Any = at(61)
    restarted: frozenset[str] = frozenset()
    # expected
    actions: list[Any] = field(default_factory=list)
    events: list[str] = field(default_factory=list)
    restarts: int = 0
    advanced_at: Any = T0
    ended: str | None = None  # the phase of the plan that ends the job


CASES = [
    Case("no stallTimeoutSeconds: off",
         J().status(phase="Running", progress=STALLED_SINCE_T0)),
    Case("within the timeout: nothing",
         J().policy(stallTimeoutSeconds=60).status(phase="Running", progress=STALLED_SINCE_T0),
         now=at(59)),
    Case("stalled: the trainers are restarted, the PS keep the parameters",
         J().policy(stallTimeoutSeconds=60).status(phase="Running", progress=STALLED_SINCE_T0),
         actions=delete("worker-0", "worker-1"), events=["RestartingStalled"], restarts=1,
         advanced_at=at(61)),
    Case("stalled while a replica restarts anyway: not counted twice",
         J().policy(stallTimeoutSeconds=60).status(phase="Running", progress=STALLED_SINCE_T0),
         restarted=frozenset({"j-worker-1"})),
    Case("stalled, restartPolicy Never: Failed",
         J().policy(stallTimeoutSeconds=60, restartPolicy="Never").status(
             phase="Running", progress=STALLED_SINCE_T0), ended="Failed"),
    Case("not Running: the watchdog sleeps",
         J().policy(stallTimeoutSeconds=60).status(phase="Starting", progress=STALLED_SINCE_T0)),
]


@pytest.mark.parametrize("case", CASES, ids=[c_.id for c_ in CASES])
def test_watch(case: Case) -> None:
    p = begin(case.job, running(J()), now=case.now).then(restarted=case.restarted)
    out, end = watch(p)
    assert list(out.actions) == case.actions
    assert [e.reason for e in out.events] == case.events
    assert out.st.restarts == case.restarts
    assert out.progress is not None and out.progress.advanced_at == case.advanced_at
    assert (end.status.phase if end else None) == case.ended


def test_the_restart_event_says_why() -> None:
    p = begin(J().policy(stallTimeoutSeconds=60).status(phase="Running",
                                                        progress=STALLED_SINCE_T0),
              running(J()), now=at(61))
    out, _ = watch(p)
    why = ("the global step stayed at 5 for 61s (stallTimeoutSeconds is 60); restarting "
           "the workers and the chief; restart 1 of 3.")
    assert list(out.events) == [Event("Warning", "RestartingStalled", why)]
    assert [a.why for a in out.actions] == [why, why]
