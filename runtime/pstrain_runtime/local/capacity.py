"""Whether this machine can hold the processes a local run starts: their memory (a
refusal) and their CPU cores (a warning).

Each replica is a Python process with torch loaded: about 250 MB resident before it
holds a single parameter (measured: `import torch, grpc, pstrain_runtime.worker.trainer` peaks
at 246 MB on Linux, torch 2.13 CPU). A job with more replicas than the available memory
holds swaps or has replicas killed for memory long before training starts, so the runner
warns first and names the numbers.
"""

from __future__ import annotations

import os
from pathlib import Path

REPLICA_MEMORY_BYTES = 250 * 2**20
GIB = 2**30


def available_memory(meminfo: Path = Path("/proc/meminfo")) -> int | None:
    """Bytes of memory available for new processes (MemAvailable), or None if unknown."""
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return None


def capacity_warning(processes: int, available: int | None) -> str | None:
    """A warning when `processes` replicas need more memory than `available`, else None."""
    need = processes * REPLICA_MEMORY_BYTES
    if available is None or need <= available:
        return None
    return (f"this job starts {processes} processes of about "
            f"{REPLICA_MEMORY_BYTES // 2**20} MB each ({need / GIB:.1f} GiB) and this machine "
            f"has {available / GIB:.1f} GiB available: expect swapping or replicas killed for "
            "memory; run fewer replicas here, or run the job on Kubernetes")


def usable_cores() -> int | None:
    """The CPU cores this process may run on (its affinity mask), else the machine's."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count()


def cores_warning(workers: int, cores: int | None) -> str | None:
    """One line when `workers` outnumber `cores`, else None. Not a refusal: the job
    runs, but the workers take turns on the cores, so more of them buy no speed."""
    if cores is None or workers <= cores:
        return None
    return (f"{workers} workers on {cores} CPU core{'s' if cores != 1 else ''}: the "
            "workers take turns on the cores, so more workers than cores train no faster "
            "here (spec.replicas.worker.maxReplicas bounds a scale)")
