"""The replicas' Prometheus metrics: the proxies around the store and the client, and
the /metrics endpoint."""

from __future__ import annotations

import socket
import urllib.request
from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry

from pstrain_runtime.metrics import (MeteredClient, MeteredStore, PSMetrics, WorkerMetrics,
                                     serve_metrics)
from pstrain_runtime.proto import ps_pb2 as pb
from pstrain_runtime.transport import wire


def value(registry: CollectorRegistry, name: str) -> float:
    got = registry.get_sample_value(name)
    assert got is not None, f"no sample {name}"
    return got


class FakeStore:
    """Consumes a push stream and answers like ParameterStore: applied at step 10."""

    def __init__(self) -> None:
        self.stopped = False

    def push(self, messages: Iterator[bytes], timeout: float | None = None) -> pb.PushReply:
        for _ in messages:
            pass
        return pb.PushReply(applied=True, apply_seconds=0.004,
                            info=pb.StepInfo(global_step=10))

    def pull(self, request: pb.PullRequest, timeout: float | None = None) -> Iterator[bytes]:
        yield wire.encode_header(pb.StreamHeader(kind=pb.STREAM_KIND_PULL))
        yield b"x" * 100

    def push_pull(self, messages: Iterator[bytes], timeout: float | None = None
                  ) -> Iterator[bytes]:
        reply = self.push(messages)
        yield wire.encode_header(pb.StreamHeader(kind=pb.STREAM_KIND_PULL, push_reply=reply))
        yield b"y" * 50

    def stop(self) -> None:
        self.stopped = True


def push_frames(step: int) -> list[bytes]:
    return [wire.encode_header(pb.StreamHeader(kind=pb.STREAM_KIND_PUSH, step=step)),
            b"g" * 200]


def test_metered_store_counts_traffic_latency_step_and_staleness() -> None:
    registry = CollectorRegistry()
    store = MeteredStore(FakeStore(), PSMetrics(registry))
    store.push(iter(push_frames(step=6)))          # applied at 9 -> 10: 3 steps stale
    out = list(store.pull(pb.PullRequest()))
    back = list(store.push_pull(iter(push_frames(step=9))))  # not stale
    store.stop()                                    # the rest is the store's own
    assert store.stopped
    assert value(registry, "pstrain_ps_pushes_total") == 2
    assert value(registry, "pstrain_ps_pushes_applied_total") == 2
    assert value(registry, "pstrain_ps_pulls_total") == 2
    sent = sum(len(f) for f in out) + sum(len(f) for f in back)
    assert value(registry, "pstrain_ps_sent_bytes_total") == sent
    assert value(registry, "pstrain_ps_received_bytes_total") == sum(
        len(f) for step in (6, 9) for f in push_frames(step))
    assert value(registry, "pstrain_ps_global_step") == 10
    assert value(registry, "pstrain_ps_apply_seconds_count") == 2
    assert value(registry, "pstrain_ps_gradient_staleness_steps_sum") == 3


class FakeClient:
    def __init__(self, clock: list[float]) -> None:
        self.clock = clock
        self.last_pull_steps = [4]

    def pull(self, params: object, worker: int = 0) -> int:
        self.clock[0] += 0.1
        return 4

    def push(self, grads: object, worker: int = 0, steps: object = None) -> list[str]:
        self.clock[0] += 0.2
        return ["reply"]

    def report(self, report: pb.StatusReport) -> None:
        pass


def test_metered_client_splits_a_step_into_pull_compute_and_push() -> None:
    now = [0.0]
    registry = CollectorRegistry()
    client = MeteredClient(FakeClient(now), WorkerMetrics(registry), batch_size=64,
                           clock=lambda: now[0])
    for _ in range(2):
        assert client.pull({}) == 4
        now[0] += 0.7  # forward and backward
        assert client.push({}) == ["reply"]
    assert client.last_pull_steps == [4]  # delegated
    assert value(registry, "pstrain_worker_steps_total") == 2
    assert value(registry, "pstrain_worker_samples_total") == 128
    assert value(registry, "pstrain_worker_step_seconds_sum") == pytest.approx(2.0)
    assert value(registry, "pstrain_worker_compute_seconds_sum") == pytest.approx(1.4)
    assert value(registry, "pstrain_worker_pull_seconds_sum") == pytest.approx(0.2)
    assert value(registry, "pstrain_worker_push_seconds_sum") == pytest.approx(0.4)
    assert value(registry, "pstrain_worker_samples_per_second") == pytest.approx(64.0)
    client.report(pb.StatusReport(loss=0.25))
    assert value(registry, "pstrain_worker_loss") == 0.25


@pytest.mark.timeout(10)
def test_metrics_are_served_over_http() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    registry = CollectorRegistry()
    PSMetrics(registry).global_step.set(7)
    serve_metrics(port, registry)
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        text = reply.read().decode()
    assert "pstrain_ps_global_step 7.0" in text


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", ["tcp", "grpc"])
@pytest.mark.parametrize("job", ["async", "sync", "large"])
def test_a_real_job_through_the_metered_store_and_client(transport: str, job: str) -> None:
    """The proxies stand in for the store (gRPC service and TCP data plane) and the
    client of a real job: async (small pushes batched in one message), sync (pushes
    streamed: the data plane reuses a frame's buffer, and the store once read the
    header's after it was overwritten), and a model whose tensors stream in chunks
    (examples/synthetic-large.yaml's, smaller)."""
    pytest.importorskip("sklearn")
    from pstrain_runtime.examples.synthetic import make_task
    from pstrain_runtime.ps.server import PSServer
    from pstrain_runtime.ps.store import ParameterStore
    from pstrain_runtime.worker.client import connect
    from pstrain_runtime.worker.context import WorkerRole
    from pstrain_runtime.worker.trainer import Trainer

    from .builders import digits_training

    ps_registry, worker_registry = CollectorRegistry(), CollectorRegistry()
    server = PSServer("127.0.0.1:0", store=MeteredStore(ParameterStore(0),
                                                         PSMetrics(ps_registry)))
    server.start()
    task = None
    training = digits_training(steps=20, transport=transport,
                               mode="sync" if job == "sync" else "async")
    if job == "large":
        training = training.model_copy(update={"batch_size": 8})
        task = make_task(hidden=1024, layers=2)
    trainer = Trainer(training, WorkerRole("ns", 0, 1), [connect(server.address, transport)],
                      task=task)
    trainer.client = MeteredClient(trainer.client, WorkerMetrics(worker_registry),
                                   training.batch_size)
    try:
        result = trainer.run()
    finally:
        trainer.close()
        server.stop(0)
    assert result.global_step == 20
    assert value(ps_registry, "pstrain_ps_global_step") == 20
    assert value(ps_registry, "pstrain_ps_pushes_applied_total") == 20
    assert value(ps_registry, "pstrain_ps_received_bytes_total") > 0
    assert value(ps_registry, "pstrain_ps_sent_bytes_total") > 0
    assert value(worker_registry, "pstrain_worker_steps_total") == 20
    assert value(worker_registry, "pstrain_worker_samples_total") == 20 * training.batch_size


def test_a_taken_metrics_port_does_not_stop_the_replica(capsys) -> None:
    from pstrain_runtime.replica import metrics_registry

    with socket.socket() as sock:
        sock.bind(("0.0.0.0", 0))
        sock.listen()
        port = sock.getsockname()[1]
        assert metrics_registry({"PSTRAIN_METRICS_PORT": str(port)}) is None
    assert "no /metrics: cannot serve" in capsys.readouterr().err
    assert metrics_registry({}) is None


def test_the_metered_store_takes_every_keyword_of_the_store() -> None:
    """A replica with metrics (every pod on Kubernetes) serves through MeteredStore: each
    call it wraps must take what the store's own takes, or the server fails the call
    (it did: a riding sparse push's `after_push`)."""
    import inspect

    from pstrain_runtime.ps.store import ParameterStore

    for name, method in vars(MeteredStore).items():
        if name.startswith("_") or not hasattr(ParameterStore, name):
            continue
        ours = inspect.signature(method).parameters.values()
        if any(p.kind is p.VAR_KEYWORD for p in ours):
            continue
        theirs = inspect.signature(getattr(ParameterStore, name)).parameters
        missing = set(theirs) - {p.name for p in ours}
        assert not missing, f"MeteredStore.{name} does not take {sorted(missing)}"


@pytest.mark.timeout(120)
def test_sparse_training_through_the_metered_store_equals_plain_pytorch() -> None:
    """Async sparse training over the data plane (each step's rows ride on the dense
    push_pull) with both servers behind MeteredStore, as a replica with metrics runs
    them: the same rows and weights as the plain PyTorch loop, every push counted."""
    import torch

    from pstrain_runtime.optim import OptimizerConfig
    from pstrain_runtime.ps.server import PSServer
    from pstrain_runtime.ps.store import ParameterStore
    from pstrain_runtime.sparse.client import SparseClient
    from pstrain_runtime.worker.client import connect

    from . import sparse_tasks
    from .builders import training
    from .test_sparse_trainer import BATCH, STEPS, reference

    torch.set_num_threads(1)
    registries = [CollectorRegistry(), CollectorRegistry()]
    servers = [PSServer("127.0.0.1:0", ps_index=i,
                        store=MeteredStore(ParameterStore(i), PSMetrics(registries[i])))
               for i in range(2)]
    for server in servers:
        server.start()
    try:
        job = training(steps=STEPS, batchSize=BATCH, mode="async", seed=3,
                       optimizer={"name": "adagrad", "learningRate": 0.1})
        chief = sparse_tasks.run_job(job, [connect(s.address, "tcp") for s in servers])[0]
        ref = reference(OptimizerConfig.from_model(job.optimizer), STEPS, seed=3)
        client = SparseClient([connect(s.address, "tcp") for s in servers], "ns")
        try:
            torch.testing.assert_close(
                client.pull(chief.sparse.specs["items"], torch.arange(sparse_tasks.ITEMS)),
                ref.items.weight.detach(), rtol=1e-6, atol=1e-6)
        finally:
            client.close()
    finally:
        for server in servers:
            server.stop(0)
    for name, weight in ref.head.named_parameters():
        torch.testing.assert_close(chief.mirror[f"head.{name}"], weight.detach(),
                                   rtol=1e-6, atol=1e-6)
    for registry in registries:
        assert value(registry, "pstrain_ps_pushes_applied_total") == STEPS
