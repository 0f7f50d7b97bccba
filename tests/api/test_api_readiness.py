"""What "ready" and "done" mean for a role's program (pstrain_api.readiness)."""

from __future__ import annotations

from typing import Any

import pytest

from pstrain_api import constants as c
from pstrain_api.model import TrainingJob
from pstrain_api.readiness import local_check, readiness_gate, stopped_on_success

from .job_builder import job

TF = ["python", "-m", "my.program"]

CASES = [
    # id, ps fields, template, gate, local check, stopped when the chief succeeds
    ("runtime-default", {}, None, c.GATE_GRPC, c.GATE_GRPC, False),
    ("own-command-tcp", {}, {"command": TF}, c.GATE_TCP, c.GATE_TCP, True),
    ("own-image-still-runtime", {}, {"image": "mine:1"}, c.GATE_GRPC, c.GATE_GRPC, False),
    ("user-tcp-probe", {}, {"command": TF, "readinessProbe": {"tcpSocket": {"port": 2222}}},
     c.GATE_PROBE, c.GATE_TCP, True),
    ("user-grpc-probe", {}, {"readinessProbe": {"grpc": {"port": 2222}}},
     c.GATE_PROBE, c.GATE_GRPC, False),
    ("no-gate", {"readiness": "None"}, {"command": TF}, c.GATE_NONE, c.GATE_NONE, True),
    ("explicit-beats-probe", {"readiness": "TCP"},
     {"readinessProbe": {"exec": {"command": ["true"]}}}, c.GATE_TCP, c.GATE_TCP, False),
]


@pytest.mark.parametrize(("fields", "template", "gate", "local", "stopped"),
                         [pytest.param(*rest, id=i) for i, *rest in CASES])
def test_readiness_follows_the_program(fields: dict[str, Any], template: dict[str, Any] | None,
                                       gate: str, local: str, stopped: bool) -> None:
    builder = job().ps(1, **fields)
    if template is not None:
        builder.template("ps", **template)
    spec = TrainingJob.model_validate(builder.build()).replica_spec("ps")
    assert (readiness_gate(spec), local_check(spec), stopped_on_success(spec)) == (
        gate, local, stopped)


def test_readiness_rejects_unknown_gates() -> None:
    with pytest.raises(ValueError, match="readiness"):
        TrainingJob.model_validate(job().ps(1, readiness="HTTP").build())


def test_replica_spec_of_a_missing_role() -> None:
    model = TrainingJob.model_validate(job().build())
    assert model.replica_spec("worker").replicas == 2
    with pytest.raises(KeyError, match="no chief replicas"):
        model.replica_spec("chief")
