"""Item 2, the transport: push and pull of one float32 tensor between a worker process
and a parameter server process over pstrain's gRPC transport (ShardedClient), for each
size. A push is timed until its reply, so it includes the server's validation and its
(SGD) update of the tensor; a pull until the last byte is in the worker's tensor.

The reference figure (a bare grpcio stream of the same bytes) shows how much of the gap
to loopback TCP is grpcio's own.
"""

from __future__ import annotations

import time

from . import rt
from .core import GB, MIB, Config, Figure, rates
from .grpc_ref import bare_grpc_stream
from .procs import free_port, run_group


def _peer(rank: int, port: int, sizes_mib: list[int], warmup: int, repeats: int,
          timeout_s: float) -> dict[str, list[float]] | None:
    if rank == 0:
        rt.serve_ps(0, port, timeout_s)
        return None
    import torch

    out: dict[str, list[float]] = {}
    client = None
    for m in sizes_mib:
        numel = m * MIB // 4
        shapes = {"w": (numel,)}
        client = rt.connect([port], shapes, namespace=f"transport-{m}")
        params = {"w": torch.zeros(numel)}
        grads = {"w": torch.full((numel,), 1e-6)}
        rt.init(client, params, num_workers=1)
        for kind, fn in (("push", lambda: client.push(grads, worker=0)),
                         ("pull", lambda: client.pull(params, worker=0))):
            secs = []
            for i in range(warmup + repeats):
                t0 = time.perf_counter()
                fn()
                dt = time.perf_counter() - t0
                if i >= warmup:
                    secs.append(dt)
            out[f"{kind}.{m}"] = secs
        if m != sizes_mib[-1]:
            client.close()
    if client is not None:
        rt.shutdown(client)
    return out


def run(cfg: Config) -> list[Figure]:
    sizes = list(cfg.transport_mib)
    res = run_group(_peer, 2, args=(free_port(), sizes, cfg.warmup, cfg.repeats,
                                    cfg.item_time_limit_s),
                    timeout_s=cfg.item_time_limit_s)[1]
    figs = []
    for kind in ("push", "pull"):
        for m in sizes:
            figs.append(Figure.of(f"transport.{kind}.{m}MiB",
                                  f"{kind} one {m} MiB fp32 tensor, worker <-> PS", "GB/s",
                                  rates(m * MIB / GB, res[f"{kind}.{m}"])))
    ref_size = next((m for m in sizes if m >= 16), sizes[-1])
    figs += bare_grpc_stream(cfg, ref_size)
    return figs
