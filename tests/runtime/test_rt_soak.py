"""Soak (issue 11): the digits job trains over real loopback servers while another
process floods both ports of every parameter server with pulls that wait for a step
that never comes, idle connections, garbage frames and oversized Init headers. It
passes when the job reaches its usual accuracy and health answers throughout.

Kept out of the default run (minutes of CPU): set PSTRAIN_SOAK=1 to run it.
"""

from __future__ import annotations

import multiprocessing
import os
import socket
import struct
import threading
import time
from typing import Any

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pstrain_runtime.proto import ps_pb2 as pb
from pstrain_runtime.ps.server import SERVICE, PSServer
from pstrain_runtime.transport import dataplane
from pstrain_runtime.worker.client import connect
from pstrain_runtime.worker.context import WorkerRole
from pstrain_runtime.worker.trainer import Trainer

from .builders import digits_training

pytestmark = [
    pytest.mark.timeout(600),
    pytest.mark.skipif(os.environ.get("PSTRAIN_SOAK") != "1",
                       reason="a soak test: set PSTRAIN_SOAK=1 to run it"),
]


def flood(targets: list[tuple[str, int]], stop: Any, rounds: Any) -> None:
    """Until `stop` is set, against every (gRPC address, data port) in `targets`;
    `rounds` counts the rounds done."""
    channels = [grpc.insecure_channel(address) for address, _ in targets]
    idle: list[socket.socket] = []
    while not stop.is_set():
        calls = []
        for channel in channels:  # pulls that wait for a step that never comes
            pull = channel.unary_stream(f"/{SERVICE}/Pull", pb.PullRequest.SerializeToString,
                                        None)
            calls += [pull(pb.PullRequest(namespace="ns", min_step=10**9), timeout=1.0)
                      for _ in range(100)]
        for _, port in targets:
            for payload in (
                os.urandom(256),  # garbage frames
                bytes([dataplane.OP_INIT]) + struct.pack("<I", 0xFFFFFF00),  # too long
                bytes([dataplane.OP_INIT]) + _huge_init(),  # claims 100 GB
            ):
                try:
                    with socket.create_connection(("127.0.0.1", port), timeout=2) as sock:
                        sock.sendall(payload)
                except OSError:
                    pass
            if len(idle) < 200:  # idle connections that never send a thing
                try:
                    idle.append(socket.create_connection(("127.0.0.1", port), timeout=2))
                except OSError:
                    pass
        for call in calls:
            try:
                list(call)
            except grpc.RpcError:
                pass
        rounds.value += 1
    for sock in idle:
        sock.close()


def _huge_init() -> bytes:
    header = pb.StreamHeader(kind=pb.STREAM_KIND_INIT, namespace="ns", mode="async",
                             num_workers=2, total_bytes=100_000_000_000,
                             tensors=[pb.TensorMeta(name="w", dtype="float32",
                                                    shape=[25_000_000_000])])
    frame = pb.Frame(header=header).SerializeToString()
    return struct.pack("<I", len(frame)) + frame + struct.pack("<I", dataplane.END)


def test_digits_trains_to_accuracy_while_both_ports_are_flooded() -> None:
    torch.set_num_threads(1)
    servers = [PSServer("127.0.0.1:0", ps_index=i) for i in range(2)]
    for server in servers:
        server.start()
    ctx = multiprocessing.get_context("spawn")
    stop, rounds = ctx.Event(), ctx.Value("i", 0)
    flooder = ctx.Process(target=flood, args=([(s.address, s.data_port) for s in servers],
                                              stop, rounds), daemon=True)
    flooder.start()
    health_failures: list[str] = []
    done = threading.Event()

    def probe() -> None:
        stubs = [health_pb2_grpc.HealthStub(grpc.insecure_channel(s.address))
                 for s in servers]
        while not done.wait(0.5):
            for stub in stubs:
                try:
                    stub.Check(health_pb2.HealthCheckRequest(service=SERVICE), timeout=2)
                except grpc.RpcError as exc:
                    health_failures.append(str(exc.code()))

    prober = threading.Thread(target=probe, daemon=True)
    prober.start()
    deadline = time.monotonic() + 120
    while rounds.value < 1 and time.monotonic() < deadline and flooder.is_alive():
        time.sleep(0.2)  # bounded poll of another process's counter
    assert rounds.value >= 1, "the flood did not start"
    before = rounds.value
    training = digits_training(steps=600, mode="async")
    events: list[tuple[str, dict[str, Any]]] = []
    trainers = [Trainer(training, WorkerRole("ns", w, 2),
                        [connect(s.address) for s in servers],
                        emit=(lambda kind, **f: events.append((kind, f))) if w == 0
                        else (lambda *a, **k: None))
                for w in range(2)]
    try:
        threads = [threading.Thread(target=t.run, daemon=True) for t in reversed(trainers)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(480)
        assert not any(thread.is_alive() for thread in threads), "the job did not finish"
        finished = [f for kind, f in events if kind == "done"]
        assert finished
        print(f"\nsoak: accuracy {finished[0]['accuracy']:.3f} after {finished[0]['step']} "
              f"steps under {rounds.value - before} flood rounds; "
              f"{len(health_failures)} failed health checks")
        assert finished[0]["accuracy"] >= 0.95
        assert health_failures == []
        assert rounds.value - before >= 2, "the flood did not go on while the job trained"
    finally:
        done.set()
        stop.set()
        flooder.join(30)
        if flooder.is_alive():
            flooder.kill()
        for trainer in trainers:
            trainer.close()
        for server in servers:
            server.stop(0)
