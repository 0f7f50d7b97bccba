"""The parameter server process edge: a grpcio server around a `ParameterStore`.

Tensor streams (Push, Init, Pull) use identity serializers: the handlers receive and
return raw frame bytes, which `wire` decodes without a protobuf copy of the payload.
The small control RPCs use the generated protobuf messages. The standard gRPC health
service (grpc.health.v1) reports SERVING while the server accepts work, so Kubernetes
can probe readiness.

Beside the gRPC port, the server listens on a data port (`dataplane.DataServer`) that
carries the same tensor calls over plain TCP; Info replies announce it in `data_port`.

Shutdown never blocks forever: the Shutdown RPC (or `PSServer.request_stop`) starts a
background stop that waits, up to a grace period, until every worker of every finished
namespace has been told the job is done, then stops the server; `PSServer.wait()`
returns and the process exits 0.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent import futures
from contextlib import contextmanager
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from ..proto import ps_pb2 as pb
from ..sparse import service as sparse_service
from ..transport import auth, wire
from ..transport.dataplane import DataServer, split_host
from ..transport.tls import TlsFiles
from .store import ParameterStore, PSError

SERVICE = "pstrain.v1.ParameterServer"
DEFAULT_SHUTDOWN_GRACE = 30.0
CONTROL_THREADS = 16  # handler threads that tensor calls may never take


@contextmanager
def aborting(context: grpc.ServicerContext) -> Iterator[None]:
    """The one translation of refusals into gRPC statuses: a PSError raised inside
    aborts the RPC with its code and message (`context.abort` raises)."""
    try:
        yield
    except PSError as exc:
        code = getattr(grpc.StatusCode, exc.code, grpc.StatusCode.UNKNOWN)
        context.abort(code, exc.message)
        raise  # unreachable: abort raises


def _caller(context: grpc.ServicerContext) -> dict[str, Any]:
    """The store's wait bounds for this call: the client's deadline, and its going
    away (cancelled, deadline passed, disconnected)."""
    return {"timeout": context.time_remaining(), "gone": lambda: not context.is_active()}


class TensorCallSlots:
    """At most `size` tensor calls at once (`with slots.take(context): ...`); one more is
    refused at once with RESOURCE_EXHAUSTED. Tensor calls can wait (a sync step, a
    pull's min_step), so without this they could take every handler thread and leave
    none for health and Info."""

    def __init__(self, size: int, ps_index: int) -> None:
        self.size = size
        self.ps_index = ps_index
        self.in_use = 0
        self._lock = threading.Lock()

    def take(self, context: grpc.ServicerContext) -> TensorCallSlots:
        with self._lock:
            free = self.in_use < self.size
            self.in_use += free
        if not free:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"parameter server {self.ps_index} is answering {self.size} "
                          "tensor calls already; retry later")
        return self

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc_info: object) -> None:
        with self._lock:
            self.in_use -= 1


class ParameterServerService:
    """RPC handlers; each one translates PSError into a gRPC status (`aborting`).
    Tensor calls hold one of `slots` while they run, and their waits in the store end
    at the client's deadline or when it goes away."""

    def __init__(self, store: ParameterStore, server: PSServer, slots: TensorCallSlots) -> None:
        self.store = store
        self.server = server
        self.slots = slots

    def push(self, request_iterator: Iterator[bytes],
             context: grpc.ServicerContext) -> pb.PushReply:
        with self.slots.take(context), aborting(context):
            return self.store.push(iter(request_iterator), **_caller(context))

    def init(self, request_iterator: Iterator[bytes], context: grpc.ServicerContext) -> pb.StepInfo:
        with self.slots.take(context), aborting(context):
            return self.store.init(iter(request_iterator))

    def pull(self, request: pb.PullRequest, context: grpc.ServicerContext) -> Iterator[bytes]:
        with self.slots.take(context):
            with aborting(context):
                frames = self.store.pull(request, **_caller(context))
            yield from frames

    def push_pull(self, request_iterator: Iterator[bytes],
                  context: grpc.ServicerContext) -> Iterator[bytes]:
        with self.slots.take(context):
            with aborting(context):
                frames = self.store.push_pull(iter(request_iterator), **_caller(context))
            yield from frames

    def push_pull_small(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        with self.slots.take(context), aborting(context):
            return self.store.push_pull_small(request, **_caller(context))

    def info(self, request: pb.NamespaceRequest, context: grpc.ServicerContext) -> pb.StepInfo:
        reply = self.store.info(request.namespace, request.worker)
        reply.data_port = self.server.data_port
        return reply

    def finish(self, request: pb.FinishRequest, context: grpc.ServicerContext) -> pb.StepInfo:
        with aborting(context):
            return self.store.finish(request.namespace)

    def shutdown(self, request: pb.ShutdownRequest,
                 context: grpc.ServicerContext) -> pb.ShutdownReply:
        grace = request.grace_seconds if request.grace_seconds > 0 else DEFAULT_SHUTDOWN_GRACE
        self.server.request_stop(grace)
        return pb.ShutdownReply(accepted=True)

    def report_status(self, request: pb.StatusReport, context: grpc.ServicerContext) -> pb.Empty:
        with aborting(context):
            self.store.report(request)
        return pb.Empty()

    def sparse(self, request_iterator: Iterator[bytes],
               context: grpc.ServicerContext) -> Iterator[bytes]:
        with aborting(context):
            role = auth.role_of_call(context.invocation_metadata())
            frames = sparse_service.handle(self.store, list(request_iterator), role)
        yield from (bytes(frame) for frame in frames)  # gRPC carries bytes only

    def get_job_status(self, request: pb.NamespaceRequest,
                       context: grpc.ServicerContext) -> pb.JobStatus:
        with aborting(context):
            return self.store.job_status(request.namespace)

    def request_checkpoint(self, request: pb.NamespaceRequest,
                           context: grpc.ServicerContext) -> pb.StepInfo:
        with aborting(context):
            return self.store.request_checkpoint(request.namespace)

    def set_workers(self, request: pb.WorkersRequest,
                    context: grpc.ServicerContext) -> pb.StepInfo:
        with aborting(context):
            return self.store.set_workers(request.namespace, request.workers)


def build_handler(service: ParameterServerService) -> grpc.GenericRpcHandler:
    unary = grpc.unary_unary_rpc_method_handler
    handlers = {
        "Push": grpc.stream_unary_rpc_method_handler(
            service.push, request_deserializer=None,
            response_serializer=pb.PushReply.SerializeToString),
        "Init": grpc.stream_unary_rpc_method_handler(
            service.init, request_deserializer=None,
            response_serializer=pb.StepInfo.SerializeToString),
        "Pull": grpc.unary_stream_rpc_method_handler(
            service.pull, request_deserializer=pb.PullRequest.FromString,
            response_serializer=None),
        "PushPull": grpc.stream_stream_rpc_method_handler(
            service.push_pull, request_deserializer=None, response_serializer=None),
        "PushPullSmall": unary(service.push_pull_small, None, None),
        "Sparse": grpc.stream_stream_rpc_method_handler(
            service.sparse, request_deserializer=None, response_serializer=None),
        "Info": unary(service.info, pb.NamespaceRequest.FromString,
                      pb.StepInfo.SerializeToString),
        "Finish": unary(service.finish, pb.FinishRequest.FromString,
                        pb.StepInfo.SerializeToString),
        "Shutdown": unary(service.shutdown, pb.ShutdownRequest.FromString,
                          pb.ShutdownReply.SerializeToString),
        "ReportStatus": unary(service.report_status, pb.StatusReport.FromString,
                              pb.Empty.SerializeToString),
        "GetJobStatus": unary(service.get_job_status, pb.NamespaceRequest.FromString,
                              pb.JobStatus.SerializeToString),
        "RequestCheckpoint": unary(service.request_checkpoint, pb.NamespaceRequest.FromString,
                                   pb.StepInfo.SerializeToString),
        "SetWorkers": unary(service.set_workers, pb.WorkersRequest.FromString,
                            pb.StepInfo.SerializeToString),
    }
    return grpc.method_handlers_generic_handler(SERVICE, handlers)


class PSServer:
    """One parameter server: start, serve, stop cleanly.

        server = PSServer("127.0.0.1:0", ps_index=0)
        port = server.start()
        ...
        server.request_stop(grace=5)   # or the Shutdown RPC
        server.wait()                  # returns once stopped
    """

    def __init__(self, bind: str, ps_index: int = 0, max_workers: int = 256,
                 store: ParameterStore | None = None, data_port: int | None = 0,
                 credentials: auth.Credentials | None = None,
                 tls: TlsFiles | None = None) -> None:
        self.bind = bind
        self.credentials = credentials  # None: every call is served (authentication off)
        self.tls = tls  # None: plain TCP on both channels
        self.data_port_wanted = data_port  # None: no data plane; 0: any free port
        # A sync push holds its handler thread until the step is applied, so the pool
        # must exceed the number of workers; threads are created only when needed.
        # Tensor calls may take all but CONTROL_THREADS of them (health and Info answer
        # even when every tensor call waits).
        if max_workers <= CONTROL_THREADS:
            raise ValueError(f"max_workers is {max_workers}; it must exceed "
                             f"{CONTROL_THREADS}, the threads kept for control calls")
        self.store = store or ParameterStore(ps_index)
        self._server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=max_workers,
                                       thread_name_prefix=f"ps{ps_index}"),
            # gRPC binds with SO_REUSEPORT by default: a second server on an address in
            # use would bind too, and the kernel would share the connections between
            # them (workers of one job reaching another job's server). Refuse instead.
            options=[*wire.GRPC_OPTIONS, ("grpc.so_reuseport", 0)],
            interceptors=auth.server_interceptors(credentials),
        )
        self.tensor_slots = TensorCallSlots(max_workers - CONTROL_THREADS, ps_index)
        service = ParameterServerService(self.store, self, self.tensor_slots)
        self._server.add_generic_rpc_handlers((build_handler(service),))
        self.health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._server)
        self._stopped = threading.Event()
        self._stop_lock = threading.Lock()
        self._stop_thread: threading.Thread | None = None
        self.port = 0
        self.data: DataServer | None = None
        self.data_port = 0

    def start(self) -> int:
        """Bind and serve; returns the bound port (useful with port 0)."""
        self.port = (self._server.add_insecure_port(self.bind) if self.tls is None else
                     self._server.add_secure_port(self.bind,
                                                  self.tls.grpc_server_credentials()))
        if self.port == 0:
            raise OSError(f"parameter server could not bind {self.bind}")
        if self.data_port_wanted is not None:
            guard = (auth.ConnectionGuard(self.credentials, self.tls and
                                          self.tls.server_context())
                     if self.credentials or self.tls else None)
            self.data = DataServer(self.store, split_host(self.bind), self.data_port_wanted,
                                   guard=guard)
            self.data_port = self.data.start()
        self._server.start()
        for name in ("", SERVICE):
            self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        return self.port

    @property
    def address(self) -> str:
        host = self.bind.rsplit(":", 1)[0]
        if host in ("0.0.0.0", "[::]", ""):
            host = "127.0.0.1"
        return f"{host}:{self.port}"

    def request_stop(self, grace: float = DEFAULT_SHUTDOWN_GRACE) -> None:
        """Stop in the background once workers know the job is done, or after `grace`."""
        with self._stop_lock:
            if self._stop_thread is not None:
                return
            self._stop_thread = threading.Thread(target=self._stop_after, args=(grace,),
                                                 name="ps-stop", daemon=True)
            self._stop_thread.start()

    def _stop_after(self, grace: float) -> None:
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and not self.store.workers_informed():
            time.sleep(0.05)  # bounded poll of in-memory state; no event to wait on
        # Let the Shutdown reply and the last replies reach their callers.
        self.stop(grace=1.0)

    def stop(self, grace: float | None = 0) -> None:
        for name in ("", SERVICE):
            self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        self.store.stop()
        stopped = self._server.stop(grace)
        if self.data is not None:
            self.data.stop(grace or 0.0)  # calls in flight get the same grace as gRPC's
        stopped.wait()
        self._stopped.set()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until stopped (True) or `timeout` passes (False). Never `join()`-forever:
        callers pass a timeout or rely on Shutdown/SIGTERM to stop the server."""
        return self._stopped.wait(timeout)
