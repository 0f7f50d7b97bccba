"""Issue 26.1: a flood of connections that never answer the data plane's handshake does
not keep a worker out, and costs the server no thread per connection (`admission`).

Bounded: a few hundred loopback connections, every wait with a deadline."""

from __future__ import annotations

import select
import socket
import threading
import time
from collections.abc import Iterator

import pytest
from pstrain_api import security

from pstrain_runtime.ps.store import ParameterStore
from pstrain_runtime.transport import auth, dataplane
from pstrain_runtime.transport.admission import Admission, pending_limit

pytestmark = pytest.mark.timeout(60)

FLOOD = 300
PROBES = 20
ADMIT_WITHIN_S = 1.0
TOKEN = security.new_token()
CHIEF = auth.Credentials.from_token(TOKEN).only(security.KEY_CHIEF)


def guard(timeout_s: float = auth.HANDSHAKE_TIMEOUT_S) -> auth.ConnectionGuard:
    return auth.ConnectionGuard(auth.Credentials.from_token(TOKEN), timeout_s=timeout_s)


def silent(port: int, source: str = "127.0.0.1") -> socket.socket:
    """A connection that will never answer the handshake."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind((source, 0))
    sock.connect(("127.0.0.1", port))
    return sock


def wait_answered(socks: list[socket.socket], within_s: float = 10.0) -> None:
    """Until the server has said something to (or closed) every one of `socks`."""
    deadline = time.monotonic() + within_s
    waiting = list(socks)
    while waiting and time.monotonic() < deadline:
        ready, _, _ = select.select(waiting, [], [], 0.2)
        waiting = [s for s in waiting if s not in ready]
    assert not waiting, f"{len(waiting)} connections were never accepted"


def still_open(sock: socket.socket) -> bool:
    """The server has not closed `sock` (what it sent is read and dropped)."""
    try:
        while sock.recv(4096, socket.MSG_DONTWAIT):
            pass
    except BlockingIOError:
        return True
    except OSError:
        return False
    return False


def admitted_in(port: int) -> float | None:
    """Seconds from connect to the server's "accepted" for a worker with the key, or None
    when it was refused."""
    t0 = time.perf_counter()
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
            auth.offer_handshake(sock, CHIEF, timeout_s=5)
    except (OSError, auth.AuthError):
        return None
    return time.perf_counter() - t0


@pytest.fixture
def server() -> Iterator[dataplane.DataServer]:
    data = dataplane.DataServer(ParameterStore(), "127.0.0.1", guard=guard())
    data.start()
    yield data
    data.stop()


@pytest.mark.parametrize("many", [False, True], ids=["one-peer", "many-peers"])
def test_a_worker_gets_in_within_a_second_during_a_handshake_flood(many: bool) -> None:
    before = threading.active_count()
    data = dataplane.DataServer(ParameterStore(), "127.0.0.1", guard=guard())
    data.start()
    flood: list[socket.socket] = []
    try:
        for i in range(FLOOD):  # from the worker's own address, or one address each
            flood.append(silent(data.port, f"127.0.{1 + i // 250}.{1 + i % 250}" if many
                                else "127.0.0.1"))
        wait_answered(flood)
        # One thread opens every connection: the flood holds none of its own.
        assert threading.active_count() - before <= 1
        times = [admitted_in(data.port) for _ in range(PROBES)]
        assert all(t is not None and t <= ADMIT_WITHIN_S for t in times), times
    finally:
        for sock in flood:
            sock.close()
        data.stop()


def test_when_full_the_oldest_opening_of_the_busiest_peer_is_closed() -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    kept: list[tuple[socket.socket, str | None, str]] = []
    admission = Admission(listener, guard(), lambda *opened: kept.append(opened),
                          max_pending=6)
    admission.start()
    try:
        busy = [silent(port, "127.0.0.2") for _ in range(4)]
        wait_answered(busy)
        quiet = [silent(port, "127.0.0.3") for _ in range(2)]
        wait_answered(quiet)
        assert admission.pending == 6
        newcomer = silent(port, "127.0.0.4")  # over the limit: room is made
        wait_answered([newcomer])
        deadline = time.monotonic() + 5
        while still_open(busy[0]) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert [still_open(s) for s in busy] == [False, True, True, True]
        assert all(still_open(s) for s in quiet) and still_open(newcomer)
        assert admission.pending == 6
        # A worker from the busiest address still gets in (the oldest goes again).
        assert admitted_in(port) is not None
        deadline = time.monotonic() + 5
        while not kept and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(kept) == 1 and kept[0][1] == security.KEY_CHIEF
        for sock in [*busy, *quiet, newcomer]:
            sock.close()
    finally:
        admission.stop()
        listener.close()
        for sock, _, _ in kept:
            sock.close()


def test_an_opening_is_closed_at_its_deadline(server: dataplane.DataServer) -> None:
    assert server.guard is not None
    server.guard.timeout_s = 0.3
    sock = silent(server.port)
    t0 = time.monotonic()
    sock.settimeout(5)
    hello = sock.recv(64)
    assert hello.startswith(auth.MAGIC)
    assert sock.recv(64) == b""  # closed by the server, not by our timeout
    assert time.monotonic() - t0 < 3
    sock.close()
    assert server.admission is not None and server.admission.pending == 0


def test_wrong_answers_are_refused_without_a_thread(server: dataplane.DataServer) -> None:
    sock = silent(server.port)
    sock.settimeout(5)
    assert sock.recv(64).startswith(auth.MAGIC)
    sock.sendall(b"\x01" + bytes(32))
    assert sock.recv(64) == auth.REFUSED
    sock.close()
    assert server.guard is not None
    deadline = time.monotonic() + 5
    while not server.guard.refusals.count and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server.guard.refusals.count == 1


def test_the_pending_limit_leaves_descriptors_for_admitted_connections() -> None:
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert pending_limit() <= max(16, soft // 4)
    assert pending_limit(8) <= 8
