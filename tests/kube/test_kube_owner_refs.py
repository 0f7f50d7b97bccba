"""The operator on an API server that enforces who may set an ownerReference's
`blockOwnerDeletion` (the OwnerReferencesPermissionEnforcement admission plugin, on by
default in OpenShift): only someone allowed to `update` the owner's `finalizers` may.
Every object the operator makes names its TrainingJob that way.

../shared/k8s runs its API server without that plugin, so this module starts a second
kube-apiserver beside it with the plugin on (`apiserver.second_api_server`: a world of
its own, with no controller-manager). The chart is installed there
and the real `pstrain operator` runs with a token of the chart's ServiceAccount, so the
API server judges exactly what the chart grants. Pods stay Pending (no node): the
tests are about what the API server lets the operator make.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from pstrain_operator.rbac import PERMISSIONS
from tests.operator.conftest import OperatorProcess

from .apiserver import (apply_example, job_namespace, operator_log, second_api_server,
                        token_kubeconfig, wait_for_crd)
from .conftest import Cluster, wait_until
from .test_kube_chart import Release, install

PLUGIN = "OwnerReferencesPermissionEnforcement"
REFUSED = "cannot set blockOwnerDeletion"
FINALIZERS = ("pstrain.io", "trainingjobs/finalizers", ("update",))
WAIT = 60  # seconds for the operator to act on a job (its first retry comes after 5 s)


@dataclass
class Enforcing:
    """The second API server, the chart installed on it, and the operator running as
    the chart's ServiceAccount."""

    cluster: Cluster
    release: Release
    operator: OperatorProcess

    def namespace(self) -> str:
        return job_namespace(self.cluster, "own")

    def apply_job(self, namespace: str, name: str) -> None:
        apply_example(self.cluster, namespace, name)

    def diagnostics(self) -> str:
        return "\n--- operator\n" + operator_log(self.operator)


@pytest.fixture(scope="module")
def enforcing(cluster: Cluster) -> Iterator[Enforcing]:
    work = Path(tempfile.mkdtemp(prefix="pstrain-owner-refs-"))
    try:
        with second_api_server(cluster, work, "--enable-admission-plugins", PLUGIN) as second:
            release = install(second)  # its crds/ make the TrainingJob CRD here
            wait_for_crd(second)
            kubeconfig = token_kubeconfig(second, release.service_account,
                                          work / "operator.kubeconfig")
            operator = OperatorProcess(kubeconfig, work,
                                       extra_env={"PSTRAIN_OPERATOR_NAMESPACES": ""})
            try:  # (stopped while its API server still answers)
                operator.start()
                yield Enforcing(second, release, operator)
            finally:
                operator.stop()
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _rules_without_finalizers() -> list[dict[str, object]]:
    return [{"apiGroups": [group], "resources": [resource], "verbs": list(verbs)}
            for group, resource, verbs in PERMISSIONS if (group, resource, verbs) != FINALIZERS]


def test_the_chart_grants_update_on_trainingjob_finalizers(
        enforcing: Enforcing) -> None:
    assert FINALIZERS in PERMISSIONS
    user = enforcing.release.service_account
    can = enforcing.cluster.kubectl("auth", "can-i", "update", "trainingjobs.pstrain.io",
                                    "--subresource=finalizers", f"--as={user}", "-n",
                                    "anywhere", check=False).stdout.strip()
    assert can == "yes"


def test_the_operator_makes_every_object_of_a_job_where_owner_references_are_enforced(
        enforcing: Enforcing) -> None:
    """The job's Service, Secret, NetworkPolicy and first pod (the parameter server) are
    made, each naming the job with blockOwnerDeletion."""
    namespace = enforcing.namespace()
    enforcing.apply_job(namespace, "digits")

    def made() -> dict[str, list[dict[str, object]]] | None:
        kinds = {kind: enforcing.cluster.get_json(kind, namespace=namespace)["items"]
                 for kind in ("pods", "services", "secrets", "networkpolicies")}
        return kinds if all(kinds.values()) else None

    try:
        objects = wait_until("the job's objects", made, timeout=WAIT)
    except AssertionError as exc:
        raise AssertionError(f"{exc}{enforcing.diagnostics()}") from None
    assert [p["metadata"]["name"] for p in objects["pods"]] == ["digits-ps-0"]
    for items in objects.values():
        for obj in items:
            [ref] = obj["metadata"]["ownerReferences"]
            assert (ref["kind"], ref["name"], ref["blockOwnerDeletion"]) == (
                "TrainingJob", "digits", True)
    assert REFUSED not in enforcing.operator.log_tail(400)


def test_without_that_grant_the_job_says_why_and_starts_once_it_is_given(
        enforcing: Enforcing) -> None:
    """The control: the same role less `update` on trainingjobs/finalizers is refused
    by this API server, and the job's status says so (CreateRejected, quoting the API
    server) instead of staying blank; the grant given back, the job starts."""
    cluster = enforcing.cluster
    [role] = [o["metadata"]["name"] for o in enforcing.release.objects
              if o["kind"] == "ClusterRole"]
    original = cluster.get_json(f"clusterrole/{role}")["rules"]
    namespace = enforcing.namespace()
    patch = [{"op": "replace", "path": "/rules", "value": _rules_without_finalizers()}]
    cluster.kubectl("patch", f"clusterrole/{role}", "--type=json", "-p", json.dumps(patch))
    try:
        enforcing.apply_job(namespace, "refused")

        def rejected() -> dict[str, object] | None:
            status = cluster.get_json("trainingjob/refused", namespace=namespace).get(
                "status") or {}
            return next((cond for cond in status.get("conditions") or []
                         if cond["type"] == "CreateRejected" and cond["status"] == "True"),
                        None)

        try:
            condition = wait_until("CreateRejected", rejected, timeout=WAIT)
        except AssertionError as exc:
            raise AssertionError(f"{exc}{enforcing.diagnostics()}") from None
        assert REFUSED in str(condition["message"])
        assert cluster.get_json("pods", namespace=namespace)["items"] == []
        events = cluster.get_json("events", namespace=namespace)["items"]
        assert any(e["reason"] == "CreateRejected" and REFUSED in e["message"]
                   for e in events)
    finally:
        restore = [{"op": "replace", "path": "/rules", "value": original}]
        cluster.kubectl("patch", f"clusterrole/{role}", "--type=json", "-p",
                        json.dumps(restore))
    pods = wait_until("the parameter server", lambda: cluster.get_json(
        "pods", namespace=namespace)["items"], timeout=WAIT)
    assert [p["metadata"]["name"] for p in pods] == ["refused-ps-0"]
