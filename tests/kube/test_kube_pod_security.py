"""Pod security on a real API server (v1.28, ../shared/k8s): the pods the operator
makes for every example, and the chart's own operator pod, created (`--dry-run=server`)
in a namespace that enforces the "restricted" Pod Security Standard through the
PodSecurity admission built into kube-apiserver. docs/install.md says they pass it with
the chart's defaults (`jobPodSecurity: restricted`); the control: the same pods without
that default are refused.

The job pods are built by the operator's own code (`steps.start_order.build_replica`:
the pod, then its credentials mounted), as the reconciler creates them.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from pstrain_api.cluster import kubernetes_cluster_spec
from pstrain_api.validate import check_for_kubernetes
from pstrain_operator.settings import PodSecurity, PodSettings
from pstrain_operator.steps.start_order import build_replica

from ..chart.helm import one, render
from .conftest import ROOT, Namespace

EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))
ENFORCED = {"pod-security.kubernetes.io/enforce": "restricted",
            "pod-security.kubernetes.io/enforce-version": "v1.28",
            "pod-security.kubernetes.io/warn": "restricted",
            "pod-security.kubernetes.io/warn-version": "v1.28"}
REFUSED = 'violates PodSecurity "restricted:v1.28"'


@pytest.fixture()
def restricted(namespace: Namespace) -> Namespace:
    namespace.kubectl("label", "namespace", namespace.name,
                      *(f"{k}={v}" for k, v in ENFORCED.items()))
    return namespace


def job_pods(path: Path, namespace: str, security: PodSecurity,
             template: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Every replica's pod of every job in `path`, as the operator builds it (with
    `template` as every role's pod template, when given)."""
    pods = []
    for doc in (d for d in yaml.safe_load_all(path.read_text()) if d):
        for spec in doc["spec"]["replicas"].values() if template else ():
            spec["template"] = template
        doc["metadata"].update(namespace=namespace, uid="00000000-0000-0000-0000-000000000001")
        job, problems = check_for_kubernetes(doc, source=str(path))
        assert job is not None, problems
        cluster = kubernetes_cluster_spec(job)
        pods += [build_replica(job, cluster, task, PodSettings(pod_security=security)).manifest
                 for task in cluster.tasks()]
    return pods


def dry_run(ns: Namespace, objects: list[dict[str, Any]]) -> subprocess.CompletedProcess[str]:
    return ns.kubectl("create", "--dry-run=server", "-o", "name", "-f", "-", check=False,
                      input=json.dumps({"apiVersion": "v1", "kind": "List", "items": objects}))


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_every_pod_of_every_example_passes_the_restricted_standard(
        restricted: Namespace, path: Path) -> None:
    pods = job_pods(path, restricted.name, "restricted")
    assert pods
    proc = dry_run(restricted, pods)
    assert proc.returncode == 0, proc.stderr
    assert "Warning" not in proc.stderr, proc.stderr
    assert sorted(proc.stdout.split()) == sorted(f"pod/{p['metadata']['name']}" for p in pods)


def test_a_template_with_a_sidecar_and_an_init_container_passes_it_too(
        restricted: Namespace) -> None:
    """Containers the template adds without a securityContext get the default."""
    busybox = {"image": "busybox:1.36", "command": ["sh", "-c", "true"]}
    template = {"spec": {"containers": [{"name": "pstrain"}, {"name": "log", **busybox}],
                         "initContainers": [{"name": "fetch", **busybox}]}}
    pods = job_pods(ROOT / "examples" / "digits.yaml", restricted.name, "restricted",
                    template)
    proc = dry_run(restricted, pods)
    assert proc.returncode == 0, proc.stderr
    assert "Warning" not in proc.stderr, proc.stderr


def test_without_the_default_the_same_pods_are_refused(restricted: Namespace) -> None:
    pods = job_pods(ROOT / "examples" / "digits.yaml", restricted.name, "none")
    proc = dry_run(restricted, pods)
    assert proc.returncode != 0
    assert proc.stderr.count(REFUSED) == len(pods), proc.stderr


def test_the_charts_operator_pod_passes_the_restricted_standard(
        restricted: Namespace) -> None:
    deployment = one(render(namespace=restricted.name), "Deployment")
    template = deployment["spec"]["template"]
    account = template["spec"]["serviceAccountName"]
    restricted.kubectl("create", "serviceaccount", account)  # pods name an existing one
    pod = {"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": "operator", "namespace": restricted.name,
                        "labels": template["metadata"].get("labels", {})},
           "spec": template["spec"]}
    proc = dry_run(restricted, [pod])
    assert proc.returncode == 0, proc.stderr
    assert "Warning" not in proc.stderr, proc.stderr
    assert proc.stdout.split() == ["pod/operator"]
