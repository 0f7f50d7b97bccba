"""Authentication and roles on both parameter-server channels.

Keys: see `pstrain_api.security` (a job token, a chief key and a worker key derived
from it, files in `PSTRAIN_AUTH_DIR`). `load_credentials` reads them.

gRPC: every call carries metadata `pstrain-auth: <role> <time ms> <nonce> <mac>`, where
mac = HMAC-SHA256(role key, "grpc <method> <time ms> <nonce>"): the key never travels,
and a proof only opens the method it was made for, within `GRPC_WINDOW_S` of its time;
a nonce seen in that window is refused (replay). `ServerGuard`, a server interceptor,
checks it in constant time (`hmac.compare_digest`) and answers UNAUTHENTICATED (no or
bad proof) or PERMISSION_DENIED (a worker calling a chief-only method) before the
handler runs, so a refused call changes nothing. The health service stays open for
probes. `client_channel` adds the proof on the client side.

Data plane: a connection opens with a handshake, before any call:

    server -> client   MAGIC (4 bytes), nonce (32 random bytes)
    client -> server   role (1 byte: 1 chief, 2 worker), HMAC(role key, CONTEXT + nonce + role)
    server -> client   1 byte: 1 accepted, 0 refused (then the server closes)

`ConnectionGuard.admit` (server) answers it within `HANDSHAKE_TIMEOUT_S`, and at most
`MAX_PENDING_HANDSHAKES` handshakes wait at a time: a connection over the limit is
closed at once, so a flood holds neither threads nor memory for long. Refusals are
logged with the peer and the reason (never a key or a proof), at most once a second.
`offer_handshake` is the client side. Once admitted, the connection's role decides
which calls it may make (`may_call`), as on gRPC.

Authentication stops whoever lacks the keys and cannot watch the job's traffic; on a
network an attacker can watch or alter, use TLS as well (`spec.security.tls`).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import math
import os
import secrets
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from pstrain_api import security

from .tls import TlsFiles, TrustedCa
from .tls import accept as tls_accept

_log = logging.getLogger(__name__)

SERVICE_PREFIX = "/pstrain.v1.ParameterServer/"
OPEN_PREFIXES = ("/grpc.health.v1.Health/",)  # probes need no credentials
# Calls only the chief key may make: installing parameters (Init, also a restore),
# marking the job done, reporting its status and stopping the servers; for sparse
# tables, defining them and installing rows (a restore): `Sparse.<op>`.
CHIEF_ONLY = frozenset({"Init", "Finish", "ReportStatus", "Shutdown", "SetWorkers",
                        "Sparse.configure", "Sparse.import"})
METADATA_KEY = "pstrain-auth"
GRPC_WINDOW_S = 300.0  # a proof's time may differ this much from the server's clock
REPLAY_CACHE_MAX = 1 << 16

MAGIC = b"PSA1"
NONCE_BYTES = 32
HANDSHAKE_CONTEXT = b"pstrain/v1 data plane "
ROLE_CODES = {security.KEY_CHIEF: 1, security.KEY_WORKER: 2}
ROLES_BY_CODE = {code: role for role, code in ROLE_CODES.items()}
ACCEPTED, REFUSED = b"\x01", b"\x00"
HANDSHAKE_TIMEOUT_S = 5.0
MAX_PENDING_HANDSHAKES = 64


class AuthError(Exception):
    """A call or a connection without valid credentials (code UNAUTHENTICATED) or with
    too few rights (PERMISSION_DENIED). Imports no torch (the operator uses this
    module through `status_client`)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


# ---------------------------------------------------------------------- keys


@dataclass(frozen=True)
class Credentials:
    """The role keys one replica holds. A client proves the strongest it has (chief,
    else worker); a server checks any of them."""

    keys: Mapping[str, bytes]

    def __post_init__(self) -> None:
        unknown = set(self.keys) - set(security.KEY_ROLES)
        if unknown or not self.keys:
            raise ValueError(f"credentials hold keys {sorted(self.keys)}; they must be "
                             f"some of {list(security.KEY_ROLES)}")

    @classmethod
    def from_token(cls, token: bytes) -> Credentials:
        """Every role key of a job token (what a parameter server holds)."""
        return cls(security.derive_keys(token))

    def only(self, *roles: str) -> Credentials:
        """These credentials restricted to `roles` (e.g. what a worker is given)."""
        return Credentials({r: k for r, k in self.keys.items() if r in roles})

    @property
    def role(self) -> str:
        return security.KEY_CHIEF if security.KEY_CHIEF in self.keys else security.KEY_WORKER

    @property
    def key(self) -> bytes:
        return self.keys[self.role]

    def __repr__(self) -> str:  # never print a key
        return f"Credentials(roles={sorted(self.keys)})"


def write_credentials(directory: Path, credentials: Credentials) -> Path:
    """Write `credentials` as key files into `directory` (created private, 0700; files
    0600). Returns the directory, for `PSTRAIN_AUTH_DIR`."""
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(directory, 0o700)
    for role, key in credentials.keys.items():
        path = directory / role
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(security.encode_key(key))
    return directory


def load_credentials(environ: Mapping[str, str]) -> Credentials | None:
    """The keys in `PSTRAIN_AUTH_DIR`, or None when it is unset (authentication off).
    A set directory without any key file is an error, never "off"."""
    raw = environ.get(security.ENV_AUTH_DIR)
    if not raw:
        return None
    directory = Path(raw)
    keys: dict[str, bytes] = {}
    for role in security.KEY_ROLES:
        path = directory / role
        try:
            text = path.read_text()
        except FileNotFoundError:
            continue
        except OSError as exc:
            raise ValueError(f"{security.ENV_AUTH_DIR}: cannot read {path}: "
                             f"{exc.strerror}") from exc
        keys[role] = security.decode_key(text, str(path))
    if not keys:
        raise ValueError(f"{security.ENV_AUTH_DIR} is {raw!r}; it holds no key file "
                         f"({' or '.join(security.KEY_ROLES)})")
    return Credentials(keys)


def role_of_call(metadata: Any) -> str | None:
    """The role a gRPC call's credentials name (the interceptor has checked them), or
    None for a call without credentials (a server without authentication)."""
    value = next((v for k, v in metadata or () if k == METADATA_KEY), None)
    return value.split(" ", 1)[0] if isinstance(value, str) and value else None


def may_call(role: str, method: str) -> bool:
    """Whether a holder of `role`'s key may make the call `method` (a short name)."""
    return role == security.KEY_CHIEF or method not in CHIEF_ONLY


class RefusalLog:
    """Logs refusals with their reason, at most one line a second (a flood is one line
    with a count), so refusing costs no more than a bad request."""

    def __init__(self, what: str, interval_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.what = what
        self.interval_s = interval_s
        self.clock = clock
        self._lock = threading.Lock()
        self._next = 0.0
        self._suppressed = 0
        self.count = 0

    def refused(self, peer: str, reason: str) -> None:
        with self._lock:
            self.count += 1
            now = self.clock()
            if now < self._next:
                self._suppressed += 1
                return
            suppressed, self._suppressed = self._suppressed, 0
            self._next = now + self.interval_s
        more = f" ({suppressed} more refused since the last report)" if suppressed else ""
        _log.warning("%s: refused %s: %s%s", self.what, peer, reason, more)


# ---------------------------------------------------------------------- gRPC


def _grpc_mac(key: bytes, method: str, stamp: str, nonce: str) -> str:
    return hmac.digest(key, f"grpc {method} {stamp} {nonce}".encode(), "sha256").hex()


def grpc_proof(credentials: Credentials, method: str, now: float | None = None) -> str:
    """The `pstrain-auth` metadata value that opens `method` (a full method path)."""
    stamp = str(int((time.time() if now is None else now) * 1000))
    nonce = secrets.token_hex(12)
    return f"{credentials.role} {stamp} {nonce} " + _grpc_mac(credentials.key, method,
                                                              stamp, nonce)


class _ReplayCache:
    """Nonces seen lately, in two generations: the current one, and the one before it,
    which is dropped when the current one is a window old or holds `limit` nonces. So a
    nonce is remembered for at least one window (unless more than `limit` calls come in
    one window) and memory stays bounded, at the cost of a set lookup per call."""

    def __init__(self, window_s: float, limit: int = REPLAY_CACHE_MAX) -> None:
        self.window_s = window_s
        self.limit = limit
        self._current: set[str] = set()
        self._previous: set[str] = set()
        self._rotate_at = -math.inf
        self._lock = threading.Lock()

    def first_use(self, nonce: str, now: float) -> bool:
        with self._lock:
            if now >= self._rotate_at or len(self._current) >= self.limit:
                self._previous, self._current = self._current, set()
                self._rotate_at = now + self.window_s
            if nonce in self._current or nonce in self._previous:
                return False
            self._current.add(nonce)
            return True


class ServerGuard(grpc.ServerInterceptor):
    """Checks every call's `pstrain-auth` proof before its handler runs."""

    def __init__(self, credentials: Credentials, window_s: float = GRPC_WINDOW_S,
                 clock: Callable[[], float] = time.time) -> None:
        self.credentials = credentials
        self.window_s = window_s
        self.clock = clock
        self._replays = _ReplayCache(window_s)
        self.refusals = RefusalLog("gRPC")

    def check(self, method: str, metadata: Any) -> None:
        """Raise AuthError unless `metadata` proves the right to call `method`."""
        value = next((v for k, v in metadata or () if k == METADATA_KEY), None)
        if value is None:
            raise AuthError("UNAUTHENTICATED", "the call carries no pstrain credentials")
        parts = value.split(" ") if isinstance(value, str) else []
        if len(parts) != 4:
            raise AuthError("UNAUTHENTICATED", "the call's credentials are malformed")
        role, stamp, nonce, mac = parts
        key = self.credentials.keys.get(role)
        if key is None:
            raise AuthError("UNAUTHENTICATED", "the call's credentials name an unknown role")
        now = self.clock()
        try:
            age = abs(now - int(stamp) / 1000.0)
        except ValueError:
            age = float("inf")
        good = hmac.compare_digest(_grpc_mac(key, method, stamp, nonce), mac)
        if not good:
            raise AuthError("UNAUTHENTICATED", "the call's credentials are not valid for "
                            "this job")
        if age > self.window_s:
            raise AuthError("UNAUTHENTICATED", "the call's credentials are too old or from "
                            "the future (check the clocks)")
        if not self._replays.first_use(nonce, now):
            raise AuthError("UNAUTHENTICATED", "the call's credentials were used before")
        short = method[len(SERVICE_PREFIX):] if method.startswith(SERVICE_PREFIX) else method
        if not may_call(role, short):
            raise AuthError("PERMISSION_DENIED", f"{short} needs the chief's credentials")

    def intercept_service(self, continuation: Callable[[Any], Any],
                          handler_call_details: Any) -> Any:
        method = handler_call_details.method
        if method.startswith(OPEN_PREFIXES):
            return continuation(handler_call_details)
        try:
            self.check(method, handler_call_details.invocation_metadata)
        except AuthError as exc:
            self.refusals.refused(f"a {method} call", exc.message)
            handler = continuation(handler_call_details)
            return _refusing_handler(handler, exc) if handler is not None else None
        return continuation(handler_call_details)


def _refusing_handler(handler: Any, exc: AuthError) -> Any:
    """A handler of the same kind as `handler` that answers `exc` without reading the
    request or running the real handler."""
    code = getattr(grpc.StatusCode, exc.code)

    def refuse(request: Any, context: grpc.ServicerContext) -> Any:
        context.abort(code, exc.message)

    def refuse_stream(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
        context.abort(code, exc.message)
        yield  # pragma: no cover - abort raises

    streaming_out = handler.response_streaming
    if handler.request_streaming and streaming_out:
        return grpc.stream_stream_rpc_method_handler(refuse_stream)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(refuse)
    if streaming_out:
        return grpc.unary_stream_rpc_method_handler(refuse_stream)
    return grpc.unary_unary_rpc_method_handler(refuse)


class _CallDetails(grpc.ClientCallDetails):  # type: ignore[misc]
    def __init__(self, base: Any, metadata: list[tuple[str, str]]) -> None:
        self.method = base.method
        self.timeout = base.timeout
        self.metadata = metadata
        self.credentials = base.credentials
        self.wait_for_ready = getattr(base, "wait_for_ready", None)
        self.compression = getattr(base, "compression", None)


class ClientAuth(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                 grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """Adds a fresh `pstrain-auth` proof to every call on a channel."""

    def __init__(self, credentials: Credentials) -> None:
        self.credentials = credentials

    def _details(self, details: Any) -> _CallDetails:
        metadata = list(details.metadata or ())
        metadata.append((METADATA_KEY, grpc_proof(self.credentials, details.method)))
        return _CallDetails(details, metadata)

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation: Any, details: Any,
                               request_iterator: Any) -> Any:
        return continuation(self._details(details), request_iterator)

    def intercept_stream_stream(self, continuation: Any, details: Any,
                                request_iterator: Any) -> Any:
        return continuation(self._details(details), request_iterator)


def client_channel(address: str, credentials: Credentials | None,
                   options: list[tuple[str, Any]] | None = None,
                   tls: TlsFiles | TrustedCa | None = None) -> grpc.Channel:
    """A channel to `address` whose calls carry `credentials` (none: no proof), over
    TLS when `tls` is given."""
    channel = (grpc.insecure_channel(address, options=options) if tls is None else
               grpc.secure_channel(address, tls.grpc_channel_credentials(), options=options))
    if credentials is None:
        return channel
    return grpc.intercept_channel(channel, ClientAuth(credentials))


def server_interceptors(credentials: Credentials | None) -> list[grpc.ServerInterceptor]:
    return [] if credentials is None else [ServerGuard(credentials)]


# ---------------------------------------------------------------------- data plane


def _handshake_mac(key: bytes, nonce: bytes, code: int) -> bytes:
    return hmac.new(key, HANDSHAKE_CONTEXT + nonce + bytes((code,)), hashlib.sha256).digest()


def _recv_exactly(sock: socket.socket, size: int, deadline: float) -> bytes:
    """`size` bytes, all before `deadline` (a slow sender does not get more time by
    sending a byte at a time); b"" when the peer closed first."""
    buf = bytearray(size)
    view, got = memoryview(buf), 0
    while got < size:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the handshake took too long")
        sock.settimeout(left)
        n = sock.recv_into(view[got:], size - got)
        if n == 0:
            return b""
        got += n
    return bytes(buf)


class ConnectionGuard:
    """The server side of a data connection's opening: TLS (when configured), then the
    handshake (when there are credentials); and the limit on openings in progress."""

    def __init__(self, credentials: Credentials | None, tls: ssl.SSLContext | None = None,
                 timeout_s: float = HANDSHAKE_TIMEOUT_S,
                 max_pending: int = MAX_PENDING_HANDSHAKES) -> None:
        self.credentials = credentials
        self.tls = tls
        self.timeout_s = timeout_s
        self._pending = threading.BoundedSemaphore(max_pending)
        self.refusals = RefusalLog("data plane")

    def may_start(self, peer: str) -> bool:
        """Take a handshake slot for a new connection; False (logged) when all are in use:
        close the connection. Every True must be followed by `admit`."""
        if self._pending.acquire(blocking=False):
            return True
        self.refusals.refused(peer, f"more than {MAX_PENDING_HANDSHAKES} handshakes are "
                              "in progress")
        return False

    def admit(self, sock: socket.socket, peer: str) -> tuple[socket.socket, str | None] | None:
        """Open a connection `may_start` let in: (the socket to use, the peer's role, None
        without credentials), or None when refused (logged; the caller closes it)."""
        try:
            if self.tls is not None:
                try:
                    sock = tls_accept(self.tls, sock, self.timeout_s)
                except OSError as exc:
                    self.refusals.refused(peer, f"the TLS handshake failed: "
                                          f"{type(exc).__name__}")
                    return None
            if self.credentials is None:
                sock.settimeout(None)
                return sock, None
            role = self._handshake(sock, peer, self.credentials)
            return None if role is None else (sock, role)
        finally:
            self._pending.release()

    def _handshake(self, sock: socket.socket, peer: str,
                   credentials: Credentials) -> str | None:
        deadline = time.monotonic() + self.timeout_s
        nonce = secrets.token_bytes(NONCE_BYTES)
        try:
            sock.settimeout(self.timeout_s)
            sock.sendall(MAGIC + nonce)
            answer = _recv_exactly(sock, 1 + hashlib.sha256().digest_size, deadline)
            if not answer:
                self.refusals.refused(peer, "the peer closed the connection during the "
                                      "handshake")
                return None
            role = ROLES_BY_CODE.get(answer[0])
            key = credentials.keys.get(role) if role else None
            if key is None or not hmac.compare_digest(_handshake_mac(key, nonce, answer[0]),
                                                      answer[1:]):
                self.refusals.refused(peer, "the handshake did not prove this job's "
                                      "credentials")
                sock.sendall(REFUSED)
                return None
            sock.sendall(ACCEPTED)
            sock.settimeout(None)
            return role
        except (OSError, TimeoutError) as exc:
            self.refusals.refused(peer, f"the handshake failed: {type(exc).__name__}")
            return None


def offer_handshake(sock: socket.socket, credentials: Credentials,
                    timeout_s: float = HANDSHAKE_TIMEOUT_S) -> None:
    """The client side of the handshake on a fresh connection. Raises AuthError when the
    server refuses the credentials, OSError when the connection fails."""
    deadline = time.monotonic() + timeout_s
    hello = _recv_exactly(sock, len(MAGIC) + NONCE_BYTES, deadline)
    if not hello:
        raise ConnectionError("the server closed the data connection before its handshake")
    if hello[:len(MAGIC)] != MAGIC:
        raise ConnectionError("the server did not open a pstrain handshake (is its "
                              "authentication off?)")
    code = ROLE_CODES[credentials.role]
    sock.sendall(bytes((code,)) + _handshake_mac(credentials.key, hello[len(MAGIC):], code))
    verdict = _recv_exactly(sock, 1, deadline)
    if verdict != ACCEPTED:
        raise AuthError("UNAUTHENTICATED", "the server refused this job's credentials on "
                        "the data connection")
    sock.settimeout(None)


def write_replica_keys(directory: Path, token: bytes) -> dict[str, Path]:
    """For a local run: one private key directory per key holder (`security.key_holder`)
    under `directory`, each with only the keys it may hold. Returns holder -> directory,
    the value of each replica's `PSTRAIN_AUTH_DIR`."""
    every = Credentials.from_token(token)
    return {holder: write_credentials(directory / holder, every.only(*keys))
            for holder, keys in security.KEYS_FOR_HOLDER.items()}
