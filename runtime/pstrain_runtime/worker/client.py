"""Talking to parameter servers: one server (`Transport`) and the whole sharded model
(`ShardedClient`).

`Transport` is the seam: `TcpTransport` (what `connect` returns) sends the tensor calls
over the server's plain-TCP data plane and the control calls over gRPC,
`GrpcTransport` speaks gRPC only, and `LocalTransport` calls a `ParameterStore` in this
process with the very same frames, so placement, checkpointing and the training loop
are testable without sockets.
Both raise `PSError` (code, message) for a refused request; `UNAVAILABLE` means the
server is not reachable (yet).

`ShardedClient` fans out over the servers with a thread pool: it pulls every shard
concurrently straight into the caller's tensors and pushes every shard's gradients
concurrently, and initialises or snapshots the whole model for the chief.
"""

from __future__ import annotations

import concurrent.futures as cf
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import grpc
import numpy as np
import torch

from ..optim import SLOT_NAMES, OptimizerConfig, OptimizerState
from ..proto import ps_pb2 as pb
from ..ps.server import SERVICE
from ..ps.store import SLOT_SEPARATOR, ParameterStore, PSError, optimizer_to_pb
from ..sparse import riding
from ..sparse import service as sparse_service
from ..sparse.protocol import Encoded, Frame
from ..transport import auth, dataplane, wire
from ..transport.dataplane import on_data_plane
from ..transport.tls import TlsFiles
from .placement import Piece, Placement


RETRIED_CODES = frozenset({"UNAVAILABLE", "DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED"})
# A server's refusal of this job's credentials (`transport.auth`): fatal, except while
# the chief recovers a replaced server (`retry_recovering`).
AUTH_REFUSED_CODES = frozenset({"UNAUTHENTICATED", "PERMISSION_DENIED"})


class Transport(Protocol):
    """One parameter server, as a worker sees it."""

    def push(self, frames: Iterator[bytes]) -> pb.PushReply: ...
    def init(self, frames: Iterator[bytes]) -> pb.StepInfo: ...
    def pull(self, request: pb.PullRequest) -> Iterator[bytes]: ...
    def push_pull(self, frames: Iterator[bytes]) -> Iterator[bytes]: ...
    def push_pull_small(self, message: bytes) -> bytes: ...
    def info(self, namespace: str, worker: int = 0) -> pb.StepInfo: ...
    def finish(self, namespace: str) -> pb.StepInfo: ...
    def shutdown(self, grace: float) -> None: ...
    def report(self, report: pb.StatusReport) -> None: ...
    def sparse(self, frames: Encoded) -> list[Frame]: ...
    def push_pull_sparse(self, message: bytes, rider: Encoded) -> list[Frame] | None: ...
    def close(self) -> None: ...


class LocalTransport:
    """A `ParameterStore` in this process, fed the same frames gRPC would carry."""

    def __init__(self, store: ParameterStore) -> None:
        self.store = store

    def push(self, frames: Iterator[bytes]) -> pb.PushReply:
        return self.store.push(frames)

    def init(self, frames: Iterator[bytes]) -> pb.StepInfo:
        return self.store.init(frames)

    def pull(self, request: pb.PullRequest) -> Iterator[bytes]:
        return self.store.pull(request)

    def push_pull(self, frames: Iterator[bytes]) -> Iterator[bytes]:
        return self.store.push_pull(frames)

    def push_pull_small(self, message: bytes) -> bytes:
        return self.store.push_pull_small(message)

    def info(self, namespace: str, worker: int = 0) -> pb.StepInfo:
        return self.store.info(namespace, worker)

    def finish(self, namespace: str) -> pb.StepInfo:
        return self.store.finish(namespace)

    def shutdown(self, grace: float) -> None:
        self.store.stop()

    def report(self, report: pb.StatusReport) -> None:
        self.store.report(report)

    def sparse(self, frames: Encoded) -> list[Frame]:
        return sparse_service.handle(self.store, frames)

    def push_pull_sparse(self, message: bytes, rider: Encoded) -> list[Frame] | None:
        return riding.serve(self.store, [message, *rider])

    def close(self) -> None:
        pass


def _ps_error(exc: grpc.RpcError, address: str) -> PSError:
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    details = exc.details() if hasattr(exc, "details") else str(exc)
    return PSError(code.name, f"{address}: {details}")


# A parameter server that is replaced (a new pod) comes back under the same DNS name at
# a new address. By default gRPC resolves a name again at most every 30 s and backs
# reconnects off up to 120 s, so the chief would find the new server half a minute
# late: resolve again after 1 s at the soonest, and try to reconnect every 2 s at most.
CLIENT_GRPC_OPTIONS = (
    *wire.GRPC_OPTIONS,
    ("grpc.dns_min_time_between_resolutions_ms", 1000),
    ("grpc.max_reconnect_backoff_ms", 2000),
)


class GrpcTransport:
    """A parameter server at `address` over gRPC (raw-bytes frame streams)."""

    def __init__(self, address: str, credentials: auth.Credentials | None = None,
                 tls: TlsFiles | None = None) -> None:
        self.address = address
        self.credentials = credentials  # proven on every call (None: authentication off)
        self.tls = tls  # None: plain TCP
        self.channel = auth.client_channel(address, credentials, list(CLIENT_GRPC_OPTIONS), tls)
        m = f"/{SERVICE}/"
        self._push = self.channel.stream_unary(m + "Push", request_serializer=None,
                                               response_deserializer=pb.PushReply.FromString)
        self._init = self.channel.stream_unary(m + "Init", request_serializer=None,
                                               response_deserializer=pb.StepInfo.FromString)
        self._pull = self.channel.unary_stream(m + "Pull",
                                               request_serializer=pb.PullRequest.SerializeToString,
                                               response_deserializer=None)
        self._push_pull = self.channel.stream_stream(m + "PushPull", request_serializer=None,
                                                     response_deserializer=None)
        self._push_pull_small = self.channel.unary_unary(m + "PushPullSmall",
                                                         request_serializer=None,
                                                         response_deserializer=None)
        self._info = self.channel.unary_unary(m + "Info", pb.NamespaceRequest.SerializeToString,
                                              pb.StepInfo.FromString)
        self._finish = self.channel.unary_unary(m + "Finish", pb.FinishRequest.SerializeToString,
                                                pb.StepInfo.FromString)
        self._shutdown = self.channel.unary_unary(m + "Shutdown",
                                                  pb.ShutdownRequest.SerializeToString,
                                                  pb.ShutdownReply.FromString)
        self._report = self.channel.unary_unary(m + "ReportStatus",
                                                pb.StatusReport.SerializeToString,
                                                pb.Empty.FromString)
        self._sparse = self.channel.stream_stream(m + "Sparse", request_serializer=None,
                                                  response_deserializer=None)

    def _call(self, fn: Callable[..., object], *args: object, **kw: object) -> object:
        try:
            return fn(*args, **kw)
        except grpc.RpcError as exc:
            raise _ps_error(exc, self.address) from exc

    def push(self, frames: Iterator[bytes]) -> pb.PushReply:
        return self._call(self._push, frames)  # type: ignore[return-value]

    def init(self, frames: Iterator[bytes]) -> pb.StepInfo:
        return self._call(self._init, frames)  # type: ignore[return-value]

    def pull(self, request: pb.PullRequest) -> Iterator[bytes]:
        try:
            yield from self._pull(request)
        except grpc.RpcError as exc:
            raise _ps_error(exc, self.address) from exc

    def push_pull(self, frames: Iterator[bytes]) -> Iterator[bytes]:
        try:
            yield from self._push_pull(frames)
        except grpc.RpcError as exc:
            raise _ps_error(exc, self.address) from exc

    def push_pull_small(self, message: bytes) -> bytes:
        return self._call(self._push_pull_small, message)  # type: ignore[return-value]

    def info(self, namespace: str, worker: int = 0) -> pb.StepInfo:
        return self._call(self._info, pb.NamespaceRequest(namespace=namespace, worker=worker),
                          timeout=10)  # type: ignore[return-value]

    def finish(self, namespace: str) -> pb.StepInfo:
        return self._call(self._finish, pb.FinishRequest(namespace=namespace),
                          timeout=10)  # type: ignore[return-value]

    def shutdown(self, grace: float) -> None:
        self._call(self._shutdown, pb.ShutdownRequest(grace_seconds=grace), timeout=10)

    def report(self, report: pb.StatusReport) -> None:
        self._call(self._report, report, timeout=10)

    def sparse(self, frames: Encoded) -> list[Frame]:
        as_bytes = [bytes(f) for f in frames]  # gRPC carries bytes only (`encode` gives views)
        return self._call(lambda: list(self._sparse(iter(as_bytes))))  # type: ignore[return-value]

    def push_pull_sparse(self, message: bytes, rider: Encoded) -> list[Frame] | None:
        """None: gRPC has no riding call (`sparse.riding`); the caller makes two."""
        return None

    def close(self) -> None:
        self.channel.close()


class TcpTransport(GrpcTransport):
    """A parameter server at `address`: tensor calls over its TCP data plane (see
    `dataplane`), control calls over gRPC. The data port comes from the server's Info
    reply, asked once and again after a data connection failed (a restarted server may
    listen elsewhere); a server that announces none gets every call over gRPC."""

    def __init__(self, address: str, credentials: auth.Credentials | None = None,
                 tls: TlsFiles | None = None) -> None:
        super().__init__(address, credentials, tls)
        self._data: dataplane.DataClient | None = None
        self._data_known = False
        self._data_lock = threading.Lock()

    def _data_client(self) -> dataplane.DataClient | None:
        with self._data_lock:
            if self._data is not None and self._data.broken:
                self._data.close()
                self._data, self._data_known = None, False
            if not self._data_known:
                port = super().info("").data_port  # raises UNAVAILABLE while it is down
                if port:
                    self._data = dataplane.DataClient(
                        self.address, dataplane.split_host(self.address), port,
                        credentials=self.credentials,
                        tls_context=self.tls and self.tls.client_context())
                self._data_known = True
            return self._data

    def push(self, frames: Iterator[bytes]) -> pb.PushReply:
        data = self._data_client()
        if data is None:
            return super().push(frames)
        return data.unary(dataplane.OP_PUSH, frames,  # type: ignore[return-value]
                          pb.PushReply.FromString)

    def init(self, frames: Iterator[bytes]) -> pb.StepInfo:
        data = self._data_client()
        if data is None:
            return super().init(frames)
        return data.unary(dataplane.OP_INIT, frames,  # type: ignore[return-value]
                          pb.StepInfo.FromString)

    def pull(self, request: pb.PullRequest) -> Iterator[bytes]:
        data = self._data_client()
        if data is None:
            return super().pull(request)
        return data.call(dataplane.OP_PULL, [request.SerializeToString()])  # type: ignore[return-value]

    def push_pull(self, frames: Iterator[bytes]) -> Iterator[bytes]:
        data = self._data_client()
        if data is None:
            return super().push_pull(frames)
        return data.call(dataplane.OP_PUSH_PULL, frames)  # type: ignore[return-value]

    def push_pull_small(self, message: bytes) -> bytes:
        data = self._data_client()
        if data is None:
            return super().push_pull_small(message)
        return data.unary(dataplane.OP_PUSH_PULL_SMALL, [message],  # type: ignore[return-value]
                          bytes)

    def sparse(self, frames: Encoded) -> list[Frame]:
        data = self._data_client()
        if data is None:
            return super().sparse(frames)
        return list(data.call(dataplane.OP_SPARSE, frames, owned=True))

    def push_pull_sparse(self, message: bytes, rider: Encoded) -> list[Frame] | None:
        data = self._data_client()
        if data is None:
            return None
        return list(data.call(dataplane.OP_PUSH_PULL_SPARSE, [message, *rider], owned=True))

    def has_data_plane(self) -> bool:
        """Whether calls go over the data plane (its `..._sent` halves work)."""
        return self._data_client() is not None

    def push_pull_sent(self, message: bytes, rider: Encoded | None
                       ) -> Callable[[], bytes | list[Frame]] | None:
        """`push_pull_small` (with a `rider`: `push_pull_sparse`) in two halves: the
        request sent now, and a function that reads the reply (the dense message; with
        a rider, the reply's frames). None, nothing sent: no data plane."""
        data = self._data_client()
        if data is None:
            return None
        if rider is None:
            small = data.send(dataplane.OP_PUSH_PULL_SMALL, [message])
            return lambda: data.one_message(dataplane.OP_PUSH_PULL_SMALL, small,  # type: ignore[return-value]
                                            bytes)
        both = data.send(dataplane.OP_PUSH_PULL_SPARSE, [message, *rider], owned=True)
        return lambda: list(both)

    def sparse_sent(self, frames: Encoded) -> Callable[[], list[Frame]] | None:
        """`sparse` in two halves: the request sent now, and a function that reads the
        reply (None, nothing sent: no data plane, call `sparse`)."""
        data = self._data_client()
        if data is None:
            return None
        reply = data.send(dataplane.OP_SPARSE, frames, owned=True)
        return lambda: list(reply)

    def close(self) -> None:
        with self._data_lock:
            if self._data is not None:
                self._data.close()
        super().close()


def connect(address: str, transport: str = "tcp",
            credentials: auth.Credentials | None = None,
            tls: TlsFiles | None = None) -> Transport:
    """The transport to a parameter server at `address`, as `spec.training.transport`
    names it: "tcp" (`TcpTransport`) or "grpc" (`GrpcTransport`, tensors over gRPC),
    proving `credentials` on every call (see `auth`), over TLS with `tls`."""
    if transport == "grpc":
        return GrpcTransport(address, credentials, tls)
    if transport == "tcp":
        return TcpTransport(address, credentials, tls)
    raise ValueError(f"transport is {transport!r}; it must be tcp or grpc")


@dataclass
class ShardState:
    """What `ShardedClient.pull_state` returns: the model's full state from all servers."""

    global_step: int
    params: dict[str, torch.Tensor]
    slots: dict[str, dict[str, torch.Tensor]]
    slot_steps: dict[str, int]
    positions: list[int] = field(default_factory=list)  # per worker, server 0's


def _piece_view(full: torch.Tensor, piece: Piece) -> torch.Tensor:
    return full[piece.row_start:piece.row_end] if piece.partitioned else full


class ShardedClient:
    """The model's parameters spread over `transports` according to `placement`."""

    def __init__(self, transports: Sequence[Transport], placement: Placement,
                 namespace: str, wire_dtype: torch.dtype = torch.float32,
                 chunk_bytes: int = wire.CHUNK_BYTES,
                 small_bytes: int = wire.CHUNK_BYTES) -> None:
        if len(transports) != placement.num_ps:
            raise ValueError(f"placement is for {placement.num_ps} servers, got "
                             f"{len(transports)} transports")
        self.transports = list(transports)
        self.placement = placement
        self.namespace = namespace
        self.wire_dtype = wire_dtype
        self.writer = wire.StreamWriter(chunk_bytes)
        self.small_bytes = small_bytes  # push_pull: shards up to this size use one message
        self.shards = [placement.shard(i) for i in range(placement.num_ps)]
        self.pool = cf.ThreadPoolExecutor(max_workers=max(1, placement.num_ps),
                                          thread_name_prefix="ps-client")
        self._wire_buffers: dict[str, torch.Tensor] = {}
        self.last_pull_steps: list[int] = [0] * placement.num_ps  # per server, last pull
        # Server 0's worker-set size at the last pull (elastic workers; 0: not pulled yet)
        self.last_pull_workers = 0
        # Per server, the generation of the parameters last pulled: pushes carry it, and
        # a server initialised again since refuses them (ABORTED).
        self.generations: list[int] = [0] * placement.num_ps
        # Per server, the reply frames of the sparse push the last push_pull carried.
        self.rider_replies: list[list[Frame] | None] = [None] * placement.num_ps

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        for t in self.transports:
            t.close()

    # ----------------------------------------------------------------- fan-out helper
    def _all(self, fn: Callable[[int], object], indices: Iterable[int] | None = None,
             wait_all: bool = False) -> list:
        """Run fn(ps) for every server concurrently; raise the first failure at once
        (`wait_all`: once every call has ended, so none is still running)."""
        idx = list(range(len(self.transports)) if indices is None else indices)
        if len(idx) == 1:  # one server: call it here, no thread hop
            return [fn(idx[0])]
        if wait_all:  # the first server's call on this thread: one thread hop fewer
            futs = {self.pool.submit(fn, i): i for i in idx[1:]}
            try:
                first = [fn(idx[0])]
            finally:
                cf.wait(futs)
        else:  # all on the pool, so that a failure is raised while others still run
            futs = {self.pool.submit(fn, i): i for i in idx}
            first = []
            cf.wait(futs, return_when=cf.FIRST_EXCEPTION)
        for fut in futs:
            if fut.done() and fut.exception() is not None:
                raise fut.exception()  # type: ignore[misc]
        return first + [f.result() for f in sorted(futs, key=lambda f: futs[f])]

    # ----------------------------------------------------------------- pull / push
    def pull(self, params: Mapping[str, torch.Tensor], worker: int = 0,
             min_step: int = 0) -> int:
        """Pull every shard concurrently into `params` (contiguous CPU tensors, written in
        place). Returns the global step of server 0 at pull time."""
        def one(ps: int) -> int:
            shard = self.shards[ps]
            request = pb.PullRequest(namespace=self.namespace, names=[p.key for p in shard],
                                     worker=worker, min_step=min_step if ps == 0 else 0)
            targets = [wire.byte_view(_piece_view(params[p.param], p)) for p in shard]
            header = self._read(self.transports[ps].pull(request), shard, targets)
            self.generations[ps] = header.generation
            if ps == 0:
                self.last_pull_workers = header.num_workers
            return header.global_step

        steps = [int(x) for x in self._all(one)]
        self.last_pull_steps = steps
        return steps[0]

    def _read(self, frames: Iterator[bytes], shard: list[Piece],
              targets: list[np.ndarray]) -> pb.StreamHeader:
        def targets_for(header: pb.StreamHeader) -> list[np.ndarray]:
            names = [m.name for m in header.tensors]
            if names != [p.key for p in shard]:
                raise PSError("INTERNAL", f"the server sent tensors {names[:4]}, expected "
                              f"{[p.key for p in shard][:4]}")
            return targets

        try:
            return wire.read_stream(frames, targets_for)
        except wire.WireError as exc:
            raise PSError("DATA_LOSS", f"pull: {exc}") from exc

    def _wire_grad(self, piece: Piece, grad: torch.Tensor) -> torch.Tensor:
        view = _piece_view(grad, piece)
        if view.dtype == self.wire_dtype and view.is_contiguous():
            return view
        buf = self._wire_buffers.get(piece.key)
        if buf is None:
            buf = self._wire_buffers[piece.key] = torch.empty(view.shape, dtype=self.wire_dtype)
        buf.copy_(view)
        return buf

    def push_frames(self, ps: int, grads: Mapping[str, torch.Tensor], worker: int,
                    step: int) -> Iterator[bytes]:
        shard = self.shards[ps]
        tensors = [self._wire_grad(p, grads[p.param]) for p in shard]
        header = pb.StreamHeader(kind=pb.STREAM_KIND_PUSH, namespace=self.namespace,
                                 worker=worker, step=step, generation=self.generations[ps],
                                 tensors=[wire.meta_of(p.key, t) for p, t in zip(shard, tensors,
                                                                                 strict=True)])
        return self.writer.frames(header, tensors)

    def push_one(self, ps: int, grads: Mapping[str, torch.Tensor], worker: int,
                 step: int) -> pb.PushReply:
        return self.transports[ps].push(self.push_frames(ps, grads, worker, step))

    def push(self, grads: Mapping[str, torch.Tensor], worker: int = 0,
             step: int | Sequence[int] = 0) -> list[pb.PushReply]:
        """Push every shard's gradients concurrently; replies in server order. `step` is
        the sync step, one for all servers or one per server."""
        steps = [step] * len(self.transports) if isinstance(step, int) else list(step)
        return self._all(lambda ps: self.push_one(ps, grads, worker, steps[ps]))

    def push_pull_one(self, ps: int, grads: Mapping[str, torch.Tensor],
                      params: Mapping[str, torch.Tensor], worker: int, step: int,
                      rider: Encoded | None = None
                      ) -> tuple[pb.PushReply, int, list[Frame] | None]:
        """Push server `ps`'s gradients and read its parameters back into `params` in
        one round trip; returns the push's reply, the pulled global step and, with a
        `rider` (a sparse push's frames, `sparse.riding`), the sparse reply's frames:
        the rider goes in the same call where the transport has one and the shard is
        small, else as its own call after this one when the push was applied (None:
        it was not sent)."""
        return self._push_pull_begun(ps, grads, params, worker, step, rider, send=False)()

    def _push_pull_begun(self, ps: int, grads: Mapping[str, torch.Tensor],
                         params: Mapping[str, torch.Tensor], worker: int, step: int,
                         rider: Encoded | None, send: bool
                         ) -> Callable[[], tuple[pb.PushReply, int, list[Frame] | None]]:
        """`push_pull_one` in two halves: with `send`, a small shard's request goes now
        where the transport can (`TcpTransport.push_pull_sent`); the function returned
        reads the reply, or makes the whole call."""
        shard = self.shards[ps]
        targets = [wire.byte_view(_piece_view(params[p.param], p)) for p in shard]
        frames = self.push_frames(ps, grads, worker, step)
        transport = self.transports[ps]
        # One message each way for a small shard: a unary call costs far less than two
        # streams.
        message = wire.encode_batch(frames) if self._small(ps) else None
        begin = getattr(transport, "push_pull_sent", None) if send else None
        sent = begin(message, rider) if begin is not None and message is not None else None

        def finish() -> tuple[pb.PushReply, int, list[Frame] | None]:
            carried: list[Frame] | None = None
            if message is None:
                replies = transport.push_pull(frames)
            else:
                got: bytes | list[Frame] | None = None
                if sent is not None:
                    got = sent()
                elif rider is not None:  # (None: the transport has no riding call)
                    got = transport.push_pull_sparse(message, rider)
                if isinstance(got, list):  # the dense reply and the rider's
                    dense, carried = riding.split_reply(got, f"parameter server {ps}")
                else:
                    dense = got if got is not None else transport.push_pull_small(message)
                try:
                    replies = iter(wire.decode_batch(dense))
                except wire.WireError as exc:
                    raise PSError("DATA_LOSS", f"push_pull: {exc}") from exc
            header = self._read(replies, shard, targets)
            if not header.HasField("push_reply"):
                raise PSError("INTERNAL", "the server answered a PushPull without the "
                              "push's reply")
            self.generations[ps] = header.generation
            if ps == 0:
                self.last_pull_workers = header.num_workers
            if rider is not None and carried is None and header.push_reply.applied:
                carried = transport.sparse(rider)
            return header.push_reply, int(header.global_step), carried

        return finish

    def push_pull(self, grads: Mapping[str, torch.Tensor], params: Mapping[str, torch.Tensor],
                  worker: int = 0, step: int | Sequence[int] = 0,
                  riders: Sequence[Encoded | None] | None = None
                  ) -> list[pb.PushReply]:
        """`push`, then `pull` into `params`, with one round trip per server (all
        concurrently). Each server's parameters are read after its push returned, as a
        `pull` after `push` would read them; `last_pull_steps` is updated the same way.
        `params` must not be in use (e.g. by backward) while this runs. `riders`: per
        server, a sparse push's frames to carry (`push_pull_one`); the sparse replies'
        frames are left in `rider_replies` (per server; None: not sent). Over the data
        plane with small shards every request is sent, then every reply read, from this
        thread (no thread hop); else the calls run on threads."""
        steps = [step] * len(self.transports) if isinstance(step, int) else list(step)
        riders = list(riders) if riders is not None else [None] * len(self.transports)
        if len(self.transports) > 1 and all(
                on_data_plane(t) and self._small(ps) for ps, t in enumerate(self.transports)):
            # Only this thread writes into `params`: a failure stops every write.
            begun = [self._push_pull_begun(ps, grads, params, worker, steps[ps],
                                           riders[ps], send=True)
                     for ps in range(len(self.transports))]
            results = [finish() for finish in begun]
        else:
            # Wait for every server even when one fails: none may write into `params`
            # later.
            results = self._all(lambda ps: self.push_pull_one(ps, grads, params, worker,
                                                              steps[ps], riders[ps]),
                                wait_all=True)
        self.last_pull_steps = [pulled for _, pulled, _ in results]
        self.rider_replies = [carried for _, _, carried in results]
        return [reply for reply, _, _ in results]

    def _small(self, ps: int) -> bool:
        """Whether server `ps`'s shard goes in one message each way."""
        return sum(p.nbytes for p in self.shards[ps]) <= self.small_bytes

    # ----------------------------------------------------------------- chief
    def init(self, params: Mapping[str, torch.Tensor], optimizer: OptimizerConfig, *,
             mode: str, num_workers: int, staleness_bound: int | None, fingerprint: str,
             global_step: int = 0, target_steps: int = 0, checkpoint_every: int = 0,
             states: Mapping[str, OptimizerState] | None = None,
             only: Iterable[int] | None = None,
             positions: Sequence[int] = ()) -> list[pb.StepInfo]:
        """Install `params` (and optimizer `states` keyed by piece key) on the servers
        (`only` a subset). Without states the servers start fresh optimizer state. With
        `checkpoint_every`, each server keeps a copy of its shard at every multiple of
        it, for `pull_state(at_step=...)`. `positions`: where each worker's data resumes
        (from a checkpoint)."""
        def one(ps: int) -> pb.StepInfo:
            shard = self.shards[ps]
            header = pb.StreamHeader(
                kind=pb.STREAM_KIND_INIT, namespace=self.namespace, global_step=global_step,
                optimizer=optimizer_to_pb(optimizer), mode=mode, num_workers=num_workers,
                staleness_bound=-1 if staleness_bound is None else staleness_bound,
                fingerprint=bytes.fromhex(fingerprint), ps_index=ps,
                target_steps=target_steps, checkpoint_every=checkpoint_every,
                positions=positions)
            tensors: list[torch.Tensor] = []
            for piece in shard:
                t = _piece_view(params[piece.param], piece).detach().contiguous()
                tensors.append(t)
                header.tensors.append(wire.meta_of(piece.key, t))
            if states is not None:
                for piece in shard:
                    state = states[piece.key]
                    header.slot_steps.append(state.step)
                    for slot in sorted(SLOT_NAMES[optimizer.name]):
                        t = state.slots[slot].detach().contiguous()
                        tensors.append(t)
                        header.tensors.append(wire.meta_of(f"{piece.key}{SLOT_SEPARATOR}{slot}", t))
            return self.transports[ps].init(self.writer.frames(header, tensors))

        return self._all(one, only)

    def pull_state(self, at_step: int = 0) -> ShardState:
        """Parameters and optimizer state of the whole model, each server's snapshot
        taken under its apply lock (for checkpoints): the copy each kept when its step
        reached `at_step` where it has one, else its current state."""
        def one(ps: int) -> tuple[pb.StreamHeader, dict[str, torch.Tensor]]:
            shard = self.shards[ps]
            request = pb.PullRequest(namespace=self.namespace, names=[p.key for p in shard],
                                     include_slots=True, consistent=True, at_step=at_step)
            out: dict[str, torch.Tensor] = {}

            def targets_for(header: pb.StreamHeader) -> list[np.ndarray]:
                views = []
                for meta in header.tensors:
                    t = torch.empty(tuple(meta.shape), dtype=wire.parse_dtype(meta.dtype))
                    out[meta.name] = t
                    views.append(wire.byte_view(t))
                return views

            try:
                header = wire.read_stream(self.transports[ps].pull(request), targets_for)
            except wire.WireError as exc:
                raise PSError("DATA_LOSS", f"pull_state: {exc}") from exc
            return header, out

        results = self._all(one)
        state = ShardState(global_step=int(results[0][0].global_step), params={}, slots={},
                           slot_steps={}, positions=list(results[0][0].positions))
        for header, tensors in results:
            keys = [m.name for m in header.tensors if SLOT_SEPARATOR not in m.name]
            for key, step in zip(keys, header.slot_steps, strict=False):
                state.slot_steps[key] = int(step)
            for name, t in tensors.items():
                key, sep, slot = name.partition(SLOT_SEPARATOR)
                if sep:
                    state.slots.setdefault(key, {})[slot] = t
                else:
                    state.params[key] = t
        return state

    def assemble(self, piece_tensors: Mapping[str, torch.Tensor],
                 like: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Full parameters from per-piece tensors (inverse of partitioning)."""
        out = {name: torch.empty_like(t, device="cpu") for name, t in like.items()}
        for piece in self.placement.pieces:
            _piece_view(out[piece.param], piece).copy_(piece_tensors[piece.key])
        return out

    def split(self, full: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Per-piece tensors from full tensors (views where possible)."""
        return {p.key: _piece_view(full[p.param], p) for p in self.placement.pieces}

    # ----------------------------------------------------------------- control
    def info(self, ps: int, worker: int = 0) -> pb.StepInfo:
        return self.transports[ps].info(self.namespace, worker)

    def info_all(self, worker: int = 0) -> list[pb.StepInfo | PSError]:
        """Every server's StepInfo (or its error). Asking as `worker` after the job is done
        tells each server that this worker knows, so it can shut down without waiting."""
        def one(ps: int) -> pb.StepInfo | PSError:
            try:
                return self.info(ps, worker)
            except PSError as exc:
                return exc
        return self._all(one)

    def finish(self) -> None:
        self._all(lambda ps: self.transports[ps].finish(self.namespace))

    def shutdown(self, grace: float) -> None:
        self._all(lambda ps: self.transports[ps].shutdown(grace))

    def report(self, report: pb.StatusReport) -> None:
        report.namespace = self.namespace
        self.transports[0].report(report)


def retry_unavailable(fn: Callable[[], object], deadline_s: float,
                      clock: Callable[[], float] = time.monotonic,
                      sleep: Callable[[float], None] = time.sleep,
                      codes: frozenset[str] = RETRIED_CODES) -> object:
    """Call fn until it stops failing with UNAVAILABLE (or a server's refusal for now:
    DEADLINE_EXCEEDED, RESOURCE_EXHAUSTED; or any of `codes`), with exponential
    backoff, for at most `deadline_s` seconds; then re-raise the last error."""
    end = clock() + deadline_s
    delay = 0.05
    while True:
        try:
            return fn()
        except PSError as exc:
            if exc.code not in codes or clock() >= end:
                raise
        sleep(min(delay, max(0.0, end - clock())))
        delay = min(delay * 2, 2.0)


def retry_recovering(fn: Callable[[], object], deadline_s: float,
                     clock: Callable[[], float] = time.monotonic,
                     sleep: Callable[[float], None] = time.sleep) -> object:
    """`retry_unavailable` for the chief's recovery of a replaced server, which also
    retries a refusal of this job's credentials within the same bound: until the name
    of a replaced server leads to its new pod, a call may reach whatever answers at the
    old address (another job's server refuses these keys). Still refused after the
    bound: `refused_for_good`, so a real mismatch of keys fails, once, saying so."""
    try:
        return retry_unavailable(fn, deadline_s, clock, sleep,
                                 RETRIED_CODES | AUTH_REFUSED_CODES)
    except PSError as exc:
        if exc.code not in AUTH_REFUSED_CODES:
            raise
        raise refused_for_good(exc, deadline_s) from exc


def refused_for_good(exc: PSError, bound_s: float) -> PSError:
    """`exc`, a refusal of this job's credentials that lasted `bound_s` seconds, with
    one line that says what it means (the server's own words kept)."""
    return PSError(exc.code, f"{exc.message} (still refused after {bound_s:.0f} s while "
                   "recovering the parameter servers: this replica's keys are not the "
                   "server's; check the job's credentials Secret)")


@dataclass
class RefusalBound:
    """How long the chief has met refusals of its credentials with no step applied in
    between. Each one is recovered from like an unreachable server (`retry_recovering`
    waits for the servers to accept the keys), but a server that accepts Info and goes
    on refusing the call that failed would make that a loop: past `bound_s`, `allow`
    raises `refused_for_good` instead."""

    bound_s: float
    clock: Callable[[], float] = time.monotonic
    since: float | None = None  # the first refusal since the last applied step

    def allow(self, exc: PSError) -> None:
        now = self.clock()
        if self.since is None:
            self.since = now
        elif now - self.since >= self.bound_s:
            raise refused_for_good(exc, self.bound_s) from exc

    def reset(self) -> None:
        """A step was applied: the servers accept this job's keys."""
        self.since = None
