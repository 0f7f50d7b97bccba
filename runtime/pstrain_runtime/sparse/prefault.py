"""A fixed-size table's reserved row blocks faulted in ahead of training, off its path.

A server reserves the expected shard of a fixed-size table up front (`RowTable`'s
`reserve`) without touching it, so each page is mapped by the first write of a row
on it. With uniform ids most of an early update's rows are new, and those first
touches were a third to two fifths of its time (bench/RESULTS.md, session 24). A
`Prefault` maps the blocks' pages in a background thread instead, with
`madvise(MADV_POPULATE_WRITE)` (Linux 5.14+), which maps pages as a write would
without writing them: the values stay as they are, so it runs beside updates. The
blocks are first marked `MADV_HUGEPAGE`: mapped whole, 2 MiB pages cost half the
time of 4 KiB ones and make random gathers cheaper.

The trade: the server then holds the whole expected shard from the start, as TorchRec
and a dense table do. `should_prefault` says when to make it: the reserve must fit well
within the memory this process may still use (its cgroup's limit, the machine's
available memory), and `PSTRAIN_PREFAULT=0` in a server's environment turns it off.
Where the call is missing (another OS, an older kernel) nothing happens and rows map on
first write as before.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import mmap
import os
import threading
from pathlib import Path

import torch

log = logging.getLogger(__name__)

MADV_HUGEPAGE = 14
MADV_POPULATE_WRITE = 23
CHUNK_BYTES = 64 << 20  # pages mapped per call, so that `stop` takes effect soon
HUGE_PAGE = 2 << 20
ENV = "PSTRAIN_PREFAULT"  # "0": never prefault (rows map on first write)
FIT_SHARE = 0.5  # a reserve is populated only if it needs at most this share of what is free

_libc = None


def _madvise():  # type: ignore[no-untyped-def]
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        _libc.madvise.restype = ctypes.c_int
    return _libc.madvise


def _advise(start: int, stop: int, advice: int, align: int = mmap.PAGESIZE) -> bool:
    """madvise over the whole `align` pages within [start, stop); False if refused."""
    first = (start + align - 1) // align * align
    last = stop // align * align
    if last <= first:
        return True
    return _madvise()(first, last - first, advice) == 0


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # ("max": no limit)


def free_bytes(meminfo: Path = Path("/proc/meminfo"),
               cgroup: Path = Path("/sys/fs/cgroup")) -> int | None:
    """Bytes this process may still take: the machine's available memory, or less
    where its cgroup's limit (v2, or v1's memory controller) is nearer. None where
    none can be read."""
    got: list[int] = []
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                got.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError, IndexError):
        pass
    for limit_file, used_file in (("memory.max", "memory.current"),
                                  ("memory/memory.limit_in_bytes",
                                   "memory/memory.usage_in_bytes")):
        limit, used = _read_int(cgroup / limit_file), _read_int(cgroup / used_file)
        if limit is not None and used is not None and limit < 1 << 60:  # (v1: no limit)
            got.append(max(0, limit - used))
    return min(got) if got else None


_running: set[Prefault] = set()  # the prefaults still mapping, in this process
_running_lock = threading.Lock()


def pending_bytes() -> int:
    """Bytes the running prefaults have yet to map (free memory will shrink by these)."""
    with _running_lock:
        return sum(max(0, p.total - p.mapped) for p in _running)


def should_prefault(nbytes: int, free: int | None = None) -> bool:
    """Whether to map `nbytes` up front: not turned off (`PSTRAIN_PREFAULT=0` in the
    server's environment), and it leaves room: at most FIT_SHARE of the memory this
    process may still take, less what running prefaults are about to map."""
    if nbytes <= 0 or os.environ.get(ENV) == "0":
        return False
    free = free_bytes() if free is None else free
    return free is not None and nbytes <= FIT_SHARE * (free - pending_bytes())


class Prefault:
    """Maps the pages of `blocks` (CPU tensors) in a daemon thread, chunk by chunk,
    while what is left fits the free memory. `stop` ends it soon (between chunks);
    `done` says it finished (`mapped` bytes; `ok` False if the kernel refused the call).

    The thread sees only the blocks' page ranges, never a tensor: the blocks are kept
    alive by this object (`blocks`, dropped by `stop`) in the owner's thread, so no
    torch code ever runs in the thread (a daemon thread still in C++ code at the
    interpreter's exit aborts the process)."""

    def __init__(self, blocks: list[torch.Tensor], name: str = "") -> None:
        page = mmap.PAGESIZE
        self.blocks = [b for b in blocks if b.numel()]
        self.ranges = [((b.data_ptr() + page - 1) // page * page,
                        (b.data_ptr() + b.numel() * b.element_size()) // page * page)
                       for b in self.blocks]
        self.total = sum(max(0, stop - start) for start, stop in self.ranges)
        self.mapped = 0
        self.ok = True
        self._stop = threading.Event()
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, name=f"prefault {name}",
                                       daemon=True)
        with _running_lock:
            _running.add(self)
        self.thread.start()

    def _run(self) -> None:
        try:
            for start, stop in self.ranges:
                _advise(start, stop, MADV_HUGEPAGE, HUGE_PAGE)  # a hint: refusal is fine
                for at in range(start, stop, CHUNK_BYTES):
                    if self._stop.is_set() or not self._room():
                        return
                    end = min(stop, at + CHUNK_BYTES)
                    if not _advise(at, end, MADV_POPULATE_WRITE):
                        self.ok = False
                        log.debug("prefault refused (%s); rows map on first write",
                                  os.strerror(ctypes.get_errno()))
                        return
                    self.mapped += end - at
        except (OSError, AttributeError) as exc:  # no libc or no madvise here
            self.ok = False
            log.debug("prefault unavailable: %s", exc)
        finally:
            with _running_lock:
                _running.discard(self)
            self.done.set()

    def _room(self) -> bool:
        """Whether what is left to map still fits (other processes on the machine, say
        the other servers of `pstrain run`, take memory too): if not, stop here, and
        the rest maps on first write."""
        free = free_bytes()
        return free is None or self.total - self.mapped <= FIT_SHARE * free

    def fraction(self) -> float:
        """The share of the blocks mapped so far (all of them once done unstopped)."""
        return self.mapped / self.total if self.total else 1.0

    def stop(self, timeout_s: float = 5.0) -> None:
        """End the mapping (between chunks), then let the blocks go."""
        self._stop.set()
        self.thread.join(timeout_s)
        if not self.thread.is_alive():
            self.blocks = []
