"""TLS on both channels (`tls`), against a real in-process server on 127.0.0.1 with a
test CA: tensors round-trip unchanged over TLS on the data plane (which sends buffer by
buffer, TLS having no sendmsg) and over gRPC; a client that speaks plain TCP, or trusts
another CA, is refused and changes nothing."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from pstrain_api import constants as c
from pstrain_api import security
from pstrain_runtime.optim import OptimizerConfig
from pstrain_runtime.ps.server import PSServer
from pstrain_runtime.ps.store import PSError
from pstrain_runtime.transport import auth
from pstrain_runtime.transport.tls import TlsFiles, load_tls
from pstrain_runtime.worker.client import GrpcTransport, ShardedClient, TcpTransport
from pstrain_runtime.worker.placement import build_placement, param_specs

from tests.runtime.tls_certs import write_tls_dir

pytestmark = pytest.mark.timeout(60)

FP = "12" * 32
TOKEN = security.new_token()
CHIEF = auth.Credentials.from_token(TOKEN).only("chief")
BIG = (1280, 1024)  # 5 MiB: three 2 MiB chunks


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> TlsFiles:
    return TlsFiles(write_tls_dir(tmp_path_factory.mktemp("tls")))


@pytest.fixture
def server(tls_files: TlsFiles) -> Iterator[PSServer]:
    ps = PSServer("127.0.0.1:0", credentials=auth.Credentials.from_token(TOKEN),
                  tls=tls_files)
    ps.start()
    assert ps.data is not None and ps.data.guard is not None
    ps.data.guard.timeout_s = 1.0
    yield ps
    ps.stop(0)


def sharded(ps: PSServer, transport: type[GrpcTransport], tls: TlsFiles | None,
            credentials: auth.Credentials | None = CHIEF) -> ShardedClient:
    placement = build_placement(param_specs({"w": BIG, "b": (7,)}), 1)
    return ShardedClient([transport(ps.address, credentials, tls)], placement, "ns")


@pytest.mark.parametrize("transport", [TcpTransport, GrpcTransport], ids=["tcp", "grpc"])
def test_tensors_round_trip_over_tls(server: PSServer, tls_files: TlsFiles,
                                     transport: type[GrpcTransport]) -> None:
    client = sharded(server, transport, tls_files)
    try:
        start = {"w": torch.randn(BIG), "b": torch.randn(7)}
        client.init(start, OptimizerConfig(name="sgd", learning_rate=1.0), mode="async",
                    num_workers=1, staleness_bound=None, fingerprint=FP)
        grads = {"w": torch.randn(BIG), "b": torch.randn(7)}
        out = {"w": torch.empty(BIG), "b": torch.empty(7)}
        client.push_pull(grads, out)
        for name in start:
            torch.testing.assert_close(out[name], start[name] - grads[name])
    finally:
        client.close()


@pytest.mark.parametrize("transport", [TcpTransport, GrpcTransport], ids=["tcp", "grpc"])
@pytest.mark.parametrize("who", ["plain-tcp", "other-ca"])
def test_clients_without_the_jobs_tls_are_refused(
        server: PSServer, tmp_path: Path, transport: type[GrpcTransport], who: str) -> None:
    tls = None if who == "plain-tcp" else TlsFiles(write_tls_dir(tmp_path, "another CA"))
    client = sharded(server, transport, tls)
    try:
        with pytest.raises(PSError) as caught:
            client.init({"w": torch.zeros(BIG), "b": torch.zeros(7)}, OptimizerConfig(),
                         mode="async", num_workers=1, staleness_bound=None, fingerprint=FP)
        assert caught.value.code == "UNAVAILABLE", caught.value.message
    finally:
        client.close()
    assert not server.store.info("ns", 0).initialized


def test_a_plain_connection_to_the_data_port_is_refused(server: PSServer,
                                                        tls_files: TlsFiles) -> None:
    from pstrain_runtime.transport import dataplane

    # Learn the data port over TLS, then talk plain TCP to it.
    good = TcpTransport(server.address, CHIEF, tls_files)
    port = good.info("ns").data_port
    good.close()
    plain = dataplane.DataClient(server.address, "127.0.0.1", port, credentials=CHIEF)
    with pytest.raises(PSError) as caught:
        plain.unary(dataplane.OP_PUSH_PULL_SMALL, [b"x"], bytes)
    assert caught.value.code in ("UNAVAILABLE", "UNAUTHENTICATED")
    plain.close()


def test_tls_files_are_named_when_missing(tmp_path: Path) -> None:
    assert load_tls({}) is None
    (tmp_path / "tls.crt").write_text("x")
    with pytest.raises(ValueError, match=r"it holds no tls.key \(a kubernetes.io/tls Secret"):
        load_tls({security.ENV_TLS_DIR: str(tmp_path)})


def test_the_operators_probe_reads_status_with_the_worker_key_and_the_ca(
        server: PSServer, tls_files: TlsFiles) -> None:
    from pstrain_operator.progress import ProbeSecurity, default_fetcher
    from pstrain_runtime.proto import ps_pb2 as pb

    client = sharded(server, TcpTransport, tls_files)
    try:
        client.init({"w": torch.zeros(BIG), "b": torch.zeros(7)}, OptimizerConfig(),
                     mode="async", num_workers=1, staleness_bound=None, fingerprint=FP)
        client.report(pb.StatusReport(loss=0.25))
    finally:
        client.close()
    fetch = default_fetcher()
    worker = dict(auth.Credentials.from_token(TOKEN).only("worker").keys)
    status = fetch(server.address, 5.0, ProbeSecurity(keys=worker, ca=tls_files.ca.read_bytes()))
    assert status is not None and status["loss"] == 0.25
    assert fetch(server.address, 2.0, ProbeSecurity(keys=worker)) is None  # no TLS: refused
    assert fetch(server.address, 2.0, ProbeSecurity(ca=tls_files.ca.read_bytes())) is None


def test_the_gang_startup_barrier_reaches_a_tls_only_server(server: PSServer,
                                                           tls_files: TlsFiles) -> None:
    """A gang-started trainer waits for every PS's health check before it trains; with
    spec.security.tls the PS serves only TLS, so the barrier must speak it (it used a
    plaintext channel and timed out: StartupTimeout)."""
    from pstrain_runtime.replica import startup_barrier

    environ = {c.ENV_STARTUP_TIMEOUT: "5"}
    assert startup_barrier([server.address], environ, tls_files)
    environ = {c.ENV_STARTUP_TIMEOUT: "0.5"}
    assert not startup_barrier([server.address], environ, None)
