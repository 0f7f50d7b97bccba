"""A second kube-apiserver beside the test control plane's, for tests that need the API
server run otherwise (an admission plugin on) or a world of their own (cluster-scoped
objects no other test may see): the same binary, flags, certificates and etcd as the
running one (read from its command line), its own port and its own etcd prefix, and no
controller-manager. Also what the tests on it share: a kubeconfig that logs in with a
ServiceAccount's token (to run the real operator as the chart's ServiceAccount), a job
namespace, the digits example as a named job, and an operator's log without its DEBUG
lines.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from pstrain_runtime.local.processes import find_free_ports

from tests.operator.conftest import OperatorProcess

from .conftest import ROOT, Cluster, wait_until

START_TIMEOUT = 60
EXAMPLE = ROOT / "examples" / "digits.yaml"


@contextmanager
def second_api_server(cluster: Cluster, work: Path, *flags: str) -> Iterator[Cluster]:
    """kube-apiserver as the running one is, with `flags` added, until the block ends;
    the yielded Cluster's kubeconfig is an admin's for it."""
    pid = (cluster.state / "apiserver.pid").read_text().strip()
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().rstrip(b"\0").decode().split("\0")
    cwd = os.readlink(f"/proc/{pid}/cwd")
    [port] = find_free_ports(1)
    old_port = argv[argv.index("--secure-port") + 1]
    argv[argv.index("--secure-port") + 1] = str(port)
    argv += ["--etcd-prefix", f"/pstrain-test-{uuid.uuid4().hex[:8]}", *flags]
    log_path = work / f"apiserver-{port}.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(argv, cwd=cwd, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        kubeconfig = work / f"admin-{port}.kubeconfig"
        kubeconfig.write_text(cluster.kubeconfig.read_text().replace(
            f"127.0.0.1:{old_port}", f"127.0.0.1:{port}"))
        kubeconfig.chmod(0o600)
        second = Cluster(kubeconfig, cluster.state)

        def ready() -> bool:
            if proc.poll() is not None:
                raise AssertionError(f"kube-apiserver exited {proc.returncode}:\n"
                                     + log_path.read_text()[-3000:])
            return second.kubectl("--request-timeout=2s", "get", "--raw", "/readyz",
                                  check=False).returncode == 0

        wait_until("the second kube-apiserver", ready, timeout=START_TIMEOUT)
        yield second
    finally:
        _stop(proc)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


def token_kubeconfig(cluster: Cluster, user: str, path: Path) -> Path:
    """A kubeconfig for `cluster` that logs in as ServiceAccount `user`
    ("system:serviceaccount:NS:NAME") with a bound token of an hour."""
    namespace, name = user.split(":")[2:]
    token = cluster.kubectl("create", "token", name, "--duration", "1h",
                            namespace=namespace).stdout.strip()
    config = json.loads(cluster.kubectl("config", "view", "--raw", "--flatten",
                                        "-o", "json").stdout)
    config["users"] = [{"name": "token", "user": {"token": token}}]
    for context in config["contexts"]:
        context["context"]["user"] = "token"
    path.write_text(json.dumps(config))
    path.chmod(0o600)
    return path


def wait_for_crd(cluster: Cluster) -> None:
    """Until TrainingJobs are served (the chart's crds/ made the CRD just now)."""
    wait_until("the CRD to be served", lambda: cluster.kubectl(
        "get", "trainingjobs", "-A", check=False).returncode == 0, timeout=START_TIMEOUT)


def job_namespace(cluster: Cluster, prefix: str) -> str:
    """A new namespace with the `default` ServiceAccount a job's pods run as (made
    here: no controller-manager serves a second API server)."""
    namespace = f"{prefix}-{uuid.uuid4().hex[:8]}"
    cluster.kubectl("create", "namespace", namespace)
    cluster.kubectl("create", "serviceaccount", "default", namespace=namespace)
    return namespace


def apply_example(cluster: Cluster, namespace: str, name: str) -> None:
    """The digits example as job `name` in `namespace`."""
    text = EXAMPLE.read_text().replace("name: digits", f"name: {name}", 1)
    cluster.kubectl("apply", "--server-side", "-f", "-", input=text, namespace=namespace)


def operator_log(op: OperatorProcess, lines: int = 30) -> str:
    """The last `lines` of an operator's log that are not DEBUG lines."""
    kept = [line for line in op.log_tail(400).splitlines() if " DEBUG " not in line]
    return "\n".join(kept[-lines:])
