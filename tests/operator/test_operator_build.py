"""The pod and Service constructors, compared as whole objects."""

from __future__ import annotations

import json
from typing import Any

from pstrain_api import constants as c
from pstrain_api.cluster import Task, kubernetes_cluster_spec
from pstrain_operator.build import (
    ANNOTATION_APPLIED_SPEC,
    ANNOTATION_SPEC_HASH,
    build_pod,
    build_service,
    spec_hash,
)
from pstrain_operator.settings import PodSettings

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
                "env": [{"name": k, "value": v} for k, v in env.items()],
                "ports": [{"name": "pstrain", "containerPort": 2222, "protocol": "TCP"}],
                "readinessProbe": {"grpc": {"port": 2222}, "periodSeconds": 2,
                                   "failureThreshold": 3},
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
                                "env": [{"name": "TF_CONFIG", "value": "stale"},
                                        {"name": "B", "value": "2"}]}],
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
    assert "readinessProbe" not in main and "ports" not in main
    assert pod["metadata"]["labels"]["team"] == "x"
    assert pod["metadata"]["labels"][c.LABEL_IS_CHIEF] == "true"
    assert spec["nodeSelector"] == {"gpu": "yes"}


def test_template_security_context_wins_and_none_setting_drops_default() -> None:
    job = make_job().template("ps", securityContext={"runAsUser": 0}).build()
    cluster = kubernetes_cluster_spec(job)
    pod = build_pod(job, cluster, Task("ps", 0), PodSettings())
    assert pod["spec"]["containers"][0]["securityContext"] == {"runAsUser": 0}
    bare = build_pod(job, cluster, Task("worker", 1), PodSettings(pod_security="none"))
    assert "securityContext" not in bare["spec"]["containers"][0]
    assert "securityContext" not in bare["spec"]


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
                            "protocol": "TCP"}]},
    }


def test_spec_hash_ignores_run_policy_but_not_replicas() -> None:
    base = spec_hash(make_job().build())
    assert spec_hash(make_job().policy(backoffLimit=9).build()) == base
    assert spec_hash(make_job().ps(2).build()) != base
