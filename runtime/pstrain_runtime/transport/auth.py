"""Authentication and roles on both parameter-server channels.

Keys: see `pstrain_api.security` (a job token, a chief key and a worker key derived
from it, and each worker's own key derived from the worker key; files in
`PSTRAIN_AUTH_DIR`). `load_credentials` reads them. A caller's identity is the name of
the key it proves: `chief`, `worker` (the job's shared worker key: status only) or
`worker-<i>` (worker i's own key); `claims` checks that a call acts only for the worker
its identity allows.

gRPC: every call carries metadata `pstrain-auth: <identity> <time ms> <nonce> <mac>`,
where mac = HMAC-SHA256(key, "grpc <method> <time ms> <nonce>"): the key never travels,
and a proof only opens the method it was made for, within `GRPC_WINDOW_S` of its time;
a nonce is accepted once (`replay`). Every field is bounded (`_PROOF`): anything else is
refused as malformed. `ServerGuard`, a server interceptor, checks it in constant time
(`hmac.compare_digest`) and answers UNAUTHENTICATED (no or bad proof),
RESOURCE_EXHAUSTED (the replay cache is full: retry) or PERMISSION_DENIED (a worker
calling a chief-only method, or acting for another worker) before the store is touched,
so a refused call changes nothing. The health service stays open for probes.
`client_channel` adds the proof on the client side.

Data plane: a connection opens with a handshake, before any call:

    server -> client   MAGIC (4 bytes), nonce (32 random bytes)
    client -> server   code (1 byte: 1 chief, 2 worker), HMAC(key, CONTEXT + nonce + code)
                       or, with worker i's own key: code 3, i (4 bytes, little-endian),
                       HMAC(key, CONTEXT + nonce + code + i) cut to 28 bytes
    server -> client   1 byte: 1 accepted, 0 refused (then the server closes)

The data server answers it without a thread per connection, within
`ConnectionGuard.timeout_s` (`admission.py`, which checks the answer with
`handshake_role`); `ConnectionGuard.admit` is the same opening done blocking, on a
connection `may_start` let in (at most `MAX_PENDING_HANDSHAKES` at once). Refusals are
logged with the peer and the reason (never a key or a proof), at most once a second.
`offer_handshake` is the client side. Once admitted, the connection's role decides
which calls it may make (`may_call`) and for which worker (`claims`), as on gRPC.

Authentication stops whoever lacks the keys and cannot watch the job's traffic; on a
network an attacker can watch or alter, use TLS as well (`spec.security.tls`).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import re
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

from .replay import REPLAY_CACHE_MAX, ReplayCache, ReplayCacheFull
from .tls import TlsFiles, TrustedCa
from .tls import accept as tls_accept

_log = logging.getLogger(__name__)

SERVICE_PREFIX = "/pstrain.v1.ParameterServer/"
OPEN_PREFIXES = ("/grpc.health.v1.Health/",)  # probes need no credentials
# Calls only the chief key may make: installing parameters (Init, also a restore),
# marking the job done, reporting its status and stopping the servers; for sparse
# tables, defining them, installing rows (a restore) and exporting them (a checkpoint:
# its `mark` starts the record of evicted ids a delta needs; or a server writing its
# own rows of one, `save`): `Sparse.<op>`.
CHIEF_ONLY = frozenset({"Init", "Finish", "ReportStatus", "Shutdown", "SetWorkers",
                        "Sparse.configure", "Sparse.import", "Sparse.export",
                        "Sparse.save"})
METADATA_KEY = "pstrain-auth"
GRPC_WINDOW_S = 300.0  # a proof's time may differ this much from the server's clock
# A proof: identity (a key name), time in ms (at most 15 digits), nonce (12 random
# bytes in hex), mac (HMAC-SHA256 in hex); lowercase, one space apart, nothing else.
MAX_PROOF_CHARS = 128
_PROOF = re.compile(r"([a-z0-9-]{1,20}) ([0-9]{1,15}) ([0-9a-f]{24}) ([0-9a-f]{64})",
                    re.ASCII)
MALFORMED = "the call's credentials are malformed"

MAGIC = b"PSA1"
NONCE_BYTES = 32
HANDSHAKE_CONTEXT = b"pstrain/v1 data plane "
ROLE_CODES = {security.KEY_CHIEF: 1, security.KEY_WORKER: 2}
ROLES_BY_CODE = {code: role for role, code in ROLE_CODES.items()}
OWN_WORKER_CODE = 3  # a worker's own key: its index, then the MAC cut to 28 bytes
INDEX_BYTES = 4
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
    """The keys one replica holds, by name (`chief`, `worker`, `worker-<i>`). A client
    proves the strongest it has (chief, else its own worker key, else the shared worker
    key); a server checks any of them, and a worker's own key through the worker key."""

    keys: Mapping[str, bytes]

    def __post_init__(self) -> None:
        unknown = [n for n in self.keys if n not in security.KEY_ROLES
                   and security.own_worker_index(n) is None]
        if unknown or not self.keys:
            raise ValueError(f"credentials hold keys {sorted(self.keys)}; they must be "
                             f"some of {list(security.KEY_ROLES)} or worker-<index>")

    @classmethod
    def from_token(cls, token: bytes) -> Credentials:
        """Every role key of a job token (what a parameter server holds)."""
        return cls(security.derive_keys(token))

    def only(self, *roles: str) -> Credentials:
        """These credentials restricted to `roles` (e.g. what a worker is given)."""
        return Credentials({r: k for r, k in self.keys.items() if r in roles})

    def for_worker(self, index: int) -> Credentials:
        """What worker `index` proves: the chief's key as it is (the chief may act for
        any worker), else worker `index`'s own key (derived from the shared worker key
        when that is what was given, which is then dropped). ValueError when these are
        another worker's keys."""
        if security.KEY_CHIEF in self.keys:
            return self
        name = security.own_worker_name(index)
        if name in self.keys:
            return Credentials({name: self.keys[name]})
        shared = self.keys.get(security.KEY_WORKER)
        if shared is None:
            raise ValueError(f"{security.ENV_AUTH_DIR} holds the keys "
                             f"{sorted(self.keys)}, not worker {index}'s")
        return Credentials({name: security.own_worker_key(shared, index)})

    def key_of(self, name: str) -> bytes | None:
        """The key that proves identity `name` (a server's check): a key held by that
        name, or a worker's own key derived from the worker key; None when unknown."""
        key = self.keys.get(name)
        if key is not None:
            return key
        index = security.own_worker_index(name)
        shared = self.keys.get(security.KEY_WORKER)
        if index is None or shared is None:
            return None
        return security.own_worker_key(shared, index)

    @property
    def role(self) -> str:
        """The identity this replica proves (the name of its strongest key)."""
        if security.KEY_CHIEF in self.keys:
            return security.KEY_CHIEF
        own = sorted(n for n in self.keys if security.own_worker_index(n) is not None)
        return own[0] if own else security.KEY_WORKER

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
    try:
        own = sorted(n for n in os.listdir(directory)
                     if security.own_worker_index(n) is not None)
    except OSError:
        own = []  # reported below as a directory without key files
    for role in (*security.KEY_ROLES, *own):
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
                         f"({' or '.join(security.KEY_ROLES)} or worker-<index>)")
    return Credentials(keys)


def role_of_call(metadata: Any) -> str | None:
    """The identity a gRPC call's credentials name (the interceptor has checked them),
    or None for a call without credentials (a server without authentication)."""
    value = next((v for k, v in metadata or () if k == METADATA_KEY), None)
    return value.split(" ", 1)[0] if isinstance(value, str) and value else None


def may_call(role: str, method: str) -> bool:
    """Whether identity `role` may make the call `method` (a short name). Which worker
    a call may act for is `claims`' question."""
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


class ServerGuard(grpc.ServerInterceptor):
    """Checks every call's `pstrain-auth` proof before its handler runs."""

    def __init__(self, credentials: Credentials, window_s: float = GRPC_WINDOW_S,
                 clock: Callable[[], float] = time.time,
                 replay_limit: int = REPLAY_CACHE_MAX) -> None:
        self.credentials = credentials
        self.window_s = window_s
        self.clock = clock
        self.replays = ReplayCache(window_s, replay_limit)
        self.refusals = RefusalLog("gRPC")

    def check(self, method: str, metadata: Any) -> str:
        """The identity `metadata` proves; AuthError unless it proves the right to call
        `method`."""
        value = next((v for k, v in metadata or () if k == METADATA_KEY), None)
        if value is None:
            raise AuthError("UNAUTHENTICATED", "the call carries no pstrain credentials")
        match = (_PROOF.fullmatch(value) if isinstance(value, str)
                 and len(value) <= MAX_PROOF_CHARS else None)
        if match is None:
            raise AuthError("UNAUTHENTICATED", MALFORMED)
        role, stamp, nonce, mac = match.groups()
        if role not in security.KEY_ROLES and security.own_worker_index(role) is None:
            raise AuthError("UNAUTHENTICATED", MALFORMED)
        key = self.credentials.key_of(role)
        if key is None:
            raise AuthError("UNAUTHENTICATED", "the call's credentials name an unknown role")
        now = self.clock()
        stamp_s = int(stamp) / 1000.0  # at most 15 digits: always a finite float
        good = hmac.compare_digest(_grpc_mac(key, method, stamp, nonce), mac)
        if not good:
            raise AuthError("UNAUTHENTICATED", "the call's credentials are not valid for "
                            "this job")
        if abs(now - stamp_s) > self.window_s:
            raise AuthError("UNAUTHENTICATED", "the call's credentials are too old or from "
                            "the future (check the clocks)")
        try:
            first = self.replays.first_use(int(nonce, 16), stamp_s, now)
        except ReplayCacheFull as exc:
            raise AuthError("RESOURCE_EXHAUSTED", f"the server is remembering too many "
                            f"recent calls ({exc}); retry later") from None
        if not first:
            raise AuthError("UNAUTHENTICATED", "the call's credentials were used before")
        short = method[len(SERVICE_PREFIX):] if method.startswith(SERVICE_PREFIX) else method
        if not may_call(role, short):
            raise AuthError("PERMISSION_DENIED", f"{short} needs the chief's credentials")
        return role

    def intercept_service(self, continuation: Callable[[Any], Any],
                          handler_call_details: Any) -> Any:
        method = handler_call_details.method
        if method.startswith(OPEN_PREFIXES):
            return continuation(handler_call_details)
        try:
            identity = self.check(method, handler_call_details.invocation_metadata)
        except AuthError as exc:
            self.refusals.refused(f"a {method} call", exc.message)
            handler = continuation(handler_call_details)
            return _refusing_handler(handler, exc) if handler is not None else None
        except Exception as exc:  # noqa: BLE001 - never UNKNOWN for bad credentials
            self.refusals.refused(f"a {method} call", f"{MALFORMED} ({type(exc).__name__})")
            handler = continuation(handler_call_details)
            return (_refusing_handler(handler, AuthError("UNAUTHENTICATED", MALFORMED))
                    if handler is not None else None)
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        from . import claims  # the server's side only (it decodes requests: torch)

        return claims.bind_handler(handler, identity, method.rsplit("/", 1)[-1])


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


def _handshake_proof(name: str, key: bytes, nonce: bytes) -> bytes:
    """The answer (ANSWER_BYTES) proving identity `name` with `key`: its code and the
    MAC; for a worker's own key, code 3, the index, and the MAC over both, cut to keep
    the answer's length (224 bits)."""
    index = security.own_worker_index(name)
    if index is None:
        code = ROLE_CODES[name]
        return bytes((code,)) + _handshake_mac(key, nonce, code)
    head = bytes((OWN_WORKER_CODE,)) + index.to_bytes(INDEX_BYTES, "little")
    mac = hmac.new(key, HANDSHAKE_CONTEXT + nonce + head, hashlib.sha256).digest()
    return head + mac[:len(mac) - INDEX_BYTES]


def _answer_identity(answer: bytes) -> str | None:
    """The identity an answer claims (not yet proven); None for an unknown code or an
    index out of bounds."""
    if not answer:
        return None
    if answer[0] != OWN_WORKER_CODE:
        return ROLES_BY_CODE.get(answer[0])
    index = int.from_bytes(answer[1:1 + INDEX_BYTES], "little")
    return security.own_worker_name(index) if index <= security.MAX_WORKER_INDEX else None


ANSWER_BYTES = 1 + hashlib.sha256().digest_size  # the client's answer to the hello


def handshake_role(credentials: Credentials, nonce: bytes, answer: bytes) -> str | None:
    """The role an `answer` (ANSWER_BYTES) to the hello with `nonce` proves, or None
    when it proves none of `credentials`' keys (checked in constant time)."""
    role = _answer_identity(answer) if len(answer) == ANSWER_BYTES else None
    key = credentials.key_of(role) if role else None
    if key is None or not hmac.compare_digest(_handshake_proof(role, key, nonce), answer):
        return None
    return role


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
            answer = _recv_exactly(sock, ANSWER_BYTES, deadline)
            if not answer:
                self.refusals.refused(peer, "the peer closed the connection during the "
                                      "handshake")
                return None
            role = handshake_role(credentials, nonce, answer)
            if role is None:
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
    sock.sendall(_handshake_proof(credentials.role, credentials.key, hello[len(MAGIC):]))
    verdict = _recv_exactly(sock, 1, deadline)
    if verdict != ACCEPTED:
        raise AuthError("UNAUTHENTICATED", "the server refused this job's credentials on "
                        "the data connection")
    sock.settimeout(None)
