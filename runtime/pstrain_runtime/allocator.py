"""glibc malloc settings per replica role, set once when a replica starts.

torch allocates CPU tensors with glibc's malloc. By default glibc returns freed memory
at the top of the heap to the OS (trimming) and serves large blocks with fresh mmaps,
whose thresholds it adapts as it goes; a training step that allocates and frees a few
megabytes of activations then page-faults its memory back in every step (zeroed pages:
about a tenth of a CTR worker's CPU). So:

- a trainer keeps what it freed (blocks up to 64 MiB from the heap, trimmed only above
  256 MiB free): its working set is one step's tensors, the same every step;
- a parameter server returns blocks of 4 MiB and more to the OS when freed and keeps
  at most 32 MiB free at the heap's top: its memory is its tables, which it holds in
  large blocks of their own, and a burst of large requests must not leave the heap
  holding their size for good (the servers' memory is what sizes a job). Its threads
  (gRPC's, the data plane's, torch's) share one malloc arena: glibc's default of one
  per thread up to 8 per core kept each arena's freed blocks apart from the others'
  (with a disk tier, 3-4 MB more at the peak, 5 % of the budget; in memory, 2-3 MB
  more), and the threads' speed is the same either way;
- a parameter server with a memory budget for its rows (`sparse.tiered`, set when
  such a table is made) also returns blocks of 4 MiB and more at once, and keeps at
  most 1 MiB free at the heap's top: rows moving between memory and disk pass through
  blocks of a few hundred KB each call, which it takes again the next call. Mapped
  apart (a threshold of 128 KiB, as before) each was a fresh mmap whose pages were
  faulted in zeroed every call: about 570 page faults more per read + update, 1.5 % of
  the calls' CPU; kept in the heap, the server's peak memory is 1-2 % of the budget
  higher (bench/RESULTS.md, session 29). Trimming the heap after every call instead
  cost a sixth of the server's CPU.

Elsewhere (musl, macOS) nothing is changed. `PSTRAIN_MALLOC=default` leaves glibc's
own settings.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

M_TRIM_THRESHOLD = -1
M_TOP_PAD = -2
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8
MIB = 1 << 20

SETTINGS: dict[str, dict[int, int]] = {
    "trainer": {M_MMAP_THRESHOLD: 64 * MIB, M_TRIM_THRESHOLD: 256 * MIB,
                M_TOP_PAD: 16 * MIB},
    # One arena holds only when set before the server's threads start (`tune("ps")`
    # comes first in a server's process; `budget` comes later, with its first table).
    "ps": {M_MMAP_THRESHOLD: 4 * MIB, M_TRIM_THRESHOLD: 32 * MIB, M_ARENA_MAX: 1},
    "budget": {M_MMAP_THRESHOLD: 4 * MIB, M_TRIM_THRESHOLD: 1 * MIB},
}


def tune(role: str) -> bool:
    """Apply `role`'s settings ("trainer", "ps" or "budget"); False when nothing was
    changed."""
    if os.environ.get("PSTRAIN_MALLOC") == "default":
        return False
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    return all(mallopt(param, value) == 1 for param, value in SETTINGS[role].items())
