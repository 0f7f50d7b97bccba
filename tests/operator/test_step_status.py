"""Table tests of the status step (`steps/status.py`): phase, Running condition,
progress and when to look again."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from pstrain_api import constants as c
from pstrain_api.model import CheckpointStatus, Progress
from pstrain_operator.conditions import Event
from pstrain_operator.steps.status import decide_status, is_chief_up

from .op_builders import T0, at, make_job as J, pod
from .step_builders import begin, create, running

JOB = J().build()


@dataclass
class Case:
    id: str
    job: Any
    pods: list[Any]
    progress: Progress | None = None
    restarted: frozenset[str] = frozenset()
    backoff: float = 0.0
    # expected
    phase: str = "Starting"
    running: tuple[str, str] = ("False", "WaitingForPS")  # Running condition
    events: list[Event] = field(default_factory=list)
    requeue: float = 5.0
    advanced_at: Any = None


WAITING = Event("Normal", "WaitingForPS", "waiting for parameter servers to be Ready (0/1)")
CASES = [
    Case("a PS not Ready: Starting, and say so once",
         J(), running(J(), workers=0, ready=False), events=[WAITING]),
    Case("still Starting: not said again",
         J().status(phase="Starting"), running(J(), workers=0, ready=False)),
    Case("everything up: Running, progress refreshed at its interval",
         J().status(phase="Starting"), running(J()),
         progress=Progress(global_step=3, updated_at=T0), phase="Running",
         running=("True", "AllReplicasStarted"), requeue=3.0, advanced_at=at(1)),
    Case("the chief restarts: back to Starting, waiting for it",
         J().status(phase="Running"), running(J()), restarted=frozenset({"j-worker-0"}),
         running=("False", "WaitingForRestartedReplicas")),
    Case("a PS exited 0 (the chief is done): still Running, look again soon",
         J().status(phase="Running"),
         [pod(JOB, "ps", 0, phase="Succeeded"), *running(J(), ps=0)], phase="Running",
         running=("True", "AllReplicasStarted"), requeue=5.0),
    Case("backing off a refused create: no event, the condition is the refusal's",
         J().status(phase="Starting"), running(J(), workers=0, ready=False), backoff=2.0,
         running=("", ""), requeue=2.0),
]


@pytest.mark.parametrize("case", CASES, ids=[c_.id for c_ in CASES])
def test_decide_status(case: Case) -> None:
    p = begin(case.job, case.pods, progress=case.progress, now=at(1)).then(
        restarted=case.restarted, backoff=case.backoff)
    plan = decide_status(p, 3.0)
    assert plan.status.phase == case.phase
    conds = {x.type: (x.status, x.reason) for x in plan.status.conditions}
    assert conds.get(c.COND_RUNNING, ("", "")) == case.running
    assert list(plan.events) == case.events
    assert plan.requeue_after == case.requeue
    progress = plan.status.progress
    assert (progress.advanced_at if progress else None) == case.advanced_at


def test_running_records_the_checkpoint_just_read() -> None:
    ckpt = CheckpointStatus(step=4, path="/ckpt/4")
    plan = decide_status(begin(J().status(phase="Running"), running(J()), checkpoint=ckpt),
                         10.0)
    assert (plan.status.phase, plan.status.last_checkpoint) == ("Running", ckpt)


CHIEF_UP = [
    ("running chief", running(J()), frozenset(), [], True),
    ("no chief pod", running(J(), workers=0), frozenset(), [], False),
    ("chief created this pass", running(J(), workers=0), frozenset(), create("worker-0"), True),
    ("chief restarting", running(J()), frozenset({"j-worker-0"}), [], False),
]


@pytest.mark.parametrize(("pods", "restarted", "actions", "expected"),
                         [r[1:] for r in CHIEF_UP], ids=[r[0] for r in CHIEF_UP])
def test_is_chief_up(pods: list[Any], restarted: frozenset[str], actions: list[Any],
                     expected: bool) -> None:
    p = begin(J(), pods).then(restarted=restarted, actions=actions)
    assert is_chief_up(p) is expected
