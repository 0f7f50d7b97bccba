"""Running one measurement as a group of local processes (spawned, never forked: grpc
and torch threads do not survive fork), collecting each process's result, and bounding
the whole group in time.

Every process of a group runs `fn(rank, *args)` and its return value comes back to the
parent. A process that raises sends its traceback back instead, and the group fails
with it. Only the processes started here are ever terminated.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

from pstrain_runtime.local.processes import find_free_ports

LOOPBACK = "127.0.0.1"


class GroupError(RuntimeError):
    """A process of a measurement group failed or the group ran out of time."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for several distinct ones,
    call `find_free_ports(n)`: separate calls may hand out the same port twice)."""
    return find_free_ports(1, LOOPBACK)[0]


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process so far (Linux /proc)."""
    from pathlib import Path

    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def limit_threads(n: int = 1) -> None:
    """Keep one process to `n` compute threads: the benchmark machine is small and
    shared, and every contender (PS, DDP, single process) gets the same budget."""
    os.environ["OMP_NUM_THREADS"] = str(n)
    os.environ["MKL_NUM_THREADS"] = str(n)
    try:
        import torch
    except ImportError:  # the TCP limit runs without torch
        return
    torch.set_num_threads(n)


def _entry(rank: int, fn: Callable[..., Any], args: tuple[Any, ...], out: Any,
           threads: int) -> None:
    limit_threads(threads)
    try:
        result = fn(rank, *args)
    except Exception:  # noqa: BLE001 - the boundary: the parent reports the traceback
        out.put((rank, False, traceback.format_exc()))
        raise SystemExit(1) from None
    out.put((rank, True, result))


def run_group(
    fn: Callable[..., Any],
    size: int,
    args: Sequence[Any] = (),
    timeout_s: float = 600.0,
    threads: int = 1,
    rank_args: Sequence[Sequence[Any]] | None = None,
) -> list[Any]:
    """Run `fn(rank, *args, *rank_args[rank])` in `size` spawned processes; return
    their results ordered by rank. Raises GroupError on a failure or after `timeout_s`.
    """
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = []
    for rank in range(size):
        extra = tuple(rank_args[rank]) if rank_args is not None else ()
        p = ctx.Process(target=_entry, args=(rank, fn, (*args, *extra), out, threads),
                        daemon=True, name=f"bench-{getattr(fn, '__name__', 'fn')}-{rank}")
        p.start()
        procs.append(p)
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(results) < size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise GroupError(
                    f"{getattr(fn, '__name__', fn)}: {size - len(results)} of {size} "
                    f"processes did not finish within {timeout_s:.0f} s."
                )
            try:
                rank, ok, payload = out.get(timeout=min(remaining, 0.5))
            except queue.Empty:
                dead = [p for i, p in enumerate(procs)
                        if i not in results and p.exitcode not in (None, 0)]
                if dead:
                    raise GroupError(
                        f"{dead[0].name} exited with code {dead[0].exitcode} "
                        "without reporting a result."
                    ) from None
                continue
            if not ok:
                raise GroupError(f"rank {rank} of {getattr(fn, '__name__', fn)} failed:\n"
                                 f"{payload}")
            results[rank] = payload
    finally:
        for p in procs:
            p.join(timeout=5)
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
    return [results[r] for r in range(size)]
