"""A local run is authenticated: `pstrain run` makes a token per run, each replica gets
a private key directory with only its role's keys, and the digits job still trains to
its usual accuracy while an outsider floods its parameter server's two ports with bad
handshakes and unauthenticated calls (bounded: a fixed number of attempts, loopback).
Nothing that looks like a key appears in the run's output or its --json summary."""

from __future__ import annotations

import os
import re
import socket
import stat
import threading
import time
from pathlib import Path

import grpc
import pytest

from pstrain_api import security
from pstrain_runtime.local.keys import LocalKeys
from pstrain_runtime.ps.store import PSError
from pstrain_runtime.transport import auth
from pstrain_runtime.worker.client import GrpcTransport

from .local_builders import make_job
from .test_local_e2e import DIGITS, RUN_LIMIT, Run
from .test_local_processes import fake  # noqa: F401 - the fixture

pytestmark = pytest.mark.timeout(RUN_LIMIT + 60)

HEX_KEY = re.compile(r"[0-9a-fA-F]{64}")
FLOOD_ROUNDS = 400  # per port: bounded whatever the run does


def test_each_replica_gets_only_its_own_keys_in_a_private_directory(tmp_path: Path) -> None:
    token = security.new_token()
    keys = LocalKeys("j", token, temp_dir=str(tmp_path))
    every = security.derive_keys(token)
    own_2 = security.own_worker_key(every[security.KEY_WORKER], 2)
    expected = {("j-ps-0", "ps", 0): every, ("j-chief-0", "chief", 0):
                {"chief": every["chief"]}, ("j-worker-1", "worker", 2): {"worker-2": own_2}}
    for (name, holder, index), want in expected.items():
        directory = keys.directory(name, holder, index)
        assert directory.parent == keys.root and directory.name == name
        assert stat.S_IMODE(directory.stat().st_mode) == 0o700
        assert sorted(p.name for p in directory.iterdir()) == sorted(want)
        assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in directory.iterdir())
        loaded = auth.load_credentials({security.ENV_AUTH_DIR: str(directory)})
        assert loaded is not None and dict(loaded.keys) == want
    assert stat.S_IMODE(keys.root.stat().st_mode) == 0o700
    keys.remove()
    assert not keys.root.exists()


@pytest.mark.parametrize(("role", "is_chief", "holder"), [
    ("ps", False, "ps"), ("chief", True, "chief"), ("worker", True, "chief"),
    ("worker", False, "worker"),
])
def test_the_chief_is_whoever_the_cluster_spec_makes_chief(role: str, is_chief: bool,
                                                           holder: str) -> None:
    assert security.key_holder(role, is_chief) == holder


def listening_ports(pid: int) -> set[int]:
    """The TCP ports process `pid` listens on (Linux /proc; no extra dependency)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    ports = set()
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # LISTEN
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


class Outsider:
    """Floods a replica's ports: raw connections with a made-up handshake, and gRPC
    calls with a made-up key. Counts what happened; never more than FLOOD_ROUNDS each."""

    def __init__(self) -> None:
        self.stop = threading.Event()
        self.attempts = 0
        self.admitted = 0  # connections that got past the handshake: must stay 0
        self.grpc_codes: set[str] = set()
        self.thread: threading.Thread | None = None

    def start(self, pid: int) -> None:
        self.thread = threading.Thread(target=self._run, args=(pid,), daemon=True)
        self.thread.start()

    def _run(self, pid: int) -> None:
        deadline = time.monotonic() + 30
        ports: set[int] = set()
        while len(ports) < 2 and time.monotonic() < deadline and not self.stop.is_set():
            try:
                ports = listening_ports(pid)
            except OSError:
                return  # the process is gone
            self.stop.wait(0.05)
        made_up = auth.Credentials({security.KEY_CHIEF: os.urandom(32)})
        transports = [GrpcTransport(f"127.0.0.1:{p}", made_up) for p in ports]
        try:
            for _ in range(FLOOD_ROUNDS):
                if self.stop.is_set():
                    return
                for port, transport in zip(sorted(ports), transports):
                    self._handshake(port)
                    try:
                        transport.info("default/digits")
                    except PSError as exc:
                        self.grpc_codes.add(exc.code)
        finally:
            for t in transports:
                t.close()

    def _handshake(self, port: int) -> None:
        self.attempts += 1
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=2) as sock:
                sock.sendall(b"\x01" + os.urandom(32))
                data = b""
                while chunk := sock.recv(64):
                    data += chunk
                if data[:4] == auth.MAGIC and data.endswith(auth.ACCEPTED):
                    self.admitted += 1
        except OSError:
            pass  # reset, refused, or not our protocol: not admitted


def test_digits_trains_while_an_outsider_floods_the_parameter_server() -> None:
    outsider = Outsider()

    def on_line(run: Run, line: str) -> None:
        if outsider.thread is None and "digits-ps-0" in run.pids:
            outsider.start(run.pids["digits-ps-0"])

    try:
        run = Run(DIGITS, on_line=on_line)
    finally:
        outsider.stop.set()
        if outsider.thread is not None:
            outsider.thread.join(30)
    s = run.summary
    assert s["phase"] == "Succeeded" and s["accuracy"] >= 0.95, s
    assert s["restarts"] == 0
    assert outsider.attempts >= 20, "the flood must have reached the server"
    assert outsider.admitted == 0
    assert outsider.grpc_codes <= {"UNAUTHENTICATED", "UNAVAILABLE"}
    assert "UNAUTHENTICATED" in outsider.grpc_codes
    for text in [*run.lines, str(s)]:
        assert not HEX_KEY.search(text), f"a key-like string in the output: {text[:80]}"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("authentication", [True, False])
def test_the_runner_gives_each_replica_only_its_keys(fake, authentication: bool) -> None:
    builder = make_job("j").set("spec.security", {"authentication": authentication})
    builder.set("spec.security.tls", {"secretName": "cert"})
    result, lines, starts = fake(builder, {})
    assert result.exit_code == 0
    assert any("spec.security.tls names a Kubernetes Secret; pstrain run cannot read it"
               in line for line in lines)
    got = {s["name"]: s.get("auth") for s in starts}
    dirs = [record["dir"] for record in filter(None, got.values())]
    assert len(set(dirs)) == len(dirs), "replicas share a key directory"
    for record in filter(None, got.values()):
        assert not os.path.exists(record.pop("dir")), "the run's keys outlive it"
    if not authentication:
        assert got == {"j-ps-0": None, "j-worker-0": None, "j-worker-1": None}
        return
    assert got == {
        "j-ps-0": {"mode": "0o700", "keys": ["chief", "worker"]},
        "j-worker-0": {"mode": "0o700", "keys": ["chief"]},  # worker 0 is the chief
        "j-worker-1": {"mode": "0o700", "keys": ["worker-1"]},  # its own key only
    }
