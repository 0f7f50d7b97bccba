"""A fake node for the one-machine end-to-end test: it plays kubelet for the pods the
operator creates in the emulated API server.

For each new pod it runs the main container's command as a local process with the
container's environment, reachable at the address the cluster spec gives: every pod
DNS name is mapped to its own loopback address (127.0.0.x) in /etc/hosts, and parameter
servers bind to `PSTRAIN_BIND_ADDRESS=127.0.0.x:2222` (and their data plane to the
PSTRAIN_DATA_PORT the pod sets, 2223, on the same 127.0.0.x). It reports pod phases, the
readiness of the gRPC health probe and exit codes back through the API, records the data
port each Ready parameter server announces in its Info reply, and stops the process of
a pod the operator deletes. Secret volumes of the main container are written to a
private directory per pod (only the items the volume names, as kubelet does), and an
environment value naming a mount path is pointed at that directory. Everything it changes on the machine is
restored on exit.
"""

from __future__ import annotations

import base64
import contextlib
import os
import shutil
import signal
import subprocess
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pstrain_api import constants as c
from pstrain_api import security
from pstrain_runtime.proto import ps_pb2, ps_pb2_grpc
from pstrain_runtime.transport import auth

from .emulator import HttpApi, pod_status

HOSTS = Path("/etc/hosts")
BEGIN = "# pstrain-operator-e2e BEGIN {tag}"
END = "# pstrain-operator-e2e END {tag}"
POLL_S = 0.2
PROBE_TIMEOUT_S = 0.5


def hosts_writable() -> bool:
    return os.geteuid() == 0 and os.access(HOSTS, os.W_OK)


@contextlib.contextmanager
def hosts_entries(mapping: Mapping[str, str], tag: str) -> Iterator[None]:
    """Add `name -> ip` lines to /etc/hosts for the duration; removes exactly them."""
    begin, end = BEGIN.format(tag=tag), END.format(tag=tag)
    block = "\n".join([begin, *(f"{ip} {name}" for name, ip in mapping.items()), end])
    original = HOSTS.read_text()
    HOSTS.write_text(original.rstrip("\n") + "\n" + block + "\n")
    try:
        yield
    finally:
        lines = HOSTS.read_text().splitlines()
        out, skipping = [], False
        for line in lines:
            if line == begin:
                skipping = True
            elif line == end:
                skipping = False
            elif not skipping:
                out.append(line)
        HOSTS.write_text("\n".join(out) + "\n")


@dataclass
class Replica:
    uid: str
    proc: subprocess.Popen[bytes]
    address: str
    is_ps: bool
    credentials: auth.Credentials | None = None
    ready: bool = False
    reported_exit: bool = False


class FakeNode:
    def __init__(self, api: HttpApi, namespace: str, addresses: Mapping[str, str],
                 log_dir: Path, extra_env: Mapping[str, str] | None = None):
        self.api = api
        self.namespace = namespace
        self.addresses = dict(addresses)  # pod name -> loopback ip
        self.log_dir = log_dir
        self.extra_env = dict(extra_env or {})
        self.replicas: dict[str, Replica] = {}
        self.started: list[str] = []
        self.exits: dict[str, int] = {}
        self.data_ports: dict[str, int] = {}  # PS pod name -> data port its Info announced
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> FakeNode:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
        for name in list(self.replicas):
            self._stop_process(name)

    def _loop(self) -> None:
        while not self._stop.wait(POLL_S):
            try:
                self._tick()
            except OSError as exc:  # the API went away at teardown, or a transient error
                self.errors.append(repr(exc))

    def _tick(self) -> None:
        pods = self.api.pods(self.namespace)
        for name in list(self.replicas):
            pod = pods.get(name)
            if pod is None or pod["metadata"].get("uid") != self.replicas[name].uid:
                self._stop_process(name)  # deleted (maybe already recreated)
        for name, pod in pods.items():
            phase = (pod.get("status") or {}).get("phase", "Pending")
            if name not in self.replicas and phase == "Pending":
                self._start(name, pod)
        for name, rep in list(self.replicas.items()):
            code = rep.proc.poll()
            if code is not None:
                if not rep.reported_exit:
                    rep.reported_exit = True
                    self.exits[name] = code
                    self.api.set_pod_status(self.namespace, name, pod_status(
                        "Succeeded" if code == 0 else "Failed", exit_code=code))
            elif rep.is_ps and not rep.ready and self._serving(rep.address):
                rep.ready = True
                self.data_ports[name] = self._data_port(rep.address, rep.credentials)
                self.api.set_pod_status(self.namespace, name, pod_status("Running", True))

    def _start(self, name: str, pod: dict[str, Any]) -> None:
        container = pod["spec"]["containers"][0]
        ip = self.addresses[name]
        env = {k: v for k, v in os.environ.items() if not k.startswith("PSTRAIN_")}
        env.update({e["name"]: e.get("value", "") for e in container.get("env", [])})
        env.update(self.extra_env)
        mounts = self._mount_secrets(name, pod, container)
        env = {k: mounts.get(v, v) for k, v in env.items()}
        is_ps = pod["metadata"]["labels"][c.LABEL_ROLE] == c.ROLE_PS
        address = f"{ip}:{c.REPLICA_PORT}"
        env["PSTRAIN_BIND_ADDRESS"] = address
        command = [*container["command"], *container.get("args", [])]
        exe = shutil.which(command[0])
        if exe is None:
            raise FileNotFoundError(f"pod {name}: command {command[0]!r} is not on PATH")
        log = open(self.log_dir / f"{name}.log", "ab")  # noqa: SIM115
        proc = subprocess.Popen([exe, *command[1:]], env=env, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        self.replicas[name] = Replica(pod["metadata"].get("uid", ""), proc, address, is_ps,
                                      auth.load_credentials(env))
        self.started.append(name)
        self.api.set_pod_status(self.namespace, name, pod_status("Running", ready=not is_ps))

    def _mount_secrets(self, name: str, pod: dict[str, Any],
                       container: dict[str, Any]) -> dict[str, str]:
        """Write the Secret volumes `container` mounts; mount path -> local directory."""
        volumes = {v["name"]: v for v in pod["spec"].get("volumes", [])}
        out: dict[str, str] = {}
        for mount in container.get("volumeMounts", []):
            source = volumes.get(mount["name"], {}).get("secret")
            if source is None:
                continue
            secret = self.api.request(
                "GET", f"/api/v1/namespaces/{self.namespace}/secrets/{source['secretName']}")
            assert secret is not None, f"pod {name} mounts a missing Secret"
            directory = self.log_dir / "volumes" / name / mount["name"]
            directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            for item in source.get("items") or [{"key": k, "path": k} for k in secret["data"]]:
                (directory / item["path"]).write_bytes(base64.b64decode(secret["data"][item["key"]]))
            out[mount["mountPath"]] = str(directory)
        return out

    def _serving(self, address: str) -> bool:
        """The pod's readiness probe: grpc.health.v1 Check on the replica port."""
        with grpc.insecure_channel(address) as channel:
            try:
                reply = health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(service=""), timeout=PROBE_TIMEOUT_S)
            except grpc.RpcError:
                return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    def _data_port(self, address: str, credentials: auth.Credentials | None) -> int:
        """The data port a serving parameter server announces (Info of a namespace no job
        uses, which changes nothing on the server), asked with the worker key the
        server's pod holds."""
        worker = credentials.only(security.KEY_WORKER) if credentials else None
        with auth.client_channel(address, worker) as channel:
            reply = ps_pb2_grpc.ParameterServerStub(channel).Info(
                ps_pb2.NamespaceRequest(namespace="fake-node-probe"), timeout=5)
        return int(reply.data_port)

    def _stop_process(self, name: str) -> None:
        rep = self.replicas.pop(name)
        if rep.proc.poll() is None:
            os.killpg(rep.proc.pid, signal.SIGTERM)
            try:
                rep.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(rep.proc.pid, signal.SIGKILL)
                rep.proc.wait(timeout=10)
        self.exits.setdefault(name, rep.proc.returncode)
