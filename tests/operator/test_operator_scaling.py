"""Elastic workers in the operator, the pure part: what counts as a scale, and which
trainer indices the parameter servers should take as the worker set."""

from __future__ import annotations

import json

import pytest

from pstrain_operator.build import applied_spec
from pstrain_api.model import TrainingJobStatus
from pstrain_operator.scaling import (SetWorkers, decide_worker_set, is_scale_only,
                                      server_workers, trainer_indices)

from .op_builders import make_job, pod


@pytest.mark.parametrize(("changed", "scale_only"), [
    pytest.param(lambda j: j.workers(5), True, id="worker-count"),
    pytest.param(lambda j: j.ps(3), False, id="ps-count"),
    pytest.param(lambda j: j.steps(99), False, id="training"),
    pytest.param(lambda j: j.chief(), False, id="chief-added"),
])
def test_only_the_worker_count_may_change_live(changed, scale_only) -> None:
    built_from = json.dumps(applied_spec(make_job().build()))
    assert is_scale_only(built_from, applied_spec(changed(make_job()).build())) is scale_only


def test_an_unreadable_applied_spec_is_no_scale() -> None:
    assert not is_scale_only("{not json", applied_spec(make_job().build()))


def test_trainer_indices_are_the_chief_and_the_ready_workers_within_the_count() -> None:
    job = make_job().workers(3).build()
    pods = [pod(job, "worker", 0, ready=True), pod(job, "worker", 1, ready=False),
            pod(job, "worker", 2, ready=True), pod(job, "worker", 5, ready=True)]
    assert trainer_indices(job, pods) == [0, 2]
    with_chief = make_job().workers(3).chief().build()
    assert trainer_indices(with_chief, pods) == [0, 1, 3]  # worker pod k is trainer k+1


def test_the_set_is_sent_again_when_ps_0_reports_another() -> None:
    """After a scale to 3 the set {0, 1, 2} was sent; PS 0 then reports {0, 1} (the chief
    re-initialised it from an older checkpoint): the set is sent again; when PS 0 holds
    it, or says nothing, nothing is sent."""
    job = make_job().workers(3).build()
    pods = [pod(make_job().build(), "worker", 0, ready=True),
            pod(make_job().build(), "worker", 1, ready=True),
            pod(job, "worker", 2, ready=True)]
    sent = TrainingJobStatus.model_validate(
        {"phase": "Running", "workers": {"desired": 3, "live": 3, "members": [0, 1, 2]}})
    addresses = ["ps-0:2222"]
    assert decide_worker_set(job, sent, pods, addresses) is None
    assert decide_worker_set(job, sent, pods, addresses, (0, 1, 2)) is None
    assert decide_worker_set(job, sent, pods, addresses, (0, 1)) == SetWorkers(
        ("ps-0:2222",), (0, 1, 2))


@pytest.mark.parametrize(("reply", "workers"), [
    ({"workers": [0, 1]}, (0, 1)), ({"workers": None}, None), ({}, None), (None, None),
    ({"workers": ["0"]}, None),
])
def test_server_workers_reads_the_set_from_the_status_reply(reply, workers) -> None:
    assert server_workers(reply) == workers
