"""`pstrain replica`: who am I, where do I listen, and clear refusals of a bad
environment."""

from __future__ import annotations

import pytest
from pstrain_api.cluster import Task, local_cluster_spec, parse_cluster_env
from pstrain_api.model import TrainingJob

from pstrain_runtime.replica import bind_address, namespace_of, replica_main, worker_index
from tests.api.job_builder import job


def identity_of(manifest: dict, task: Task):
    spec = local_cluster_spec(TrainingJob.model_validate(manifest), range(20000, 20010))
    return parse_cluster_env(spec.env(task))


@pytest.mark.parametrize(
    ("manifest", "task", "expected"),
    [
        pytest.param(job("j").ps(1).workers(3).build(), Task("worker", 0), (0, 3),
                     id="worker-0-is-the-chief"),
        pytest.param(job("j").ps(1).workers(3).build(), Task("worker", 2), (2, 3),
                     id="worker-2"),
        pytest.param(job("j").ps(1).workers(2).chief().build(), Task("chief", 0), (0, 3),
                     id="separate-chief-is-0"),
        pytest.param(job("j").ps(1).workers(2).chief().build(), Task("worker", 0), (1, 3),
                     id="workers-follow-a-separate-chief"),
    ],
)
def test_worker_index(manifest, task, expected) -> None:
    assert worker_index(identity_of(manifest, task)) == expected


def test_bind_address_rules() -> None:
    identity = identity_of(job("j").ps(2).workers(1).build(), Task("ps", 1))
    assert bind_address(identity, {}) == "127.0.0.1:20001"
    assert bind_address(identity, {"PSTRAIN_BIND_ADDRESS": "127.0.0.5:9"}) == "127.0.0.5:9"
    dns = parse_cluster_env({"PSTRAIN_CLUSTER": (
        '{"cluster":{"ps":["j-ps-0.j.default.svc:2222"],"worker":["w:2222"]},'
        '"task":{"type":"ps","index":0},"chief":{"type":"worker","index":0},'
        '"job":{"name":"j","namespace":"default"}}')})
    assert bind_address(dns, {}) == "0.0.0.0:2222"
    assert namespace_of(dns) == "default/j"


def test_missing_environment_is_a_clear_usage_error(monkeypatch, capsys) -> None:
    monkeypatch.delenv("PSTRAIN_CLUSTER", raising=False)
    assert replica_main([]) == 2
    assert "PSTRAIN_CLUSTER is not set" in capsys.readouterr().err


def test_trainer_without_training_settings_is_refused(monkeypatch, capsys) -> None:
    spec = local_cluster_spec(TrainingJob.model_validate(job("j").build()), range(20000, 20010))
    env = spec.env(Task("worker", 0))
    monkeypatch.setenv("PSTRAIN_CLUSTER", env["PSTRAIN_CLUSTER"])
    monkeypatch.setenv("PSTRAIN_TRAINING", '{"steps": 0}')
    assert replica_main([]) == 2
    assert "PSTRAIN_TRAINING is not valid" in capsys.readouterr().err
