"""A reference point for the transport: bare grpcio streams of raw `bytes` messages (no
protobuf, no tensors) between two processes, one shaped like a push (client stream,
timed until the reply) and one like a pull (server stream, timed until the last
message is in the client's buffer).

It answers "is the limit in our code or in grpcio?": whatever pstrain's transport does
on top of gRPC, it cannot beat a bare stream of the same chunk size by much. The
receiver writes every message into one preallocated buffer (the one copy a tensor
transport must do too).
"""

from __future__ import annotations

import threading
import time
from concurrent import futures

from .core import GB, MIB, Config, Figure, latency_samples, rates
from .procs import LOOPBACK, free_port, run_group

SMALL_BYTES = 307_240  # the digits MLP with hidden 1024
GRPC_LIMITS = (
    ("grpc.max_send_message_length", 256 * MIB),
    ("grpc.max_receive_message_length", 256 * MIB),
)


def _grpc_peer(rank: int, port: int, total: int, chunk: int, reps: int) -> dict | None:
    import grpc

    if rank == 0:
        buf = memoryview(bytearray(total))
        src = memoryview(bytes(total))
        finished = threading.Event()
        count = [0]

        def pull(request, context):  # noqa: ANN001 - grpc handler signature
            n = int(request) if request else total
            for off in range(0, n, chunk):
                yield bytes(src[off:off + min(chunk, n - off)])

        def echo(request, context):  # noqa: ANN001 - grpc handler signature
            return bytes(src[:len(request)])

        def push(request_iterator, context):  # noqa: ANN001 - grpc handler signature
            off = 0
            for msg in request_iterator:
                buf[off:off + len(msg)] = msg
                off += len(msg)
            if off == total:  # a full-size push; small ones do not count
                count[0] += 1
                if count[0] >= reps:
                    finished.set()
            return b"ok"

        handler = grpc.method_handlers_generic_handler(
            "bench.Raw", {"Push": grpc.stream_unary_rpc_method_handler(push),
                          "Pull": grpc.unary_stream_rpc_method_handler(pull),
                          "Echo": grpc.unary_unary_rpc_method_handler(echo)})
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), options=GRPC_LIMITS)
        server.add_generic_rpc_handlers((handler,))
        server.add_insecure_port(f"{LOOPBACK}:{port}")
        server.start()
        finished.wait(timeout=300)
        server.stop(grace=1).wait(5)
        return None
    channel = grpc.insecure_channel(f"{LOOPBACK}:{port}", options=GRPC_LIMITS)
    grpc.channel_ready_future(channel).result(timeout=60)
    push = channel.stream_unary("/bench.Raw/Push")
    pull = channel.unary_stream("/bench.Raw/Pull")
    data = memoryview(bytes(total))
    dst = memoryview(bytearray(total))

    def messages():
        for off in range(0, total, chunk):
            yield bytes(data[off:off + chunk])

    out: dict[str, list[float]] = {"pull": [], "push": []}
    for _ in range(reps):
        t0 = time.perf_counter()
        off = 0
        for msg in pull(b"", timeout=120):
            dst[off:off + len(msg)] = msg
            off += len(msg)
        out["pull"].append(time.perf_counter() - t0)
    # Small tensors (the digits MLP, 0.31 MB): a push and a pull as two streams, as
    # pstrain does them, against one unary call carrying the bytes both ways.
    small = bytes(SMALL_BYTES)
    echo = channel.unary_unary("/bench.Raw/Echo")
    small_calls = {
        "small_streams": lambda: (push(iter([b"h", small]), timeout=30),
                                  list(pull(str(SMALL_BYTES).encode(), timeout=30))),
        "small_unary": lambda: echo(small, timeout=30),
    }
    for kind, fn in small_calls.items():
        out[kind] = latency_samples(fn, reps)
    # The last push-shaped stream ends the server (it counts full-size pushes).
    for _ in range(reps):
        t0 = time.perf_counter()
        push(messages(), timeout=120)
        out["push"].append(time.perf_counter() - t0)
    channel.close()
    return out


def bare_grpc_stream(cfg: Config, total_mib: int, chunk_mib: int = 2) -> list[Figure]:
    reps = cfg.warmup + cfg.repeats
    res = run_group(_grpc_peer, 2, args=(free_port(), total_mib * MIB, chunk_mib * MIB, reps),
                    timeout_s=cfg.item_time_limit_s)[1]
    small = [
        Figure.of(f"transport.ref_grpc_small_{kind}",
                  f"reference: bare grpcio, {label}", "s", res[f"small_{kind}"][cfg.warmup:],
                  note="no pstrain code: per-step round-trip cost for a small model")
        for kind, label in (("streams", "push stream + pull stream of 0.31 MB each"),
                            ("unary", "one unary call carrying 0.31 MB each way "
                             "(a fused push+pull)"))
    ]
    return small + [
        Figure.of(f"transport.ref_grpc_{kind}.{total_mib}MiB",
                  f"reference: bare grpcio {shape}, {total_mib} MiB in {chunk_mib} MiB "
                  "bytes messages", "GB/s", rates(total_mib * MIB / GB, res[kind][cfg.warmup:]),
                  note="no pstrain code: a bare grpcio stream of this shape")
        for kind, shape in (("push", "client stream (push-shaped)"),
                            ("pull", "server stream (pull-shaped)"))
    ]
