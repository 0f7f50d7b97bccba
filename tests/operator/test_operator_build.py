"""The pod and Service constructors, compared as whole objects."""

from __future__ import annotations

import json
from typing import Any

import kubernetes_validate
import pytest

from pstrain_api import constants as c
from pstrain_api.cluster import Task, kubernetes_cluster_spec, local_cluster_spec
from pstrain_operator.build import (
    ANNOTATION_APPLIED_SPEC,
    ANNOTATION_SPEC_HASH,
    RESTRICTED_CONTAINER_SECURITY,
    build_pod,
    build_service,
    spec_hash,
)
from pstrain_operator.settings import PodSettings

from ..chart.helm import K8S_VERSION
from .op_builders import make_job

OWNER = {"apiVersion": c.API_VERSION, "kind": c.KIND, "name": "j", "uid": "uid-j",
         "controller": True, "blockOwnerDeletion": True}


def env_of(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in container.get("env", [])}


def test_ps_pod_whole_object() -> None:
    job = make_job().build()
    cluster = kubernetes_cluster_spec(job)
    pod = build_pod(job, cluster, Task("ps", 0), PodSettings(runtime_image="img:1"))
    env = cluster.env(Task("ps", 0))
    assert pod == {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": "j-ps-0",
            "namespace": "ns",
            "labels": {c.LABEL_JOB: "j", c.LABEL_MANAGED_BY: c.MANAGED_BY,
                       c.LABEL_ROLE: "ps", c.LABEL_INDEX: "0", c.LABEL_IS_CHIEF: "false"},
            "annotations": {
                ANNOTATION_SPEC_HASH: spec_hash(job),
                ANNOTATION_APPLIED_SPEC: pod["metadata"]["annotations"][ANNOTATION_APPLIED_SPEC],
            },
            "ownerReferences": [OWNER],
        },
        "spec": {
            "hostname": "j-ps-0",
            "subdomain": "j",
            "restartPolicy": "Never",
            "enableServiceLinks": False,
            "securityContext": {"runAsNonRoot": True,
                                "seccompProfile": {"type": "RuntimeDefault"}},
            "containers": [{
                "name": "pstrain",
                "image": "img:1",
                "command": ["pstrain", "replica"],
                "env": [{"name": k, "value": v} for k, v in env.items()]
                + [{"name": "PSTRAIN_DATA_PORT", "value": "2223"},
                   {"name": "PSTRAIN_METRICS_PORT", "value": "9400"}],
                "terminationMessagePolicy": "FallbackToLogsOnError",
                "ports": [{"name": "pstrain", "containerPort": 2222, "protocol": "TCP"},
                          {"name": "pstrain-data", "containerPort": 2223, "protocol": "TCP"},
                          {"name": "metrics", "containerPort": 9400, "protocol": "TCP"}],
                "readinessProbe": {"grpc": {"port": 2222}, "periodSeconds": 2,
                                   "failureThreshold": 3},
                "livenessProbe": {"grpc": {"port": 2222}, "initialDelaySeconds": 30,
                                  "periodSeconds": 10, "timeoutSeconds": 5,
                                  "failureThreshold": 6},
                "securityContext": {"allowPrivilegeEscalation": False,
                                    "capabilities": {"drop": ["ALL"]},
                                    "runAsNonRoot": True,
                                    "seccompProfile": {"type": "RuntimeDefault"}},
            }],
        },
    }
    applied = json.loads(pod["metadata"]["annotations"][ANNOTATION_APPLIED_SPEC])
    assert applied["replicas"]["ps"]["replicas"] == 1


def test_worker_pod_gpus_template_and_env_in_every_container() -> None:
    job = (make_job().gpus(2)
           .template("worker", image="mine:2", args=["--x"], env=[{"name": "A", "value": "1"}],
                     sidecars=[{"name": "side", "image": "s",
                                "env": [{"name": "B", "value": "2"}]}],
                     initContainers=[{"name": "init", "image": "i"}],
                     labels={"team": "x"}, nodeSelector={"gpu": "yes"})
           .build())
    cluster = kubernetes_cluster_spec(job)
    pod = build_pod(job, cluster, Task("worker", 0), PodSettings())
    spec = pod["spec"]
    main, side = spec["containers"]
    init = spec["initContainers"][0]
    want_env = cluster.env(Task("worker", 0))
    for container in (main, side, init):
        assert {k: env_of(container)[k] for k in want_env} == want_env, container["name"]
    assert env_of(side)["B"] == "2"
    assert env_of(main)["A"] == "1"
    assert main["resources"] == {"limits": {c.GPU_RESOURCE: 2}}
    assert (main["image"], main["args"]) == ("mine:2", ["--x"])
    assert "readinessProbe" not in main
    assert main["ports"] == [{"name": "metrics", "containerPort": 9400, "protocol": "TCP"}]
    assert pod["metadata"]["labels"]["team"] == "x"
    assert pod["metadata"]["labels"][c.LABEL_IS_CHIEF] == "true"
    assert spec["nodeSelector"] == {"gpu": "yes"}


DATA_PORT_CASES = [
    # (id, task, ports the main container declares, PSTRAIN_DATA_PORT it is told)
    ("ps-0", Task("ps", 0), [("pstrain", 2222), ("pstrain-data", 2223), ("metrics", 9400)],
     "2223"),
    ("ps-1", Task("ps", 1), [("pstrain", 2222), ("pstrain-data", 2223), ("metrics", 9400)],
     "2223"),
    ("worker-0", Task("worker", 0), [("metrics", 9400)], None),
    ("worker-1", Task("worker", 1), [("metrics", 9400)], None),
    ("chief", Task("chief", 0), [("metrics", 9400)], None),
]


@pytest.mark.parametrize(("task", "ports", "data_port"),
                         [pytest.param(*rest, id=i) for i, *rest in DATA_PORT_CASES])
def test_only_parameter_servers_declare_and_are_told_the_data_port(
        task: Task, ports: list[tuple[str, int]], data_port: str | None) -> None:
    job = (make_job().ps(2).chief()
           .template(task.role, sidecars=[{"name": "side", "image": "s"}]).build())
    pod = build_pod(job, kubernetes_cluster_spec(job), task, PodSettings())
    main, side = pod["spec"]["containers"]
    assert [(p["name"], p["containerPort"]) for p in main.get("ports", [])] == ports
    assert all(p["protocol"] == "TCP" for p in main.get("ports", []))
    assert env_of(main).get(c.ENV_DATA_PORT) == data_port
    assert c.ENV_DATA_PORT not in env_of(side)  # only the replica itself binds it
    # The readiness and liveness probes stay on the gRPC port, and only a PS has them.
    for probe in ("readinessProbe", "livenessProbe"):
        assert main.get(probe, {}).get("grpc") == (
            {"port": 2222} if task.role == "ps" else None)


def test_the_shared_cluster_env_leaves_the_data_port_unset() -> None:
    """The local runner uses the same ClusterSpec.env: its PS share one host, so each
    must take a free data port rather than a fixed one."""
    job = make_job().ps(2).build()
    cluster = local_cluster_spec(job, [5001, 5002, 5003, 5004])
    assert all(c.ENV_DATA_PORT not in cluster.env(t) for t in cluster.tasks())


def test_built_objects_are_valid_kubernetes_objects() -> None:
    """Every pod of a job with sidecars and init containers on each role, and its Service,
    against the strict schemas of the oldest supported Kubernetes version."""
    extra = {"sidecars": [{"name": "side", "image": "s", "ports": [{"containerPort": 80}]}],
             "initContainers": [{"name": "init", "image": "i"}]}
    job = (make_job().ps(2).chief().template("ps", **extra).template("worker", **extra)
           .template("chief", **extra).build())
    cluster = kubernetes_cluster_spec(job)
    objects = [build_pod(job, cluster, t, PodSettings()) for t in cluster.tasks()]
    objects.append(build_service(job))
    for obj in objects:
        try:
            kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{obj['kind']} {obj['metadata']['name']} is not valid: {exc}")


def test_template_security_context_wins_and_none_setting_drops_default() -> None:
    job = make_job().template("ps", securityContext={"runAsUser": 0}).build()
    cluster = kubernetes_cluster_spec(job)
    pod = build_pod(job, cluster, Task("ps", 0), PodSettings())
    assert pod["spec"]["containers"][0]["securityContext"] == {"runAsUser": 0}
    bare = build_pod(job, cluster, Task("worker", 1), PodSettings(pod_security="none"))
    assert "securityContext" not in bare["spec"]["containers"][0]
    assert "securityContext" not in bare["spec"]


def test_the_restricted_default_covers_sidecars_and_init_containers() -> None:
    """Each container the template leaves without a securityContext gets the default
    (the "restricted" standard checks every container); one that sets its own keeps it."""
    own = {"runAsUser": 1000}
    job = make_job().template("worker", sidecars=[{"name": "log", "image": "busybox"},
                                                  {"name": "own", "image": "busybox",
                                                   "securityContext": own}],
                              spec={"initContainers": [{"name": "fetch", "image": "busybox"}]}
                              ).build()
    cluster = kubernetes_cluster_spec(job)
    spec = build_pod(job, cluster, Task("worker", 1), PodSettings())["spec"]
    contexts = {ctr["name"]: ctr.get("securityContext")
                for ctr in spec["containers"] + spec["initContainers"]}
    assert contexts == {"pstrain": RESTRICTED_CONTAINER_SECURITY,
                        "log": RESTRICTED_CONTAINER_SECURITY, "own": own,
                        "fetch": RESTRICTED_CONTAINER_SECURITY}
    bare = build_pod(job, cluster, Task("worker", 1), PodSettings(pod_security="none"))
    assert [ctr.get("securityContext") for ctr in bare["spec"]["containers"]
            + bare["spec"]["initContainers"]] == [None, None, own, None]


def test_headless_service_whole_object() -> None:
    assert build_service(make_job().build()) == {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "j", "namespace": "ns",
                     "labels": {c.LABEL_JOB: "j", c.LABEL_MANAGED_BY: c.MANAGED_BY},
                     "ownerReferences": [OWNER]},
        "spec": {"clusterIP": "None", "publishNotReadyAddresses": True,
                 "selector": {c.LABEL_JOB: "j"},
                 "ports": [{"name": "pstrain", "port": 2222, "targetPort": 2222,
                            "protocol": "TCP"},
                           {"name": "pstrain-data", "port": 2223, "targetPort": 2223,
                            "protocol": "TCP"}]},
    }


def test_spec_hash_ignores_run_policy_but_not_replicas() -> None:
    base = spec_hash(make_job().build())
    assert spec_hash(make_job().policy(backoffLimit=9).build()) == base
    assert spec_hash(make_job().ps(2).build()) != base
