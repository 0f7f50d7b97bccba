"""Waiting for parameter servers to answer their gRPC health check (grpc.health.v1).

Used by the local runner's readiness gate and by a trainer's startup barrier in a
gang-started job, where every pod starts at once and the runtime itself keeps the
order: workers and the chief wait until every parameter server serves.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .transport.tls import TlsFiles


def wait_serving(address: str, stop: threading.Event, interval: float = 0.1,
                 tls: TlsFiles | None = None) -> bool:
    """Poll grpc.health.v1 Check at `address` until SERVING (True) or `stop` is set; over
    TLS with `tls` (a job with spec.security.tls serves only TLS). The health service
    needs no credentials."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    options = [("grpc.initial_reconnect_backoff_ms", 100),
               ("grpc.min_reconnect_backoff_ms", 100),
               ("grpc.max_reconnect_backoff_ms", 500)]
    channel = (grpc.insecure_channel(address, options=options) if tls is None else
               grpc.secure_channel(address, tls.grpc_channel_credentials(), options=options))
    with channel:
        stub = health_pb2_grpc.HealthStub(channel)
        request = health_pb2.HealthCheckRequest(service="")
        while not stop.is_set():
            try:
                reply = stub.Check(request, timeout=1.0, wait_for_ready=True)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return True
            except grpc.RpcError:
                pass
            stop.wait(interval)
    return False


def wait_all_serving(addresses: Sequence[str], timeout: float,
                     wait: Callable[[str, threading.Event, float], bool] = wait_serving,
                     ) -> list[str]:
    """Wait until every address serves or `timeout` seconds pass; the addresses that did
    not serve in time (empty: all did)."""
    stop = threading.Event()
    timer = threading.Timer(timeout, stop.set)
    timer.daemon = True
    timer.start()
    try:
        return [a for a in addresses if not wait(a, stop, 0.2)]
    finally:
        timer.cancel()
