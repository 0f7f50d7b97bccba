"""The operator with programs of the user's own (an unmodified TensorFlow PS program):
the readiness probe fits the program, and the job succeeds when the chief exits 0 even
though the servers never exit by themselves."""

from __future__ import annotations

from typing import Any

import pytest

from pstrain_api.cluster import Task, kubernetes_cluster_spec
from pstrain_operator.build import build_pod
from pstrain_operator.settings import PodSettings

from .fake_kube import FakeKube
from .op_builders import make_job
from .test_operator_controller import FakeStatus, Recorder, make_reconciler

TF = ["python", "-m", "pstrain_runtime.examples.tf_config_program"]
GRPC = {"grpc": {"port": 2222}, "periodSeconds": 2, "failureThreshold": 3}
TCP = {"tcpSocket": {"port": 2222}, "periodSeconds": 2, "failureThreshold": 3}
OWN = {"httpGet": {"path": "/ready", "port": 8080}}

PROBES = [
    # id, role, role fields, template, expected readinessProbe of the main container
    ("runtime-ps-grpc", "ps", {}, {}, GRPC),
    ("runtime-worker-none", "worker", {}, {}, None),
    ("program-ps-tcp", "ps", {}, {"command": TF}, TCP),
    ("program-worker-none", "worker", {}, {"command": TF}, None),
    ("own-probe-ps", "ps", {}, {"command": TF, "readinessProbe": OWN}, OWN),
    ("own-probe-worker", "worker", {}, {"readinessProbe": OWN}, OWN),
    ("no-gate-ps", "ps", {"readiness": "None"}, {"command": TF}, None),
    ("asked-worker-tcp", "worker", {"readiness": "TCP"}, {"command": TF}, TCP),
]
# With spec.security.tls the gRPC health check is a TCP check: a kubelet's gRPC probe
# speaks plaintext only, and the servers serve TLS only.
TLS_PROBES = [
    ("tls-runtime-ps-tcp", "ps", {}, {}, TCP),
    ("tls-asked-grpc-ps-tcp", "ps", {"readiness": "GRPCHealth"}, {}, TCP),
    ("tls-own-probe-ps", "ps", {}, {"readinessProbe": OWN}, OWN),
    ("tls-program-ps-tcp", "ps", {}, {"command": TF}, TCP),
]


def main_container(role: str, fields: dict[str, Any], template: dict[str, Any],
                   tls: bool) -> dict[str, Any]:
    """The main container of replica 0 of `role` in a job (with a separate chief) whose
    role has `fields` and a template of `template`, with spec.security.tls when `tls`."""
    builder = make_job().chief()
    if template:
        builder.template(role, **template)
    builder.data["spec"]["replicas"][role].update(fields)
    if tls:
        builder.data["spec"]["security"] = {"tls": {"secretName": "job-tls"}}
    job = builder.build()
    return build_pod(job, kubernetes_cluster_spec(job), Task(role, 0),
                     PodSettings())["spec"]["containers"][0]


@pytest.mark.parametrize(("role", "fields", "template", "probe", "tls"),
                         [pytest.param(*rest, False, id=i) for i, *rest in PROBES]
                         + [pytest.param(*rest, True, id=i) for i, *rest in TLS_PROBES])
def test_readiness_probe_fits_the_program(role: str, fields: dict[str, Any],
                                          template: dict[str, Any],
                                          probe: dict[str, Any] | None, tls: bool) -> None:
    assert main_container(role, fields, template, tls).get("readinessProbe") == probe


LIVE = {"grpc": {"port": 2222}, "initialDelaySeconds": 30, "periodSeconds": 10,
        "timeoutSeconds": 5, "failureThreshold": 6}
OWN_LIVE = {"exec": {"command": ["true"]}, "periodSeconds": 30}
# Only a check that a hung server fails: the runtime's gRPC health service, without TLS
# (a hung process's kernel still accepts TCP); the template's own livenessProbe is kept.
LIVENESS = [
    # id, role, role fields, template, tls, expected livenessProbe of the main container
    ("runtime-ps-grpc", "ps", {}, {}, False, LIVE),
    ("runtime-worker-none", "worker", {}, {}, False, None),
    ("runtime-chief-none", "chief", {}, {}, False, None),
    ("program-ps-none", "ps", {}, {"command": TF}, False, None),
    ("program-asked-grpc-ps", "ps", {"readiness": "GRPCHealth"}, {"command": TF}, False, LIVE),
    ("own-readiness-ps-none", "ps", {}, {"readinessProbe": OWN}, False, None),
    ("no-gate-ps-none", "ps", {"readiness": "None"}, {}, False, None),
    ("own-liveness-ps-kept", "ps", {}, {"livenessProbe": OWN_LIVE}, False, OWN_LIVE),
    ("tls-runtime-ps-none", "ps", {}, {}, True, None),
    ("tls-own-liveness-ps-kept", "ps", {}, {"livenessProbe": OWN_LIVE}, True, OWN_LIVE),
]


@pytest.mark.parametrize(("role", "fields", "template", "tls", "probe"),
                         [pytest.param(*rest, id=i) for i, *rest in LIVENESS])
def test_liveness_probe_only_where_it_tells_a_hung_server(
        role: str, fields: dict[str, Any], template: dict[str, Any], tls: bool,
        probe: dict[str, Any] | None) -> None:
    assert main_container(role, fields, template, tls).get("livenessProbe") == probe


@pytest.mark.parametrize(("seconds", "probe"), [
    (60, LIVE),
    (10, {**LIVE, "periodSeconds": 2, "timeoutSeconds": 2, "failureThreshold": 5}),
    (3600, {**LIVE, "periodSeconds": 600, "failureThreshold": 6}),
    (100, {**LIVE, "periodSeconds": 16, "failureThreshold": 7}),  # 112 s: never less
    (0, None),
])
def test_the_liveness_window_is_the_operators_setting(seconds: int,
                                                      probe: dict[str, Any] | None) -> None:
    job = make_job().build()
    pod = build_pod(job, kubernetes_cluster_spec(job), Task("ps", 0),
                    PodSettings(ps_liveness_seconds=seconds))
    assert pod["spec"]["containers"][0].get("livenessProbe") == probe


def test_a_tf_config_program_job_succeeds_and_its_servers_are_stopped() -> None:
    kube, events, status = FakeKube(), Recorder(), FakeStatus()
    builder = make_job().chief()
    for role in ("ps", "worker", "chief"):
        builder.template(role, command=TF)
    kube.add_job(builder.body())
    op = make_reconciler(kube, events, status)

    op.reconcile("ns", "j")
    ps = kube.pods[("ns", "j-ps-0")]
    assert ps["spec"]["containers"][0]["readinessProbe"] == TCP
    kube.set_pod("ns", "j-ps-0", "Running", ready=True)  # the port accepts connections
    op.reconcile("ns", "j")
    assert kube.pod_names() == ["j-chief-0", "j-ps-0", "j-worker-0", "j-worker-1"]
    for name in ("j-worker-0", "j-worker-1", "j-chief-0"):
        kube.set_pod("ns", name, "Running", ready=True)
    op.reconcile("ns", "j")
    assert kube.jobs[("ns", "j")]["status"]["phase"] == "Running"
    assert status.asked == []  # such a program has no pstrain status service to ask

    kube.set_pod("ns", "j-chief-0", "Succeeded", exit_code=0)
    op.reconcile("ns", "j")
    assert kube.jobs[("ns", "j")]["status"]["phase"] == "Succeeded"
    assert kube.pod_names() == ["j-chief-0"]  # the servers, which never exit, are gone
    assert events.reasons()[-2:] == ["ChiefSucceeded", "CleanedUpPods"]


def test_a_full_pod_template_is_kept_and_pstrain_fills_in_its_own_fields() -> None:
    builder = make_job().gpus(1)
    builder.data["spec"]["replicas"]["worker"]["template"] = {
        "metadata": {"labels": {"team": "ml"}, "annotations": {"a": "b"}},
        "spec": {
            "runtimeClassName": "nvidia",
            "topologySpreadConstraints": [{"maxSkew": 1, "topologyKey": "zone",
                                           "whenUnsatisfiable": "DoNotSchedule"}],
            "containers": [
                {"name": "pstrain", "workingDir": "/work",
                 "resources": {"requests": {"cpu": "2"}, "limits": {"memory": "4Gi"}},
                 "env": [{"name": "A", "value": "1"}]},
                {"name": "side", "image": "busybox"},
            ],
        },
    }
    job = builder.build()
    cluster = kubernetes_cluster_spec(job)
    pod = build_pod(job, cluster, Task("worker", 1), PodSettings(runtime_image="rt:1"))
    spec = pod["spec"]
    main, side = spec["containers"]
    assert spec["runtimeClassName"] == "nvidia"
    assert spec["topologySpreadConstraints"][0]["topologyKey"] == "zone"
    assert (spec["hostname"], spec["subdomain"], spec["restartPolicy"]) == (
        "j-worker-1", "j", "Never")
    assert (main["name"], main["image"], main["command"], main["workingDir"]) == (
        "pstrain", "rt:1", ["pstrain", "replica"], "/work")
    assert main["resources"] == {"requests": {"cpu": "2"},
                                 "limits": {"memory": "4Gi", "nvidia.com/gpu": 1}}
    env = [e["name"] for e in main["env"]]
    assert env[:3] == ["PSTRAIN_CLUSTER", "TF_CONFIG", "PSTRAIN_TRAINING"] and env[-1] == "A"
    assert "TF_CONFIG" in [e["name"] for e in side["env"]]
    assert main["securityContext"]["runAsNonRoot"] is True  # the restrictive default
    assert pod["metadata"]["labels"]["team"] == "ml"
    assert pod["metadata"]["annotations"]["a"] == "b"
