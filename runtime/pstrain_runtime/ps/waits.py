"""The one wait of the parameter server: every blocking call (a sync step, the staleness
bound, a pull's min_step) waits here, and every wait ends: when it is ready, at the
caller's deadline, when the caller is gone (cancelled or disconnected), when the job
is done, the server stops or the namespace is initialised again, and in any case after
`max_wait` seconds."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from .namespace import Namespace

WAIT_SLICE = 0.5  # seconds between checks of done/stop/cancel while blocking
MAX_WAIT = 60.0  # seconds: no wait in the store lasts longer, whatever the caller asks
Gone = Callable[[], bool]  # True once the caller cancelled or disconnected
# wait(ns, ready, timeout, gone): True once ready(), False when the wait ended otherwise
Wait = Callable[["Namespace", Callable[[], bool], "float | None", "Gone | None"], bool]


class WaitBounds(Protocol):
    """What bounds a wait besides the caller: the store's clock, limit and stop flag."""

    clock: Callable[[], float]
    max_wait: float
    stopping: threading.Event


def wait_until(bounds: WaitBounds, ns: Namespace, ready: Callable[[], bool],
               timeout: float | None, gone: Gone | None = None) -> bool:
    """Wait on ns.cond (held) until ready(), done, stop, re-init, the caller is `gone`
    (checked every WAIT_SLICE), or the deadline: `timeout` (the caller's), never more
    than `bounds.max_wait`."""
    limit = bounds.max_wait if timeout is None else min(timeout, bounds.max_wait)
    deadline = bounds.clock() + limit
    epoch = ns.epoch
    while not ready():
        if ns.done or bounds.stopping.is_set() or ns.epoch != epoch:
            return False
        if gone is not None and gone():
            return False
        left = min(WAIT_SLICE, deadline - bounds.clock())
        if left <= 0:
            return False
        ns.cond.wait(left)
    return True
