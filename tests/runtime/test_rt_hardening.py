"""A parameter server under hostile or careless use (issue 11): waits that never end,
bogus headers, transient accept failures, stale pushes. What must hold: the server
stays healthy and answers, and nothing it holds changes on a refusal."""

from __future__ import annotations

import errno
import os
import socket
import struct
import time
from collections.abc import Callable, Iterator

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pstrain_runtime.transport import dataplane
from pstrain_api.model import Training
from pstrain_runtime.optim import OptimizerConfig
from pstrain_runtime.proto import ps_pb2 as pb
from pstrain_runtime.ps.server import SERVICE, PSServer
from pstrain_runtime.ps.store import ParameterStore, PSError
from pstrain_runtime.worker.client import (
    GrpcTransport,
    LocalTransport,
    ShardedClient,
    retry_unavailable,
)
from pstrain_runtime.worker.context import WorkerRole
from pstrain_runtime.worker.placement import build_placement, param_specs
from pstrain_runtime.worker.trainer import Trainer

pytestmark = pytest.mark.timeout(60)

FP = "34" * 32
WAIT_S = 10.0  # upper bound on anything that should take well under a second
NEVER = 10**9  # a step that never comes


@pytest.fixture
def server() -> Iterator[PSServer]:
    started = PSServer("127.0.0.1:0")
    started.start()
    client = ShardedClient([GrpcTransport(started.address)],
                           build_placement(param_specs({"w": (4,)}), 1), "ns")
    client.init({"w": torch.zeros(4)}, OptimizerConfig(name="sgd", learning_rate=0.1),
                mode="sync", num_workers=2, staleness_bound=None, fingerprint=FP)
    client.close()
    yield started
    started.stop(0)


def wait_until(predicate: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {WAIT_S} s: {what}")
        time.sleep(0.02)  # bounded poll of another thread's state


def assert_control_answers(channel: grpc.Channel) -> None:
    health = health_pb2_grpc.HealthStub(channel)
    reply = health.Check(health_pb2.HealthCheckRequest(service=SERVICE), timeout=2)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
    info = channel.unary_unary(f"/{SERVICE}/Info", pb.NamespaceRequest.SerializeToString,
                               pb.StepInfo.FromString)
    assert info(pb.NamespaceRequest(namespace="ns"), timeout=2).initialized


# ---------------------------------------------------------------------- item 1


def test_hundreds_of_waiting_pulls_leave_health_and_info_answering(server: PSServer) -> None:
    channel = grpc.insecure_channel(server.address)
    pull = channel.unary_stream(f"/{SERVICE}/Pull", pb.PullRequest.SerializeToString, None)
    calls = [pull(pb.PullRequest(namespace="ns", min_step=NEVER), timeout=1.0)
             for _ in range(300)]
    try:
        wait_until(lambda: server.tensor_slots.in_use == server.tensor_slots.size,
                   "every tensor slot is taken by a waiting pull")
        assert_control_answers(channel)  # while the pulls wait
        refused = 0
        for call in calls:  # every call ends: at its deadline, or refused at once
            try:
                list(call)
            except grpc.RpcError as exc:
                refused += exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert refused >= 300 - server.tensor_slots.size
        wait_until(lambda: server.tensor_slots.in_use == 0,
                   "the waits ended with their callers' deadlines")
        assert_control_answers(channel)
    finally:
        for call in calls:
            call.cancel()
        channel.close()


def test_a_data_plane_wait_ends_when_its_caller_disconnects(server: PSServer) -> None:
    assert server.data is not None
    message = pb.PullRequest(namespace="ns", min_step=NEVER).SerializeToString()
    socks = []
    for _ in range(20):
        sock = socket.create_connection(("127.0.0.1", server.data_port), timeout=WAIT_S)
        sock.sendall(bytes([dataplane.OP_PULL]) + struct.pack("<I", len(message)) + message
                     + struct.pack("<I", dataplane.END))
        socks.append(sock)
    wait_until(lambda: server.data._busy == 20, "the pulls wait for their step")  # type: ignore[union-attr]
    for sock in socks:
        sock.close()
    wait_until(lambda: server.data._busy == 0 and not server.data._links,  # type: ignore[union-attr]
               "the server ended the waits of callers that went away")


def test_a_busy_server_is_retried_like_an_unreachable_one() -> None:
    answers = iter([PSError("RESOURCE_EXHAUSTED", "busy"), PSError("UNAVAILABLE", "down"),
                    "ok"])

    def call() -> object:
        answer = next(answers)
        if isinstance(answer, PSError):
            raise answer
        return answer

    slept: list[float] = []
    assert retry_unavailable(call, 10.0, clock=lambda: 0.0, sleep=slept.append) == "ok"
    assert len(slept) == 2


# ---------------------------------------------------------------------- item 3


def bogus_init(shape: list[int], total_bytes: int) -> list[bytes]:
    """An Init header claiming one float32 tensor of `shape`, and a body of 8 bytes."""
    header = pb.StreamHeader(kind=pb.STREAM_KIND_INIT, namespace="ns", mode="sync",
                             num_workers=2, fingerprint=bytes.fromhex(FP),
                             optimizer=pb.OptimizerSpec(name="sgd", learning_rate=0.1),
                             tensors=[pb.TensorMeta(name="w", dtype="float32", shape=shape)],
                             total_bytes=total_bytes)
    chunk = pb.Frame(seq=0, offset=0, data=b"\0" * 8)
    return [pb.Frame(header=header).SerializeToString(), chunk.SerializeToString()]


HUGE = [25_000_000_000]  # 100 GB of float32


@pytest.mark.parametrize(("frames", "code", "message"), [
    pytest.param(bogus_init(HUGE, 8), grpc.StatusCode.INVALID_ARGUMENT,
                 "shapes add up to 100000000000 bytes but the header announces a body "
                 "of 8 bytes", id="body-disagrees"),
    pytest.param(bogus_init(HUGE, 100_000_000_000), grpc.StatusCode.RESOURCE_EXHAUSTED,
                 "the tensors hold 100000000000 bytes, more than the", id="over-the-limit"),
])
def test_an_init_claiming_a_huge_tensor_is_refused_before_allocating(
        server: PSServer, frames: list[bytes], code: grpc.StatusCode, message: str) -> None:
    server.store.max_init_bytes = 1 << 30
    before = server.store.namespace("ns").params["w"].clone()
    with grpc.insecure_channel(server.address) as channel:
        init = channel.stream_unary(f"/{SERVICE}/Init", None, pb.StepInfo.FromString)
        with pytest.raises(grpc.RpcError) as caught:
            init(iter(frames), timeout=WAIT_S)
    assert caught.value.code() == code
    assert message in caught.value.details()
    ns = server.store.namespace("ns")
    assert ns.mode == "sync" and ns.num_workers == 2 and torch.equal(ns.params["w"], before)


# ---------------------------------------------------------------------- item 2


class FailingListener:
    """A listening socket whose next `failures` accepts fail with `code`, as a burst of
    connections under a low open-files limit makes them fail."""

    def __init__(self, listener: socket.socket, failures: int, code: int) -> None:
        self.listener = listener
        self.failures = failures
        self.code = code

    def accept(self) -> tuple[socket.socket, object]:
        if self.failures:
            self.failures -= 1
            raise OSError(self.code, os.strerror(self.code))
        return self.listener.accept()

    def __getattr__(self, name: str) -> object:
        return getattr(self.listener, name)


@pytest.mark.parametrize("code", [errno.EMFILE, errno.ENFILE, errno.ECONNABORTED],
                         ids=errno.errorcode.get)
def test_the_data_plane_keeps_accepting_after_transient_accept_failures(code: int) -> None:
    store = ParameterStore()
    data = dataplane.DataServer(store, "127.0.0.1")
    data._listener = FailingListener(data._listener, 3, code)  # type: ignore[assignment]
    data.start()
    try:
        client = dataplane.DataClient("test", "127.0.0.1", data.port, io_timeout=WAIT_S)
        message = pb.PullRequest(namespace="ns").SerializeToString()
        with pytest.raises(PSError) as caught:  # answered: the namespace does not exist
            client.unary(dataplane.OP_PULL, [message], bytes)
        assert caught.value.code == "FAILED_PRECONDITION"
        assert data._listener.failures == 0  # type: ignore[attr-defined]
        client.close()
    finally:
        data.stop()


def test_a_data_call_to_a_server_that_never_answers_fails_unavailable() -> None:
    silent = socket.create_server(("127.0.0.1", 0))  # accepts (backlog), never answers
    try:
        client = dataplane.DataClient("silent", "127.0.0.1", silent.getsockname()[1],
                                      io_timeout=0.3)
        message = pb.PullRequest(namespace="ns").SerializeToString()
        started = time.monotonic()
        with pytest.raises(PSError) as caught:
            client.unary(dataplane.OP_PULL, [message], bytes)
        assert caught.value.code == "UNAVAILABLE" and client.broken
        assert time.monotonic() - started < WAIT_S
    finally:
        silent.close()


# ---------------------------------------------------------------------- item 5


def test_a_push_computed_before_a_restore_is_refused_and_applies_after_a_pull() -> None:
    store = ParameterStore()
    placement = build_placement(param_specs({"w": (4,)}), 1)
    worker = ShardedClient([LocalTransport(store)], placement, "ns")
    chief = ShardedClient([LocalTransport(store)], placement, "ns")
    sgd = OptimizerConfig(name="sgd", learning_rate=1.0)

    def install(value: float) -> None:
        chief.init({"w": torch.full((4,), value)}, sgd, mode="async", num_workers=1,
                   staleness_bound=None, fingerprint=FP)

    install(0.0)
    mirror = {"w": torch.zeros(4)}
    worker.pull(mirror)
    before = worker.generations[0]
    install(5.0)  # the chief restores: a new incarnation of the server's state
    with pytest.raises(PSError) as caught:
        worker.push({"w": torch.ones(4)})
    assert caught.value.code == "ABORTED"
    assert "pull the parameters again" in caught.value.message
    assert torch.equal(store.namespace("ns").params["w"], torch.full((4,), 5.0))
    worker.pull(mirror)
    assert worker.generations[0] not in (0, before)
    assert worker.push({"w": torch.ones(4)})[0].applied
    assert torch.equal(store.namespace("ns").params["w"], torch.full((4,), 4.0))


class RestoringTransport(LocalTransport):
    """Runs `restore` once, just before the `at`-th push reaches the server: a
    restore by the chief that lands between a worker's pull and its push."""

    def __init__(self, store: ParameterStore, at: int) -> None:
        super().__init__(store)
        self.at = at
        self.pushes = 0
        self.refused: list[str] = []
        self.restore: Callable[[], None] = lambda: None

    def push(self, frames: Iterator[bytes]) -> pb.PushReply:
        self.pushes += 1
        if self.pushes == self.at:
            self.restore()
        try:
            return super().push(frames)
        except PSError as exc:
            self.refused.append(exc.code)
            raise


def test_a_trainer_whose_push_is_refused_as_stale_pulls_again_and_finishes() -> None:
    training = Training.model_validate({"steps": 6, "batchSize": 16, "mode": "sync",
                                        "optimizer": {"name": "sgd", "learningRate": 0.1}})
    transport = RestoringTransport(ParameterStore(), at=3)
    trainer = Trainer(training, WorkerRole("ns", 0, 1), [transport], emit=lambda *a, **k: None)
    transport.restore = lambda: trainer._install(trainer.mirror, None, 2)
    result = trainer.run()
    trainer.close()
    assert transport.refused == ["ABORTED"]
    assert result.global_step == 6 and result.local_steps == 6
