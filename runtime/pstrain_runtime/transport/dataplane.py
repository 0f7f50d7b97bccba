"""The data plane: tensor calls over one plain TCP connection per worker and server.

gRPC stays the control plane (health, Info, Finish, Shutdown, status reports). The
tensor calls (Init, Push, Pull, PushPull, PushPullSmall, Sparse) carry the very same
frames (see `wire`) over a plain TCP connection as well (and PushPullSparse, a sparse
push riding on a PushPullSmall, `sparse.riding`, exists only here), because grpcio's
Python receive path costs two to three times the CPU per byte of a socket
(bench/RESULTS.md), and on a busy machine CPU per byte is throughput. A server
announces its data port in the `data_port` of its Info reply; `TcpTransport` asks once,
then keeps a small pool of connections to it. A server without one (`data_port` 0) is
spoken to over gRPC.

On a connection, one call at a time:

    request  = op (1 byte), then frames
    response = frames
    frames   = (u32 length, that many bytes)*, then END (u32 0xFFFFFFFF)
               or ERROR (u32 0xFFFFFFFE) and two frames: status code, message

Lengths are little-endian. The server reads the whole request before it answers, also
when it refuses it, so the connection stays usable after an error. A frame longer than
`wire.MAX_MESSAGE_BYTES` or an unknown op breaks the protocol: that connection closes.
With credentials, a connection opens with the handshake of `auth` before its first
call (done by `admission`, one thread for every connection still opening), and its role
decides which calls it may make (a worker's Init is refused with
PERMISSION_DENIED, the request read and dropped, the store untouched).
"""

from __future__ import annotations

import logging
import select
import socket
import ssl
import struct
import threading
import time
from collections.abc import Callable, Iterable, Iterator

import numpy as np

from ..proto import ps_pb2 as pb
from ..ps.store import ParameterStore, PSError
from ..sparse import riding
from ..sparse import service as sparse_service
from . import auth, claims, tls, wire
from .admission import Admission

OP_INIT, OP_PUSH, OP_PULL, OP_PUSH_PULL, OP_PUSH_PULL_SMALL, OP_SPARSE = 1, 2, 3, 4, 5, 6
OP_PUSH_PULL_SPARSE = 7  # a sparse push riding on a PushPullSmall (`sparse.riding`)
OPS = {OP_INIT: "Init", OP_PUSH: "Push", OP_PULL: "Pull", OP_PUSH_PULL: "PushPull",
       OP_PUSH_PULL_SMALL: "PushPullSmall", OP_SPARSE: "Sparse",
       OP_PUSH_PULL_SPARSE: "PushPullSparse"}
OWNED_OPS = frozenset({OP_SPARSE, OP_PUSH_PULL_SPARSE})  # the sparse service keeps frames
END = 0xFFFFFFFF
ERROR = 0xFFFFFFFE
_LEN = struct.Struct("<I")
_END = _LEN.pack(END)
COALESCE_BYTES = 64 * 1024  # smaller frames are gathered into one send
SOCKET_BUFFER_BYTES = 4 * 1024 * 1024
MAX_IOVECS = 512  # buffers per sendmsg call (the kernel's limit, IOV_MAX, is 1024)
CONNECT_TIMEOUT_S = 10.0
# A client waits this long for each read or write of a call, more than a server ever
# holds one (its store's waits end within `store.MAX_WAIT`); then the call fails with
# UNAVAILABLE and takes the usual retry path (a server that stopped answering).
IO_TIMEOUT_S = 120.0
LISTEN_BACKLOG = 4096  # connections the kernel holds until accepted (capped by somaxconn)
_log = logging.getLogger(__name__)


class ProtocolError(ConnectionError):
    """The peer broke the framing; the connection cannot be used any more."""


class RemoteError(PSError):
    """The peer answered with ERROR: the call was refused, the connection is intact."""


def _check_size(size: int) -> None:
    if size > wire.MAX_MESSAGE_BYTES:
        raise ProtocolError(f"a frame of {size} bytes exceeds the limit of "
                            f"{wire.MAX_MESSAGE_BYTES}")


def _tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        try:
            sock.setsockopt(socket.SOL_SOCKET, opt, SOCKET_BUFFER_BYTES)
        except OSError:  # pragma: no cover - a kernel that caps the size keeps its own
            pass


def _set_io_timeout(sock: socket.socket, seconds: float) -> None:
    """Make each receive and send on `sock` fail (EAGAIN, an OSError: UNAVAILABLE for
    the caller, retried) after `seconds` without progress. Set in the kernel
    (SO_RCVTIMEO/SO_SNDTIMEO) with the socket left blocking: Python's own timeout would
    poll() before every call on the data path."""
    whole = int(seconds)
    timeval = struct.pack("ll", whole, int((seconds - whole) * 1_000_000))
    for option in (socket.SO_RCVTIMEO, socket.SO_SNDTIMEO):
        sock.setsockopt(socket.SOL_SOCKET, option, timeval)


class Link:
    """One TCP connection speaking the frame protocol. Frames read from it are views of
    one reused buffer: each is valid until the next frame is read; chunk frames can
    instead be read straight into their destination tensors (`LinkFrames`)."""

    def __init__(self, sock: socket.socket) -> None:
        _tune(sock)
        self.sock = sock
        self._buf = bytearray(COALESCE_BYTES)
        self._word = bytearray(4)
        self.role: str | None = None  # the handshake's role (None: no authentication)

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:  # pragma: no cover
            pass

    def peer_gone(self) -> bool:
        """The peer went away. Asked while a call waits, after its whole request was
        read: nothing is due from the peer until the answer, so anything readable (its
        end of stream, a reset, a TLS close alert, or bytes that break the one call at a
        time rule) ends the wait."""
        poller = select.poll()
        try:
            poller.register(self.sock, select.POLLIN | select.POLLERR | select.POLLHUP)
            return bool(poller.poll(0))
        except (OSError, ValueError):  # closed under us
            return True

    # ------------------------------------------------------------------ receiving
    def _recv_exact(self, view: memoryview) -> None:
        got, size = 0, len(view)
        while got < size:
            n = self.sock.recv_into(view[got:], size - got)
            if n == 0:
                raise ConnectionError("the peer closed the data connection")
            got += n

    def _word_value(self) -> int:
        self._recv_exact(memoryview(self._word))
        return _LEN.unpack(self._word)[0]

    def recv_op(self) -> int | None:
        """The next request's op, or None when the peer closed between calls."""
        view = memoryview(self._word)[:1]
        if self.sock.recv_into(view, 1) == 0:
            return None
        return self._word[0]

    def _recv_frame(self, size: int, have: int = 0) -> memoryview:
        """A frame of `size` bytes in the buffer, whose first `have` bytes are there."""
        _check_size(size)
        if size > len(self._buf):
            grown = bytearray(size)
            grown[:have] = self._buf[:have]
            self._buf = grown
        view = memoryview(self._buf)[:size]
        self._recv_exact(view[have:])
        return view

    def _recv_owned(self, size: int) -> np.ndarray:
        """A frame of `size` bytes in a buffer of its own (uint8), not the link's: the
        caller keeps it, and tensors can be views of it."""
        _check_size(size)
        frame = np.empty(size, dtype=np.uint8)
        self._recv_exact(memoryview(frame))
        return frame

    def _discard(self, size: int) -> None:
        view = memoryview(self._buf)
        while size:
            take = min(size, len(view))
            self._recv_exact(view[:take])
            size -= take

    def frames(self, owned: bool = False) -> LinkFrames:
        """The frames up to END; ERROR raises `RemoteError` once it is fully read. With
        `owned`, each frame comes in a buffer of its own (see `LinkFrames`)."""
        return LinkFrames(self, owned)

    # ------------------------------------------------------------------ sending
    def _send_parts(self, parts: list[bytes | memoryview]) -> None:
        views = [memoryview(p).cast("B") for p in parts if len(p)]
        if isinstance(self.sock, ssl.SSLSocket):  # TLS has no sendmsg: buffer by buffer
            for view in views:
                self.sock.sendall(view)
            return
        while views:
            sent = self.sock.sendmsg(views[:MAX_IOVECS])
            while views and sent >= len(views[0]):
                sent -= len(views[0])
                views.pop(0)
            if views and sent:
                views[0] = views[0][sent:]

    def send_frames(self, frames: Iterable[bytes | memoryview], op: int | None = None,
                    error: PSError | None = None) -> None:
        """Send `op` (a request), the frames, then END; an exception raised by `frames`
        while they are sent is answered with ERROR (a PSError's code, else INTERNAL)
        and re-raised unless it is a PSError."""
        pending = bytearray() if op is None else bytearray((op,))
        failure: BaseException | None = None
        # A fresh `wire.FrameStream` gives each frame as parts (views of the tensors):
        # large frames go out with sendmsg straight from tensor memory, no join.
        framed: Iterable[list[bytes | memoryview]] = (
            frames.parts() if isinstance(frames, wire.FrameStream) and not frames.started
            else ([frame] for frame in frames))
        held: list[bytes | memoryview] = []  # the last large frame, sent with what follows
        try:
            for parts in framed:
                size = sum(len(part) for part in parts)
                if size < COALESCE_BYTES:
                    pending += _LEN.pack(size)
                    for part in parts:
                        pending += part
                    if len(pending) >= COALESCE_BYTES:
                        self._send_parts([*held, pending])
                        held, pending = [], bytearray()
                else:
                    if held:
                        self._send_parts(held)
                    held = [pending, _LEN.pack(size), *parts]
                    pending = bytearray()
        except PSError as exc:
            error = exc
        except Exception as exc:  # noqa: BLE001 - answered, then raised again below
            error, failure = PSError("INTERNAL", f"{type(exc).__name__}: {exc}"), exc
        if error is None:
            pending += _END
        else:
            code, message = error.code.encode(), error.message.encode()
            pending += _LEN.pack(ERROR)
            pending += _LEN.pack(len(code)) + code + _LEN.pack(len(message)) + message
        self._send_parts([*held, pending])  # the end (or error) rides with the last frame
        if failure is not None:
            raise failure

    def send_error(self, error: PSError) -> None:
        self.send_frames((), error=error)


class LinkFrames:
    """The frames of one request or response on a link, up to END (a `wire.DirectChunks`
    source). Iterated, it yields views of the link's buffer. `read_chunks_into` reads
    chunk frames straight into a stream reader's destination tensors instead: the frame's
    prefix first, then its data with `recv_into` on the destination slices, so received
    bytes are copied once (kernel to tensor), not twice (kernel to buffer to tensor).
    Other frames take the buffered path. A chunk the reader refuses (out of order, too
    long) has the rest of its frame read and dropped before the error is raised, so the
    link stays in step for draining. With `owned`, each frame is received into a uint8
    array of its own instead (one copy, kernel to array), which the caller may keep:
    the sparse calls' frames, whose tensors are read straight from them."""

    def __init__(self, link: Link, owned: bool = False) -> None:
        self.link = link
        self.owned = owned
        self.ended = False

    def __iter__(self) -> LinkFrames:
        return self

    def _next_size(self) -> int | None:
        """The next frame's size; None at END (and after it); ERROR raises RemoteError."""
        if self.ended:
            return None
        try:
            size = self.link._word_value()
            if size == END:
                self.ended = True
                return None
            if size == ERROR:
                self.ended = True
                link = self.link
                code = bytes(link._recv_frame(link._word_value())).decode("utf-8", "replace")
                message = bytes(link._recv_frame(link._word_value())).decode("utf-8",
                                                                             "replace")
                raise RemoteError(code, message)
            _check_size(size)  # also for chunks read straight into their tensors
        except OSError:
            self.ended = True
            raise
        return size

    def __next__(self) -> memoryview | np.ndarray:
        size = self._next_size()
        if size is None:
            raise StopIteration
        try:
            return self.link._recv_owned(size) if self.owned else self.link._recv_frame(size)
        except OSError:
            self.ended = True
            raise

    def read_chunks_into(self, reader: wire.StreamReader) -> None:
        link = self.link
        while (size := self._next_size()) is not None:
            try:
                head = link._recv_frame(min(size, wire.CHUNK_HEAD_BYTES))
                chunk = wire.chunk_head(head)
                if (chunk is None or not chunk.complete
                        or chunk.start + chunk.size != size):
                    # Not a hand-encoded chunk: the whole frame, decoded as usual (a
                    # second header and a corrupt frame are named there).
                    reader.feed(wire.decode_chunk(link._recv_frame(size, len(head))))
                    continue
                try:
                    destinations = reader.destinations(chunk.seq, chunk.offset, chunk.size)
                except wire.WireError:
                    link._discard(size - len(head))
                    raise
                early = head[chunk.start:]  # data bytes that came with the head
                for dst in destinations:
                    view = memoryview(dst)
                    take = min(len(early), len(view))
                    if take:
                        view[:take] = early[:take]
                        early = early[take:]
                    if take < len(view):
                        link._recv_exact(view[take:])
                reader.filled(chunk.offset, chunk.offset + chunk.size)
            except OSError:
                self.ended = True
                raise


# ---------------------------------------------------------------------- server side


def _only_frame(frames: Iterator[memoryview], call: str) -> memoryview:
    first = next(frames, None)
    if first is None:
        raise PSError("INVALID_ARGUMENT", f"{call}: the request holds no message")
    return first


class DataServer:
    """Serves a `ParameterStore`'s tensor calls on a TCP port, a thread per open
    connection (a sync push holds its connection until its step is applied). Connections
    are accepted and opened (TLS, handshake) by one thread for all (`admission`)."""

    def __init__(self, store: ParameterStore, host: str, port: int = 0,
                 guard: auth.ConnectionGuard | None = None) -> None:
        self.store = store
        self.guard = guard  # None: no handshake, every call served
        host = host.strip("[]") or "0.0.0.0"
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.create_server((host, port), family=family,
                                              backlog=LISTEN_BACKLOG)
        self.port = self._listener.getsockname()[1]
        self._links: set[Link] = set()
        self._lock = threading.Lock()
        self._quiet = threading.Condition(self._lock)  # notified when a call ends
        self._busy = 0  # calls being answered
        self._closed = False
        self.admission: Admission | None = None

    def start(self) -> int:
        self.admission = Admission(self._listener, self.guard, self._admitted)
        self.admission.start()
        return self.port

    def stop(self, grace: float = 0.0) -> None:
        """Stop accepting connections and calls, give the calls in flight up to `grace`
        seconds to answer (as grpc's stop does), then close every connection: calls
        still running fail."""
        with self._lock:
            self._closed = True
        if self.admission is not None:
            self.admission.stop()
        try:
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._listener.close()
        deadline = time.monotonic() + grace
        with self._lock:
            while self._busy and (left := deadline - time.monotonic()) > 0:
                self._quiet.wait(left)
            links = list(self._links)
        for link in links:
            try:
                link.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def _admitted(self, sock: socket.socket, role: str | None, peer: str) -> None:
        """A connection the admission opened: served by a thread of its own."""
        link = Link(sock)
        link.role = role
        with self._lock:
            if self._closed:
                link.close()
                return
            self._links.add(link)
        threading.Thread(target=self._serve, args=(link,), name="ps-data",
                         daemon=True).start()

    def _serve(self, link: Link) -> None:
        try:
            while True:
                op = link.recv_op()
                if op is None:
                    return
                with self._lock:
                    if self._closed:
                        return  # stopping: no new calls
                    self._busy += 1
                try:
                    self.handle(link, op)
                finally:
                    with self._lock:
                        self._busy -= 1
                        self._quiet.notify_all()
        except (OSError, PSError):
            return  # the peer went away or broke the framing: drop the connection
        finally:
            with self._lock:
                self._links.discard(link)
            link.close()

    def handle(self, link: Link, op: int) -> None:
        """Answer one call whose op has been read."""
        call = OPS.get(op)
        if call is None:
            raise ProtocolError(f"unknown data-plane op {op}")
        received = link.frames(owned=op in OWNED_OPS)
        request: Iterator[memoryview | np.ndarray] = received
        error: PSError | None = None
        try:
            if link.role is not None and not auth.may_call(link.role, call):
                raise PSError("PERMISSION_DENIED", f"{call} needs the chief's credentials")
            request = claims.checked_frames(link.role, call, received)  # acts for itself
            reply = self._dispatch(op, call, request, link.role, link.peer_gone)
        except PSError as exc:
            error = exc
        except OSError:
            raise  # the connection failed or the framing broke: drop it
        except Exception as exc:  # noqa: BLE001 - a bug in the server: refuse the call
            # as gRPC does (UNKNOWN), not by closing: UNAVAILABLE would make trainers retry
            _log.exception("data plane: %s failed", call)
            error = PSError("INTERNAL", f"{call}: {type(exc).__name__}: {exc}")
        received.owned = False  # what is left is dropped: into the link's buffer
        for _ in request:  # read the rest of the request: the link stays in step
            pass
        if error is not None:
            link.send_error(error)
            return
        try:
            link.send_frames(reply)
        except OSError:
            raise
        except Exception:  # noqa: BLE001 - answered with INTERNAL, the link is in step
            _log.exception("data plane: %s failed while answering", call)

    def _dispatch(self, op: int, call: str, request: Iterator[memoryview | np.ndarray],
                  role: str | None, gone: Callable[[], bool]) -> Iterable[bytes | memoryview]:
        """The answer to one call from a peer holding `role`'s key (None: no
        authentication). A wait in the store ends when the peer is `gone`."""
        store = self.store
        if op == OP_PUSH:
            return [store.push(request, gone=gone).SerializeToString()]
        if op == OP_INIT:
            return [store.init(request).SerializeToString()]
        if op == OP_PUSH_PULL:
            return store.push_pull(request, gone=gone)
        if op == OP_SPARSE:  # each frame in a buffer of its own (`handle` asked so)
            return sparse_service.handle(store, list(request), role)
        if op == OP_PUSH_PULL_SPARSE:  # the same, and the dense message first
            return riding.serve(store, list(request), role, gone)
        message = bytes(_only_frame(request, call))
        for _ in request:  # read up to END: a wait then sees the peer's close
            pass
        if op == OP_PULL:
            try:
                pull = pb.PullRequest.FromString(message)
            except Exception as exc:  # noqa: BLE001 - protobuf's DecodeError and kin
                raise PSError("INVALID_ARGUMENT", f"Pull: the request could not be "
                              f"decoded: {exc}") from exc
            return store.pull(pull, gone=gone)
        return [store.push_pull_small(message, gone=gone)]


# ---------------------------------------------------------------------- client side


def split_host(address: str) -> str:
    """The host of a `host:port` address (brackets of an IPv6 literal removed)."""
    return address.rpartition(":")[0].strip("[]")


def on_data_plane(transport: object) -> bool:
    """Whether a worker's `transport` makes its calls over the data plane, where one
    thread can have a call in flight to each server (`TcpTransport.has_data_plane`)."""
    check = getattr(transport, "has_data_plane", None)
    return check is not None and bool(check())


class CallReply:
    """The response frames of a `DataClient.call`: an iterator, and a `wire.DirectChunks`
    source. Once `read_chunks_into` is called, the call's exchange reads the remaining
    frames straight into the reader's destinations, with the same error mapping and the
    same return of the connection to the pool."""

    def __init__(self) -> None:
        self.reader: wire.StreamReader | None = None
        self.frames: Iterator[memoryview | np.ndarray] = iter(())

    def __iter__(self) -> CallReply:
        return self

    def __next__(self) -> memoryview | np.ndarray:
        return next(self.frames)

    def read_chunks_into(self, reader: wire.StreamReader) -> None:
        self.reader = reader
        for _ in self.frames:  # the exchange reads the rest into `reader`, then ends
            pass


class DataClient:
    """The client end of a server's data plane: a pool of `Link`s to (host, port), one
    per call in flight, reused across calls."""

    def __init__(self, address: str, host: str, port: int,
                 connect_timeout: float = CONNECT_TIMEOUT_S,
                 credentials: auth.Credentials | None = None,
                 tls_context: ssl.SSLContext | None = None,
                 io_timeout: float = IO_TIMEOUT_S) -> None:
        self.address = address  # the server's control address, for messages
        self.host, self.port = host, port
        self.connect_timeout = connect_timeout
        self.credentials = credentials  # proven in each new connection's handshake
        self.tls_context = tls_context  # None: plain TCP
        self.io_timeout = io_timeout
        self._idle: list[Link] = []
        self._lock = threading.Lock()
        self.broken = False  # a connection failed: the server may have moved

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for link in idle:
            link.close()

    def _take(self) -> Link:
        with self._lock:
            if self._idle:
                return self._idle.pop()
        sock: socket.socket | None = None
        try:
            sock = socket.create_connection((self.host, self.port), self.connect_timeout)
            if self.tls_context is not None:
                sock = tls.connect(self.tls_context, sock, self.host)
            if self.credentials is not None:
                auth.offer_handshake(sock, self.credentials)
        except auth.AuthError as exc:
            sock.close()  # type: ignore[union-attr]
            raise PSError(exc.code, f"{self.address}: {exc.message}") from None
        except OSError as exc:
            if sock is not None:
                sock.close()
            self.broken = True
            raise PSError("UNAVAILABLE", f"{self.address}: cannot connect to the data port "
                          f"{self.host}:{self.port}: {exc}") from exc
        sock.settimeout(None)
        _set_io_timeout(sock, self.io_timeout)
        return Link(sock)

    def _give(self, link: Link) -> None:
        with self._lock:
            self._idle.append(link)

    def call(self, op: int, frames: Iterable[bytes | memoryview],
             owned: bool = False) -> CallReply:
        """Send a request; yield the response frames (views valid until the next one;
        with `owned`, each in a buffer of its own, see `LinkFrames`). Refusals raise
        PSError with the server's code; a broken connection raises UNAVAILABLE. Nothing
        is sent until the first frame is asked for. The reply can also read chunk
        frames straight into a stream reader (`CallReply`)."""
        reply = CallReply()
        reply.frames = self._exchange(op, frames, reply, owned)
        return reply

    def send(self, op: int, frames: Iterable[bytes | memoryview],
             owned: bool = False) -> CallReply:
        """`call` with the request sent now, its reply read when its frames are asked
        for: one thread can have a request in flight to each of several servers. A
        reply never read closes its connection (it is not reused with data pending)."""
        reply = CallReply()
        reply.frames = self._exchange(op, frames, reply, owned, mark_sent=True)
        next(reply.frames)  # sends, then stops before the reply
        return reply

    def _exchange(self, op: int, frames: Iterable[bytes | memoryview],
                  reply: CallReply, owned: bool, mark_sent: bool = False
                  ) -> Iterator[memoryview | np.ndarray]:
        link = self._take()
        reusable = False
        try:
            link.send_frames(frames, op=op)
            if mark_sent:
                yield memoryview(b"")  # (`send`'s stop, not a frame)
            received = link.frames(owned)
            while reply.reader is None:
                frame = next(received, None)
                if frame is None:
                    break
                yield frame
            else:
                received.read_chunks_into(reply.reader)
            reusable = True
        except RemoteError as exc:
            reusable = True
            raise PSError(exc.code, f"{self.address}: {exc.message}") from None
        except OSError as exc:
            self.broken = True
            raise PSError("UNAVAILABLE", f"{self.address}: the data connection failed: "
                          f"{exc}") from exc
        finally:
            if reusable:
                self._give(link)
            else:
                link.close()

    def unary(self, op: int, frames: Iterable[bytes | memoryview],
              parse: Callable[[bytes], object]) -> object:
        """A call answered by one message."""
        return self.one_message(op, self.call(op, frames), parse)

    def one_message(self, op: int, frames: Iterable[memoryview | np.ndarray],
                    parse: Callable[[bytes], object]) -> object:
        """The one message of a reply to `op` (a `call`'s or a `send`'s)."""
        reply = None
        for frame in frames:
            if reply is not None:
                raise PSError("INTERNAL", f"{self.address}: {OPS[op]} answered more "
                              "than one message")
            reply = parse(bytes(frame))
        if reply is None:
            raise PSError("INTERNAL", f"{self.address}: {OPS[op]} answered no message")
        return reply
