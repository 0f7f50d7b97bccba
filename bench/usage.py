"""What a benchmark's processes use, read from the operating system: TCP bytes moved
(`ss -ti`), resident memory and threads (`/proc/PID/status`) and the memory still available
(`/proc/meminfo`). Shared by the training items and the CTR item, so neither imports
the other for it."""

from __future__ import annotations

import re
import subprocess
from collections.abc import Sequence
from pathlib import Path

_SS_PID = re.compile(r"pid=(\d+)")
_SS_BYTES = re.compile(r"\bbytes_(sent|received):(\d+)")


def parse_ss(text: str) -> dict[int, int]:
    """Bytes sent + received per process id, from `ss -tinpH` output (a socket line
    naming its processes, then an indented line of TCP info)."""
    out: dict[int, int] = {}
    owners: list[int] = []
    for line in text.splitlines():
        if not line.startswith((" ", "\t")):
            owners = [int(p) for p in _SS_PID.findall(line)]
            continue
        moved = sum(int(n) for _, n in _SS_BYTES.findall(line))
        for pid in owners[:1]:  # a socket shared after fork counts once
            out[pid] = out.get(pid, 0) + moved
    return out


def wire_bytes(pids: Sequence[int]) -> int:
    """TCP bytes sent + received so far over the open sockets of `pids`."""
    text = subprocess.run(["ss", "-tinpH"], capture_output=True, text=True,
                          timeout=10).stdout
    moved = parse_ss(text)
    return sum(moved.get(p, 0) for p in pids)


def status_field(pid: int | str, name: str) -> int:
    """One number of `/proc/PID/status` (`pid` "self" for this process): `VmRSS`,
    `VmHWM` (in kB there), `Threads`, ...; 0 when the field is absent."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{name}:"):
            return int(line.split()[1])
    return 0


def rss_bytes(pid: int) -> int:
    return status_field(pid, "VmRSS") * 1024


def peak_rss_bytes(pid: int | str = "self") -> int:
    """The process's peak resident memory (`VmHWM`)."""
    return status_field(pid, "VmHWM") * 1024


def thread_count(pid: int | str = "self") -> int:
    """The process's OS threads: its compute threads and every library's I/O threads."""
    return status_field(pid, "Threads")


def mem_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0
