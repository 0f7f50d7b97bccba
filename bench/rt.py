"""The one place the benchmarks touch the runtime's API (`pstrain_runtime`): a
parameter server process, and a worker-side sharded client over gRPC. When the
runtime's API moves, only this module follows it."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence

from .procs import LOOPBACK

CONNECT_DEADLINE_S = 60.0


def serve_ps(ps_index: int, port: int, timeout_s: float) -> None:
    """Run one parameter server on 127.0.0.1:`port` until a client's Shutdown RPC (or
    `timeout_s`)."""
    from pstrain_runtime.server import PSServer

    server = PSServer(f"{LOOPBACK}:{port}", ps_index=ps_index)
    server.start()
    if not server.wait(timeout_s):
        server.stop(grace=0)


def connect(ports: Sequence[int], shapes: Mapping[str, Sequence[int]], namespace: str,
            wire_dtype: str = "float32"):  # noqa: ANN201 - runtime type, imported lazily
    """A ShardedClient for a model of `shapes` over the servers on `ports`, once every
    server answers."""
    import torch
    from pstrain_runtime.client import GrpcTransport, ShardedClient, retry_unavailable
    from pstrain_runtime.placement import build_placement, param_specs

    transports = [GrpcTransport(f"{LOOPBACK}:{p}") for p in ports]
    for t in transports:
        retry_unavailable(lambda t=t: t.info(namespace), CONNECT_DEADLINE_S)
    placement = build_placement(param_specs(shapes), len(ports))
    return ShardedClient(transports, placement, namespace,
                         wire_dtype=getattr(torch, wire_dtype))


def fingerprint(shapes: Mapping[str, Sequence[int]]) -> str:
    text = ";".join(f"{k}:{list(v)}" for k, v in sorted(shapes.items()))
    return hashlib.sha256(text.encode()).hexdigest()


def init(client, params: Mapping[str, object], num_workers: int,  # noqa: ANN001
         mode: str = "async", lr: float = 1e-3) -> None:
    """Install `params` on the servers with a plain SGD optimizer."""
    from pstrain_runtime.optim import OptimizerConfig

    shapes = {k: tuple(v.shape) for k, v in params.items()}  # type: ignore[attr-defined]
    client.init(params, OptimizerConfig(name="sgd", learning_rate=lr), mode=mode,
                num_workers=num_workers, staleness_bound=None,
                fingerprint=fingerprint(shapes))


def shutdown(client, grace: float = 1.0) -> None:  # noqa: ANN001
    client.shutdown(grace)
    client.close()
