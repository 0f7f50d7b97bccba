"""docs/install.md's "Try it without a cluster", as a new user runs it: the chart installed
on the real API server with tests/kube/node-values.yaml, the operator running as the
chart's own pod (with the chart's ServiceAccount and RBAC) under kubelet.py, whose image
map stands in for the images, and examples/digits.yaml, unchanged, to Succeeded.

The doc's commands are read from the doc: a command changed there and not here (or here
and not there) fails the first test.
"""

from __future__ import annotations

import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pstrain_api import constants as c

from ..chart.helm import require_helm, run_helm
from .conftest import ROOT, Cluster, wait_until
from .node import IMAGE_MAP, Kubelet

DOC = ROOT / "docs" / "install.md"
SECTION = "## Try it without a cluster"
RELEASE_NAMESPACE = "pstrain-system"
JOB_NAMESPACE = "default"
JOB = "digits"
# The doc's commands, in order, as this module runs them (the control plane and the CRD
# are the `cluster` fixture's; kubelet.py is started through the same Kubelet class).
COMMANDS = [
    "export $(../shared/k8s/up | tail -1)",
    "kubectl apply --server-side -f crds/trainingjob.yaml",
    ".tools/node_modules/.bin/helm install pstrain charts/pstrain -n pstrain-system "
    "--create-namespace -f tests/kube/node-values.yaml",
    "python -m tests.kube.node &",
    "kubectl -n pstrain-system rollout status deployment/pstrain --timeout=120s",
    "kubectl apply -n default -f examples/digits.yaml",
    "kubectl get tj -n default -w",
]


def doc_commands() -> list[str]:
    """The commands of the section's first bash block (comments dropped)."""
    text = DOC.read_text()
    section = text[text.index(SECTION):]
    block = re.search(r"```bash\n(.*?)```", section, re.S)
    assert block, f"no bash block under {SECTION!r} in {DOC}"
    return [line.split(" #")[0].strip() for line in block[1].splitlines()
            if line.strip() and not line.lstrip().startswith("#")]


def test_the_doc_says_what_this_module_runs() -> None:
    assert doc_commands() == COMMANDS


@pytest.fixture(scope="module")
def node(cluster: Cluster) -> Iterator[Kubelet]:
    """The chart installed as the doc says, and kubelet.py as the node (doc lines 3-4)."""
    require_helm()
    result = run_helm("install", "pstrain", "charts/pstrain", "-n", RELEASE_NAMESPACE,
                      "--create-namespace", "-f", "tests/kube/node-values.yaml",
                      "--kubeconfig", str(cluster.kubeconfig))
    assert result.returncode == 0, result.stderr
    work = Path(tempfile.mkdtemp(prefix="pstrain-kube-install-"))
    kubelet = Kubelet(cluster, work, IMAGE_MAP)
    try:
        kubelet.start()
        yield kubelet
    finally:
        cluster.kubectl("delete", "tj", JOB, "--ignore-not-found", "--wait=false",
                        namespace=JOB_NAMESPACE, check=False)
        wait_until_gone(cluster, JOB_NAMESPACE, f"{c.LABEL_JOB}={JOB}")
        run_helm("uninstall", "pstrain", "-n", RELEASE_NAMESPACE,
                 "--kubeconfig", str(cluster.kubeconfig))
        # The node must see the operator pod go (a pod deleted after its node stopped
        # stays Terminating, and so would the namespace).
        wait_until_gone(cluster, RELEASE_NAMESPACE)
        kubelet.stop()
        for namespace in (RELEASE_NAMESPACE, JOB_NAMESPACE):  # what no node can finish
            cluster.kubectl("delete", "pods", "--all", "--force", "--grace-period=0",
                            namespace=namespace, check=False)
        cluster.kubectl("delete", "namespace", RELEASE_NAMESPACE, "--wait=false",
                        check=False)
        shutil.rmtree(work, ignore_errors=True)


def wait_until_gone(cluster: Cluster, namespace: str, selector: str = "",
                    timeout: float = 60) -> None:
    """The pods of `namespace` (matching `selector`) gone, waiting at most `timeout` s
    (teardown: what is left then is force-deleted after the node stops)."""
    def gone() -> bool:
        return not cluster.kubectl("get", "pods", *(["-l", selector] if selector else []),
                                   "-o", "name", namespace=namespace,
                                   check=False).stdout.strip()

    try:
        wait_until(f"the pods of {namespace} to be gone", gone, timeout=timeout, interval=1)
    except AssertionError:
        pass


def _phase(cluster: Cluster) -> dict[str, Any]:
    return (cluster.get_json("tj", JOB, namespace=JOB_NAMESPACE).get("status") or {})


@pytest.mark.timeout(420)
def test_the_chart_runs_the_digits_example_on_the_test_control_plane(
        cluster: Cluster, node: Kubelet) -> None:
    cluster.kubectl("rollout", "status", "deployment/pstrain", "--timeout=120s",
                    namespace=RELEASE_NAMESPACE, timeout=150)
    [operator] = cluster.get_json("pods", namespace=RELEASE_NAMESPACE)["items"]
    assert operator["spec"]["containers"][0]["image"] == "pstrain-operator:dev"
    cluster.kubectl("apply", "-f", str(ROOT / "examples" / "digits.yaml"),
                    namespace=JOB_NAMESPACE)

    def ended() -> dict[str, Any] | None:
        status = _phase(cluster)
        return status if status.get("phase") in c.TERMINAL_PHASES else None

    status = wait_until("the digits job to end", ended, timeout=330, interval=2)
    assert status["phase"] == "Succeeded", (status, node.tail(60))
    assert status["progress"]["globalStep"] == 900
    assert 0 < status["progress"]["loss"] < 1
    # The operator's own pod made the job's children (its ServiceAccount, the chart's RBAC).
    events = cluster.kubectl("get", "events", "--field-selector",
                             f"involvedObject.name={JOB}", namespace=JOB_NAMESPACE).stdout
    assert "Succeeded" in events, events
    table = cluster.kubectl("get", "tj", JOB, namespace=JOB_NAMESPACE).stdout
    assert re.search(rf"^{JOB}\s+Succeeded\s", table, re.M), table
