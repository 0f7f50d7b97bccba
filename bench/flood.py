"""Item `flood`: a handshake flood on a parameter server's data port (issue 26.1).

Three processes on loopback: a data-plane server with authentication on (a
`dataplane.DataServer` with the `auth.ConnectionGuard` a PS builds), an outsider that
holds `FLOOD` connections open without ever answering the handshake (a closed one is
opened again at once, so the flood never shrinks), and a worker that, once the flood is
up, opens `PROBES` fresh connections one after the other, each with the chief's key,
and times each from `connect` to the server's "accepted".

Three floods: from one peer (the outsider on 127.0.0.1, the address the worker uses
too), from many peers (each connection from its own 127.0.x.y source address), and from
one peer with `OVER_LIMIT` connections, more than the server keeps in its handshake
table (`admission.MAX_PENDING`), so it must close some all the time. Reported:
each probe's time to admission, how many were admitted within `ADMIT_WITHIN_S`, and
the most threads and open file descriptors the server process held during the flood.
"""

from __future__ import annotations

import errno
import os
import selectors
import socket
import threading
import time
from typing import Any

from .core import Config, Figure
from .procs import LOOPBACK, run_group

FLOOD = 1000  # unanswered connections held open
OVER_LIMIT = 3000  # a flood larger than the server's handshake table
PROBES = 20  # fresh connections from the worker, one at a time
PROBE_GAP_S = 0.1
ADMIT_WITHIN_S = 1.0
PROBE_TIMEOUT_S = 5.0
FLOOD_UP_TIMEOUT_S = 60.0
TOKEN = b"b" * 32


def _raise_open_files(want: int) -> None:
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(want, hard), hard))


def _server(port_to: list[Any], done: Any) -> dict[str, int]:
    from pstrain_runtime.ps.store import ParameterStore
    from pstrain_runtime.transport import auth, dataplane

    data = dataplane.DataServer(ParameterStore(), LOOPBACK,
                                guard=auth.ConnectionGuard(auth.Credentials.from_token(TOKEN)))
    port = data.start()
    for conn in port_to:
        conn.send(port)
    threads = fds = 0
    try:
        while not done.wait(0.02):
            threads = max(threads, threading.active_count())
            fds = max(fds, len(os.listdir("/proc/self/fd")))
    finally:
        data.stop()
    return {"threads": threads, "fds": fds}


def _source(index: int, many: bool) -> str:
    if not many:
        return LOOPBACK
    return f"127.0.{1 + index // 250}.{1 + index % 250}"


def _outsider(port_from: Any, many: bool, size: int, up: Any, done: Any) -> dict[str, int]:
    """Hold `size` connections that never answer; reopen each one the server closes."""
    _raise_open_files(size + 256)
    port = port_from.recv()
    sel = selectors.DefaultSelector()
    opened = reopened = 0

    def open_one(index: int) -> None:
        nonlocal opened
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setblocking(False)
        if many:
            sock.bind((_source(index, many), 0))
        code = sock.connect_ex((LOOPBACK, port))
        if code not in (0, errno.EINPROGRESS):
            sock.close()
            raise OSError(code, os.strerror(code))
        sel.register(sock, selectors.EVENT_READ, index)
        opened += 1

    for index in range(size):
        open_one(index)
    up.set()
    while not done.is_set():
        for key, _ in sel.select(0.05):
            sock = key.fileobj
            try:
                if sock.recv(4096):  # type: ignore[union-attr]
                    continue  # the server's hello: never answered
            except (BlockingIOError, InterruptedError):
                continue
            except OSError:
                pass
            sel.unregister(sock)
            sock.close()  # type: ignore[union-attr]
            open_one(key.data)
            reopened += 1
    for key in list(sel.get_map().values()):
        key.fileobj.close()  # type: ignore[union-attr]
    return {"opened": opened, "reopened": reopened}


def _worker(port_from: Any, up: Any, done: Any) -> list[float | None]:
    """Seconds from connect to "accepted" for each probe; None when it was refused."""
    from pstrain_runtime.transport import auth

    port = port_from.recv()
    chief = auth.Credentials.from_token(TOKEN).only("chief")
    try:
        if not up.wait(FLOOD_UP_TIMEOUT_S):
            raise TimeoutError("the flood did not start")
        time.sleep(1.0)  # let the flood settle on the server
        out: list[float | None] = []
        for _ in range(PROBES):
            t0 = time.perf_counter()
            try:
                with socket.create_connection((LOOPBACK, port), PROBE_TIMEOUT_S) as sock:
                    auth.offer_handshake(sock, chief, PROBE_TIMEOUT_S)
                out.append(time.perf_counter() - t0)
            except (OSError, auth.AuthError):
                out.append(None)
            time.sleep(PROBE_GAP_S)
        return out
    finally:
        done.set()


def _role(rank: int, many: bool, size: int, up: Any, done: Any, *pipes: Any) -> Any:
    if rank == 0:
        return _server(list(pipes), done)
    if rank == 1:
        return _outsider(pipes[0], many, size, up, done)
    return _worker(pipes[0], up, done)


def flood(cfg: Config, name: str, many: bool, size: int) -> list[Figure]:
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    to_outsider, from_server_1 = ctx.Pipe()
    to_worker, from_server_2 = ctx.Pipe()
    up, done = ctx.Event(), ctx.Event()
    server, outsider, probes = run_group(
        _role, 3, args=(many, size, up, done),
        rank_args=[(to_outsider, to_worker), (from_server_1,), (from_server_2,)],
        timeout_s=min(cfg.item_time_limit_s, 180.0))
    who = (f"{size} connections from {size} source addresses" if many
           else f"{size} connections from the worker's own address")
    admitted = [t for t in probes if t is not None]
    within = sum(1 for t in admitted if t <= ADMIT_WITHIN_S)
    refused = len(probes) - len(admitted)
    note = (f"{within} of {len(probes)} admitted within {ADMIT_WITHIN_S:g} s, {refused} "
            f"refused; the outsider opened {outsider['opened']} connections "
            f"({outsider['reopened']} again after the server closed them)")
    figs = [
        Figure(f"flood.{name}.admitted", f"fresh worker connections admitted within "
               f"{ADMIT_WITHIN_S:g} s during a flood of {who}", f"of {len(probes)}",
               float(within), n=len(probes), note=note),
        Figure(f"flood.{name}.server_threads", "most threads of the server process "
               "during the flood", "threads", float(server["threads"])),
        Figure(f"flood.{name}.server_fds", "most open file descriptors of the server "
               "process during the flood", "fds", float(server["fds"])),
    ]
    if admitted:
        figs.insert(1, Figure.of(f"flood.{name}.admit_ms", f"time from connect to "
                                 f"admission of the admitted ones, flood of {who}", "ms",
                                 [t * 1e3 for t in admitted], note=note))
    else:
        figs.insert(1, Figure.missing(f"flood.{name}.admit_ms", "time from connect to "
                                      f"admission, flood of {who}", "ms",
                                      "no probe was admitted"))
    return figs


def run(cfg: Config) -> list[Figure]:
    return [*flood(cfg, "one_peer", many=False, size=FLOOD),
            *flood(cfg, "many_peers", many=True, size=FLOOD),
            *flood(cfg, "over_limit", many=False, size=OVER_LIMIT)]
