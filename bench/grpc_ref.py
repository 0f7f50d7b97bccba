"""A reference point for the transport: a bare grpcio client stream of raw `bytes`
messages (no protobuf, no tensors) from one process to another, timed like a push.

It answers "is the limit in our code or in grpcio?": whatever pstrain's transport does
on top of gRPC, it cannot beat a bare stream of the same chunk size by much. The
receiver writes every message into one preallocated buffer (the one copy a tensor
transport must do too).
"""

from __future__ import annotations

import threading
import time
from concurrent import futures

from .core import GB, MIB, Config, Figure, rates
from .procs import LOOPBACK, free_port, run_group

GRPC_LIMITS = (
    ("grpc.max_send_message_length", 256 * MIB),
    ("grpc.max_receive_message_length", 256 * MIB),
)


def _grpc_peer(rank: int, port: int, total: int, chunk: int, reps: int) -> list[float] | None:
    import grpc

    if rank == 0:
        buf = memoryview(bytearray(total))
        finished = threading.Event()
        count = [0]

        def push(request_iterator, context):  # noqa: ANN001 - grpc handler signature
            off = 0
            for msg in request_iterator:
                buf[off:off + len(msg)] = msg
                off += len(msg)
            count[0] += 1
            if count[0] >= reps:
                finished.set()
            return b"ok"

        handler = grpc.method_handlers_generic_handler(
            "bench.Raw", {"Push": grpc.stream_unary_rpc_method_handler(push)})
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), options=GRPC_LIMITS)
        server.add_generic_rpc_handlers((handler,))
        server.add_insecure_port(f"{LOOPBACK}:{port}")
        server.start()
        finished.wait(timeout=300)
        server.stop(grace=1).wait(5)
        return None
    channel = grpc.insecure_channel(f"{LOOPBACK}:{port}", options=GRPC_LIMITS)
    grpc.channel_ready_future(channel).result(timeout=60)
    call = channel.stream_unary("/bench.Raw/Push")
    data = memoryview(bytes(total))

    def messages():
        for off in range(0, total, chunk):
            yield bytes(data[off:off + chunk])

    secs = []
    for _ in range(reps):
        t0 = time.perf_counter()
        call(messages(), timeout=120)
        secs.append(time.perf_counter() - t0)
    channel.close()
    return secs


def bare_grpc_stream(cfg: Config, total_mib: int, chunk_mib: int = 2) -> Figure:
    reps = cfg.warmup + cfg.repeats
    res = run_group(_grpc_peer, 2, args=(free_port(), total_mib * MIB, chunk_mib * MIB, reps),
                    timeout_s=cfg.item_time_limit_s)
    secs = res[1][cfg.warmup:]
    return Figure.of(f"transport.ref_grpc.{total_mib}MiB",
                     f"reference: bare grpcio bytes stream, {total_mib} MiB in "
                     f"{chunk_mib} MiB messages", "GB/s", rates(total_mib * MIB / GB, secs),
                     note="no pstrain code: the grpcio ceiling for this stream shape")
