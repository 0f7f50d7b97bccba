"""Who may push, on the parameter server's side.

- The workers are a `WorkerSet` (Init: 0..num_workers-1) that `set_workers` (the
  SetWorkers call) changes while the job runs (elastic workers; rules in
  `pstrain_api.membership`). A push of a worker outside the set is refused
  (`check_member`); one whose worker is removed while it is in flight is dropped whole
  under the namespace lock (`removed`).
- Where a worker joins: `set_workers` adds it level with the slowest live worker (the
  staleness bound never waits for it to catch up); sync steps wait for it from its
  first push on (`join`, called by the sync barrier).
- Every Init starts a new generation (`new_generation`); pulls carry it and pushes,
  dense and sparse, send it back. A push computed on parameters of another generation
  is refused (ABORTED, `check_generation`), so no gradient computed before a restore
  is applied after it.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterable
from typing import TYPE_CHECKING

from ..proto import ps_pb2 as pb
from .errors import PSError, invalid

if TYPE_CHECKING:
    from .namespace import Namespace


def new_generation(previous: int) -> int:
    """A random nonzero 64-bit generation other than `previous` (0 means "unknown" on
    the wire). Random rather than counted, so that a restarted server, which counts
    from nothing, never repeats the generation of its previous incarnation."""
    while True:
        generation = secrets.randbits(64)
        if generation not in (0, previous):
            return generation


def listed(workers: frozenset[int]) -> str:
    return ", ".join(map(str, sorted(workers)))


def check_member(ns: Namespace, worker: int, call: str) -> None:
    """INVALID_ARGUMENT unless `worker` is one of the job's live workers."""
    if worker not in ns.members:
        raise invalid(f"{call}: worker is {worker}; this job's workers are "
                      f"{listed(ns.members.live)}")


def check_generation(ns: Namespace, worker: int, generation: int, ps_index: int,
                     call: str) -> None:
    """ABORTED when `generation` (0: unknown, not checked) is not the namespace's: the
    push was computed on parameters the server has replaced since."""
    if generation and generation != ns.generation:
        raise PSError("ABORTED",
                      f"{call}: the gradients of worker {worker} were computed on "
                      f"parameters of generation {generation:#x}; parameter "
                      f"server {ps_index} was initialised again since (generation "
                      f"{ns.generation:#x}): pull the parameters again")


def removed_note(worker: int) -> str:
    return (f"worker {worker} was removed from the job while its push was in flight; the "
            "push was dropped whole")


def removed(ns: Namespace, worker: int) -> pb.PushReply:
    """The reply to a push whose worker left the set while it was in flight."""
    return ns.not_applied(worker, removed_note(worker))


def set_workers(ns: Namespace, workers: Iterable[int]) -> None:
    """Make `workers` the namespace's live set (the chief's or the operator's control
    call; ns.cond held). A newcomer starts level with the slowest live worker and reads
    a new partition from 0; a removed worker is waited for by no step from now on (the
    caller applies the open sync steps it held back)."""
    try:
        members = ns.members.changed(workers)
    except ValueError as exc:
        raise invalid(f"set_workers: {exc}") from exc
    slowest = min((ns.worker_pushes.get(w, 0) for w in ns.members.live
                   if w in members), default=0)
    for worker in members.live - ns.members.live:
        ns.worker_pushes[worker] = slowest
        ns.positions.pop(worker, None)  # a newcomer reads a new partition from 0
    ns.members = members


def join(ns: Namespace, worker: int, step: int) -> None:
    """Where a worker joins a sync job: its first contribution, to step `step`, makes
    it waited for from that step on; anyone else is unchanged (ns.cond held)."""
    ns.members = ns.members.joined(worker, step)
