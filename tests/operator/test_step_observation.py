"""Table tests of the observe step (`steps/observation.py`) and the InvalidSpec
condition it clears (`steps/invalid_spec.py`)."""

from __future__ import annotations

from typing import Any

import pytest

from pstrain_api import constants as c
from pstrain_api.model import Progress
from pstrain_operator.steps.invalid_spec import spec_valid_again

from .op_builders import T0, at, make_job as J, pod
from .step_builders import begin

JOB = J().build()

PODS = [
    ("our pod", dict(owner_uid="uid-j"), False),
    ("a pod of no recorded owner is ours", dict(), False),
    ("a pod of an earlier job of the same name is going away", dict(owner_uid="old"), True),
]


@pytest.mark.parametrize(("kw", "deleting"), [r[1:] for r in PODS], ids=[r[0] for r in PODS])
def test_begin_marks_foreign_pods(kw: dict[str, Any], deleting: bool) -> None:
    p = begin(J(), [pod(JOB, "ps", 0, **kw)])
    assert [q.deleting for q in p.obs.pods] == [deleting]
    assert len(p.live) == (0 if deleting else 1)


PROGRESS = [
    ("nothing read: the last progress", None, Progress(global_step=5, advanced_at=T0)),
    ("the same step read: advancedAt kept", Progress(global_step=5, updated_at=at(9)),
     Progress(global_step=5, updated_at=at(9), advanced_at=T0)),
    ("the step moved: advancedAt now", Progress(global_step=6, updated_at=at(9)),
     Progress(global_step=6, updated_at=at(9), advanced_at=at(9))),
]


@pytest.mark.parametrize(("read", "expected"), [r[1:] for r in PROGRESS],
                         ids=[r[0] for r in PROGRESS])
def test_begin_merges_progress(read: Progress | None, expected: Progress) -> None:
    job = J().status(progress={"globalStep": 5, "advancedAt": "2026-01-01T12:00:00Z"})
    p = begin(job, progress=read, now=at(9))
    assert p.progress == expected
    assert p.st.observed_generation == 1


INVALID = {"type": c.COND_CREATED, "status": "False", "reason": "InvalidSpec", "message": "m",
           "lastTransitionTime": "2026-01-01T12:00:00Z"}
VALID_AGAIN = [
    ("no InvalidSpec: unchanged", {}, False, None),
    ("invalid from the start, no pods: the condition goes", {"conditions": [INVALID]}, False,
     None),
    ("invalid while running: Created is True again", {"conditions": [INVALID]}, True,
     ("True", "SpecValid")),
]


@pytest.mark.parametrize(("status", "has_pods", "expected"), [r[1:] for r in VALID_AGAIN],
                         ids=[r[0] for r in VALID_AGAIN])
def test_spec_valid_again(status: dict[str, Any], has_pods: bool,
                          expected: tuple[str, str] | None) -> None:
    st = J().status(**status).build().status
    assert st is not None
    conditions = spec_valid_again(st, [pod(JOB, "ps", 0)] if has_pods else [], at(1))
    got = {x.type: (x.status, x.reason) for x in conditions}.get(c.COND_CREATED)
    assert got == expected
