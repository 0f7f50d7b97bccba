"""The end-to-end harness on the real API server: `kubelet.py` (../shared/k8s) as the
node, the real `pstrain operator` watching a pool of test namespaces, and a pod watch
that records the order in which pods appear, run and stop.

`kubelet.py` runs every pod as a local process in the host's network namespace, where
a server that binds 0.0.0.0 (what a parameter server does in a pod, whose network
namespace is its own) would collide with the next one. A shim `pstrain` first on the
kubelet's PATH plays the pod's network namespace: it binds a parameter server (and
the replica's /metrics) to its pod IP (`$KUBELET_POD_IP`, PSTRAIN_BIND_ADDRESS) and
keeps each replica to one CPU thread, then runs the real `pstrain`; shims `python` and
`python3` do the same for a pod's own program (a socket bound to 0.0.0.0 binds the pod
IP). Nothing else differs from a cluster: the pods are the operator's, unchanged.

kubelet.py runs the pods of every namespace (its --namespace takes one): the module
that starts it should be the only one with pods then (the test run's modules run one
after the other).

Only one kubelet.py may run on a machine (it owns a block of /etc/hosts and the Node
`local-node`); `Kubelet.start` refuses to start a second one.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pstrain_api import constants as c
from pstrain_runtime.replica import ENV_NUM_THREADS

from .conftest import KUBE_DIR, Cluster, wait_until

# The images of tests/kube/node-values.yaml, as the Dockerfile's entrypoints run them.
IMAGE_MAP = {"pstrain-operator:dev": ["pstrain", "operator"],
             "pstrain-runtime:dev": ["pstrain", "replica"]}
HOSTS_BLOCK = "# BEGIN process-kubelet"
NODE = "local-node"
STOP_TIMEOUT_S = 30


def _other_kubelet() -> int | None:
    """The pid of a kubelet.py already running on this machine, if any."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(a.endswith(b"kubelet.py") for a in argv[:3]) and int(proc.name) != os.getpid():
            return int(proc.name)
    return None


def write_shim(directory: Path) -> Path:
    """The `pstrain` the kubelet's pods run (see the module docstring)."""
    directory.mkdir(parents=True, exist_ok=True)
    shim = directory / "pstrain"
    shim.write_text(f"""#!{sys.executable}
# kubelet.py runs pods in the host's network namespace: a server of a pod binds the
# pod's own IP, as 0.0.0.0 would in the pod's network namespace.
import os, sys
# Before anything imports torch: OpenMP reads its thread count once, when torch loads.
for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "{ENV_NUM_THREADS}"):
    os.environ.setdefault(name, "1")
ip = os.environ.get("KUBELET_POD_IP")
if ip:
    os.environ.setdefault("PSTRAIN_BIND_ADDRESS", ip + ":{c.REPLICA_PORT}")
    import pstrain_runtime.metrics as metrics
    serve = metrics.start_http_server
    metrics.start_http_server = lambda port, addr="", **kw: serve(port, addr=ip, **kw)
from pstrain_api.cli import main
sys.exit(main())
""")
    shim.chmod(0o755)
    write_python_shim(directory)
    return shim


SITECUSTOMIZE = """# kubelet.py runs pods in the host's network namespace: 0.0.0.0 in a pod is the
# pod's own IP.
import os
import socket

_ip = os.environ.get("KUBELET_POD_IP")
if _ip:
    _bind = socket.socket.bind

    def _pod_bind(self, address):
        if (self.family == socket.AF_INET and isinstance(address, tuple)
                and address[0] in ("", "0.0.0.0")):
            address = (_ip, *address[1:])
        return _bind(self, address)

    socket.socket.bind = _pod_bind
"""


def write_python_shim(directory: Path) -> None:
    """`python` and `python3` for the pods' own programs (a container whose command is
    `python -m ...`, as examples/tf-config-program.yaml's): this Python with a
    sitecustomize that binds a socket asked for 0.0.0.0 (every interface: the pod's
    own, in a pod) to the pod's IP instead."""
    site = directory / "site"
    site.mkdir(parents=True, exist_ok=True)
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    for name in ("python", "python3"):
        shim = directory / name
        shim.write_text(f"""#!/bin/sh
PYTHONPATH="{site}${{PYTHONPATH:+:$PYTHONPATH}}" exec {sys.executable} "$@"
""")
        shim.chmod(0o755)


class Kubelet:
    """`kubelet.py` as a subprocess: every pod of the control plane runs here."""

    def __init__(self, cluster: Cluster, work: Path, image_map: dict[str, Any] | None = None,
                 namespace: str | None = None):
        """`image_map`: image -> command for containers without one (kubelet.py's
        --image-map, e.g. the chart's operator image -> ["pstrain", "operator"]);
        `namespace`: run only that namespace's pods."""
        self.cluster = cluster
        self.work = work
        self.image_map = image_map
        self.namespace = namespace
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = work / "kubelet.log"

    def start(self) -> None:
        other = _other_kubelet()
        if other is not None:
            raise AssertionError(f"another kubelet.py runs already (pid {other}); only one "
                                 "may run on a machine")
        shim_dir = self.work / "bin"
        write_shim(shim_dir)
        env = {**os.environ, "KUBECONFIG": str(self.cluster.kubeconfig),
               "PATH": f"{shim_dir}:{os.environ.get('PATH', '')}"}
        argv = [sys.executable, str(KUBE_DIR / "kubelet.py"),
                "--kubeconfig", str(self.cluster.kubeconfig)]
        if self.image_map is not None:
            images = self.work / "images.json"
            images.write_text(json.dumps(self.image_map))
            argv += ["--image-map", str(images)]
        if self.namespace:
            argv += ["--namespace", self.namespace]
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                argv,
                env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

        def running() -> bool:
            # Its own line, not the Node's Ready condition (a stopped kubelet's Node keeps
            # its last heartbeat for a while).
            if self.proc is not None and self.proc.poll() is not None:
                raise AssertionError(f"kubelet.py exited with {self.proc.returncode}:\n"
                                     + self.tail())
            return f"process-kubelet running as node {NODE}" in self.tail(200)

        wait_until("kubelet.py to run", running, timeout=60, interval=0.2)

    def stop(self) -> None:
        """SIGTERM: the kubelet kills its pods and removes its /etc/hosts block."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)
        if HOSTS_BLOCK in Path("/etc/hosts").read_text():
            _remove_hosts_block()

    def tail(self, lines: int = 40) -> str:
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return "\n".join(text.splitlines()[-lines:])


def _remove_hosts_block() -> None:
    """The kubelet's /etc/hosts block, after a kubelet that could not remove it."""
    out, skipping = [], False
    for line in Path("/etc/hosts").read_text().splitlines():
        if line.startswith("# BEGIN process-kubelet"):
            skipping = True
        elif line.startswith("# END process-kubelet"):
            skipping = False
        elif not skipping:
            out.append(line)
    Path("/etc/hosts").write_text("\n".join(out) + "\n")


def pod_dir(namespace: str, pod: str) -> Path:
    """Where kubelet.py keeps a pod's logs and termination-message files."""
    return Path("/tmp/process-kubelet") / namespace / pod


def pod_log(namespace: str, pod: str, container: str = "pstrain") -> str:
    path = pod_dir(namespace, pod) / f"{container}.log"
    return path.read_text(errors="replace") if path.exists() else ""


@dataclass
class PodRecord:
    """When (in watch order) a pod was first seen, first Running, first stopped."""

    created: int | None = None
    running: int | None = None
    stopped: int | None = None  # Succeeded, Failed, terminating or deleted
    final_phase: str = ""
    uids: list[str] = field(default_factory=list)


class PodWatch:
    """A watch on one namespace's pods, from before the job exists; each change gets
    a sequence number, so the order of creations, starts and stops can be checked."""

    def __init__(self, cluster: Cluster, namespace: str):
        from kubernetes import client, config

        self.core = client.CoreV1Api(config.new_client_from_config(str(cluster.kubeconfig)))
        self.namespace = namespace
        self.pods: dict[str, PodRecord] = {}
        self.seq = 0
        self.lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.error: BaseException | None = None
        self._version = ""

    def __enter__(self) -> PodWatch:
        # List first, then watch from the list's version: nothing that happens after
        # __enter__ returns is missed or reordered, however late the watch connects.
        listed = self.core.list_namespaced_pod(self.namespace, _request_timeout=30)
        for pod in listed.items:
            self._record("ADDED", pod)
        self._version = listed.metadata.resource_version
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        from kubernetes import watch

        version = self._version
        while not self._stop.is_set():
            w = watch.Watch()
            try:
                for event in w.stream(self.core.list_namespaced_pod, self.namespace,
                                      resource_version=version, timeout_seconds=2,
                                      allow_watch_bookmarks=False):
                    pod = event["object"]
                    version = pod.metadata.resource_version
                    self._record(event["type"], pod)
                    if self._stop.is_set():
                        break
            except Exception as exc:  # noqa: BLE001 - a 410 Gone: list and watch again
                if "410" in str(exc):
                    version = ""  # a watch without a version lists what exists first
                    continue
                self.error = exc
                time.sleep(0.2)
            finally:
                w.stop()

    def _record(self, kind: str, pod: Any) -> None:
        with self.lock:
            self.seq += 1
            rec = self.pods.setdefault(pod.metadata.name, PodRecord())
            if pod.metadata.uid not in rec.uids:
                rec.uids.append(pod.metadata.uid)
            if rec.created is None:
                rec.created = self.seq
            phase = pod.status.phase if pod.status else ""
            if phase == "Running" and rec.running is None:
                rec.running = self.seq
            stopped = (kind == "DELETED" or pod.metadata.deletion_timestamp is not None
                       or phase in ("Succeeded", "Failed"))
            if stopped and rec.stopped is None and rec.created is not None:
                rec.stopped = self.seq
            if phase:
                rec.final_phase = "Deleted" if kind == "DELETED" else phase

    def record(self, name: str) -> PodRecord:
        with self.lock:
            return self.pods.get(name) or PodRecord()


@dataclass
class Pool:
    """Namespaces made before the operator starts (it serves exactly these)."""

    cluster: Cluster
    names: list[str]
    free: list[str] = field(default_factory=list)

    def take(self) -> str:
        if not self.free:
            raise AssertionError("the e2e namespace pool is exhausted: add to POOL_SIZE")
        return self.free.pop(0)


def main() -> int:
    """`python -m tests.kube.node` (as root, KUBECONFIG set): kubelet.py as the node of the
    test control plane, with IMAGE_MAP and the `pstrain` shim, until Ctrl-C."""
    kubeconfig = os.environ.get("KUBECONFIG")
    if not kubeconfig:
        print("set KUBECONFIG first: export $(../shared/k8s/up | tail -1)", file=sys.stderr)
        return 2
    import tempfile

    work = Path(tempfile.mkdtemp(prefix="pstrain-node-"))
    kubelet = Kubelet(Cluster(Path(kubeconfig), Path(kubeconfig).parent), work, IMAGE_MAP)
    kubelet.start()
    print(f"kubelet.py runs the pods of {kubeconfig} (log: {kubelet.log}); Ctrl-C stops it",
          flush=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        while not stop.wait(1.0):
            if kubelet.proc is not None and kubelet.proc.poll() is not None:
                print(kubelet.tail(), file=sys.stderr)
                return 1
    finally:
        kubelet.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
