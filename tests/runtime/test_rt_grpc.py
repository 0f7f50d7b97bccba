"""Real loopback gRPC: health, chunked transfer of large tensors, status codes for bad
input, the job-status RPC for the operator, and shutdown that returns."""

from __future__ import annotations

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pstrain_runtime.optim import OptimizerConfig
from pstrain_runtime.proto import ps_pb2 as pb
from pstrain_runtime.ps.server import SERVICE, PSServer
from pstrain_runtime.ps.store import PSError
from pstrain_runtime.status_client import fetch_job_status
from pstrain_runtime.transport import wire
from pstrain_runtime.worker.client import GrpcTransport, ShardedClient
from pstrain_runtime.worker.placement import build_placement, param_specs

FP = "12" * 32


def client_for(servers: list[PSServer], shapes: dict[str, tuple[int, ...]],
               namespace: str = "ns", partition_bytes: int | None = None) -> ShardedClient:
    placement = build_placement(param_specs(shapes), len(servers), partition_bytes)
    return ShardedClient([GrpcTransport(s.address) for s in servers], placement, namespace)


def test_health_service_reports_serving(servers: list[PSServer]) -> None:
    with grpc.insecure_channel(servers[0].address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for service in ("", SERVICE):
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_tensors_larger_than_8_mib_round_trip_partitioned_over_two_servers(
        servers: list[PSServer]) -> None:
    shapes = {"big": (1536, 2048), "bias": (2048,)}  # 12 MiB, split across both servers
    client = client_for(servers, shapes)
    gen = torch.Generator().manual_seed(0)
    params = {n: torch.randn(s, generator=gen) for n, s in shapes.items()}
    assert isinstance(client.placement.as_table()["big"], list)
    client.init(params, OptimizerConfig(name="sgd", learning_rate=1.0), mode="async",
                num_workers=1, staleness_bound=None, fingerprint=FP)
    grads = {n: torch.randn(s, generator=gen) for n, s in shapes.items()}
    client.push(grads)
    out = {n: torch.zeros(s) for n, s in shapes.items()}
    assert client.pull(out) == 1
    for name in shapes:
        torch.testing.assert_close(out[name], params[name] - grads[name])
    client.close()


def test_bad_input_gets_a_grpc_status_and_message(servers: list[PSServer]) -> None:
    transport = GrpcTransport(servers[0].address)
    channel = grpc.insecure_channel(servers[0].address)
    push = channel.stream_unary(f"/{SERVICE}/Push", request_serializer=None,
                                response_deserializer=pb.PushReply.FromString)
    header = pb.StreamHeader(kind=pb.STREAM_KIND_PUSH, namespace="nowhere",
                             tensors=[wire.meta_of("w", torch.zeros(2))])
    frames = list(wire.StreamWriter().frames(header, [torch.zeros(2)]))
    with pytest.raises(grpc.RpcError) as err:
        push(iter(frames))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "namespace 'nowhere' is not initialised" in err.value.details()

    client = client_for(servers[:1], {"w": (4,)})
    client.init({"w": torch.zeros(4)}, OptimizerConfig(), mode="async", num_workers=1,
                staleness_bound=None, fingerprint=FP)
    header = pb.StreamHeader(kind=pb.STREAM_KIND_PUSH, namespace="ns",
                             tensors=[wire.meta_of("w", torch.zeros(4))])
    nan = torch.tensor([0.0, float("nan"), 0.0, 0.0])
    with pytest.raises(PSError, match="contains NaN or inf") as caught:
        transport.push(wire.StreamWriter().frames(header, [nan]))
    assert caught.value.code == "INVALID_ARGUMENT"
    with pytest.raises(PSError, match="tensor 'x' is not on parameter server 0") as caught:
        list(transport.pull(pb.PullRequest(namespace="ns", names=["x"])))
    assert caught.value.code == "NOT_FOUND"
    out = {"w": torch.ones(4)}
    client.pull(out)
    assert torch.equal(out["w"], torch.zeros(4))
    channel.close()
    transport.close()


def test_job_status_for_the_operator(servers: list[PSServer]) -> None:
    address = servers[0].address
    assert fetch_job_status(address, timeout=5) is None  # no job yet
    client = client_for(servers[:1], {"w": (4,)}, namespace="default/digits")
    client.init({"w": torch.zeros(4)}, OptimizerConfig(), mode="async", num_workers=1,
                staleness_bound=None, fingerprint=FP)
    client.push({"w": torch.ones(4)})
    client.report(pb.StatusReport(loss=0.5, samples_per_sec=100.0, eval_accuracy=0.9,
                                  has_eval=True, has_checkpoint=True, checkpoint_step=1,
                                  checkpoint_path="/c/ckpt-1.pt", checkpoint_time=123.0,
                                  target_steps=10))
    status = fetch_job_status(address, timeout=5)
    assert status is not None
    status.pop("updated_time")
    assert status == {
        "namespace": "default/digits", "global_step": 1, "loss": 0.5,
        "samples_per_sec": 100.0, "eval_accuracy": 0.9, "auc": None, "logloss": None,
        "eval_metrics": {}, "checkpoint_step": 1,
        "checkpoint_path": "/c/ckpt-1.pt", "checkpoint_time": 123.0, "done": False,
        "target_steps": 10, "initialized": True, "sparse_rows": None, "sparse_bytes": None,
        "workers": [0],  # the live worker set (elastic workers)
    }
    # A task without accuracy (the CTR example) reports AUC and log loss.
    client.report(pb.StatusReport(eval_accuracy=float("nan"), has_eval=True,
                                  eval_metrics={"auc": 0.85, "logloss": 0.47}))
    status = fetch_job_status(address, timeout=5)
    assert status is not None
    assert (status["eval_accuracy"], status["auc"], status["logloss"],
            status["eval_metrics"]) == (None, 0.85, 0.47, {"auc": 0.85, "logloss": 0.47})
    assert fetch_job_status("127.0.0.1:1", timeout=0.5) is None


def test_shutdown_rpc_stops_the_server_and_wait_returns(servers: list[PSServer]) -> None:
    client = client_for(servers, {"w": (4,)})
    client.shutdown(grace=5)
    assert all(s.wait(timeout=10) for s in servers)
    with grpc.insecure_channel(servers[0].address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        with pytest.raises(grpc.RpcError):
            stub.Check(health_pb2.HealthCheckRequest(), timeout=1)


def test_shutdown_waits_for_workers_to_learn_the_job_is_done(servers: list[PSServer]) -> None:
    server = servers[0]
    client = client_for([server], {"w": (4,)})
    client.init({"w": torch.zeros(4)}, OptimizerConfig(), mode="async", num_workers=2,
                staleness_bound=None, fingerprint=FP)
    client.finish()
    client.shutdown(grace=30)
    assert not server.wait(timeout=0.3), "worker 1 has not been told yet"
    assert client.info(0, worker=1).done
    assert server.wait(timeout=10)


@pytest.mark.parametrize("small_bytes", [0, wire.CHUNK_BYTES], ids=["stream", "small"])
def test_push_pull_over_grpc(servers: list[PSServer], small_bytes: int) -> None:
    shapes = {"w": (300, 40), "b": (40,)}
    client = client_for(servers, shapes, partition_bytes=1024)
    client.small_bytes = small_bytes
    start = {n: torch.ones(s) for n, s in shapes.items()}
    client.init(start, OptimizerConfig(name="sgd", learning_rate=0.5), mode="async",
                num_workers=1, staleness_bound=None, fingerprint=FP)
    out = {n: torch.zeros(s) for n, s in shapes.items()}
    replies = client.push_pull({n: torch.ones(s) for n, s in shapes.items()}, out)
    assert [r.applied for r in replies] == [True, True]
    assert client.last_pull_steps == [1, 1]
    for name in shapes:
        assert torch.equal(out[name], torch.full(shapes[name], 0.5)), name
    nan = {n: torch.full(s, float("nan")) for n, s in shapes.items()}
    with pytest.raises(PSError, match="contains NaN or inf") as caught:
        client.push_pull(nan, out)
    assert caught.value.code == "INVALID_ARGUMENT"
    client.close()


@pytest.mark.timeout(30)
def test_request_checkpoint_flags_the_chief_until_a_checkpoint_is_reported(
        servers: list[PSServer]) -> None:
    from pstrain_runtime.status_client import request_checkpoint

    address = servers[0].address
    assert request_checkpoint(address, timeout=5) is None  # no job yet
    client = client_for(servers[:1], {"w": (4,)}, namespace="default/digits")
    client.init({"w": torch.zeros(4)}, OptimizerConfig(), mode="async", num_workers=1,
                staleness_bound=None, fingerprint=FP)
    client.push({"w": torch.ones(4)})
    client.report(pb.StatusReport(target_steps=10))
    transport = GrpcTransport(address)
    try:
        assert not transport.info("default/digits").checkpoint_requested
        assert request_checkpoint(address, timeout=5) == 1  # asked at step 1
        client.push({"w": torch.ones(4)})
        assert transport.info("default/digits").checkpoint_requested  # the chief sees it
        assert request_checkpoint(address, timeout=5) == 2  # asking again: still standing
        # A checkpoint before the requested step does not answer it; one at or after does.
        client.report(pb.StatusReport(has_checkpoint=True, checkpoint_step=0,
                                      checkpoint_path="/c/0.pt"))
        assert transport.info("default/digits").checkpoint_requested
        client.report(pb.StatusReport(has_checkpoint=True, checkpoint_step=2,
                                      checkpoint_path="/c/2.pt"))
        assert not transport.info("default/digits").checkpoint_requested
        assert fetch_job_status(address, timeout=5)["checkpoint_step"] == 2  # type: ignore[index]
    finally:
        transport.close()
        client.close()
    assert request_checkpoint("127.0.0.1:1", timeout=0.5) is None


def test_a_replaced_server_is_found_again_within_seconds(monkeypatch: pytest.MonkeyPatch,
                                                        ) -> None:
    """A parameter server pod that is replaced comes back under the same DNS name at a new
    address. gRPC's defaults (a name resolved again at most every 30 s, reconnects backed
    off up to 120 s) left the chief half a minute without it on a real cluster; the
    workers' channels resolve again after 1 s and retry every 2 s at most."""
    import pstrain_runtime.worker.client as client_module

    seen: list[dict[str, object]] = []
    real = client_module.auth.client_channel

    def capture(address: str, credentials: object, options: list[tuple[str, object]],
                tls: object = None) -> grpc.Channel:
        seen.append(dict(options))
        return real(address, credentials, options, tls)  # type: ignore[arg-type]

    monkeypatch.setattr(client_module.auth, "client_channel", capture)
    transport = GrpcTransport("ps-0.job.ns.svc:2222")
    transport.channel.close()
    (options,) = seen
    assert options["grpc.dns_min_time_between_resolutions_ms"] <= 1000
    assert options["grpc.max_reconnect_backoff_ms"] <= 2000
    assert options["grpc.max_receive_message_length"] == wire.MAX_MESSAGE_BYTES


def test_a_second_server_on_an_address_in_use_is_refused(servers: list[PSServer]) -> None:
    """gRPC binds with SO_REUSEPORT by default, so a second parameter server on the same
    address would start too and the kernel would share the connections between the two
    (a worker's calls reaching another job's server). It must fail to bind instead."""
    taken = servers[0].address
    second = PSServer(taken, ps_index=0, data_port=None)
    with pytest.raises((OSError, RuntimeError)):
        second.start()
    second.stop(0)
