"""Item `auth`: what authentication (and TLS) costs per call, against the same calls
without it, in the same two processes and interleaved sample by sample.

One process serves a parameter server per mode ("off": no credentials; "auth": the
job's keys checked on every gRPC call and in every data connection's handshake; "tls":
authentication over TLS on both channels, with a test CA). The other process
is a worker with one client per mode, and times, round-robin over the modes:

- the fused push_pull of a 0.31 MB tensor (the digits MLP; one PushPullSmall message
  each way over the data plane), the call a small model pays every step;
- an Info RPC (gRPC, no tensor): the per-call cost of the gRPC proof;
- a push of one 64 MiB tensor to its reply (the stream).

Targets (issue 12): authentication adds at most 10 us per small call and makes the
64 MiB stream at most 3% slower. Per-pair differences are reported, so load that
changes during the run moves both sides of each pair alike.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

from . import rt
from .core import (GB, MIB, SMALL_CALLS, SMALL_WARMUP, Config, Figure, latency_samples, rates,
                   time_repeated)
from .procs import cpu_seconds, find_free_ports, run_group
from .transport import SMALL_NUMEL

STREAM_MIB = 64
CALLS_PER_SAMPLE = 100  # each small-call sample is the median of this many calls
TOKEN = bytes(range(32))  # a fixed job token: both processes must know it


MODES = ("off", "auth", "tls")


def _token(mode: str) -> bytes | None:
    return None if mode == "off" else TOKEN


def _tls(mode: str, tls_dir: str) -> str | None:
    return tls_dir if mode == "tls" else None


def _peer(rank: int, ports: list[int], cfg: Config, tls_dir: str,
          pids: Any) -> dict[str, Any] | None:
    import os

    pids[rank] = os.getpid()
    modes = MODES
    if rank == 0:
        servers = [rt.start_ps(0, port, _token(mode), _tls(mode, tls_dir))
                   for mode, port in zip(modes, ports, strict=True)]
        deadline = time.monotonic() + cfg.item_time_limit_s
        for server in servers:
            if not server.wait(max(0.0, deadline - time.monotonic())):
                server.stop(grace=0)
        return None
    import torch

    out: dict[str, Any] = {}
    numel = STREAM_MIB * MIB // 4
    small, big = {}, {}
    for mode, port in zip(modes, ports, strict=True):
        small[mode] = rt.connect([port], {"w": (SMALL_NUMEL,)}, "auth-small",
                                 token=_token(mode), tls_dir=_tls(mode, tls_dir))
        big[mode] = rt.connect([port], {"w": (numel,)}, "auth-stream", token=_token(mode),
                               tls_dir=_tls(mode, tls_dir))
    s_params, s_grads = {"w": torch.zeros(SMALL_NUMEL)}, {"w": torch.full((SMALL_NUMEL,), 1e-6)}
    b_params, b_grads = {"w": torch.zeros(numel)}, {"w": torch.full((numel,), 1e-6)}
    for mode in modes:
        rt.init(small[mode], s_params, num_workers=1)
        rt.init(big[mode], b_params, num_workers=1)

    samples = cfg.repeats
    per_sample = max(CALLS_PER_SAMPLE, SMALL_CALLS // samples)
    calls = {
        "push_pull_small": lambda c: c.push_pull(s_grads, s_params, worker=0),
        "info": lambda c: c.info(0),
    }
    def cpu() -> float:  # both processes: CPU time is what load cannot inflate
        return cpu_seconds(pids[0]) + cpu_seconds(pids[1])

    for kind, fn in calls.items():
        for mode in modes:  # warm every connection and cache
            time_repeated(lambda m=mode: fn(small[m]), 0, SMALL_WARMUP)
        for i in range(samples):
            for mode in modes[i % len(modes):] + modes[:i % len(modes)]:  # rotate the order
                c0 = cpu()
                secs = time_repeated(lambda m=mode: fn(small[m]), 0, per_sample)
                out[f"cpu.{kind}.{mode}"] = out.get(f"cpu.{kind}.{mode}", 0.0) + cpu() - c0
                out.setdefault(f"{kind}.{mode}", []).append(statistics.median(secs))
        out[f"calls.{kind}"] = samples * per_sample
    for i in range(cfg.warmup + samples):
        for mode in modes:
            c0, t0 = cpu(), time.perf_counter()
            big[mode].push(b_grads, worker=0)
            dt, used = time.perf_counter() - t0, cpu() - c0
            if i >= cfg.warmup:
                out.setdefault(f"stream.{mode}", []).append(dt)
                out[f"cpu.stream.{mode}"] = out.get(f"cpu.stream.{mode}", 0.0) + used
    for mode in modes:
        small[mode].close()
        rt.shutdown(big[mode])
    return out


def _compute_costs(samples: int) -> dict[str, list[float]]:
    """Seconds of the work authentication adds, in this process without sockets' noise:
    a gRPC call's proof (client) and its check (server); a data connection's handshake
    (both sides, over a socketpair)."""
    import socket
    import threading

    from pstrain_runtime.transport import auth

    every = auth.Credentials.from_token(TOKEN)
    chief = every.only("chief")
    guard = auth.ServerGuard(every)
    method = "/pstrain.v1.ParameterServer/PushPullSmall"

    def grpc_call() -> None:
        guard.check(method, [(auth.METADATA_KEY, auth.grpc_proof(chief, method))])

    connections = auth.ConnectionGuard(every)

    def handshake() -> None:
        a, b = socket.socketpair()
        with a, b:
            assert connections.may_start("bench")
            server = threading.Thread(target=connections.admit, args=(a, "bench"))
            server.start()
            auth.offer_handshake(b, chief)
            server.join()

    return {"grpc_call": latency_samples(grpc_call, samples, calls=2000),
            "handshake": latency_samples(handshake, samples, warmup=5, calls=200)}


def run(cfg: Config) -> list[Figure]:
    import multiprocessing as mp
    import tempfile

    # Test certificates (a CA and a cert for 127.0.0.1), made with `cryptography`.
    from tests.runtime.tls_certs import write_tls_dir

    modes = MODES
    with tempfile.TemporaryDirectory(prefix="pstrain-bench-tls-") as tmp:
        tls_dir = str(write_tls_dir(Path(tmp)))
        pids = mp.get_context("spawn").Array("i", 2)
        res = run_group(_peer, 2, args=(find_free_ports(len(modes)), cfg, tls_dir, pids),
                        timeout_s=cfg.item_time_limit_s)[1]
    compute = _compute_costs(cfg.repeats)
    figs: list[Figure] = [
        Figure.of("auth.compute.grpc_call", "authentication work per gRPC call: the "
                  "client's proof and the server's check (one process, no socket)", "us",
                  [s * 1e6 for s in compute["grpc_call"]]),
        Figure.of("auth.compute.handshake", "a data connection's handshake, both sides "
                  "(socketpair; once per pooled connection, not per call)", "us",
                  [s * 1e6 for s in compute["handshake"]]),
    ]
    what = {"off": "without authentication", "auth": "with authentication",
            "tls": "with authentication over TLS"}
    for mode in modes:
        figs.append(Figure.of(f"auth.push_pull_small.{mode}",
                              f"fused push_pull of a 0.31 MB tensor, {what[mode]}", "us",
                              [s * 1e6 for s in res[f"push_pull_small.{mode}"]],
                              note=f"each sample: median of "
                              f"{max(CALLS_PER_SAMPLE, SMALL_CALLS // cfg.repeats)} calls"))
        figs.append(Figure.of(f"auth.info.{mode}", f"Info RPC (gRPC), {what[mode]}", "us",
                              [s * 1e6 for s in res[f"info.{mode}"]]))
        figs.append(Figure.of(f"auth.stream.{STREAM_MIB}MiB.{mode}",
                              f"push of one {STREAM_MIB} MiB tensor to its reply, {what[mode]}",
                              "GB/s", rates(STREAM_MIB * MIB / GB, res[f"stream.{mode}"])))
    for mode in modes[1:]:
        for kind in ("push_pull_small", "info"):
            deltas = [(on - off) * 1e6 for on, off in zip(res[f"{kind}.{mode}"],
                                                          res[f"{kind}.off"], strict=True)]
            figs.append(Figure.of(f"auth.{kind}.{mode}_minus_off",
                                  f"{kind}: {what[mode]} less without, per interleaved pair",
                                  "us", deltas))
        for kind in ("push_pull_small", "info"):
            extra = (res[f"cpu.{kind}.{mode}"] - res[f"cpu.{kind}.off"]) / res[f"calls.{kind}"]
            figs.append(Figure(f"auth.cpu.{kind}.{mode}_minus_off",
                               f"{kind}: CPU per call (worker + PS) {what[mode]} less without",
                               "us", extra * 1e6,
                               note=f"over {res[f'calls.{kind}']} calls each; clock tick "
                               "10 ms"))
        gb = cfg.repeats * STREAM_MIB * MIB / GB
        figs.append(Figure(f"auth.cpu.stream.{STREAM_MIB}MiB.{mode}_per_gb",
                           f"{STREAM_MIB} MiB push: CPU seconds per GB (worker + PS), "
                           f"{what[mode]}", "CPU-s/GB", res[f"cpu.stream.{mode}"] / gb,
                           note=f"without: {res['cpu.stream.off'] / gb:.2f} CPU-s/GB"))
        slower = [(on / off - 1) * 100 for on, off in zip(res[f"stream.{mode}"],
                                                          res["stream.off"], strict=True)]
        figs.append(Figure.of(f"auth.stream.{STREAM_MIB}MiB.{mode}_slower_pct",
                              f"{STREAM_MIB} MiB push: time {what[mode]} over without, less 1, "
                              "per interleaved pair", "%", slower))
    return figs
