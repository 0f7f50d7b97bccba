"""The Helm chart on a real API server (v1.28, ../shared/k8s): `helm install` with the
chart's RBAC, what its ServiceAccount may and may not do, and `helm uninstall`.

The operator's own list of API calls is PERMISSIONS in operator/pstrain_operator/rbac.py;
the ServiceAccount must be allowed exactly those. Access is asked of the API server's
authorizer as `kubectl auth can-i --as=system:serviceaccount:NS:SA` asks it: a
SelfSubjectAccessReview made as the ServiceAccount (`kubectl create --as=...`), many in
one call, naming the API group explicitly (`kubectl auth can-i VERB podgroups.scheduling.
volcano.sh` sends the resource "podgroups.scheduling.volcano.sh" with no group when that
CRD is not installed, and so answers "no" for what the chart does grant); a test checks
that `kubectl auth can-i` itself agrees where the resource is served, and `kubectl auth
can-i --list` shows nothing beyond PERMISSIONS.

The operator's Deployment is installed with an image that exists nowhere: no operator may
run from these releases even when a process kubelet (kubelet.py) runs pods beside them.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import pytest
import yaml

from pstrain_operator.rbac import CLUSTER_SCOPED, PERMISSIONS

from ..chart.helm import CHART, RELEASE, run_helm
from .conftest import CRD_FILE, CRD_NAME, Cluster, wait_until

NOT_RUN_IMAGE = "pstrain.invalid/operator-not-run"


@dataclass
class Release:
    cluster: Cluster
    namespace: str
    objects: list[dict[str, Any]]

    @property
    def refs(self) -> list[str]:
        """kind/name of every object of the release (to `kubectl get -n NAMESPACE`)."""
        return [f"{o['kind'].lower()}/{o['metadata']['name']}" for o in self.objects]

    @property
    def service_account(self) -> str:
        [sa] = [o for o in self.objects if o["kind"] == "ServiceAccount"]
        return f"system:serviceaccount:{self.namespace}:{sa['metadata']['name']}"


def helm(cluster: Cluster, *args: str, values: dict[str, Any] | None = None) -> str:
    result = run_helm(*args, "--kubeconfig", str(cluster.kubeconfig), values=values)
    assert result.returncode == 0, f"helm {' '.join(args)}:\n{result.stderr}"
    return result.stdout


def install(cluster: Cluster, values: dict[str, Any] | None = None) -> Release:
    namespace = f"chart-{uuid.uuid4().hex[:10]}"
    values = {"image": {"repository": NOT_RUN_IMAGE}, **(values or {})}
    helm(cluster, "install", RELEASE, str(CHART), "--namespace", namespace,
         "--create-namespace", values=values)
    manifest = helm(cluster, "get", "manifest", RELEASE, "--namespace", namespace)
    return Release(cluster, namespace, [d for d in yaml.safe_load_all(manifest) if d])


def uninstall(release: Release) -> None:
    run_helm("uninstall", RELEASE, "--namespace", release.namespace,
             "--kubeconfig", str(release.cluster.kubeconfig))
    release.cluster.kubectl("delete", "namespace", release.namespace, "--wait=false",
                            check=False)


@pytest.fixture(scope="module")
def release(cluster: Cluster) -> Iterator[Release]:
    """The chart with its default values (one ClusterRole), in a namespace of its own."""
    found = install(cluster)
    try:
        yield found
    finally:
        uninstall(found)


# --------------------------------------------------------------------------- access

Check = tuple[str, str, str, str | None]  # verb, group, resource[/subresource], namespace


def allowed(cluster: Cluster, user: str, checks: list[Check]) -> dict[Check, bool]:
    """The authorizer's answer to each check for `user`, as `kubectl auth can-i`."""
    items = []
    for verb, group, resource, namespace in checks:
        name, _, sub = resource.partition("/")
        attributes = {"verb": verb, "group": group, "resource": name,
                      **({"subresource": sub} if sub else {}),
                      **({"namespace": namespace} if namespace else {})}
        items.append({"apiVersion": "authorization.k8s.io/v1",
                      "kind": "SelfSubjectAccessReview",
                      "spec": {"resourceAttributes": attributes}})
    out = cluster.kubectl("create", f"--as={user}", "-o", "json", "-f", "-",
                          input=json.dumps({"apiVersion": "v1", "kind": "List",
                                            "items": items})).stdout
    answers, decoder, at = [], json.JSONDecoder(), 0
    while out[at:].strip():
        at += len(out[at:]) - len(out[at:].lstrip())
        review, end = decoder.raw_decode(out, at)
        answers.append(review["status"]["allowed"])
        at = end
    assert len(answers) == len(checks)
    return dict(zip(checks, answers))


def operator_checks(namespace: str, scopes: str = "all") -> list[Check]:
    """Every (verb, resource) of PERMISSIONS; `scopes` "namespaced" or "cluster" for
    one kind only."""
    out = []
    for group, resource, verbs in PERMISSIONS:
        cluster_scoped = (group, resource) in CLUSTER_SCOPED
        if (scopes == "namespaced" and cluster_scoped) or (scopes == "cluster"
                                                           and not cluster_scoped):
            continue
        out += [(verb, group, resource, None if cluster_scoped else namespace)
                for verb in verbs]
    return out


def test_the_chart_installs_beside_the_crd_that_is_already_there(release: Release) -> None:
    """The CRD is applied by the session (as an admin does before upgrading the chart);
    Helm skips a crds/ file whose CRD exists, and the chart's objects are created. The
    chart's copy of the CRD is the file the API server accepted."""
    cluster = release.cluster
    assert (CHART / "crds" / "trainingjob.yaml").read_bytes() == CRD_FILE.read_bytes()
    status = json.loads(helm(cluster, "status", RELEASE, "--namespace", release.namespace,
                             "-o", "json"))
    assert status["info"]["status"] == "deployed"
    crd = cluster.get_json(f"crd/{CRD_NAME}", "--show-managed-fields")
    managers = {entry["manager"] for entry in crd["metadata"]["managedFields"]}
    assert "helm" not in managers, "helm wrote the CRD that was already there"
    kinds = {o["kind"] for o in release.objects}
    assert {"ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Deployment"} <= kinds
    assert all(o["metadata"].get("namespace") in (None, release.namespace)
               for o in release.objects)
    # Each object exists; so do the CRDs of the chart's other crds/ file.
    cluster.kubectl("get", "-n", release.namespace, *release.refs,
                    "crd/clusterkopfpeerings.kopf.dev", "crd/kopfpeerings.kopf.dev")


def test_the_service_account_may_make_every_call_the_operator_makes(
        release: Release) -> None:
    elsewhere = f"anywhere-{uuid.uuid4().hex[:6]}"  # cluster mode: every namespace
    checks = operator_checks(elsewhere) + operator_checks(release.namespace, "namespaced")
    answers = allowed(release.cluster, release.service_account, checks)
    assert [check for check, ok in answers.items() if not ok] == []


NOT_ALLOWED: list[Check] = [
    ("delete", "", "namespaces", None),
    ("create", "", "namespaces", None),
    ("create", "apiextensions.k8s.io", "customresourcedefinitions", None),
    ("delete", "apiextensions.k8s.io", "customresourcedefinitions", None),
    ("list", "", "secrets", "default"),
    ("watch", "", "secrets", "default"),
    ("delete", "", "secrets", "default"),
    ("update", "", "secrets", "default"),
    ("get", "", "configmaps", "default"),
    ("create", "pstrain.io", "trainingjobs", "default"),
    ("update", "pstrain.io", "trainingjobs", "default"),
    ("update", "pstrain.io", "trainingjobs/status", "default"),
    ("patch", "pstrain.io", "trainingjobs/scale", "default"),
    ("update", "", "pods", "default"),
    ("patch", "", "pods", "default"),
    ("create", "", "pods/exec", "default"),
    ("delete", "", "services", "default"),
    ("create", "apps", "deployments", "default"),
    ("create", "rbac.authorization.k8s.io", "clusterroles", None),
    ("create", "rbac.authorization.k8s.io", "rolebindings", "default"),
    ("bind", "rbac.authorization.k8s.io", "clusterroles", None),
    ("impersonate", "", "serviceaccounts", "default"),
    ("create", "", "serviceaccounts/token", "default"),
    ("patch", "", "nodes", None),
    ("delete", "kopf.dev", "clusterkopfpeerings", None),
]


def test_the_service_account_may_not_do_more(release: Release) -> None:
    answers = allowed(release.cluster, release.service_account, NOT_ALLOWED)
    assert [check for check, ok in answers.items() if ok] == []


_CAN_I_ROW = re.compile(r"^(\S+)\s+\[(.*?)\]\s+\[(.*?)\]\s+\[(.*?)\]\s*$")


def can_i_list(cluster: Cluster, user: str, namespace: str) -> set[tuple[str, str]]:
    """(resource.group[/sub], verb) of `kubectl auth can-i --list` (no resource names)."""
    out = cluster.kubectl("auth", "can-i", "--list", f"--as={user}", "-n", namespace).stdout
    found = set()
    for line in out.splitlines()[1:]:
        row = _CAN_I_ROW.match(line)
        if row:
            assert row[3] == "", f"a rule limited to resource names: {line}"
            found |= {(row[1], verb) for verb in row[4].split()}
    return found


def granted(namespace: str, scopes: str = "all") -> set[tuple[str, str]]:
    """PERMISSIONS as `kubectl auth can-i --list` spells them."""
    out = set()
    for verb, group, resource, _ in operator_checks(namespace, scopes):
        name, _, sub = resource.partition("/")
        out.add(((f"{name}.{group}" if group else name) + (f"/{sub}" if sub else ""), verb))
    return out


def test_kubectl_auth_can_i_list_shows_exactly_the_operators_calls(
        release: Release) -> None:
    cluster = release.cluster
    nobody = f"system:serviceaccount:{release.namespace}:nobody"  # what every SA may
    baseline = can_i_list(cluster, nobody, "default")
    assert can_i_list(cluster, release.service_account, "default") - baseline == granted(
        "default")


def test_kubectl_auth_can_i_agrees(release: Release) -> None:
    """`kubectl auth can-i` itself, on resources this cluster serves."""
    cluster, user = release.cluster, release.service_account
    cases = [(["patch", "trainingjobs.pstrain.io", "--subresource=status"], "yes"),
             (["watch", "trainingjobs"], "yes"),
             (["create", "pods"], "yes"),
             (["list", "customresourcedefinitions.apiextensions.k8s.io"], "yes"),
             (["patch", "clusterkopfpeerings.kopf.dev"], "yes"),
             (["update", "trainingjobs.pstrain.io"], "no"),
             (["list", "secrets"], "no"),
             (["delete", "namespaces"], "no")]

    def ask(args: list[str]) -> str:
        return cluster.kubectl("auth", "can-i", *args, f"--as={user}", "-n", "default",
                               check=False).stdout.strip()

    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(ask, [args for args, _ in cases]))
    assert answers == [want for _, want in cases]


def test_a_namespaced_install_grants_only_the_watched_namespaces(cluster: Cluster) -> None:
    watched, other = (f"{kind}-{uuid.uuid4().hex[:8]}" for kind in ("watched", "other"))
    for name in (watched, other):
        cluster.kubectl("create", "namespace", name)
    release = install(cluster, {"watchNamespaces": [watched]})
    try:
        user = release.service_account
        kinds = sorted(o["kind"] for o in release.objects if "Role" in o["kind"])
        assert kinds == ["ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding"]
        answers = allowed(cluster, user, operator_checks(watched)
                          + operator_checks(other, "namespaced"))
        assert {check for check, ok in answers.items() if not ok} == set(
            operator_checks(other, "namespaced"))
        nobody = f"system:serviceaccount:{release.namespace}:nobody"
        baseline = can_i_list(cluster, nobody, other)
        assert can_i_list(cluster, user, watched) - baseline == granted(watched)
        assert can_i_list(cluster, user, other) - baseline == granted(other, "cluster")
    finally:
        uninstall(release)
        for name in (watched, other):
            cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)


def test_helm_uninstall_removes_the_release_and_keeps_the_crds(cluster: Cluster) -> None:
    release = install(cluster)
    result = run_helm("uninstall", RELEASE, "--namespace", release.namespace,
                      "--kubeconfig", str(cluster.kubeconfig))
    try:
        assert result.returncode == 0, result.stderr
        gone = run_helm("status", RELEASE, "--namespace", release.namespace,
                        "--kubeconfig", str(cluster.kubeconfig))
        assert gone.returncode != 0 and "not found" in gone.stderr
        wait_until("the release's objects deleted", lambda: cluster.kubectl(
            "get", "-n", release.namespace, *release.refs, "--ignore-not-found",
            "-o", "name").stdout.strip() == "", timeout=30)
        answers = allowed(cluster, release.service_account,
                          operator_checks("default"))
        assert not any(answers.values()), "the ServiceAccount kept its permissions"
        cluster.kubectl("get", f"crd/{CRD_NAME}")
    finally:
        cluster.kubectl("delete", "namespace", release.namespace, "--wait=false",
                        check=False)
