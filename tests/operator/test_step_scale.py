"""Table tests of the scale step (`steps/scale.py`): a scale down removes workers,
pods of no replica go, and the parameter servers learn the worker set."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from pstrain_operator.plan import SetWorkers
from pstrain_operator.steps.scale import remove_extra, worker_set

from .op_builders import make_job as J, pod
from .step_builders import begin, delete, running

PS0 = ("j-ps-0.j.ns.svc:2222",)


@dataclass
class Case:
    id: str
    job: Any
    pods: list[Any]
    hold: bool = False
    # expected
    actions: list[Any] = field(default_factory=list)
    events: list[str] = field(default_factory=list)


CASES = [
    Case("no scale: nothing", J().status(workers={"desired": 2, "live": 2}), running(J())),
    Case("4 -> 1: workers 3, 2, 1 go, worker 0 (the chief) stays",
         J().workers(1).status(workers={"desired": 4, "live": 4}),
         running(J().workers(4), workers=4), actions=delete("worker-3", "worker-2", "worker-1"),
         events=["WorkersScaledDown"]),
    Case("a pod of no replica goes", J().workers(1),
         [*running(J().workers(1), workers=1), pod(J().workers(1).build(), "worker", 5)],
         actions=delete("worker-5"), events=["UnexpectedPod"]),
    Case("a holding pass does not scale: extra workers go only as pods of no replica",
         J().workers(1).status(workers={"desired": 4, "live": 4}),
         running(J().workers(4), workers=4), hold=True,
         actions=delete("worker-1", "worker-2", "worker-3"),
         events=["UnexpectedPod", "UnexpectedPod", "UnexpectedPod"]),
]


@pytest.mark.parametrize("case", CASES, ids=[c_.id for c_ in CASES])
def test_remove_extra(case: Case) -> None:
    out = remove_extra(begin(case.job, case.pods).then(hold=case.hold))
    assert list(out.actions) == case.actions
    assert [e.reason for e in out.events] == case.events


SETS = [
    ("nothing scaled: nothing to send", J().status(workers={"desired": 2, "live": 2}),
     running(J()), None),
    ("scaled down to 1: the servers learn {0}",
     J().workers(1).status(workers={"desired": 4, "live": 4}),
     running(J().workers(4), workers=1), SetWorkers(PS0, (0,))),
    ("sent before: not again",
     J().workers(1).status(workers={"desired": 1, "live": 1, "members": [0]}),
     running(J().workers(4), workers=1), None),
    ("servers that run a program of their own are not told",
     J().template("ps", command=["python", "ps.py"]).workers(1).status(
         workers={"desired": 4, "live": 4}),
     running(J().template("ps", command=["python", "ps.py"]).workers(4), workers=1), None),
]


@pytest.mark.parametrize(("job", "pods", "expected"), [r[1:] for r in SETS],
                         ids=[r[0] for r in SETS])
def test_worker_set(job: Any, pods: list[Any], expected: SetWorkers | None) -> None:
    assert worker_set(begin(job, pods)) == expected
