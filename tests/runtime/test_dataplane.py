"""The plain-TCP data plane (`dataplane`, `client.TcpTransport`) against real
in-process parameter servers on 127.0.0.1.

What must hold: the tensor calls give the same bytes over TCP as over gRPC; a refused
call raises the server's PSError and keeps its pooled connection; a broken frame or an
unknown op closes only its own connection; a server without a data plane is spoken to
over gRPC; a restarted server's new data port is found again; one transport serves
many threads; stopping the data plane fails calls instead of hanging them.
"""

from __future__ import annotations

import concurrent.futures as cf
import socket
import struct
import time
from collections.abc import Callable, Iterator, Mapping

import pytest
import torch
from pstrain_api.cluster import Task, local_cluster_spec, parse_cluster_env
from pstrain_api.model import TrainingJob
from pstrain_runtime.local.processes import find_free_ports
from pstrain_runtime.optim import SLOT_NAMES, OptimizerConfig
from pstrain_runtime.proto import ps_pb2 as pb
from pstrain_runtime.ps.server import PSServer
from pstrain_runtime.ps.store import ParameterStore, PSError
from pstrain_runtime.replica import run_ps
from pstrain_runtime.transport import dataplane, wire
from pstrain_runtime.worker.client import (
    GrpcTransport,
    ShardedClient,
    TcpTransport,
    Transport,
    connect,
)
from pstrain_runtime.worker.placement import build_placement, param_specs

from tests.api.job_builder import job

FP = "12" * 32
NS = "ns"
WAIT_S = 15.0  # upper bound on anything that should take milliseconds
BIG = (1280, 1024)  # 5 MiB of float32: a stream of three 2 MiB chunks

Shapes = Mapping[str, tuple[int, ...]]


# ---------------------------------------------------------------------- fixtures


@pytest.fixture
def start_server() -> Iterator[Callable[..., PSServer]]:
    """Start a PSServer on 127.0.0.1 (`port` 0: any; `data_port` None: no data plane);
    every server started is stopped at the end."""
    started: list[PSServer] = []

    def start(port: int = 0, data_port: int | None = 0, ps_index: int = 0) -> PSServer:
        server = PSServer(f"127.0.0.1:{port}", ps_index=ps_index, data_port=data_port)
        server.start()
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop(0)


@pytest.fixture
def open_transport() -> Iterator[Callable[..., Transport]]:
    opened: list[Transport] = []

    def open_(address: str, kind: str = "tcp") -> Transport:
        transport = connect(address, kind)
        opened.append(transport)
        return transport

    yield open_
    for transport in opened:
        transport.close()


# ---------------------------------------------------------------------- helpers


def sharded(transports: list[Transport], shapes: Shapes,
            partition_bytes: int | None = None) -> ShardedClient:
    placement = build_placement(param_specs(shapes), len(transports), partition_bytes)
    return ShardedClient(transports, placement, NS)


def randn(shapes: Shapes, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=gen) for name, shape in shapes.items()}


def zeros(shapes: Shapes) -> dict[str, torch.Tensor]:
    return {name: torch.zeros(shape) for name, shape in shapes.items()}


def init(client: ShardedClient, params: Mapping[str, torch.Tensor],
         optimizer: OptimizerConfig | None = None, mode: str = "async",
         num_workers: int = 1, fingerprint: str = FP) -> list[pb.StepInfo]:
    return client.init(params, optimizer or OptimizerConfig(name="sgd", learning_rate=1.0),
                       mode=mode, num_workers=num_workers, staleness_bound=None,
                       fingerprint=fingerprint)


def push_frames(tensors: Mapping[str, torch.Tensor], namespace: str = NS, worker: int = 0,
                step: int = 0) -> list[bytes]:
    header = pb.StreamHeader(kind=pb.STREAM_KIND_PUSH, namespace=namespace, worker=worker,
                             step=step,
                             tensors=[wire.meta_of(n, t) for n, t in tensors.items()])
    return [bytes(f) for f in wire.StreamWriter().frames(header, list(tensors.values()))]


def pooled(transport: Transport) -> list[dataplane.Link]:
    """The idle connections of a TcpTransport's data-plane pool."""
    assert isinstance(transport, TcpTransport)
    assert transport._data is not None, "the transport has no data plane"
    return list(transport._data._idle)


def data_links(server: PSServer) -> int:
    """How many data connections the server holds open."""
    assert server.data is not None
    with server.data._lock:
        return len(server.data._links)


def wait_until(predicate: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} did not happen within {WAIT_S} s")
        time.sleep(0.01)


def as_bytes(tensors: Mapping[str, torch.Tensor]) -> dict[str, bytes]:
    return {name: t.contiguous().numpy().tobytes() for name, t in tensors.items()}


def reply_bytes(replies: list[pb.PushReply]) -> list[bytes]:
    """Replies without `apply_seconds`, which is a measured time and differs per run."""
    out = []
    for reply in replies:
        copy = pb.PushReply()
        copy.CopyFrom(reply)
        copy.ClearField("apply_seconds")
        out.append(copy.SerializeToString())
    return out


# ---------------------------------------------------------------------- same results


ROUND_TRIP_SHAPES = {"big": BIG, "w": (64, 32), "b": (32,)}


def round_trip(client: ShardedClient, optimizer: OptimizerConfig) -> dict[str, object]:
    """Every tensor call once, with their results as bytes. With partitioning off,
    server 0 holds the 5 MiB `big` (streams of three chunks) and server 1 the small
    `w` and `b` (one chunk)."""
    params = randn(ROUND_TRIP_SHAPES, seed=0)
    grads = [randn(ROUND_TRIP_SHAPES, seed=s) for s in (1, 2, 3, 4)]
    out = zeros(ROUND_TRIP_SHAPES)
    record: dict[str, object] = {}
    record["init"] = [r.SerializeToString() for r in init(client, params, optimizer)]
    record["push"] = reply_bytes(client.push(grads[0]))
    record["pull_step"] = client.pull(out)
    record["pull"] = as_bytes(out)
    # Default small_bytes: PushPull for server 0's 5 MiB, PushPullSmall for server 1.
    record["push_pull_mixed"] = reply_bytes(client.push_pull(grads[1], out))
    record["after_mixed"] = as_bytes(out)
    client.small_bytes = 0  # streams for both
    record["push_pull_streams"] = reply_bytes(client.push_pull(grads[2], out))
    record["after_streams"] = as_bytes(out)
    client.small_bytes = 64 * 1024 * 1024  # one message each way, 5 MiB included
    record["push_pull_small"] = reply_bytes(client.push_pull(grads[3], out))
    record["after_small"] = as_bytes(out)
    record["pull_steps"] = list(client.last_pull_steps)
    state = client.pull_state()
    record["state_step"] = state.global_step
    record["state_params"] = as_bytes(state.params)
    record["state_slots"] = {key: as_bytes(slots) for key, slots in state.slots.items()}
    record["slot_steps"] = dict(state.slot_steps)
    return record


@pytest.mark.parametrize("optimizer", [
    pytest.param(OptimizerConfig(name="momentum", learning_rate=0.1, momentum=0.9,
                                 nesterov=True), id="momentum"),
    pytest.param(OptimizerConfig(name="adam", learning_rate=0.01, weight_decay=0.01),
                 id="adam"),
])
def test_tcp_gives_the_same_bytes_as_grpc(start_server, open_transport,
                                          optimizer: OptimizerConfig) -> None:
    records = {}
    for kind in ("tcp", "grpc"):
        transports = [open_transport(start_server(ps_index=i).address, kind)
                      for i in range(2)]
        client = sharded(transports, ROUND_TRIP_SHAPES, partition_bytes=1 << 30)
        assert [p.key for p in client.shards[0]] == ["big"]
        records[kind] = round_trip(client, optimizer)
        client.pool.shutdown(wait=True)
        if kind == "tcp":  # the tensors went over the data plane, not a gRPC fallback
            assert all(len(pooled(t)) >= 1 for t in transports)
    tcp, grpc_ = records["tcp"], records["grpc"]
    assert tcp.keys() == grpc_.keys()
    for key in tcp:
        assert tcp[key] == grpc_[key], f"{key} differs between tcp and grpc"
    # The calls did something: four applied pushes, moved parameters, filled slots.
    assert tcp["pull_steps"] == [4, 4] and tcp["state_step"] == 4
    assert tcp["pull"] != as_bytes(randn(ROUND_TRIP_SHAPES, seed=0))
    assert tcp["after_small"] != tcp["pull"]
    assert {k: set(v) for k, v in tcp["state_slots"].items()} == {
        k: set(SLOT_NAMES[optimizer.name]) for k in ROUND_TRIP_SHAPES}
    assert tcp["slot_steps"] == dict.fromkeys(ROUND_TRIP_SHAPES, 4)


def test_tcp_transport_carries_tensors_on_the_data_port(start_server, open_transport) -> None:
    server = start_server()
    transport = open_transport(server.address)
    client = sharded([transport], {"w": (4, 3)})
    init(client, {"w": torch.ones(4, 3)})
    assert transport._data is not None and transport._data.port == server.data_port
    assert server.data_port not in (0, server.port)
    assert len(pooled(transport)) == 1 and data_links(server) == 1


# ---------------------------------------------------------------------- refusals

NAN = torch.tensor([[0.0, float("nan"), 0.0]] * 4)


def push_nan(t: Transport) -> object:
    return t.push(iter(push_frames({"w": NAN})))


def push_pull_nan(t: Transport) -> object:
    return list(t.push_pull(iter(push_frames({"w": NAN}))))


def push_pull_small_nan(t: Transport) -> object:
    return t.push_pull_small(wire.encode_batch(iter(push_frames({"w": NAN}))))


def push_unknown_namespace(t: Transport) -> object:
    return t.push(iter(push_frames({"w": torch.zeros(4, 3)}, namespace="nowhere")))


def pull_unknown_namespace(t: Transport) -> object:
    return list(t.pull(pb.PullRequest(namespace="nowhere")))


def push_wrong_shape(t: Transport) -> object:
    return t.push(iter(push_frames({"w": torch.zeros(3, 4)})))


def pull_unknown_tensor(t: Transport) -> object:
    return list(t.pull(pb.PullRequest(namespace=NS, names=["x"])))


def push_unknown_big_tensor(t: Transport) -> object:
    # Refused at the header; the server must still read the 5 MiB behind it.
    return t.push(iter(push_frames({"x": torch.zeros(BIG)})))


def init_another_model(t: Transport) -> object:
    return init(sharded([t], {"w": (4, 3)}), {"w": torch.zeros(4, 3)}, fingerprint="34" * 32)


@pytest.mark.parametrize(("call", "code", "fragment"), [
    pytest.param(push_nan, "INVALID_ARGUMENT", "gradient 'w' contains NaN or inf",
                 id="nan-push"),
    pytest.param(push_pull_nan, "INVALID_ARGUMENT", "contains NaN or inf",
                 id="nan-push-pull"),
    pytest.param(push_pull_small_nan, "INVALID_ARGUMENT", "contains NaN or inf",
                 id="nan-push-pull-small"),
    pytest.param(push_unknown_namespace, "FAILED_PRECONDITION",
                 "namespace 'nowhere' is not initialised", id="unknown-namespace-push"),
    pytest.param(pull_unknown_namespace, "FAILED_PRECONDITION",
                 "namespace 'nowhere' is not initialised", id="unknown-namespace-pull"),
    pytest.param(push_wrong_shape, "INVALID_ARGUMENT",
                 "gradient 'w' has shape [3, 4], the parameter has [4, 3]", id="wrong-shape"),
    pytest.param(pull_unknown_tensor, "NOT_FOUND", "tensor 'x' is not on parameter server 0",
                 id="unknown-tensor-pull"),
    pytest.param(push_unknown_big_tensor, "NOT_FOUND",
                 "tensor 'x' is not on parameter server 0", id="unknown-tensor-5mib-push"),
    pytest.param(init_another_model, "FAILED_PRECONDITION", "fingerprint mismatch",
                 id="another-model-init"),
])
def test_a_refused_call_keeps_state_and_its_pooled_connection(
        start_server, open_transport, call: Callable[[Transport], object], code: str,
        fragment: str) -> None:
    server = start_server()
    transport = open_transport(server.address)
    client = sharded([transport], {"w": (4, 3)})
    init(client, {"w": torch.arange(12.0).reshape(4, 3)})
    [link] = pooled(transport)
    step_before = client.info(0).global_step

    with pytest.raises(PSError) as caught:
        call(transport)
    assert caught.value.code == code
    assert caught.value.message.startswith(f"{server.address}: "), caught.value.message
    assert fragment in caught.value.message

    assert pooled(transport) == [link] and data_links(server) == 1
    out = zeros({"w": (4, 3)})
    assert client.pull(out) == step_before
    assert torch.equal(out["w"], torch.arange(12.0).reshape(4, 3))
    [reply] = client.push({"w": torch.ones(4, 3)})
    assert reply.applied and reply.info.global_step == step_before + 1
    assert pooled(transport) == [link] and data_links(server) == 1


class BrokenPushStore(ParameterStore):
    """A store with a bug in its push: an exception that is not a PSError."""

    def push(self, messages: Iterator[bytes], *args: object, **kw: object) -> pb.PushReply:
        for _ in messages:
            pass
        raise RuntimeError("a bug in the store")


class BrokenPullStore(ParameterStore):
    """A store with a bug in its pull stream: it fails after the header."""

    def pull(self, request: pb.PullRequest, *args: object, **kw: object) -> Iterator[bytes]:
        frames = super().pull(request, *args, **kw)
        yield next(frames)
        raise RuntimeError("a bug in the store")


@pytest.mark.parametrize(("kind", "code"), [("tcp", "INTERNAL"), ("grpc", "UNKNOWN")])
@pytest.mark.parametrize(("store", "call"), [
    pytest.param(BrokenPushStore, lambda c: c.push({"w": torch.ones(4, 3)}), id="push"),
    pytest.param(BrokenPullStore, lambda c: c.pull(zeros({"w": (4, 3)})), id="pull-stream"),
])
def test_a_server_bug_is_an_error_not_unavailable(
        open_transport, kind: str, code: str, store: type[ParameterStore],
        call: Callable[[ShardedClient], object]) -> None:
    """UNAVAILABLE sends trainers into their retry and recovery loop; a bug in the
    server must rather fail the call, as gRPC fails it, and leave the connection."""
    server = PSServer("127.0.0.1:0", store=store())
    server.start()
    try:
        transport = open_transport(server.address, kind)
        client = sharded([transport], {"w": (4, 3)})
        init(client, {"w": torch.ones(4, 3)})
        for _ in range(2):  # twice: the same connection answers the second time
            with pytest.raises(PSError) as caught:
                call(client)
            assert caught.value.code == code
            assert "a bug in the store" in caught.value.message
            if kind == "tcp":
                assert len(pooled(transport)) == 1 and data_links(server) == 1
    finally:
        server.stop(0)


# ---------------------------------------------------------------------- the protocol


def raw_connection(server: PSServer) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.data_port), timeout=WAIT_S)


def recv_all(sock: socket.socket) -> bytes:
    """Everything the peer sends until it closes."""
    parts = []
    while chunk := sock.recv(65536):
        parts.append(chunk)
    return b"".join(parts)


def recv_exact(sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise ConnectionError(f"the server closed after {len(data)} of {size} bytes")
        data += chunk
    return data


def framed(*frames: bytes) -> bytes:
    return b"".join(struct.pack("<I", len(f)) + f for f in frames)


def test_raw_protocol_request_and_error_reply(start_server) -> None:
    """The layout the module docstring documents: op, frames, END; a refusal is
    ERROR, a code frame and a message frame, and the connection stays in step."""
    server = start_server()
    request = pb.PullRequest(namespace="nowhere").SerializeToString()
    with raw_connection(server) as sock:
        for _ in range(2):  # the same connection answers twice
            sock.sendall(bytes([dataplane.OP_PULL]) + framed(request)
                         + struct.pack("<I", dataplane.END))
            marker, code_size = struct.unpack("<II", recv_exact(sock, 8))
            assert marker == dataplane.ERROR
            assert recv_exact(sock, code_size) == b"FAILED_PRECONDITION"
            (message_size,) = struct.unpack("<I", recv_exact(sock, 4))
            message = recv_exact(sock, message_size).decode()
            assert message.startswith("namespace 'nowhere' is not initialised")


@pytest.mark.parametrize("payload", [
    pytest.param(bytes([dataplane.OP_PUSH]) + struct.pack("<I", wire.MAX_MESSAGE_BYTES + 1),
                 id="frame-over-the-limit"),
    pytest.param(bytes([dataplane.OP_PULL]) + struct.pack("<I", dataplane.ERROR - 1),
                 id="frame-of-4-gib"),
    pytest.param(bytes([0]), id="op-0"),
    pytest.param(bytes([99]), id="op-99"),
])
def test_a_protocol_break_closes_only_its_own_connection(start_server, open_transport,
                                                         payload: bytes) -> None:
    server = start_server()
    transport = open_transport(server.address)
    client = sharded([transport], {"w": (4, 3)})
    init(client, {"w": torch.ones(4, 3)})
    [link] = pooled(transport)

    with raw_connection(server) as sock:
        sock.sendall(payload)
        assert recv_all(sock) == b"", "the server answered a broken request"
    wait_until(lambda: data_links(server) == 1, "dropping the broken connection")

    out = zeros({"w": (4, 3)})
    client.pull(out)  # the connection that was open keeps working
    assert torch.equal(out["w"], torch.ones(4, 3)) and pooled(transport) == [link]
    other = open_transport(server.address)  # and new ones are accepted
    assert sharded([other], {"w": (4, 3)}).pull(out) == 0
    assert len(pooled(other)) == 1 and data_links(server) == 2


# ---------------------------------------------------------------------- fallback, restart


def test_without_a_data_plane_tcp_falls_back_to_grpc(start_server, open_transport) -> None:
    server = start_server(data_port=None)
    assert server.data is None and server.data_port == 0
    transport = open_transport(server.address)
    shapes = {"w": (300, 40), "big": BIG}
    client = sharded([transport], shapes)
    params = randn(shapes, seed=0)
    init(client, params)  # sgd, learning rate 1: params - grads
    grads = randn(shapes, seed=1)
    out = zeros(shapes)
    [reply] = client.push_pull(grads, out)
    assert reply.applied and client.last_pull_steps == [1]
    for name in shapes:
        assert torch.equal(out[name], params[name] - grads[name]), name
    assert isinstance(transport, TcpTransport)
    assert transport._data is None and transport._data_known


@pytest.mark.parametrize("same_data_port", [False, True],
                         ids=["new-data-port", "same-data-port-as-in-a-cluster"])
def test_a_restarted_server_is_found_again(start_server, open_transport,
                                           same_data_port: bool) -> None:
    port, first_data, second_data = find_free_ports(3)
    if same_data_port:
        second_data = first_data
    first = start_server(port=port, data_port=first_data)
    transport = open_transport(first.address)
    client = sharded([transport], {"w": (4, 3)})
    init(client, {"w": torch.ones(4, 3)})
    first.stop(0)
    second = start_server(port=port, data_port=second_data)
    assert second.address == first.address

    out = zeros({"w": (4, 3)})
    with pytest.raises(PSError) as caught:  # the pooled connection went with the old one
        client.pull(out)
    assert caught.value.code == "UNAVAILABLE"
    assert caught.value.message.startswith(f"{first.address}: the data connection failed")

    init(client, {"w": torch.full((4, 3), 2.0)})  # the next call asks Info again
    assert transport._data is not None and transport._data.port == second_data
    assert client.pull(out) == 0 and torch.equal(out["w"], torch.full((4, 3), 2.0))


# ---------------------------------------------------------------------- concurrency, stop


def test_threads_share_one_transport_and_the_pool_grows(start_server, open_transport) -> None:
    server = start_server()
    transport = open_transport(server.address)
    shapes = {"w": (256, 256), "big": BIG}
    client = sharded([transport], shapes)
    params = randn(shapes, seed=0)
    init(client, params, mode="sync", num_workers=3)

    # A sync push returns once all three workers pushed: three calls must be in flight
    # at once, on three connections.
    def push(worker: int) -> pb.PushReply:
        grads = {n: torch.full(s, float(worker + 1)) for n, s in shapes.items()}
        return transport.push(iter(push_frames(grads, worker=worker, step=0)))

    with cf.ThreadPoolExecutor(3) as pool:
        replies = [f.result(timeout=WAIT_S) for f in [pool.submit(push, w) for w in range(3)]]
    assert [(r.applied, r.info.global_step) for r in replies] == [(True, 1)] * 3
    assert len(pooled(transport)) == 3 and data_links(server) == 3

    expected = {n: params[n] - 2.0 for n in shapes}  # sgd, lr 1, mean gradient 2

    def pull(_: int) -> bool:
        out = zeros(shapes)
        sharded([transport], shapes).pull(out)
        return all(torch.equal(out[n], expected[n]) for n in shapes)

    with cf.ThreadPoolExecutor(4) as pool:
        assert list(pool.map(pull, range(12), timeout=WAIT_S)) == [True] * 12
    assert 3 <= len(pooled(transport)) <= 4


def test_stopping_the_data_plane_fails_calls_instead_of_hanging(start_server,
                                                                open_transport) -> None:
    server = start_server()
    blocked, idle = open_transport(server.address), open_transport(server.address)
    client = sharded([blocked], {"w": (4, 3)})
    init(client, {"w": torch.ones(4, 3)}, mode="sync", num_workers=2)
    sharded([idle], {"w": (4, 3)}).pull(zeros({"w": (4, 3)}))
    assert len(pooled(idle)) == 1
    ns = server.store.namespace(NS)

    with cf.ThreadPoolExecutor(1) as pool:
        # Worker 0's sync push waits on the server for worker 1, who never comes.
        in_flight = pool.submit(blocked.push, iter(push_frames({"w": torch.ones(4, 3)})))
        wait_until(lambda: 0 in ns.buckets and ns.buckets[0].contributors == {0},
                   "the server receiving worker 0's push")
        assert server.data is not None
        server.data.stop()
        with pytest.raises(PSError) as caught:
            in_flight.result(timeout=WAIT_S)
        assert caught.value.code == "UNAVAILABLE"

        for _ in range(2):  # the idle pooled connection, then a fresh one: both refused
            call = pool.submit(lambda: list(idle.pull(pb.PullRequest(namespace=NS))))
            with pytest.raises(PSError) as caught:
                call.result(timeout=WAIT_S)
            assert caught.value.code == "UNAVAILABLE", caught.value.message
            assert caught.value.message.startswith(f"{server.address}: ")


# ---------------------------------------------------------------------- small contracts


@pytest.mark.parametrize("kind", ["tcp", "grpc"])
def test_an_applied_async_push_reports_its_apply_time(start_server, open_transport,
                                                      kind: str) -> None:
    server = start_server()
    client = sharded([open_transport(server.address, kind)], {"w": (512, 512)})
    init(client, {"w": torch.zeros(512, 512)},
         OptimizerConfig(name="adam", learning_rate=0.01))
    [reply] = client.push({"w": torch.ones(512, 512)})
    assert reply.applied and reply.apply_seconds > 0
    client.finish()
    [reply] = client.push({"w": torch.ones(512, 512)})
    assert not reply.applied and reply.apply_seconds == 0


@pytest.mark.parametrize(("address", "host"), [
    ("127.0.0.1:2222", "127.0.0.1"),
    ("[::1]:2222", "::1"),
    ("j-ps-0.j.default.svc:2222", "j-ps-0.j.default.svc"),
])
def test_the_data_port_is_on_the_host_of_the_grpc_address(address: str, host: str) -> None:
    assert dataplane.split_host(address) == host


def test_connect_names_the_transport() -> None:
    tcp, grpc_ = connect("127.0.0.1:1"), connect("127.0.0.1:1", "grpc")
    try:
        assert type(tcp) is TcpTransport and type(grpc_) is GrpcTransport
    finally:
        tcp.close()
        grpc_.close()
    with pytest.raises(ValueError, match=r"^transport is 'udp'; it must be tcp or grpc$"):
        connect("127.0.0.1:1", "udp")


def ps_identity():
    manifest = TrainingJob.model_validate(job("j").ps(1).workers(1).build())
    spec = local_cluster_spec(manifest, find_free_ports(2))
    return parse_cluster_env(spec.env(Task("ps", 0)))


@pytest.mark.parametrize("value", ["abc", "2223x", "1.5"])
def test_run_ps_refuses_a_data_port_that_is_not_a_number(capsys, value: str) -> None:
    assert run_ps(ps_identity(), {"PSTRAIN_DATA_PORT": value}) == 2
    assert (f"pstrain replica: PSTRAIN_DATA_PORT is {value!r}; it must be a port number"
            in capsys.readouterr().err)


@pytest.mark.parametrize("value", ["-1", "65536"])
def test_run_ps_refuses_a_data_port_out_of_range(capsys, value: str) -> None:
    assert run_ps(ps_identity(), {"PSTRAIN_DATA_PORT": value}) == 2
    assert f"PSTRAIN_DATA_PORT is {value!r}" in capsys.readouterr().err


def test_run_ps_reports_a_data_port_in_use(capsys) -> None:
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        assert run_ps(ps_identity(), {"PSTRAIN_DATA_PORT": str(port)}) == 1
    err = capsys.readouterr().err
    assert "pstrain replica: parameter server 0 could not bind" in err


def test_a_graceful_stop_lets_a_reply_in_flight_finish(start_server, open_transport) -> None:
    """The Shutdown path stops once every worker was told the job is done; a worker
    told so in a PushPull reply must still get that reply (gRPC gets a grace period for
    calls in flight, so must the data plane)."""
    server = start_server()
    shapes = {"big": (6144, 1024)}  # 24 MiB back: more than the sockets buffer
    client = sharded([open_transport(server.address)], shapes)
    init(client, zeros(shapes), mode="async", num_workers=2)
    client.finish()  # worker 0 (the chief) knows; worker 1 is told by its next reply
    ns = server.store.namespace(NS)
    with raw_connection(server) as sock:
        link = dataplane.Link(sock)
        link.send_frames(push_frames(zeros(shapes), worker=1), op=dataplane.OP_PUSH_PULL)
        wait_until(lambda: 1 in ns.told_done, "the server answering worker 1")
        server.request_stop(grace=WAIT_S)
        wait_until(lambda: server.data is not None and server.data._closed,
                   "the data plane stopping")
        frames = link.frames()  # read only now: the server is stopping meanwhile
        header = wire.decode_frame(next(frames))
        received = sum(len(frame) for frame in frames)
    assert isinstance(header, pb.StreamHeader) and header.push_reply.info.done
    assert received > 24 * 1024 * 1024
    assert server.wait(timeout=WAIT_S)


def test_a_frame_of_many_small_tensors_goes_out_in_several_sendmsg_calls(
        start_server, open_transport, monkeypatch) -> None:
    """1100 tensors of 400 bytes coalesce into one chunk frame of 1100 parts: more
    buffers than the kernel takes in one sendmsg (IOV_MAX, 1024), so the frame must go
    out in slices of dataplane.MAX_IOVECS; the pushed and pulled values arrive whole."""
    calls: list[int] = []
    real = dataplane.Link._send_parts

    def counting(self, parts):  # noqa: ANN001, ANN202
        calls.append(len(parts))
        return real(self, parts)

    monkeypatch.setattr(dataplane.Link, "_send_parts", counting)
    shapes = {f"t{i:04d}": (100,) for i in range(1100)}
    server = start_server()
    client = sharded([open_transport(server.address)], shapes)
    params = randn(shapes, 1)
    init(client, params)
    grads = randn(shapes, 2)
    client.push(grads)
    out = zeros(shapes)
    client.pull(out)
    assert max(calls) > 1024
    for name in shapes:
        torch.testing.assert_close(out[name], params[name] - grads[name])


@pytest.mark.parametrize(("kind", "small_bytes"), [("tcp", 1 << 20), ("tcp", 16),
                                                   ("grpc", 1 << 20)],
                         ids=["one-message", "streams", "grpc"])
def test_a_push_pull_to_several_servers_runs_on_the_callers_thread(
        start_server, open_transport, monkeypatch, kind: str, small_bytes: int) -> None:
    """Over the data plane with small shards, every server's request is sent, then
    every reply read, from the caller's thread (no thread hop); larger shards, and
    gRPC, make one call per server on threads (still all at once). Each way pushes,
    then reads back, every shard."""
    from pstrain_runtime.worker import client as worker_client

    shapes = {"a": (40, 3), "b": (50,), "c": (7, 7)}
    transports = [open_transport(start_server(ps_index=i).address, kind) for i in range(2)]
    placement = build_placement(param_specs(shapes), 2, None)
    client = worker_client.ShardedClient(transports, placement, NS, small_bytes=small_bytes)
    assert all(client.shards)
    params = randn(shapes, 1)
    init(client, params)
    hops: list[object] = []
    real = client.pool.submit
    monkeypatch.setattr(client.pool, "submit", lambda *a, **k: hops.append(a) or real(*a, **k))
    grads = randn(shapes, 2)
    out = zeros(shapes)
    assert all(reply.applied for reply in client.push_pull(grads, out))
    assert bool(hops) == (small_bytes == 16 or kind == "grpc")
    for name in shapes:
        torch.testing.assert_close(out[name], params[name] - grads[name])


# ---------------------------------------------------------------------- fan-out helpers


def _fan_outs() -> list[tuple[str, Callable[[Callable[[int], object]], list]]]:
    """The two ways a worker calls every server at once: the dense client's `_all`
    waiting for every call, and the sparse client's `_each` (3 servers each)."""
    from pstrain_runtime.sparse.client import SparseClient

    dense = sharded([object()] * 3, {f"p{i}": (64, 64) for i in range(3)})  # type: ignore[list-item]
    sparse = SparseClient([object()] * 3, NS)
    return [("dense", lambda fn: dense._all(fn, wait_all=True)),
            ("sparse", lambda fn: sparse._each(fn, [0, 1, 2]))]


@pytest.mark.parametrize("which", [0, 1])
def test_fan_out_runs_the_first_call_here_and_answers_in_server_order(which: int) -> None:
    import threading

    name, fan_out = _fan_outs()[which]
    threads: dict[int, int] = {}

    def call(ps: int) -> int:
        threads[ps] = threading.get_ident()
        time.sleep(0.02 * (3 - ps))  # the last server answers first
        return 10 * ps

    assert fan_out(call) == [0, 10, 20], name
    assert threads[0] == threading.get_ident()  # no thread hop for one of the calls
    assert threading.get_ident() not in (threads[1], threads[2])


@pytest.mark.parametrize("which", [0, 1])
def test_fan_out_raises_a_failure_only_once_every_call_has_ended(which: int) -> None:
    """The first server's call fails at once while the others still run: nothing is
    raised before they end (they write into the caller's tensors)."""
    name, fan_out = _fan_outs()[which]
    ended: list[int] = []

    def call(ps: int) -> int:
        if ps == 0:
            raise PSError("UNAVAILABLE", "server 0 is gone")
        time.sleep(0.1)
        ended.append(ps)
        return ps

    with pytest.raises(PSError, match="server 0 is gone"):
        fan_out(call)
    assert sorted(ended) == [1, 2], name
