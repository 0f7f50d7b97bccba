"""Table tests of the spec-change step (`steps/spec_change.py`): a change that cannot be
applied live is refused, and the pass goes on with the job its pods were built from."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import pytest

from pstrain_api import constants as c
from pstrain_operator.build import applied_spec
from pstrain_operator.steps.spec_change import refuse_live_change

from .op_builders import make_job as J, pod
from .step_builders import begin, running

OLD = J().build()
APPLIED = json.dumps(applied_spec(OLD))


def built_before(role: str, index: int) -> Any:
    """A pod built from the job as `J()` builds it."""
    return pod(OLD, role, index, ready=True, applied_spec=APPLIED)


@dataclass
class Case:
    id: str
    job: Any
    pods: list[Any] = field(default_factory=list)
    # expected
    ps_replicas: int = 1  # of the job the pass goes on with
    hold: bool = False
    events: list[str] = field(default_factory=list)
    condition: tuple[str, str] | None = None  # SpecChangeRejected: (status, reason)


CASES = [
    Case("the spec matches the pods: nothing to say", J(), running(J())),
    Case("a scale is no spec change", J().workers(4), running(J())),
    Case("the PS count changed under running pods: refused, the old one goes on",
         J().ps(2), [built_before("ps", 0), built_before("worker", 0)],
         events=["SpecChangeNotApplicable"],
         condition=("True", "SpecChangeNotApplicable")),
    Case("refused before: no second event",
         J().ps(2).status(conditions=[{"type": c.COND_SPEC_REJECTED, "status": "True",
                                       "reason": "SpecChangeNotApplicable", "message": "m"}]),
         [built_before("ps", 0)], condition=("True", "SpecChangeNotApplicable")),
    Case("reverted: the condition turns False",
         J().status(conditions=[{"type": c.COND_SPEC_REJECTED, "status": "True",
                                 "reason": "SpecChangeNotApplicable", "message": "m"}]),
         running(J()), condition=("False", "SpecApplied")),
    Case("the applied spec cannot be read: hold, create and remove nothing",
         J().ps(2), [pod(OLD, "ps", 0, applied_spec="{not json")], ps_replicas=2, hold=True,
         events=["SpecChangeNotApplicable"],
         condition=("True", "SpecChangeNotApplicable")),
]


@pytest.mark.parametrize("case", CASES, ids=[c_.id for c_ in CASES])
def test_refuse_live_change(case: Case) -> None:
    out = refuse_live_change(begin(case.job, case.pods))
    assert out.job.spec.replicas.ps.replicas == case.ps_replicas
    assert out.hold is case.hold
    assert [e.reason for e in out.events] == case.events
    conds = {x.type: (x.status, x.reason) for x in out.st.conditions}
    assert conds.get(c.COND_SPEC_REJECTED) == case.condition
