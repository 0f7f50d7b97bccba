"""Item 1, the limits of this machine, measured in the same run as everything else:
single-thread memcpy bandwidth, and loopback TCP throughput between two processes with
plain sockets.

The TCP figure is what a transport could reach on this machine: one process sends a
length-prefixed buffer, the other receives it into a preallocated buffer and answers
one byte. The time runs from the first send to the answer, the same shape as a push
that waits for its acknowledgement.
"""

from __future__ import annotations

import socket
import struct
import time
from typing import Any

from .core import GB, MIB, Config, Figure, rates, time_repeated
from .procs import LOOPBACK, run_group

CHUNK = 1 * MIB  # recv_into granularity; sends go out whole (sendall)


def memcpy(cfg: Config) -> Figure:
    """Single-threaded copy of a large buffer (torch copy_ on uint8)."""
    import torch

    torch.set_num_threads(1)
    n = cfg.memcpy_mib * MIB
    src = torch.ones(n, dtype=torch.uint8)
    dst = torch.empty_like(src)
    secs = time_repeated(lambda: dst.copy_(src), cfg.warmup + 1, max(cfg.repeats, 5))
    return Figure.of("limits.memcpy", f"memcpy {cfg.memcpy_mib} MiB (1 thread)", "GB/s",
                     rates(n / GB, secs))


def _recv_exact(sock: socket.socket, view: memoryview, chunk: int = CHUNK) -> None:
    got = 0
    total = len(view)
    while got < total:
        k = sock.recv_into(view[got:], min(chunk, total - got))
        if k == 0:
            raise ConnectionError(f"peer closed after {got} of {total} bytes")
        got += k


def _tcp_peer(rank: int, sizes: list[int], reps: int, recv_chunk: int, port_conn: Any) -> Any:
    """rank 0 receives (and acks), rank 1 sends and times."""
    if rank == 0:
        srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        srv.bind((LOOPBACK, 0))
        srv.listen(1)
        port_conn.send(srv.getsockname()[1])
        srv.settimeout(60)
        conn, _ = srv.accept()
        conn.settimeout(120)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        buf = bytearray(max(sizes))
        view = memoryview(buf)
        header = bytearray(8)
        for _ in range(len(sizes) * reps):
            _recv_exact(conn, memoryview(header))
            (n,) = struct.unpack("!Q", header)
            _recv_exact(conn, view[:n], recv_chunk)
            conn.sendall(b"k")
        conn.close()
        srv.close()
        return None
    port = port_conn.recv()
    sock = socket.create_connection((LOOPBACK, port), timeout=60)
    sock.settimeout(120)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    payload = memoryview(bytearray(b"\x01") * max(sizes))
    ack = bytearray(1)
    out: dict[int, list[float]] = {}
    for n in sizes:
        secs = []
        for _ in range(reps):
            t0 = time.perf_counter()
            sock.sendall(struct.pack("!Q", n))
            sock.sendall(payload[:n])
            _recv_exact(sock, memoryview(ack))
            secs.append(time.perf_counter() - t0)
        out[n] = secs
    sock.close()
    return out


def tcp_loopback(cfg: Config, sizes_mib: list[int], recv_chunk: int = CHUNK) -> list[Figure]:
    """Loopback TCP GB/s for each size, one connection, 2 processes."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    sizes = [m * MIB for m in sizes_mib]
    reps = cfg.warmup + cfg.repeats
    res = run_group(_tcp_peer, 2, args=(sizes, reps, recv_chunk), rank_args=[(a,), (b,)],
                    timeout_s=cfg.item_time_limit_s)
    figs = []
    for m, n in zip(sizes_mib, sizes, strict=True):
        secs = res[1][n][cfg.warmup:]
        figs.append(Figure.of(f"limits.tcp.{m}MiB", f"loopback TCP, {m} MiB transfers",
                              "GB/s", rates(n / GB, secs)))
    return figs


def run(cfg: Config) -> list[Figure]:
    sizes = sorted({*cfg.transport_mib, cfg.ps_step_mib})
    return [memcpy(cfg), *tcp_loopback(cfg, sizes)]

