"""Table tests of the start-order decision (`steps/start_order.py`): Service and
parameter servers first, workers once every PS is Ready, the chief last."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from pstrain_api import constants as c
from pstrain_operator.conditions import Event
from pstrain_operator.plan import CreateObject, CreateService
from pstrain_operator.settings import PodSettings
from pstrain_operator.steps.start_order import (PsReadiness, create_missing,
                                                may_start_workers, ps_readiness)

from .op_builders import T0, make_job as J, pod
from .step_builders import begin, create, running

SETTINGS = PodSettings()


@dataclass
class Case:
    id: str
    job: Any
    pods: list[Any] = field(default_factory=list)
    service: bool = True
    # expected
    actions: list[Any] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)
    start_time: Any = T0


CASES = [
    Case("new job: the Service and every PS, no worker yet",
         J().ps(2), service=False,
         actions=[CreateService({}, "j"), *create("ps-0", "ps-1")],
         events=[Event("Normal", "CreatedService", "created headless Service j"),
                 Event("Normal", "CreatedPS", "created parameter servers j-ps-0, j-ps-1")]),
    Case("a PS not Ready: nothing more",
         J().status(phase="Starting"), pods=running(J(), workers=0, ready=False),
         start_time=None),
    Case("every PS Ready: the non-chief workers, then the chief (worker 0) last",
         J().workers(3), pods=running(J().workers(3), workers=0),
         actions=create("worker-1", "worker-2", "worker-0"),
         events=[Event("Normal", "StartedWorkers", "all 1 parameter servers are Ready; "
                       "started workers j-worker-1, j-worker-2"),
                 Event("Normal", "StartedChief", "started the chief j-worker-0")]),
    Case("a separate chief comes after every worker",
         J().chief(), pods=running(J().chief(), workers=0),
         actions=create("worker-0", "worker-1", "chief-0"),
         events=[Event("Normal", "StartedWorkers", "all 1 parameter servers are Ready; "
                       "started workers j-worker-0, j-worker-1"),
                 Event("Normal", "StartedChief", "started the chief j-chief-0")]),
    Case("only the missing worker is recreated; the start time stays",
         J().status(phase="Running", startTime="2026-01-01T11:00:00Z"),
         pods=running(J(), workers=1),
         actions=create("worker-1"),
         events=[Event("Normal", "StartedWorkers", "all 1 parameter servers are Ready; "
                       "started workers j-worker-1")],
         start_time=T0.replace(hour=11)),
]


@pytest.mark.parametrize("case", CASES, ids=[c_.id for c_ in CASES])
def test_create_missing(case: Case) -> None:
    p = begin(case.job, case.pods, service=case.service)
    out = create_missing(p, SETTINGS)
    assert list(out.actions) == case.actions
    assert list(out.events) == case.events
    assert out.st.start_time == case.start_time


def test_a_gang_starts_every_pod_at_once_with_its_pod_group() -> None:
    j = J().policy(gangScheduling={"provider": "Volcano"})
    out = create_missing(begin(j, service=True), SETTINGS)
    assert [type(a).__name__ for a in out.actions] == ["CreateObject"] + ["CreatePod"] * 3
    assert isinstance(out.actions[0], CreateObject)
    assert list(out.actions[1:]) == create("ps-0", "worker-1", "worker-0")
    assert [e.message for e in out.events][1] == (
        "gang start: created with the parameter servers; started workers j-worker-1")


def test_a_holding_pass_creates_nothing() -> None:
    p = begin(J(), service=False).then(hold=True)
    out = create_missing(p, SETTINGS)
    assert (out.actions, out.events, out.st.start_time) == ((), (), None)


def test_the_first_parameter_servers_set_created() -> None:
    out = create_missing(begin(J(), service=True), SETTINGS)
    created = {x.type: x for x in out.st.conditions}[c.COND_CREATED]
    assert (created.status, created.reason) == ("True", "PodsCreated")


@pytest.mark.parametrize(("ps", "gang", "expected"), [
    pytest.param(PsReadiness(2, 2), False, True, id="every-PS-ready"),
    pytest.param(PsReadiness(1, 2), False, False, id="one-PS-not-ready"),
    pytest.param(PsReadiness(0, 2), True, True, id="gang-does-not-wait"),
])
def test_may_start_workers(ps: PsReadiness, gang: bool, expected: bool) -> None:
    assert may_start_workers(ps, gang) is expected


READINESS = [
    ("none observed", [], PsReadiness(0, 2)),
    ("one ready", [dict(index=0, ready=True)], PsReadiness(1, 2)),
    ("a ready one going away does not count",
     [dict(index=0, ready=True, deleting=True), dict(index=1, ready=True)], PsReadiness(1, 2)),
    ("one exited 0: finished", [dict(index=0, phase="Succeeded")], PsReadiness(0, 2, True)),
]


@pytest.mark.parametrize(("pods", "expected"), [r[1:] for r in READINESS],
                         ids=[r[0] for r in READINESS])
def test_ps_readiness(pods: list[dict[str, Any]], expected: PsReadiness) -> None:
    job = J().ps(2).build()
    assert ps_readiness(begin(J().ps(2), [pod(job, "ps", **kw) for kw in pods])) == expected
