"""The progress the operator writes into the status (`progress.py`): the loss keeps 4
significant digits, so the Loss column of `kubectl get trainingjobs` stays readable,
and stays a number (the CRD's column and field are `number`)."""

from __future__ import annotations

import json
from datetime import UTC, datetime

import pytest

from pstrain_api.model import TrainingJobStatus
from pstrain_operator.plan import status_to_api
from pstrain_operator.progress import progress_from_status

NOW = datetime(2026, 1, 1, tzinfo=UTC)

LOSSES = [
    ("a long fraction: 4 significant digits", 0.0006786651997649411, 0.0006787),
    ("above one", 2.302585092994046, 2.303),
    ("large", 1234567.0, 1235000.0),
    ("already short: unchanged", 0.5, 0.5),
    ("zero", 0.0, 0.0),
    ("a string from the runtime", "0.123456", 0.1235),
]


@pytest.mark.parametrize(("raw", "expected"), [r[1:] for r in LOSSES],
                         ids=[r[0] for r in LOSSES])
def test_the_loss_is_rounded_for_display(raw: object, expected: float) -> None:
    progress = progress_from_status({"global_step": 1, "loss": raw}, NOW)
    assert progress is not None and progress.loss == expected
    wire = status_to_api(TrainingJobStatus(progress=progress))["progress"]["loss"]
    assert isinstance(wire, float) and json.dumps(wire) == repr(expected)
