"""The replay cache of a parameter server's gRPC proofs (`auth.ServerGuard`).

A proof carries its own time and is accepted only within `window_s` of the server's
clock, so its nonce needs remembering only until its time plus the window: after that
the proof is refused as too old anyway. Nonces are kept in buckets by the second of
their proof's time, and forgetting is dropping the buckets whose proofs have all
expired. So no proof is accepted twice, whatever the call rate.

Memory is bounded by `limit` nonces: when that many proofs were accepted within the
window, a new one is refused (`ReplayCacheFull`) until older ones expire, never by
forgetting a nonce early. Only proofs whose MAC checked out are recorded, so only a
holder of the job's keys can fill the cache.
"""

from __future__ import annotations

import math
import threading

# Nonces: over a 300 s window, ~3,500 calls/s sustained; about 80 MiB when full (the
# cache holds only what the window's calls need: a job's usual few calls a second
# keep it small).
REPLAY_CACHE_MAX = 1 << 20
_SWEEP_EVERY_S = 1.0


class ReplayCacheFull(Exception):
    """`limit` proofs are remembered, none expired yet: refuse the call, retry later."""


class ReplayCache:
    def __init__(self, window_s: float, limit: int = REPLAY_CACHE_MAX) -> None:
        self.window_s = window_s
        self.limit = limit
        self._buckets: dict[int, set[int]] = {}  # second of a proof's time -> nonces
        self._size = 0
        self._next_sweep = -math.inf
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return self._size

    def first_use(self, nonce: int, stamp_s: float, now: float) -> bool:
        """Record `nonce` of a proof made at `stamp_s` (within the window of `now`):
        True the first time, False when it was seen before (a replay). Raises
        ReplayCacheFull when `limit` unexpired nonces are remembered."""
        second = math.floor(stamp_s)
        with self._lock:
            if now >= self._next_sweep:
                self._sweep(now)
            bucket = self._buckets.get(second)
            if bucket is not None and nonce in bucket:
                return False
            if self._size >= self.limit:
                self._sweep(now)
                if self._size >= self.limit:
                    raise ReplayCacheFull(f"{self.limit} proofs were accepted within "
                                          f"{self.window_s:g} s")
                bucket = self._buckets.get(second)
            if bucket is None:
                bucket = self._buckets[second] = set()
            bucket.add(nonce)
            self._size += 1
            return True

    def _sweep(self, now: float) -> None:
        """Drop the buckets whose proofs are all older than the window (a proof of
        second s is at most s + 1, so it expires by s + 1 + window)."""
        expired = [s for s in self._buckets if s + 1 + self.window_s < now]
        for second in expired:
            self._size -= len(self._buckets.pop(second))
        self._next_sweep = now + _SWEEP_EVERY_S
