"""A job's credentials Secret and how its pods mount it (`pstrain_operator.security`),
the RBAC it needs, and that no key reaches the status, events, logs or metrics.

Objects are compared whole and checked with kubernetes-validate's strict schemas; the
executor runs against the in-memory API (`FakeKube`)."""

from __future__ import annotations

import base64
import json
import logging
from collections.abc import Mapping
from typing import Any

import kubernetes_validate
import pytest
from prometheus_client import generate_latest

from pstrain_api import security
from pstrain_api.cluster import kubernetes_cluster_spec
from pstrain_api.model import CreateRefusal
from pstrain_operator import rbac
from pstrain_operator.build import build_pod, owner_reference
from pstrain_operator.kube import KubeError
from pstrain_operator.security import (
    build_auth_secret,
    ensure_auth_secret,
    secure_pod,
    worker_keys,
)
from pstrain_operator.settings import PodSettings
from pstrain_operator.steps.refused_creates import refusal_cause

from ..chart.helm import K8S_VERSION
from .fake_kube import FakeKube
from .op_builders import make_job
from .test_operator_controller import Clock, FakeStatus, Recorder, conditions, make_reconciler

TOKEN = bytes(range(32))
KEYS = security.derive_keys(TOKEN)


def _b64(key: bytes) -> str:
    return base64.b64encode(security.encode_key(key).encode()).decode()


def test_the_secret_holds_the_role_keys_and_goes_with_the_job() -> None:
    job = make_job("j", "ns").build()
    assert build_auth_secret(job, TOKEN) == {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {
            "name": "j-pstrain-auth",
            "namespace": "ns",
            "labels": {"pstrain.io/job-name": "j",
                       "app.kubernetes.io/managed-by": "pstrain-operator"},
            "ownerReferences": [owner_reference(job)],
        },
        "type": "Opaque",
        "immutable": True,
        "data": {"chief": _b64(KEYS["chief"]), "worker": _b64(KEYS["worker"])},
    }
    assert worker_keys(build_auth_secret(job, TOKEN)) == {"worker": KEYS["worker"]}


def _mounts(pod: dict[str, Any]) -> tuple[list[str], list[dict[str, Any]], str | None]:
    main = pod["spec"]["containers"][0]
    volume = next(v for v in pod["spec"]["volumes"] if v["name"] == security.AUTH_VOLUME)
    env = {e["name"]: e.get("value") for e in main["env"]}
    return ([f"{volume['secret']['secretName']}:{i['key']}"
             for i in volume["secret"]["items"]],
            [m for m in main["volumeMounts"] if m["name"] == security.AUTH_VOLUME],
            env.get(security.ENV_AUTH_DIR))


@pytest.mark.parametrize(("chief_role", "expected"), [
    (False, {"j-ps-0": ["j-pstrain-auth:chief", "j-pstrain-auth:worker"],
             "j-worker-0": ["j-pstrain-auth:chief"],
             "j-worker-1": ["j-pstrain-auth-worker-1:worker-1"]}),
    (True, {"j-ps-0": ["j-pstrain-auth:chief", "j-pstrain-auth:worker"],
            "j-chief-0": ["j-pstrain-auth:chief"],
            "j-worker-0": ["j-pstrain-auth-worker-1:worker-1"],
            "j-worker-1": ["j-pstrain-auth-worker-2:worker-2"]}),
], ids=["worker-0-is-chief", "chief-role"])
def test_each_pod_mounts_only_the_keys_its_replica_may_hold(
        chief_role: bool, expected: dict[str, list[str]]) -> None:
    builder = make_job().template("worker", volumeMounts=[{"name": "d", "mountPath": "/d"}],
                                  volumes=[{"name": "d", "emptyDir": {}}])
    job = (builder.chief() if chief_role else builder).build()
    cluster = kubernetes_cluster_spec(job)
    got = {}
    for task in cluster.tasks():
        pod = secure_pod(build_pod(job, cluster, task, PodSettings()), job, cluster, task)
        keys, mounts, env = _mounts(pod)
        assert mounts == [{"name": "pstrain-auth", "mountPath": "/var/run/pstrain/auth",
                           "readOnly": True}]
        assert env == "/var/run/pstrain/auth"
        got[pod["metadata"]["name"]] = keys
        kubernetes_validate.validate(pod, K8S_VERSION, strict=True)
        if task.role == "worker":  # the template's own volume is kept
            assert {v["name"] for v in pod["spec"]["volumes"]} == {"d", "pstrain-auth"}
    assert got == expected
    kubernetes_validate.validate(build_auth_secret(job, TOKEN), K8S_VERSION, strict=True)


def test_tls_mounts_the_users_secret_and_authentication_can_be_turned_off() -> None:
    job = make_job().security(authentication=False, tls={"secretName": "my-cert"}).build()
    cluster = kubernetes_cluster_spec(job)
    task = cluster.tasks()[0]
    pod = secure_pod(build_pod(job, cluster, task, PodSettings()), job, cluster, task)
    assert [v["name"] for v in pod["spec"]["volumes"]] == ["pstrain-tls"]
    assert pod["spec"]["volumes"][0]["secret"]["secretName"] == "my-cert"
    env = {e["name"] for e in pod["spec"]["containers"][0]["env"]}
    assert "PSTRAIN_TLS_DIR" in env and security.ENV_AUTH_DIR not in env
    kubernetes_validate.validate(pod, K8S_VERSION, strict=True)
    off = make_job().security(authentication=False).build()
    built = build_pod(off, cluster, task, PodSettings())
    assert secure_pod(built, off, cluster, task) == built


def test_ensure_creates_the_secret_once_and_keeps_it() -> None:
    kube, job = FakeKube(), make_job().build()
    first = ensure_auth_secret(kube, job)
    stored = kube.secrets[("ns", "j-pstrain-auth")]
    assert first == worker_keys(stored) and len(first["worker"]) == 32
    assert ensure_auth_secret(kube, job) == first  # read back, not made again
    assert kube.calls.count(("create", "Secret/j-pstrain-auth")) == 1


def test_a_secret_made_meanwhile_is_read_back() -> None:
    class Racing(FakeKube):
        def create(self, manifest: Mapping[str, Any]) -> bool:
            # Someone else (an earlier operator) created it just before us: 409.
            super().create(build_auth_secret(make_job().build(), TOKEN))
            return super().create(manifest)

    assert ensure_auth_secret(Racing(), make_job().build()) == {"worker": KEYS["worker"]}


def test_rbac_grants_only_get_and_create_on_secrets() -> None:
    assert [p for p in rbac.PERMISSIONS if p[1] == "secrets"] == [("", "secrets",
                                                                  ("get", "create"))]
    assert ("", "secrets") not in rbac.CLUSTER_SCOPED


def test_the_executor_makes_the_secret_first_and_never_shows_a_key(
        caplog: pytest.LogCaptureFixture) -> None:
    kube, events, status = FakeKube(), Recorder(), FakeStatus()
    kube.add_job(make_job().body())
    op = make_reconciler(kube, events, status)
    with caplog.at_level(logging.DEBUG):
        op.reconcile("ns", "j")
        kube.set_pod("ns", "j-ps-0", "Running", ready=True)
        op.reconcile("ns", "j")
        kube.jobs[("ns", "j")]["status"]["phase"] = "Running"
        status.reply = {"global_step": 3}
        op.reconcile("ns", "j")
    creates = [what for verb, what in kube.calls if verb == "create"]
    assert creates[0] == "Secret/j-pstrain-auth"
    secret = kube.secrets[("ns", "j-pstrain-auth")]
    probe = status.security[-1]  # the probe proves the worker key
    assert probe is not None and probe.keys == worker_keys(secret) and probe.ca is None
    shown = "\n".join([
        json.dumps(kube.jobs[("ns", "j")].get("status")),
        *(f"{e.reason} {e.message}" for e in events.events),
        caplog.text,
        generate_latest(op.metrics.registry).decode(),
    ])
    stored = [(role, value) for one in kube.secrets.values()
              for role, value in one["data"].items()]
    assert len(stored) == 3  # the role keys and worker 1's own
    for role, value in stored:
        key = security.decode_key(base64.b64decode(value).decode(), role)
        for form in (value, key.hex(), base64.b64encode(key).decode()):
            assert form not in shown


def test_each_worker_gets_a_secret_of_its_own_before_its_pod() -> None:
    kube, events, status = FakeKube(), Recorder(), FakeStatus()
    kube.add_job(make_job().chief().body())  # a chief, workers 0 and 1 (trainers 1, 2)
    op = make_reconciler(kube, events, status)
    op.reconcile("ns", "j")
    kube.set_pod("ns", "j-ps-0", "Running", ready=True)
    op.reconcile("ns", "j")
    op.reconcile("ns", "j")
    creates = [what for verb, what in kube.calls if verb == "create"]
    worker_key = worker_keys(kube.secrets[("ns", "j-pstrain-auth")])["worker"]
    job = make_job().chief().build()
    for replica, trainer in (("j-worker-0", 1), ("j-worker-1", 2)):
        name = f"j-pstrain-auth-worker-{trainer}"
        assert creates.count(f"Secret/{name}") == 1
        assert creates.index(f"Secret/{name}") < creates.index(f"Pod/{replica}")
        secret = kube.secrets[("ns", name)]
        assert secret["immutable"] is True
        assert secret["metadata"]["ownerReferences"] == [owner_reference(job)]
        assert secret["data"] == {
            f"worker-{trainer}": _b64(security.own_worker_key(worker_key, trainer))}
        kubernetes_validate.validate({k: v for k, v in secret.items() if k != "status"},
                                     K8S_VERSION, strict=True)
    # The chief and the parameter servers mount the job's Secret: no own Secret for them.
    assert sorted(n for _, n in kube.secrets) == [
        "j-pstrain-auth", "j-pstrain-auth-worker-1", "j-pstrain-auth-worker-2"]


def test_a_worker_secret_made_by_someone_else_is_never_mounted() -> None:
    """An outsider who may create Secrets made `j-pstrain-auth-worker-1` first, with a
    key of their own: the operator does not create the pod that would mount it, and
    says why in the status; the other pods start."""
    kube, events, status = FakeKube(), Recorder(), FakeStatus()
    kube.add_job(make_job().body())
    other = security.own_worker_key(security.derive_keys(bytes(32 * [7]))["worker"], 1)
    kube.secrets[("ns", "j-pstrain-auth-worker-1")] = {
        "metadata": {"name": "j-pstrain-auth-worker-1", "namespace": "ns"},
        "data": {"worker-1": _b64(other)}}
    op = make_reconciler(kube, events, status)
    op.reconcile("ns", "j")
    kube.set_pod("ns", "j-ps-0", "Running", ready=True)
    op.reconcile("ns", "j")
    assert ("ns", "j-worker-1") not in kube.pods
    shown = json.dumps(kube.jobs[("ns", "j")].get("status"))
    assert "Secret j-pstrain-auth-worker-1 exists and does not hold worker 1's own key" in shown
    assert kube.secrets[("ns", "j-pstrain-auth-worker-1")]["data"] == {"worker-1": _b64(other)}


def test_a_job_secret_the_job_does_not_control_is_never_used() -> None:
    """Someone who may create Secrets made `j-pstrain-auth` before the job, so they know
    its keys: no pod of the job is created, the status says why, the Secret is kept."""
    kube, events, status = FakeKube(), Recorder(), FakeStatus()
    body = make_job().body()
    body["metadata"]["uid"] = "job-uid"
    kube.add_job(body)
    planted = build_auth_secret(make_job().build(), TOKEN)  # a controller reference to no job
    kube.secrets[("ns", "j-pstrain-auth")] = planted
    make_reconciler(kube, events, status).reconcile("ns", "j")
    assert kube.pods == {}
    shown = json.dumps(kube.jobs[("ns", "j")].get("status"))
    assert "Secret j-pstrain-auth exists and is not this job's" in shown
    assert kube.secrets[("ns", "j-pstrain-auth")] == planted


def test_a_long_job_name_keeps_each_own_secret_name_distinct_and_valid() -> None:
    name = "j" * 253
    for index in (1, 12, 2**31 - 1):
        secret = security.worker_secret_name(name, index)
        assert len(secret) == 253 and secret.endswith(f"-pstrain-auth-worker-{index}")


@pytest.mark.parametrize("body", [
    make_job().security(authentication=False).body(),
    make_job().status(phase="Succeeded").body(),
], ids=["authentication-off", "finished"])
def test_no_secret_without_authentication_or_after_the_end(body: dict[str, Any]) -> None:
    kube, events, status = FakeKube(), Recorder(), FakeStatus()
    kube.add_job(body)
    make_reconciler(kube, events, status).reconcile("ns", "j")
    assert kube.secrets == {}


# ---------------------------------------------------------------------- NetworkPolicy


def test_the_network_policy_admits_only_the_jobs_pods_and_the_operator() -> None:
    from pstrain_operator.security import build_network_policy

    job = make_job("j", "ns").build()
    own = {"pstrain.io/job-name": "j", "app.kubernetes.io/managed-by": "pstrain-operator"}
    ports = [{"protocol": "TCP", "port": 2222}, {"protocol": "TCP", "port": 2223}]
    policy = build_network_policy(job, "pstrain-system")
    assert policy == {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": "j-pstrain-ps", "namespace": "ns", "labels": own,
                     "ownerReferences": [owner_reference(job)]},
        "spec": {
            "podSelector": {"matchLabels": {**own, "pstrain.io/replica-role": "ps"}},
            "policyTypes": ["Ingress"],
            "ingress": [
                {"from": [{"podSelector": {"matchLabels": own}}], "ports": ports},
                {"from": [{"namespaceSelector": {"matchLabels": {
                    "kubernetes.io/metadata.name": "pstrain-system"}}}],
                 "ports": ports[:1]},
            ],
        },
    }
    kubernetes_validate.validate(policy, K8S_VERSION, strict=True)
    assert build_network_policy(job, "")["spec"]["ingress"] == policy["spec"]["ingress"][:1]


@pytest.mark.parametrize("enabled", [True, False])
def test_the_executor_makes_one_network_policy_per_job_when_enabled(enabled: bool) -> None:
    kube, events, status = FakeKube(), Recorder(), FakeStatus()
    kube.add_job(make_job().body())
    op = make_reconciler(kube, events, status)
    op.network_policy, op.operator_namespace = enabled, "pstrain-system"
    op.reconcile("ns", "j")
    op.reconcile("ns", "j")
    assert list(kube.network_policies) == ([("ns", "j-pstrain-ps")] if enabled else [])
    assert kube.calls.count(("create", "NetworkPolicy/j-pstrain-ps")) == int(enabled)


OWNER_REFS = ("cannot set blockOwnerDeletion if an ownerReference refers to a resource you "
              "can't set finalizers on")


@pytest.mark.parametrize("kind", ["Secret", "NetworkPolicy"])
def test_a_refused_secret_or_network_policy_is_reported_and_no_pod_is_made(
        kind: str) -> None:
    """What the API server refuses before any pod (here as OwnerReferencesPermission-
    Enforcement refuses an operator without `update` on trainingjobs/finalizers) is the
    job's CreateRejected condition and one Warning, with back-off, not a blank row."""
    kube, events, status, clock = FakeKube(), Recorder(), FakeStatus(), Clock()
    kube.add_job(make_job().body())
    op = make_reconciler(kube, events, status)
    op.clock, op.network_policy, op.operator_namespace = clock, True, "pstrain-system"
    name = {"Secret": "j-pstrain-auth", "NetworkPolicy": "j-pstrain-ps"}[kind]
    message = f'{kind.lower()}s "{name}" is forbidden: {OWNER_REFS}'
    tried: list[str] = []

    def create(manifest: Mapping[str, Any]) -> bool:
        if manifest["kind"] == kind:
            tried.append(manifest["metadata"]["name"])
            raise KubeError(403, f"POST returned 403: {message}", message)
        return FakeKube.create(kube, manifest)

    kube.create = create  # type: ignore[method-assign]
    assert op.reconcile("ns", "j") == 5.0
    assert tried == [name] and kube.pod_names() == [] and not kube.services
    st = kube.jobs[("ns", "j")]["status"]
    assert st["createRefusal"]["object"] == f"{kind}/{name}"
    assert st["createRefusal"]["code"] == 403
    assert OWNER_REFS in conditions(kube)["CreateRejected"]["message"]
    assert events.reasons().count("CreateRejected") == 1

    clock.seconds = 2  # a pod or job event meanwhile: no new attempt is reported
    calls = len(kube.calls)
    op.reconcile("ns", "j")
    assert events.reasons() == [] and kube.pod_names() == [] and tried == [name]
    # The Secret, made before the policy, is still read (its key lets the probe in).
    read = ("get", "Secret/j-pstrain-auth") in kube.calls[calls:]
    assert read == (kind == "NetworkPolicy")

    # The operator's role is mended: the next try makes it, then the pods follow.
    kube.create = FakeKube.create.__get__(kube)  # type: ignore[method-assign]
    clock.seconds = 5
    op.reconcile("ns", "j")
    assert kube.pod_names() == ["j-ps-0"]
    assert conditions(kube)["CreateRejected"]["status"] == "False"
    assert (kube.secrets if kind == "Secret" else kube.network_policies)[("ns", name)]


def test_a_missing_or_incomplete_tls_secret_is_named_and_no_pod_is_made() -> None:
    """spec.security.tls names a Secret that does not exist yet (cert-manager issues it
    after the job is made), then one without ca.crt: the job says so in its
    CreateRejected condition, one Warning each, no pod (a kubelet would leave every pod
    in ContainerCreating); once the Secret holds all three files the pods follow."""
    kube, events, status, clock = FakeKube(), Recorder(), FakeStatus(), Clock()
    kube.add_job(make_job().security(tls={"secretName": "cert"}).body())
    op = make_reconciler(kube, events, status)
    op.clock = clock
    op.reconcile("ns", "j")
    assert kube.pod_names() == [] and not kube.services
    st = kube.jobs[("ns", "j")]["status"]
    assert st["createRefusal"]["object"] == "Secret/cert"
    message = conditions(kube)["CreateRejected"]["message"]
    assert ("spec.security.tls.secretName is 'cert'; no Secret of that name in namespace "
            "ns") in message and "\n" not in message
    assert events.reasons().count("CreateRejected") == 1

    pem = base64.b64encode(b"PEM").decode()
    kube.secrets[("ns", "cert")] = {"data": {"tls.crt": pem, "tls.key": pem}}
    clock.seconds = 5
    op.reconcile("ns", "j")
    assert kube.pod_names() == []
    assert ("spec.security.tls.secretName is 'cert'; that Secret holds no ca.crt"
            in conditions(kube)["CreateRejected"]["message"])

    kube.secrets[("ns", "cert")]["data"]["ca.crt"] = pem
    clock.seconds = 30
    op.reconcile("ns", "j")
    assert kube.pod_names() == ["j-ps-0"]
    assert conditions(kube)["CreateRejected"]["status"] == "False"


def test_a_job_failed_by_a_refused_network_policy_names_no_pod() -> None:
    cluster = kubernetes_cluster_spec(make_job().build())
    for obj, pod, role in (("NetworkPolicy/j-pstrain-ps", "", ""),
                           ("Secret/j-pstrain-auth", "", ""), ("Service/j", "", ""),
                           ("Pod/j-ps-0", "j-ps-0", "ps")):
        cause = refusal_cause(cluster, CreateRefusal(object=obj, message=OWNER_REFS))
        assert (cause.pod, cause.role, cause.message) == (pod, role, OWNER_REFS)


def test_settings_turn_the_network_policy_off_and_know_their_namespace() -> None:
    from pstrain_operator.settings import load_settings

    default = load_settings([], {"PSTRAIN_OPERATOR_NAMESPACE": "ops"})
    assert default.job_network_policy and default.operator_namespace == "ops"
    assert not load_settings(["--job-network-policy", "false"], {}).job_network_policy


def test_the_probe_trusts_the_ca_of_the_jobs_tls_secret() -> None:
    kube, events, status = FakeKube(), Recorder(), FakeStatus()
    kube.add_job(make_job().security(tls={"secretName": "cert"}).status(phase="Running")
                 .body())
    kube.secrets[("ns", "cert")] = {"data": {"ca.crt": base64.b64encode(b"PEM").decode()}}
    make_reconciler(kube, events, status).reconcile("ns", "j")
    probe = status.security[-1]
    assert probe is not None and probe.ca == b"PEM" and "worker" in probe.keys


def test_security_cannot_change_under_running_pods() -> None:
    kube, events, status = FakeKube(), Recorder(), FakeStatus()
    kube.add_job(make_job().body())
    op = make_reconciler(kube, events, status)
    op.reconcile("ns", "j")
    kube.jobs[("ns", "j")]["spec"]["security"] = {"authentication": False}
    op.reconcile("ns", "j")
    conditions = kube.jobs[("ns", "j")]["status"]["conditions"]
    rejected = next(cond for cond in conditions if cond["type"] == "SpecChangeRejected")
    assert rejected["status"] == "True"
    assert rejected["message"].startswith("spec.security changed while pods built from the "
                                          "previous spec are running (j-ps-0)")
