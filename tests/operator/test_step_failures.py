"""Table tests of the failures step (`steps/failures.py`): a failed replica is restarted
within the run policy, or fails the job with its root cause."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from pstrain_operator.conditions import Event
from pstrain_operator.steps.failures import restart_or_fail

from .op_builders import T0, at, make_job as J, pod
from .step_builders import begin, delete, running

JOB = J().build()


@dataclass
class Case:
    id: str
    job: Any
    pods: list[Any]
    now: Any = T0
    # expected
    actions: list[Any] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)
    restarted: frozenset[str] = frozenset()
    restarts: int = 0
    ended: tuple[str, str] | None = None  # (phase, Failed condition's reason)


def failed(index: int, **kw: Any) -> Any:
    return pod(JOB, "worker", index, phase="Failed", **kw)


CASES = [
    Case("nothing failed: nothing to do",
         J().status(phase="Running"), running(J())),
    Case("OnFailure: a failed worker is deleted to be recreated and counted",
         J().status(phase="Running"),
         [*running(J(), workers=1), failed(1, exit_code=1, reason="Error")],
         actions=delete("worker-1"),
         events=[Event("Warning", "RestartingReplica", "restarting pod j-worker-1: it failed "
                       "(Error, exit code 1); restart 1 of 3")],
         restarted=frozenset({"j-worker-1"}), restarts=1),
    Case("a failed pod already going away is not counted again",
         J().status(phase="Running", restarts=1),
         [*running(J(), workers=1), failed(1, exit_code=1, deleting=True)], restarts=1),
    Case("Never: the first failure fails the job; no restart is counted",
         J().policy(restartPolicy="Never").status(phase="Running"),
         [*running(J(), workers=1), failed(1, exit_code=3, reason="Error")],
         ended=("Failed", "RestartPolicyNever")),
    Case("backoffLimit spent: Failed",
         J().policy(backoffLimit=1).status(phase="Running", restarts=1),
         [*running(J(), workers=1), failed(1, reason="Evicted")],
         restarts=1, ended=("Failed", "BackoffLimitExceeded")),
    Case("disruptions from outside do not spend the backoffLimit",
         J().policy(backoffLimit=1).status(phase="Running", restarts=1, disruptions=1),
         [*running(J(), workers=1), failed(1, exit_code=137, reason="OOMKilled")],
         actions=delete("worker-1"),
         events=[Event("Warning", "RestartingReplica", "restarting pod j-worker-1: it failed "
                       "(OOMKilled, exit code 137); restart 1 of 1")],
         restarted=frozenset({"j-worker-1"}), restarts=2),
    Case("a PS that exited 0 within the grace: not a failure yet",
         J().status(phase="Running"),
         [pod(JOB, "ps", 0, phase="Succeeded", exit_code=0, finished_at=T0),
          *running(J(), ps=0)], now=at(29)),
    Case("a PS that exited 0 past the grace while the chief trains: restarted",
         J().status(phase="Running"),
         [pod(JOB, "ps", 0, phase="Succeeded", exit_code=0, finished_at=T0,
              reason="Completed"), *running(J(), ps=0)], now=at(30),
         actions=delete("ps-0"),
         events=[Event("Warning", "RestartingReplica", "restarting pod j-ps-0: it failed "
                       "(Completed, exit code 0); restart 1 of 3")],
         restarted=frozenset({"j-ps-0"}), restarts=1),
    Case("a PS that exited 0 after the chief succeeded: no failure",
         J().status(phase="Running"),
         [pod(JOB, "ps", 0, phase="Succeeded", exit_code=0, finished_at=T0),
          pod(JOB, "worker", 0, phase="Succeeded"), pod(JOB, "worker", 1, ready=True)],
         now=at(30)),
]


@pytest.mark.parametrize("case", CASES, ids=[c_.id for c_ in CASES])
def test_restart_or_fail(case: Case) -> None:
    p, end = restart_or_fail(begin(case.job, case.pods, now=case.now))
    assert list(p.actions) == case.actions
    assert list(p.events) == case.events
    assert (p.restarted, p.st.restarts) == (case.restarted, case.restarts)
    ended = None if end is None else (
        end.status.phase, next(x.reason for x in end.status.conditions if x.type == "Failed"))
    assert ended == case.ended
