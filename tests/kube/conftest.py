"""A real Kubernetes API server for the tests that need one (marker `kube`).

`../shared/k8s/up` (or the folder named by $PSTRAIN_KUBE_DIR) starts etcd,
kube-apiserver and kube-controller-manager v1.28.7 on 127.0.0.1 in about 10 s. The
control plane starts once per test run and is stopped at the end when this run started
it; the CRD is applied once; each test gets a namespace of its own, deleted afterwards.
When the folder is absent (a user's clone has no `../shared`), the tests skip and say
why. Every call here is bounded in time.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
CRD_FILE = ROOT / "crds" / "trainingjob.yaml"
CRD_NAME = "trainingjobs.pstrain.io"
KUBE_DIR = Path(os.environ.get("PSTRAIN_KUBE_DIR", ROOT.parent / "shared" / "k8s"))
UP_TIMEOUT = 240  # the first start installs etcd from Debian's packages
CALL_TIMEOUT = 60


def kube_missing() -> str | None:
    """Why the real-API tests cannot run here, or None."""
    if not (KUBE_DIR / "up").is_file():
        return (f"no real Kubernetes API server: {KUBE_DIR}/up is absent (set "
                "PSTRAIN_KUBE_DIR to a folder with up/down/kubelet.py, as ../shared/k8s)")
    if subprocess.run(["which", "kubectl"], capture_output=True).returncode != 0:
        return "no kubectl on PATH"
    return None


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    reason = kube_missing()
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.kube)
            if reason:
                item.add_marker(pytest.mark.skip(reason=reason))


@dataclass
class Cluster:
    """The control plane: its kubeconfig, and kubectl bound to it."""

    kubeconfig: Path
    state: Path

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, "KUBECONFIG": str(self.kubeconfig)}

    def kubectl(self, *args: str, input: str | None = None, check: bool = True,
                timeout: float = CALL_TIMEOUT, namespace: str | None = None,
                ) -> subprocess.CompletedProcess[str]:
        argv = ["kubectl", *(["-n", namespace] if namespace else []), *args]
        proc = subprocess.run(argv, input=input, capture_output=True, text=True,
                              env=self.env, timeout=timeout)
        if check and proc.returncode != 0:
            raise AssertionError(f"{' '.join(argv)} exited {proc.returncode}:\n"
                                 f"{proc.stdout}{proc.stderr}")
        return proc

    def get_json(self, *args: str, namespace: str | None = None) -> Any:
        return json.loads(self.kubectl("get", *args, "-o", "json",
                                       namespace=namespace).stdout)


@dataclass
class Namespace:
    """One test's namespace on the shared control plane."""

    cluster: Cluster
    name: str
    cleanups: list[Any] = field(default_factory=list)

    def kubectl(self, *args: str, **kwargs: Any) -> subprocess.CompletedProcess[str]:
        return self.cluster.kubectl(*args, namespace=self.name, **kwargs)

    def apply(self, manifest: dict[str, Any] | str, *args: str, check: bool = True,
              ) -> subprocess.CompletedProcess[str]:
        text = manifest if isinstance(manifest, str) else json.dumps(manifest)
        return self.kubectl("apply", "--server-side", "-f", "-", *args, input=text,
                            check=check)

    def get_json(self, *args: str) -> Any:
        return self.cluster.get_json(*args, namespace=self.name)


def wait_until(what: str, predicate: Any, timeout: float, interval: float = 0.2) -> Any:
    """Poll `predicate` until it returns a truthy value (returned), at most `timeout` s."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)


def _ready(env: dict[str, str]) -> bool:
    return subprocess.run(["kubectl", "--request-timeout=2s", "get", "--raw", "/readyz"],
                          capture_output=True, env=env, timeout=10).returncode == 0


@pytest.fixture(scope="session")
def cluster() -> Iterator[Cluster]:
    """The control plane, started once per run (and stopped when this run started it),
    with the CRD applied and Established."""
    state = Path(os.environ.get("KUBE_STATE", "/tmp/kube-test"))
    kubeconfig = state / "kubeconfig"
    env = {**os.environ, "KUBECONFIG": str(kubeconfig)}
    was_running = kubeconfig.exists() and _ready(env)
    if not was_running:
        proc = subprocess.run([str(KUBE_DIR / "up")], capture_output=True, text=True,
                              timeout=UP_TIMEOUT)
        if proc.returncode != 0:
            raise AssertionError(f"{KUBE_DIR}/up failed:\n{proc.stdout}{proc.stderr}")
        kubeconfig = Path(proc.stdout.strip().splitlines()[-1].split("=", 1)[1])
    found = Cluster(kubeconfig, state)
    try:
        found.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(CRD_FILE))
        # Polled, not `kubectl wait --for=condition=Established`: kubectl 1.32 fails at
        # once ("status.conditions accessor error") while a new CRD has no conditions yet.
        wait_until("the CRD to be Established", lambda: found.kubectl(
            "get", f"crd/{CRD_NAME}", "-o",
            'jsonpath={.status.conditions[?(@.type=="Established")].status}',
            check=False).stdout.strip() == "True", timeout=60)
        yield found
    finally:
        if not was_running:
            subprocess.run([str(KUBE_DIR / "down")], capture_output=True, timeout=60)


@pytest.fixture()
def namespace(cluster: Cluster) -> Iterator[Namespace]:
    """A fresh namespace for one test, deleted (without waiting) afterwards."""
    ns = Namespace(cluster, f"t-{uuid.uuid4().hex[:10]}")
    cluster.kubectl("create", "namespace", ns.name)
    # The ServiceAccount controller creates `default` shortly after the namespace; pods
    # are refused until it exists.
    wait_until("the default ServiceAccount", lambda: cluster.kubectl(
        "get", "serviceaccount", "default", namespace=ns.name, check=False).returncode == 0,
        timeout=30)
    try:
        yield ns
    finally:
        for cleanup in reversed(ns.cleanups):
            cleanup()
        cluster.kubectl("delete", "namespace", ns.name, "--wait=false", check=False)
