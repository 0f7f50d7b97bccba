"""The cluster spec for 1..N PS and workers, with and without a separate chief; names and
their truncation."""

from __future__ import annotations

import json

import pytest

from pstrain_api.cluster import (
    Task,
    kubernetes_cluster_spec,
    local_cluster_spec,
    parse_cluster_env,
    task_count,
)
from pstrain_api.model import TrainingJob
from pstrain_api.names import bounded_name, replica_name

from .job_builder import job


def make(doc) -> TrainingJob:
    return TrainingJob.model_validate(doc)


def k8s(name: str, role: str, i: int, ns: str = "default") -> str:
    return f"{name}-{role}-{i}.{name}.{ns}.svc:2222"


CASES = [
    pytest.param(
        job("a").ps(1).workers(1), None,
        {"ps": [k8s("a", "ps", 0)], "worker": [k8s("a", "worker", 0)]},
        [("ps", 0), ("worker", 0)], ("worker", 0), id="1ps-1worker"),
    pytest.param(
        job("a").ps(1).workers(2), None,
        {"ps": [k8s("a", "ps", 0)], "worker": [k8s("a", "worker", 0), k8s("a", "worker", 1)]},
        [("ps", 0), ("worker", 1), ("worker", 0)], ("worker", 0), id="1ps-2workers"),
    pytest.param(
        job("b", "ml").ps(3).workers(4), None,
        {"ps": [k8s("b", "ps", i, "ml") for i in range(3)],
         "worker": [k8s("b", "worker", i, "ml") for i in range(4)]},
        [("ps", 0), ("ps", 1), ("ps", 2), ("worker", 1), ("worker", 2), ("worker", 3),
         ("worker", 0)], ("worker", 0), id="3ps-4workers-namespace"),
    pytest.param(
        job("c").ps(2).workers(2).chief(), None,
        {"ps": [k8s("c", "ps", 0), k8s("c", "ps", 1)],
         "worker": [k8s("c", "worker", 0), k8s("c", "worker", 1)],
         "chief": [k8s("c", "chief", 0)]},
        [("ps", 0), ("ps", 1), ("worker", 0), ("worker", 1), ("chief", 0)], ("chief", 0),
        id="2ps-2workers-separate-chief"),
    pytest.param(
        job("d").ps(1).workers(1).chief(), None,
        {"ps": [k8s("d", "ps", 0)], "worker": [k8s("d", "worker", 0)],
         "chief": [k8s("d", "chief", 0)]},
        [("ps", 0), ("worker", 0), ("chief", 0)], ("chief", 0), id="1ps-1worker-chief"),
]


@pytest.mark.parametrize(("builder", "_", "cluster", "order", "chief"), CASES)
def test_kubernetes_cluster_spec(builder, _, cluster, order, chief):
    spec = kubernetes_cluster_spec(make(builder.build()))
    assert spec.cluster == cluster
    assert [(t.role, t.index) for t in spec.tasks()] == order
    assert (spec.chief.role, spec.chief.index) == chief
    assert spec.tasks()[-1] == spec.chief, "the chief starts last"
    assert all(t.role == "ps" for t in spec.tasks()[: len(cluster["ps"])]), "PS start first"


@pytest.mark.parametrize(("n_ps", "n_workers"), [(p, w) for p in (1, 2, 5) for w in (1, 3, 8)])
def test_env_of_every_task(n_ps, n_workers):
    parsed = make(job("e").ps(n_ps).workers(n_workers).training(steps=7).build())
    spec = kubernetes_cluster_spec(parsed)
    assert len(spec.tasks()) == task_count(parsed) == n_ps + n_workers
    for task in spec.tasks():
        env = spec.env(task)
        tf = json.loads(env["TF_CONFIG"])
        assert tf == {"cluster": spec.cluster, "task": {"type": task.role, "index": task.index}}
        assert list(tf) == ["cluster", "task"], "TensorFlow's exact shape"
        ident = parse_cluster_env(env)
        assert ident.task == task
        assert ident.is_chief == (task == Task("worker", 0))
        assert (ident.job_name, ident.namespace) == ("e", "default")
        assert json.loads(env["PSTRAIN_TRAINING"])["steps"] == 7


def test_tf_config_has_chief_key_only_with_separate_chief():
    without = kubernetes_cluster_spec(make(job("f").build()))
    with_chief = kubernetes_cluster_spec(make(job("f").chief().build()))
    assert "chief" not in json.loads(without.env(Task("worker", 0))["TF_CONFIG"])["cluster"]
    tf = json.loads(with_chief.env(Task("chief", 0))["TF_CONFIG"])
    assert tf["cluster"]["chief"] == [k8s("f", "chief", 0)]
    assert tf["task"] == {"type": "chief", "index": 0}


def test_local_cluster_spec_uses_loopback_and_distinct_ports():
    parsed = make(job("g").ps(2).workers(3).build())
    spec = local_cluster_spec(parsed, [5001, 5002, 5003, 5004, 5005])
    assert spec.cluster == {
        "ps": ["127.0.0.1:5001", "127.0.0.1:5002"],
        "worker": ["127.0.0.1:5003", "127.0.0.1:5004", "127.0.0.1:5005"],
    }
    assert [spec.replica_name(t) for t in spec.tasks()] == [
        "g-ps-0", "g-ps-1", "g-worker-1", "g-worker-2", "g-worker-0"]


def test_local_cluster_spec_refuses_too_few_or_repeated_ports():
    parsed = make(job("g").ps(1).workers(2).build())
    with pytest.raises(ValueError, match="needs 3 distinct ports"):
        local_cluster_spec(parsed, [5001, 5001, 5002])


def test_operator_and_runner_agree_on_everything_but_addresses():
    parsed = make(job("h").ps(2).workers(2).build())
    remote = kubernetes_cluster_spec(parsed)
    local = local_cluster_spec(parsed, range(7000, 7004))
    assert remote.tasks() == local.tasks()
    assert remote.chief == local.chief
    for task in remote.tasks():
        r, lo = parse_cluster_env(remote.env(task)), parse_cluster_env(local.env(task))
        assert (r.task, r.chief, {k: len(v) for k, v in r.cluster.items()}) == (
            lo.task, lo.chief, {k: len(v) for k, v in lo.cluster.items()})


def test_env_of_unknown_task_is_an_error():
    spec = kubernetes_cluster_spec(make(job("i").build()))
    with pytest.raises(KeyError, match="not a task of job i"):
        spec.env(Task("ps", 5))


@pytest.mark.parametrize(
    ("environ", "message"),
    [
        ({}, "PSTRAIN_CLUSTER is not set"),
        ({"PSTRAIN_CLUSTER": "{"}, "PSTRAIN_CLUSTER is not valid cluster JSON"),
        ({"PSTRAIN_CLUSTER": '{"cluster": {}}'}, "PSTRAIN_CLUSTER is not valid cluster JSON"),
    ],
)
def test_parse_cluster_env_errors(environ, message):
    with pytest.raises(ValueError, match=message):
        parse_cluster_env(environ)


# ------------------------------------------------------------------ names and truncation


def test_short_names_are_kept_verbatim():
    assert replica_name("digits", "worker", 3) == "digits-worker-3"


def test_long_names_are_truncated_to_63_and_stay_unique():
    base = "a" * 60
    names = {replica_name(base, role, i) for role in ("ps", "worker", "chief") for i in range(50)}
    assert len(names) == 150
    assert all(len(n) <= 63 for n in names)
    other = replica_name("a" * 59 + "b", "worker", 0)
    assert other != replica_name(base, "worker", 0), "same prefix, different job"
    assert all(n[0].isalpha() and n[-1].isalnum() for n in names)


def test_long_names_in_the_cluster_spec_are_hostnames():
    parsed = make(job("x" * 63).ps(2).workers(12).build())
    spec = kubernetes_cluster_spec(parsed)
    hosts = [a.split(".")[0] for role in spec.cluster.values() for a in role]
    assert len(set(hosts)) == 14
    assert all(len(h) <= 63 for h in hosts)


def test_truncation_does_not_leave_a_dash_before_the_hash():
    name = bounded_name("ab-" + "c" * 60, "-worker-1")
    assert "--" not in name and len(name) <= 63
