"""Authentication and roles on a parameter server's two channels (`auth`), against a
real in-process server on 127.0.0.1 that holds job A's keys.

What must hold: every gRPC method and every data-plane call is refused without
credentials, with a made-up key, and with the keys of another job (B), and the store
is unchanged after each refusal (same step, same parameters, still serving); a worker's
key cannot Init (restore), Finish, report or Shutdown; the health check needs no key; a
gRPC proof only opens its own method, only once, and only near its time; a flood of
bad handshakes is refused without holding the server; no key is ever logged.
"""

from __future__ import annotations

import logging
import os
import socket
import stat
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from pstrain_api import security
from pstrain_runtime.optim import OptimizerConfig
from pstrain_runtime.proto import ps_pb2 as pb
from pstrain_runtime.ps.server import SERVICE, PSServer
from pstrain_runtime.ps.store import PSError
from pstrain_runtime.replica import run_ps
from pstrain_runtime.sparse import protocol as sparse_protocol
from pstrain_runtime.transport import auth, dataplane, wire
from pstrain_runtime.worker.client import GrpcTransport, ShardedClient, TcpTransport
from pstrain_runtime.worker.placement import build_placement, param_specs

from tests.runtime.test_dataplane import ps_identity

pytestmark = pytest.mark.timeout(60)

FP = "12" * 32
NS = "ns"
SHAPES = {"w": (4,)}
JOB_A = security.new_token()
JOB_B = security.new_token()
CHIEF_A = auth.Credentials.from_token(JOB_A).only(security.KEY_CHIEF)
WORKER_A = auth.Credentials.from_token(JOB_A).only(security.KEY_WORKER).for_worker(1)
BAD: dict[str, auth.Credentials | None] = {
    "no-token": None,
    "made-up-key": auth.Credentials({security.KEY_CHIEF: os.urandom(32)}),
    "other-job-chief": auth.Credentials.from_token(JOB_B).only(security.KEY_CHIEF),
    "other-job-worker": auth.Credentials.from_token(JOB_B).only(security.KEY_WORKER),
}


@pytest.fixture
def server() -> Iterator[PSServer]:
    """Job A's server, initialised with w = [1, 2, 3, 4] at step 1 by A's chief."""
    ps = PSServer("127.0.0.1:0", credentials=auth.Credentials.from_token(JOB_A))
    ps.start()
    assert ps.data is not None and ps.data.guard is not None
    ps.data.guard.timeout_s = 1.0  # a silent client is dropped quickly in these tests
    chief = sharded(ps, CHIEF_A)
    chief.init({"w": torch.tensor([1.0, 2.0, 3.0, 4.0])}, OptimizerConfig(), mode="async",
               num_workers=2, staleness_bound=None, fingerprint=FP)
    chief.push({"w": torch.zeros(4)})
    chief.close()
    yield ps
    ps.stop(0)


def sharded(ps: PSServer, credentials: auth.Credentials | None,
            transport: type[GrpcTransport] = TcpTransport) -> ShardedClient:
    placement = build_placement(param_specs(SHAPES), 1)
    return ShardedClient([transport(ps.address, credentials)], placement, NS)


def state_of(ps: PSServer) -> tuple[int, list[float], bool, bool, bool, str, list[int]]:
    """(global step, w, serving, done, checkpoint asked for, reported loss), read with A's
    chief key."""
    client = sharded(ps, CHIEF_A)
    try:
        out = {"w": torch.empty(4)}
        step = client.pull(out)
        info = ps.store.info(NS, 0)
        loss = repr(ps.store.job_status(NS).loss)  # nan when none yet: compare as text
        return (step, out["w"].tolist(), not ps.wait(0), info.done,
                info.checkpoint_requested, loss, sorted(ps.store.namespace(NS).members.live))
    finally:
        client.close()


def push_frames(worker: int = 1) -> wire.FrameStream:
    header = pb.StreamHeader(kind=pb.STREAM_KIND_PUSH, namespace=NS, worker=worker,
                             tensors=[wire.meta_of("w", torch.ones(4))])
    return wire.StreamWriter().frames(header, [torch.ones(4)])


def init_frames() -> wire.FrameStream:
    header = pb.StreamHeader(kind=pb.STREAM_KIND_INIT, namespace=NS, mode="async",
                             num_workers=1, staleness_bound=-1,
                             fingerprint=bytes.fromhex(FP),
                             optimizer=pb.OptimizerSpec(name="sgd", learning_rate=0.1),
                             tensors=[wire.meta_of("w", torch.zeros(4))])
    return wire.StreamWriter().frames(header, [torch.full((4,), 9.0)])


def sparse_frames(op: str = "configure") -> list[bytes]:
    """A sparse call that would define a table (`configure`) or read one (`stats`)."""
    table = {"name": "t", "num_embeddings": 10, "embedding_dim": 2, "init_std": 0.1,
             "optimizer": {"name": "sgd", "learning_rate": 0.1}}
    return sparse_protocol.encode({"op": op, "namespace": NS, "reset": False, "num_ps": 1,
                                   "tables": [table]})


# Every call a transport makes, each with a request that would change or read state.
CALLS: dict[str, Callable[[GrpcTransport], object]] = {
    "Push": lambda t: t.push(push_frames()),
    "Init": lambda t: t.init(init_frames()),
    "Pull": lambda t: list(t.pull(pb.PullRequest(namespace=NS, names=["w"]))),
    "PushPull": lambda t: list(t.push_pull(push_frames())),
    "PushPullSmall": lambda t: t.push_pull_small(wire.encode_batch(push_frames())),
    "Info": lambda t: t.info(NS),
    "Finish": lambda t: t.finish(NS),
    "Shutdown": lambda t: t.shutdown(0.1),
    "ReportStatus": lambda t: t.report(pb.StatusReport(namespace=NS, loss=9.0)),
    "GetJobStatus": lambda t: t.channel.unary_unary(
        f"/{SERVICE}/GetJobStatus", pb.NamespaceRequest.SerializeToString,
        pb.JobStatus.FromString)(pb.NamespaceRequest(namespace=NS), timeout=5),
    "RequestCheckpoint": lambda t: t.channel.unary_unary(
        f"/{SERVICE}/RequestCheckpoint", pb.NamespaceRequest.SerializeToString,
        pb.StepInfo.FromString)(pb.NamespaceRequest(namespace=NS), timeout=5),
    "Sparse": lambda t: t.sparse(sparse_frames()),
    "SetWorkers": lambda t: t.channel.unary_unary(
        f"/{SERVICE}/SetWorkers", pb.WorkersRequest.SerializeToString,
        pb.StepInfo.FromString)(pb.WorkersRequest(namespace=NS, workers=[0]), timeout=5),
}
DATA_CALLS = ("Push", "Init", "Pull", "PushPull", "PushPullSmall", "Sparse")


def test_every_grpc_method_is_covered() -> None:
    from pstrain_runtime.ps.server import ParameterServerService, build_handler

    handler = build_handler(ParameterServerService(None, None, None))  # type: ignore[arg-type]
    names = {m.rsplit("/", 1)[-1] for m in handler._method_handlers}  # type: ignore[attr-defined]
    assert names == set(CALLS)


def _refusal(fn: Callable[[], object]) -> PSError:
    with pytest.raises((PSError, grpc.RpcError)) as caught:
        fn()
    exc = caught.value
    if isinstance(exc, grpc.RpcError):
        return PSError(exc.code().name, exc.details() or "")
    return exc


@pytest.mark.parametrize("who", list(BAD))
@pytest.mark.parametrize("call", list(CALLS))
def test_grpc_calls_without_this_jobs_key_are_refused_and_change_nothing(
        server: PSServer, call: str, who: str) -> None:
    before = state_of(server)
    transport = GrpcTransport(server.address, BAD[who])
    try:
        refusal = _refusal(lambda: CALLS[call](transport))
    finally:
        transport.close()
    assert refusal.code == "UNAUTHENTICATED", refusal.message
    assert "credentials" in refusal.message
    if call == "Shutdown":
        assert not server.wait(0.3), "a refused Shutdown stopped the server"
    assert state_of(server) == before


@pytest.mark.parametrize("who", [w for w in BAD if w != "no-token"])
@pytest.mark.parametrize("call", DATA_CALLS)
def test_data_plane_connections_without_this_jobs_key_are_refused(
        server: PSServer, call: str, who: str) -> None:
    before = state_of(server)
    transport = TcpTransport(server.address, BAD[who])
    transport._data_client = lambda: dataplane.DataClient(  # type: ignore[method-assign]
        server.address, "127.0.0.1", server.data_port, credentials=BAD[who])
    try:
        refusal = _refusal(lambda: CALLS[call](transport))
    finally:
        transport.close()
    assert refusal.code == "UNAUTHENTICATED", refusal.message
    assert state_of(server) == before


def _raw_call(op: int, frames: list[bytes]) -> bytes:
    """A data-plane call sent with no handshake, as an old or hostile client would; what
    the server sent back before it closed the connection."""
    link_bytes = bytearray((op,))
    for frame in frames:
        link_bytes += len(frame).to_bytes(4, "little") + frame
    link_bytes += dataplane.END.to_bytes(4, "little")
    return bytes(link_bytes)


@pytest.mark.parametrize("call", DATA_CALLS)
def test_data_plane_calls_without_a_handshake_are_refused(
        server: PSServer, call: str, caplog: pytest.LogCaptureFixture) -> None:
    before = state_of(server)
    op = {v: k for k, v in dataplane.OPS.items()}[call]
    frames = ([pb.PullRequest(namespace=NS, names=["w"]).SerializeToString()]
              if call == "Pull" else sparse_frames() if call == "Sparse" else
              [wire.encode_batch(push_frames())] if call == "PushPullSmall" else
              [bytes(f) for f in (init_frames() if call == "Init" else push_frames())])
    received = bytearray()
    with caplog.at_level(logging.WARNING, logger="pstrain_runtime.transport.auth"), \
            socket.create_connection(("127.0.0.1", server.data_port), timeout=5) as sock:
        sock.sendall(_raw_call(op, frames))
        try:
            while chunk := sock.recv(4096):  # the server closes: bounded by its timeouts
                received += chunk
        except ConnectionResetError:
            pass  # closed with our unread request in its buffer: a reset, not a FIN
    # The server's hello, at most its refusal byte, and never a reply frame.
    assert received[:4] in (auth.MAGIC, b"")
    assert len(received) <= 5 + auth.NONCE_BYTES
    assert state_of(server) == before
    assert any("data plane: refused" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("transport", [GrpcTransport, TcpTransport], ids=["grpc", "tcp"])
def test_a_worker_key_trains_but_cannot_init_finish_report_or_shut_down(
        server: PSServer, transport: type[GrpcTransport]) -> None:
    worker = sharded(server, WORKER_A, transport)
    try:
        out = {"w": torch.empty(4)}
        step = worker.pull(out, worker=1)
        replies = worker.push({"w": torch.ones(4)}, worker=1)
        assert replies[0].applied and replies[0].info.global_step == step + 1
        before = state_of(server)
        t = worker.transports[0]
        for call in ("Init", "Finish", "ReportStatus", "Shutdown", "SetWorkers"):
            refusal = _refusal(lambda call=call: CALLS[call](t))  # type: ignore[misc]
            assert refusal.code == "PERMISSION_DENIED", (call, refusal.message)
            assert f"{call} needs the chief's credentials" in refusal.message
        assert not server.wait(0.3)
        assert state_of(server) == before
        # The refused Init (data plane) was read and dropped: the connection still works.
        assert worker.push({"w": torch.ones(4)}, worker=1)[0].applied
    finally:
        worker.close()


@pytest.mark.parametrize("transport", [GrpcTransport, TcpTransport], ids=["grpc", "tcp"])
def test_a_worker_key_reads_sparse_tables_but_cannot_define_or_restore_them(
        server: PSServer, transport: type[GrpcTransport]) -> None:
    chief, worker = transport(server.address, CHIEF_A), transport(server.address, WORKER_A)
    try:
        sparse_protocol.header_of(chief.sparse(sparse_frames("configure")))
        stats = sparse_protocol.header_of(worker.sparse(sparse_frames("stats")))
        assert set(stats["tables"]) == {"t"}
        for op in ("configure", "import"):
            refusal = _refusal(lambda op=op: worker.sparse(sparse_frames(op)))  # type: ignore[misc]
            assert refusal.code == "PERMISSION_DENIED", (op, refusal.message)
            assert f"sparse {op} needs the chief's credentials" in refusal.message
        assert sparse_protocol.header_of(worker.sparse(sparse_frames("stats"))) == stats
    finally:
        chief.close()
        worker.close()


def test_the_chief_key_may_shut_down(server: PSServer) -> None:
    chief = sharded(server, CHIEF_A, GrpcTransport)
    chief.shutdown(grace=0.1)
    chief.close()
    assert server.wait(10)


def test_the_health_check_needs_no_key(server: PSServer) -> None:
    with grpc.insecure_channel(server.address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(),
                                                          timeout=5)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


# ---------------------------------------------------------------------- gRPC proofs


def test_a_grpc_proof_opens_one_method_once_near_its_time() -> None:
    now = [1_000_000.0]
    guard = auth.ServerGuard(auth.Credentials.from_token(JOB_A), window_s=60,
                             clock=lambda: now[0])
    pull, shutdown = f"/{SERVICE}/Pull", f"/{SERVICE}/Shutdown"
    proof = auth.grpc_proof(CHIEF_A, pull, now=now[0])
    guard.check(pull, [(auth.METADATA_KEY, proof)])

    def refused(method: str, value: str) -> str:
        with pytest.raises(auth.AuthError) as caught:
            guard.check(method, [(auth.METADATA_KEY, value)])
        return caught.value.message

    assert "used before" in refused(pull, proof)
    assert "not valid" in refused(shutdown, auth.grpc_proof(CHIEF_A, pull, now=now[0]))
    assert "too old" in refused(pull, auth.grpc_proof(CHIEF_A, pull, now=now[0] - 61))
    assert "too old" in refused(pull, auth.grpc_proof(CHIEF_A, pull, now=now[0] + 61))
    assert "malformed" in refused(pull, "chief 1 2")
    assert "malformed" in refused(pull, "root 1 2 3")
    role, stamp, nonce, mac = auth.grpc_proof(WORKER_A, pull, now=now[0]).split()
    assert "malformed" in refused(pull, f"root {stamp} {nonce} {mac}")
    assert "not valid" in refused(pull, f"chief {stamp} {nonce} {mac}")  # role is bound
    assert "not valid" in refused(pull, f"worker-2 {stamp} {nonce} {mac}")  # so is the index


# ---------------------------------------------------------------------- flood


def test_a_flood_of_bad_handshakes_is_refused_while_the_job_keeps_working(
        server: PSServer) -> None:
    """Outsiders open connections and send garbage (bounded: 300 attempts) while a
    worker keeps pushing; every worker call succeeds and every outsider is refused."""
    stop = threading.Event()
    refused = [0]

    def outsider() -> None:
        for _ in range(100):
            if stop.is_set():
                return
            try:
                with socket.create_connection(("127.0.0.1", server.data_port),
                                              timeout=5) as sock:
                    sock.sendall(b"\x01" + os.urandom(32))
                    data = b""
                    while chunk := sock.recv(64):
                        data += chunk
                    if data[:4] == auth.MAGIC and data.endswith(auth.REFUSED):
                        refused[0] += 1
            except OSError:
                refused[0] += 1  # reset by the server's close

    threads = [threading.Thread(target=outsider, daemon=True) for _ in range(3)]
    for t in threads:
        t.start()
    worker = sharded(server, WORKER_A)
    try:
        deadline = time.monotonic() + 30
        while any(t.is_alive() for t in threads) and time.monotonic() < deadline:
            assert worker.push({"w": torch.ones(4)}, worker=1)[0].applied
    finally:
        stop.set()
        for t in threads:
            t.join(10)
        worker.close()
    assert refused[0] == 300
    assert server.data is not None and server.data.guard is not None
    assert server.data.guard.refusals.count >= 300


def test_connections_over_the_handshake_limit_are_closed_at_once() -> None:
    guard = auth.ConnectionGuard(auth.Credentials.from_token(JOB_A), max_pending=2)
    assert guard.may_start("a") and guard.may_start("b")
    assert not guard.may_start("c")
    assert guard.refusals.count == 1


# ---------------------------------------------------------------------- keys


def test_key_files_are_private_and_keys_never_printed(tmp_path: Path) -> None:
    keys = auth.Credentials.from_token(JOB_A)
    directory = auth.write_credentials(tmp_path / "auth", keys)
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    for role in security.KEY_ROLES:
        assert stat.S_IMODE((directory / role).stat().st_mode) == 0o600
    loaded = auth.load_credentials({security.ENV_AUTH_DIR: str(directory)})
    assert loaded == keys
    assert all(key.hex() not in repr(loaded) for key in keys.keys.values())
    assert auth.load_credentials({}) is None


def test_worker_key_does_not_yield_the_chief_key() -> None:
    keys = security.derive_keys(JOB_A)
    assert keys[security.KEY_CHIEF] != keys[security.KEY_WORKER] != JOB_A
    assert security.derive_keys(JOB_A) == keys  # deterministic
    assert security.derive_keys(JOB_B)[security.KEY_CHIEF] != keys[security.KEY_CHIEF]


@pytest.mark.parametrize(("files", "message"), [
    ({}, "holds no key file"),
    ({"chief": "zz"}, "does not hold a hex key"),
    ({"chief": "ab" * 8}, "holds a key of 8 bytes; it must have at least 32"),
])
def test_unreadable_key_files_are_named(tmp_path: Path, files: dict[str, str],
                                        message: str) -> None:
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    with pytest.raises(ValueError, match=message) as caught:
        auth.load_credentials({security.ENV_AUTH_DIR: str(tmp_path)})
    assert "ab" * 8 not in str(caught.value)


# ---------------------------------------------------------------------- replicas


@pytest.mark.parametrize("role", ["chief", "worker"])
def test_a_parameter_server_without_both_keys_does_not_start(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], role: str) -> None:
    directory = auth.write_credentials(tmp_path, auth.Credentials.from_token(JOB_A).only(role))
    assert run_ps(ps_identity(), {security.ENV_AUTH_DIR: str(directory)}) == 2
    err = capsys.readouterr().err
    assert "a parameter server needs every role key (chief, worker) in PSTRAIN_AUTH_DIR" in err


def test_the_chief_key_sets_the_worker_set(server: PSServer) -> None:
    """Elastic workers over gRPC (status_client.set_workers): the chief's key changes the
    live set; a worker's key may not (test above)."""
    from pstrain_runtime.status_client import set_workers

    assert set_workers(server.address, 5, NS, [0, 1, 2], credentials=CHIEF_A) == 1
    assert server.store.namespace(NS).members.live == {0, 1, 2}
    assert set_workers(server.address, 5, NS, [], credentials=CHIEF_A) is None  # refused
    assert server.store.namespace(NS).members.live == {0, 1, 2}
