"""Opening data connections: accept, TLS, handshake, all in one thread (issue 26.1).

A data connection is served by a thread of its own once it is open (`DataServer`), but
its opening (TLS when configured, then the handshake of `auth` when there are
credentials) is not: `Admission` runs one thread with a selector over the listening
socket and every opening in progress, each a small non-blocking state machine
(`Opening`). An outsider who never answers the handshake therefore holds no thread, and
the server's bounds under a flood of such connections are:

- threads: one for every opening at once, plus one per admitted connection (admission
  needs this job's keys);
- descriptors: at most `max_pending` openings in progress (`pending_limit`: 1024, or a
  quarter of the open-files limit when that is lower), plus the admitted connections;
- time: an opening has `guard.timeout_s` from its accept to finish, then it is closed.

A new connection is always accepted: when `max_pending` openings are in progress, the
oldest opening of the peer (host) holding the most is closed to make room. An outsider
flooding from one address thus loses its own oldest connections first, one flooding from
many addresses loses those of its busiest address, and a worker's fresh connection stays
until it has answered (a round trip), which takes it far less time than the outsider
needs to open `max_pending` newer ones. Answers that have arrived are read before more
connections are accepted (at most `ACCEPT_BATCH` per round), and the listening backlog is
drained as fast as connections come, so a worker's SYN is never dropped into a
retransmission (1 s and more). Refusals are logged through the guard's `RefusalLog`.

A failed accept (out of file descriptors, a connection aborted before it was accepted)
is logged and the listener is left alone for a pause that grows while it keeps failing
(`ACCEPT_BACKOFF_S`): the listener never dies of it, nor spins.
"""

from __future__ import annotations

import errno
import logging
import resource
import secrets
import selectors
import socket
import ssl
import threading
import time
from collections.abc import Callable

from . import auth

_log = logging.getLogger(__name__)

MAX_PENDING = 1024  # openings in progress at most (fewer under a low open-files limit)
ACCEPT_BATCH = 256  # accepts per round, between which arrived answers are read
ACCEPT_BACKOFF_S = (0.01, 1.0)  # first and longest pause after a failed accept
STOP_TIMEOUT_S = 5.0
READ, WRITE, ADMITTED, REFUSED = "read", "write", "admitted", "refused"

# `admitted(sock, role, peer)`: a connection whose opening succeeded (blocking socket;
# role None without credentials). It owns the socket from then on.
Admitted = Callable[[socket.socket, "str | None", str], None]


def pending_limit(wanted: int = MAX_PENDING) -> int:
    """`wanted`, or a quarter of the soft open-files limit when that is lower (at least
    16): openings never take the descriptors admitted connections need."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return wanted
    return min(wanted, max(16, soft // 4))


class Opening:
    """One connection's opening, moved on by `step` as far as it goes without blocking."""

    def __init__(self, sock: socket.socket, peer: str, host: str, deadline: float,
                 guard: auth.ConnectionGuard) -> None:
        self.sock = sock
        self.peer, self.host, self.deadline = peer, host, deadline
        self.role: str | None = None
        self.reason = ""  # why it was refused
        self._tls = guard.tls
        self._credentials = guard.credentials
        self._nonce = secrets.token_bytes(auth.NONCE_BYTES)
        self._out = b""
        self._answer = bytearray()
        self._stage = "tls" if guard.tls is not None else "hello"

    def step(self) -> str:
        """READ or WRITE (what it waits for), ADMITTED, or REFUSED (with `reason`)."""
        try:
            return self._step()
        except ssl.SSLWantReadError:
            return READ
        except ssl.SSLWantWriteError:
            return WRITE
        except ssl.SSLError as exc:
            what = "TLS" if self._stage == "tls" else "handshake"
            return self._refuse(f"the {what} handshake failed: {type(exc).__name__}")
        except OSError as exc:
            return self._refuse(f"the handshake failed: {type(exc).__name__}")

    def _refuse(self, reason: str) -> str:
        self.reason = reason
        return REFUSED

    def _step(self) -> str:
        if self._stage == "tls":
            if not isinstance(self.sock, ssl.SSLSocket):
                assert self._tls is not None
                self.sock = self._tls.wrap_socket(self.sock, server_side=True,
                                                  do_handshake_on_connect=False)
            self.sock.do_handshake()
            self._stage = "hello"
        if self._stage == "hello":
            if self._credentials is None:
                return ADMITTED  # TLS only
            if not self._out:
                self._out = auth.MAGIC + self._nonce
            if not self._flush():
                return WRITE
            self._stage = "answer"
        if self._stage == "answer":
            while len(self._answer) < auth.ANSWER_BYTES:
                try:
                    chunk = self.sock.recv(auth.ANSWER_BYTES - len(self._answer))
                except BlockingIOError:
                    return READ
                if not chunk:
                    return self._refuse("the peer closed the connection during the "
                                        "handshake")
                self._answer += chunk
            assert self._credentials is not None
            self.role = auth.handshake_role(self._credentials, self._nonce,
                                            bytes(self._answer))
            if self.role is None:
                try:  # best effort: the verdict, then the close
                    self.sock.send(auth.REFUSED)
                except OSError:
                    pass
                return self._refuse("the handshake did not prove this job's credentials")
            self._out = auth.ACCEPTED
            self._stage = "verdict"
        if not self._flush():
            return WRITE
        return ADMITTED

    def _flush(self) -> bool:
        """Send what is left of `_out`; True once all of it is sent."""
        while self._out:
            try:
                sent = self.sock.send(self._out)
            except BlockingIOError:
                return False
            self._out = self._out[sent:]
        return True


class Admission:
    """Accepts connections on `listener` and opens them (see the module doc); each that
    opens goes to `admitted`. Without a guard, every connection is admitted at once."""

    def __init__(self, listener: socket.socket, guard: auth.ConnectionGuard | None,
                 admitted: Admitted, max_pending: int | None = None) -> None:
        self.listener = listener
        self.guard = guard
        self.admitted = admitted
        self.max_pending = pending_limit() if max_pending is None else max_pending
        self._pending: dict[Opening, None] = {}  # oldest first
        self._by_host: dict[str, dict[Opening, None]] = {}  # each oldest first
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._stopping = False
        self._listening = True
        self._resume_at = 0.0  # when a paused listener is watched again
        self._pause = ACCEPT_BACKOFF_S[0]
        self._thread = threading.Thread(target=self._run, name="ps-data-admission",
                                        daemon=True)

    @property
    def pending(self) -> int:
        return len(self._pending)

    def start(self) -> None:
        self.listener.setblocking(False)
        self._selector.register(self.listener, selectors.EVENT_READ, None)
        self._selector.register(self._wake_r, selectors.EVENT_READ, self._wake_r)
        self._thread.start()

    def stop(self) -> None:
        """Stop accepting and close every opening in progress (the listener stays open:
        its owner closes it)."""
        self._stopping = True
        try:
            self._wake_w.send(b"\0")
        except OSError:
            pass
        self._thread.join(STOP_TIMEOUT_S)

    # ------------------------------------------------------------------ the loop
    def _run(self) -> None:
        try:
            while not self._stopping:
                accept = False
                for key, _ in self._selector.select(self._timeout()):
                    if key.data is None:
                        accept = True
                    elif key.data is self._wake_r:
                        self._wake_r.recv(64)
                    else:
                        self._advance(key.data)
                now = time.monotonic()
                self._expire(now)
                if accept and not self._stopping:
                    self._accept_some(now)
                if not self._listening and now >= self._resume_at and not self._stopping:
                    self._selector.register(self.listener, selectors.EVENT_READ, None)
                    self._listening = True
        except Exception:  # noqa: BLE001 - a bug here must not pass unnoticed
            _log.exception("data plane: the admission loop failed")
        finally:
            for opening in list(self._pending):
                self._drop(opening)
            self._selector.close()
            self._wake_r.close()
            self._wake_w.close()

    def _timeout(self) -> float:
        """Until the oldest opening's deadline or the listener's pause ends (at most 1 s)."""
        now = time.monotonic()
        due = [1.0]
        if self._pending:
            due.append(next(iter(self._pending)).deadline - now)
        if not self._listening:
            due.append(self._resume_at - now)
        return max(0.0, min(due))

    def _accept_some(self, now: float) -> None:
        for _ in range(ACCEPT_BATCH):
            try:
                sock, address = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                _log.warning("data plane: accept failed (%s); retrying in %.2f s",
                             errno.errorcode.get(exc.errno or 0, exc), self._pause)
                self._selector.unregister(self.listener)
                self._listening = False
                self._resume_at = now + self._pause
                self._pause = min(self._pause * 2, ACCEPT_BACKOFF_S[1])
                return
            self._pause = ACCEPT_BACKOFF_S[0]
            peer = str(address)
            if self.guard is None:
                self._hand_over(sock, None, peer)
                continue
            sock.setblocking(False)
            if len(self._pending) >= self.max_pending:
                self._make_room()
            host = address[0] if isinstance(address, tuple) else peer
            opening = Opening(sock, peer, host, now + self.guard.timeout_s, self.guard)
            self._pending[opening] = None
            self._by_host.setdefault(host, {})[opening] = None
            self._selector.register(sock.fileno(), selectors.EVENT_READ, opening)
            self._advance(opening)

    def _make_room(self) -> None:
        """Close the oldest opening of the peer holding the most."""
        host = max(self._by_host, key=lambda h: len(self._by_host[h]))
        oldest = next(iter(self._by_host[host]))
        self._refuse(oldest, f"{self.max_pending} handshakes were in progress; this "
                     f"peer's oldest was closed to make room")

    def _expire(self, now: float) -> None:
        while self._pending:
            oldest = next(iter(self._pending))
            if oldest.deadline > now:
                return
            self._refuse(oldest, "the handshake took too long")

    def _advance(self, opening: Opening) -> None:
        try:
            self._move(opening)
        except Exception:  # noqa: BLE001 - one connection's failure is not the loop's
            _log.exception("data plane: opening a connection from %s failed", opening.peer)
            self._drop(opening)

    def _move(self, opening: Opening) -> None:
        outcome = opening.step()
        if outcome == ADMITTED:
            self._forget(opening)
            self._hand_over(opening.sock, opening.role, opening.peer)
        elif outcome == REFUSED:
            self._refuse(opening, opening.reason)
        else:
            events = selectors.EVENT_READ if outcome == READ else selectors.EVENT_WRITE
            fd = opening.sock.fileno()
            if self._selector.get_key(fd).events != events:
                self._selector.modify(fd, events, opening)

    # ------------------------------------------------------------------ endings
    def _hand_over(self, sock: socket.socket, role: str | None, peer: str) -> None:
        sock.setblocking(True)
        try:
            self.admitted(sock, role, peer)
        except Exception:  # noqa: BLE001 - one connection's failure is not the loop's
            _log.exception("data plane: serving a new connection from %s failed", peer)
            sock.close()

    def _refuse(self, opening: Opening, reason: str) -> None:
        assert self.guard is not None
        self.guard.refusals.refused(opening.peer, reason)
        self._drop(opening)

    def _drop(self, opening: Opening) -> None:
        self._forget(opening)
        try:
            opening.sock.close()
        except OSError:  # pragma: no cover
            pass

    def _forget(self, opening: Opening) -> None:
        self._pending.pop(opening, None)
        same_host = self._by_host.get(opening.host)
        if same_host is not None:
            same_host.pop(opening, None)
            if not same_host:
                del self._by_host[opening.host]
        try:
            self._selector.unregister(opening.sock.fileno())
        except (KeyError, ValueError, OSError):
            pass
