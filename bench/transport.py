"""Item 2, the transport: push and pull of one float32 tensor between a worker process
and a parameter server process over pstrain's gRPC transport (ShardedClient), for each
size. A push is timed until its reply, so it includes the server's validation and its
(SGD) update of the tensor; a pull until the last byte is in the worker's tensor.

The same two processes also run the loopback TCP limit (plain sockets, as in item 1),
interleaved with the pushes and pulls repetition by repetition, so that the ratio to
TCP is not skewed by load that changes between items on a shared machine, and two
references without pstrain code: the same bytes as 2 MiB frames over the plain socket
with one copy per side (pstrain's framing without gRPC), and a bare grpcio stream.

The reference figure (a bare grpcio stream of the same bytes) shows how much of the gap
to loopback TCP is grpcio's own.
"""

from __future__ import annotations

import socket
import struct
import threading
import time
from typing import Any

from . import rt
from .core import GB, MIB, SMALL_CALLS, Config, Figure, latency_samples, rates
from .grpc_ref import bare_grpc_stream
from .limits import _recv_exact
from .procs import LOOPBACK, cpu_seconds, find_free_ports, run_group

FRAME = 2 * MIB  # pstrain's chunk size (pstrain_runtime.transport.wire.CHUNK_BYTES)
SMALL_NUMEL = 76_810  # parameters of the digits MLP with hidden 1024 (0.31 MB)
RAW, FRAMED = 0, 1


def _tcp_sink(port: int, max_bytes: int) -> None:
    """Receive buffers and acknowledge each. RAW: one length-prefixed buffer straight
    into the destination (as limits._tcp_peer). FRAMED: the buffer as length-prefixed
    frames of FRAME bytes, each received into a fresh buffer and then copied into the
    destination, i.e. with the one copy per side that pstrain's framing costs (see
    _framed_send); this is what a plain-socket data plane for pstrain's frames could
    reach."""
    import numpy as np

    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind((LOOPBACK, port))
    srv.listen(1)
    srv.settimeout(120)
    conn, _ = srv.accept()
    conn.settimeout(300)
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    dest = np.empty(max_bytes, dtype=np.uint8)
    view = memoryview(dest)
    header = bytearray(9)
    frame_len = bytearray(4)
    while True:
        try:
            _recv_exact(conn, memoryview(header))
        except ConnectionError:
            break
        n, mode = struct.unpack("!QB", header)
        if n == 0:
            break
        if mode == RAW:
            _recv_exact(conn, view[:n])
        else:
            got = 0
            while got < n:
                _recv_exact(conn, memoryview(frame_len))
                (k,) = struct.unpack("!I", frame_len)
                frame = bytearray(k)
                _recv_exact(conn, memoryview(frame))
                dest[got:got + k] = np.frombuffer(frame, dtype=np.uint8)
                got += k
        conn.sendall(b"k")
    conn.close()
    srv.close()


def _tcp_source(port: int) -> socket.socket:
    sock = socket.create_connection((LOOPBACK, port), timeout=60)
    sock.settimeout(300)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def _tcp_send(sock: socket.socket, payload: memoryview) -> None:
    sock.sendall(struct.pack("!QB", len(payload), RAW))
    sock.sendall(payload)
    _recv_exact(sock, memoryview(bytearray(1)))


def _framed_send(sock: socket.socket, payload: memoryview) -> None:
    """The payload as FRAME-sized frames, each built by one join (the sender's copy in
    pstrain_runtime.transport.wire.encode_chunk)."""
    sock.sendall(struct.pack("!QB", len(payload), FRAMED))
    for off in range(0, len(payload), FRAME):
        part = payload[off:off + FRAME]
        sock.sendall(b"".join((struct.pack("!I", len(part)), part)))
    _recv_exact(sock, memoryview(bytearray(1)))


def _peer(rank: int, port: int, tcp_port: int, sizes_mib: list[int], warmup: int,
          repeats: int, timeout_s: float, pids: Any) -> dict[str, list[float]] | None:
    import os

    pids[rank] = os.getpid()
    if rank == 0:
        sink = threading.Thread(target=_tcp_sink, args=(tcp_port, max(sizes_mib) * MIB),
                                daemon=True)
        sink.start()
        rt.serve_ps(0, port, timeout_s)
        sink.join(timeout=10)
        return None
    import torch

    out: dict[str, list[float]] = {}
    client = None
    sock = None
    payload = memoryview(bytearray(b"\x01") * (max(sizes_mib) * MIB))
    for m in sizes_mib:
        numel = m * MIB // 4
        shapes = {"w": (numel,)}
        client = rt.connect([port], shapes, namespace=f"transport-{m}")
        client_grpc = rt.connect([port], shapes, namespace=f"transport-grpc-{m}",
                                 transport="grpc")
        params = {"w": torch.zeros(numel)}
        grads = {"w": torch.full((numel,), 1e-6)}
        rt.init(client, params, num_workers=1)
        rt.init(client_grpc, params, num_workers=1)
        if sock is None:
            sock = _tcp_source(tcp_port)
        data = payload[:m * MIB]
        applies: list[float] = []

        def push(c=client, g=grads, applies=applies) -> None:  # noqa: ANN001
            applies.append(sum(r.apply_seconds for r in c.push(g, worker=0)))

        steps = (("tcp", lambda s=sock, d=data: _tcp_send(s, d)),
                 ("framed", lambda s=sock, d=data: _framed_send(s, d)),
                 ("push", push),
                 ("pull", lambda c=client, p=params: c.pull(p, worker=0)),
                 ("push_grpc", lambda c=client_grpc, g=grads: c.push(g, worker=0)),
                 ("pull_grpc", lambda c=client_grpc, p=params: c.pull(p, worker=0)))
        for i in range(warmup + repeats):
            for kind, fn in steps:  # interleaved: one of each per repetition
                c0 = (cpu_seconds(pids[1]), cpu_seconds(pids[0]))
                t0 = time.perf_counter()
                fn()
                dt = time.perf_counter() - t0
                c1 = (cpu_seconds(pids[1]), cpu_seconds(pids[0]))
                if i >= warmup:
                    out.setdefault(f"{kind}.{m}", []).append(dt)
                    cpu = out.setdefault(f"cpu.{kind}.{m}", [0.0, 0.0])
                    cpu[0] += c1[0] - c0[0]
                    cpu[1] += c1[1] - c0[1]
                    if kind == "push":
                        out.setdefault(f"push_stream.{m}", []).append(dt - applies[-1])
                        out.setdefault(f"apply.{m}", []).append(applies[-1])
        client_grpc.close()
        if m != sizes_mib[-1]:
            client.close()
    if client is not None:
        # Per-call overhead: a control RPC and a push/pull of a digits-MLP-sized tensor
        # (0.31 MB), the round trips a small model pays on every step.
        client.close()
        small = SMALL_NUMEL
        client = rt.connect([port], {"w": (small,)}, namespace="transport-small")
        params, grads = {"w": torch.zeros(small)}, {"w": torch.full((small,), 1e-6)}
        rt.init(client, params, num_workers=1)
        calls = [("info", lambda: client.info(0)),
                 ("push_small", lambda: client.push(grads, worker=0)),
                 ("pull_small", lambda: client.pull(params, worker=0))]
        if rt.has_push_pull(client):
            calls.append(("push_pull_small", lambda: client.push_pull(grads, params, worker=0)))
        for kind, fn in calls:
            out[kind] = latency_samples(fn, repeats)
    if sock is not None:
        sock.sendall(struct.pack("!QB", 0, RAW))
        sock.close()
    if client is not None:
        rt.shutdown(client)
    return out


def run(cfg: Config) -> list[Figure]:
    sizes = list(cfg.transport_mib)
    import multiprocessing as mp

    res = run_group(_peer, 2, args=(*find_free_ports(2), sizes, cfg.warmup,
                                    cfg.repeats, cfg.item_time_limit_s,
                                    mp.get_context("spawn").Array("i", 2)),
                    timeout_s=cfg.item_time_limit_s)[1]
    figs = [Figure.of(f"transport.tcp.{m}MiB",
                      f"loopback TCP {m} MiB, same processes, interleaved with push/pull",
                      "GB/s", rates(m * MIB / GB, res[f"tcp.{m}"])) for m in sizes]
    for kind, label in (
            ("push", "push one {m} MiB fp32 tensor to the PS, timed to its reply (with "
             "the server's NaN check and SGD update)"),
            ("push_stream", "push one {m} MiB fp32 tensor: the stream (the push less the "
             "server's SGD update, which the reply reports)"),
            ("pull", "pull one {m} MiB fp32 tensor from the PS"),
            ("push_grpc", "reference: push one {m} MiB fp32 tensor over gRPC, timed to its "
             "reply (spec.training.transport grpc)"),
            ("pull_grpc", "reference: pull one {m} MiB fp32 tensor over gRPC "
             "(spec.training.transport grpc)")):
        for m in sizes:
            figs.append(Figure.of(f"transport.{kind}.{m}MiB", label.format(m=m), "GB/s",
                                  rates(m * MIB / GB, res[f"{kind}.{m}"])))
    figs += [Figure.of(f"transport.apply.{m}MiB",
                       f"the server's SGD update of the pushed {m} MiB (apply_seconds)", "s",
                       res[f"apply.{m}"]) for m in sizes]
    figs += [Figure.of(f"transport.ref_socket_frames.{m}MiB",
                       f"reference: plain socket, {m} MiB as 2 MiB frames with one copy per "
                       "side (pstrain's framing without gRPC)", "GB/s",
                       rates(m * MIB / GB, res[f"framed.{m}"]),
                       note="no pstrain code: what a socket data plane could reach")
             for m in sizes]
    for m in sizes:
        gb = cfg.repeats * m * MIB / GB
        for kind, what in (("tcp", "loopback TCP"), ("framed", "plain-socket frames"),
                           ("push", "push"), ("pull", "pull"), ("push_grpc", "push over gRPC"),
                           ("pull_grpc", "pull over gRPC")):
            worker_s, ps_s = res[f"cpu.{kind}.{m}"]
            value = (worker_s + ps_s) / gb
            figs.append(Figure(f"transport.cpu.{kind}.{m}MiB",
                               f"CPU seconds per GB moved, {what}, {m} MiB", "CPU-s/GB",
                               value, note=f"worker process {worker_s / gb:.2f}, PS process "
                               f"{ps_s / gb:.2f} (clock tick 10 ms)"))
    for kind, label in (("info", "Info RPC (control, no tensor) round trip"),
                        ("push_small", "push of a 0.31 MB tensor (digits MLP size)"),
                        ("pull_small", "pull of a 0.31 MB tensor (digits MLP size)"),
                        ("push_pull_small", "fused push_pull of a 0.31 MB tensor")):
        if kind not in res:
            continue
        figs.append(Figure.of(f"transport.latency.{kind}", label, "s", res[kind],
                              note=f"each sample: median of {SMALL_CALLS // cfg.repeats} calls"))
    ref_size = next((m for m in sizes if m >= 16), sizes[-1])
    figs += bare_grpc_stream(cfg, ref_size)
    return figs
