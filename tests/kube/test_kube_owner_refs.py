"""The operator on an API server that enforces who may set an ownerReference's
`blockOwnerDeletion` (the OwnerReferencesPermissionEnforcement admission plugin, on by
default in OpenShift): only someone allowed to `update` the owner's `finalizers` may.
Every object the operator makes names its TrainingJob that way.

../shared/k8s runs its API server without that plugin, so this module starts a second
kube-apiserver beside it with the plugin on: the same binary, flags, certificates and
etcd as the running one (read from its command line), its own port and its own etcd
prefix (a world of its own, with no controller-manager). The chart is installed there
and the real `pstrain operator` runs with a token of the chart's ServiceAccount, so the
API server judges exactly what the chart grants. Pods stay Pending (no node): the
tests are about what the API server lets the operator make.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from pstrain_operator.rbac import PERMISSIONS
from pstrain_runtime.local.processes import find_free_ports
from tests.operator.conftest import OperatorProcess

from .conftest import ROOT, Cluster, wait_until
from .test_kube_chart import Release, install

PLUGIN = "OwnerReferencesPermissionEnforcement"
REFUSED = "cannot set blockOwnerDeletion"
FINALIZERS = ("pstrain.io", "trainingjobs/finalizers", ("update",))
START_TIMEOUT = 60
WAIT = 60  # seconds for the operator to act on a job (its first retry comes after 5 s)


@dataclass
class Enforcing:
    """The second API server, the chart installed on it, and the operator running as
    the chart's ServiceAccount."""

    cluster: Cluster
    release: Release
    operator: OperatorProcess

    def namespace(self) -> str:
        """A namespace for a job, with the `default` ServiceAccount its pods run as
        (made here: no controller-manager serves this API server)."""
        name = f"own-{uuid.uuid4().hex[:8]}"
        self.cluster.kubectl("create", "namespace", name)
        self.cluster.kubectl("create", "serviceaccount", "default", namespace=name)
        return name

    def apply_job(self, namespace: str, name: str) -> None:
        text = (ROOT / "examples" / "digits.yaml").read_text()
        self.cluster.kubectl("apply", "--server-side", "-f", "-", input=text.replace(
            "name: digits", f"name: {name}", 1), namespace=namespace)

    def diagnostics(self) -> str:
        lines = [line for line in self.operator.log_tail(400).splitlines()
                 if " DEBUG " not in line]
        return "\n--- operator\n" + "\n".join(lines[-30:])


def _second_api_server(cluster: Cluster, work: Path) -> tuple[subprocess.Popen[bytes], Path]:
    """kube-apiserver as the running one is, with the plugin on, on a port and an etcd
    prefix of its own; returns the process and an admin kubeconfig for it."""
    pid = (cluster.state / "apiserver.pid").read_text().strip()
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().rstrip(b"\0").decode().split("\0")
    cwd = os.readlink(f"/proc/{pid}/cwd")
    [port] = find_free_ports(1)
    old_port = argv[argv.index("--secure-port") + 1]
    argv[argv.index("--secure-port") + 1] = str(port)
    argv += ["--etcd-prefix", f"/pstrain-owner-refs-{uuid.uuid4().hex[:8]}",
             "--enable-admission-plugins", PLUGIN]
    log = open(work / "apiserver.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen(argv, cwd=cwd, stdout=log, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, start_new_session=True)
    log.close()
    kubeconfig = work / "admin.kubeconfig"
    kubeconfig.write_text(cluster.kubeconfig.read_text().replace(
        f"127.0.0.1:{old_port}", f"127.0.0.1:{port}"))
    kubeconfig.chmod(0o600)
    return proc, kubeconfig


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


def _token_kubeconfig(admin: Path, release: Release, work: Path) -> Path:
    """A kubeconfig that logs in as the chart's ServiceAccount (a bound token)."""
    sa = release.service_account.rsplit(":", 1)[1]
    token = release.cluster.kubectl("create", "token", sa, "--duration", "1h",
                                    namespace=release.namespace).stdout.strip()
    config = json.loads(subprocess.run(
        ["kubectl", "config", "view", "--raw", "--flatten", "-o", "json"],
        env={**os.environ, "KUBECONFIG": str(admin)}, capture_output=True, text=True,
        timeout=30, check=True).stdout)
    config["users"] = [{"name": "operator", "user": {"token": token}}]
    for context in config["contexts"]:
        context["context"]["user"] = "operator"
    path = work / "operator.kubeconfig"
    path.write_text(json.dumps(config))
    path.chmod(0o600)
    return path


@pytest.fixture(scope="module")
def enforcing(cluster: Cluster) -> Iterator[Enforcing]:
    work = Path(tempfile.mkdtemp(prefix="pstrain-owner-refs-"))
    proc, admin = _second_api_server(cluster, work)
    operator: OperatorProcess | None = None
    try:
        second = Cluster(admin, cluster.state)

        def ready() -> bool:
            if proc.poll() is not None:
                raise AssertionError(f"kube-apiserver exited {proc.returncode}:\n"
                                     + (work / "apiserver.log").read_text()[-3000:])
            return second.kubectl("--request-timeout=2s", "get", "--raw", "/readyz",
                                  check=False).returncode == 0

        wait_until("the second kube-apiserver", ready, timeout=START_TIMEOUT)
        release = install(second)  # its crds/ make the TrainingJob CRD here
        wait_until("the CRD to be served", lambda: second.kubectl(
            "get", "trainingjobs", "-A", check=False).returncode == 0, timeout=START_TIMEOUT)
        operator = OperatorProcess(_token_kubeconfig(admin, release, work), work,
                                   extra_env={"PSTRAIN_OPERATOR_NAMESPACES": ""})
        operator.start()
        yield Enforcing(second, release, operator)
    finally:
        if operator is not None:
            operator.stop()
        _stop(proc)


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
