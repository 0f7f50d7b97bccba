"""Table tests of the refused-creates step (`steps/refused_creates.py`)."""

from __future__ import annotations

from typing import Any

import pytest

from pstrain_api.model import FailureCause
from pstrain_operator.steps.refused_creates import back_off, give_up

from .op_builders import at, make_job as J
from .step_builders import begin


def refused(attempts: int, first: str, last: str) -> dict[str, Any]:
    return {"object": "Pod/j-ps-0", "message": "quota exceeded", "attempts": attempts,
            "firstTime": first, "lastTime": last}


CASES = [
    ("no refusal: go on", None, at(0), (0.0, False, None)),
    ("refused 1 s ago, first back-off 5 s: hold 4 s more",
     refused(1, "2026-01-01T11:59:59Z", "2026-01-01T11:59:59Z"), at(0), (4.0, True, None)),
    ("back-off over: try again", refused(1, "2026-01-01T11:59:00Z", "2026-01-01T11:59:00Z"),
     at(0), (0.0, False, None)),
    ("refused for 10 minutes: the job fails, naming the refused pod",
     refused(9, "2026-01-01T11:00:00Z", "2026-01-01T11:10:00Z"), at(0),
     (0.0, False, FailureCause(role="ps", pod="j-ps-0", reason="CreateRejected",
                               message="quota exceeded"))),
]


@pytest.mark.parametrize(("refusal", "now", "expected"), [r[1:] for r in CASES],
                         ids=[r[0] for r in CASES])
def test_back_off_and_give_up(refusal: dict[str, Any] | None, now: Any,
                              expected: tuple[float, bool, FailureCause | None]) -> None:
    job = J().status(phase="Starting", observedGeneration=1,
                     **({"createRefusal": refusal} if refusal else {}))
    p = back_off(begin(job, now=now))
    plan = give_up(p)
    assert (p.backoff, p.hold, plan.status.failure if plan else None) == expected
