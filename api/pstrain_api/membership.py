"""Elastic workers: which workers belong to a running job, and what a scale changes.

Pure, shared by the operator (which worker pods to add or remove), the local runner
(which worker processes to start or stop) and the parameter server (which workers a
sync step waits for, and whose pushes it takes). Nothing here does I/O.

Workers are numbered. A scale keeps the lowest indices: a scale-up adds the lowest free
indices, a scale-down removes the highest ones. Worker 0 is never removed: without a
separate chief it is the chief, and the minimum worker count is 1.

Step boundaries (sync mode): a worker removed while global step `g` is open is waited
for by no step from `g` on (no step waits for a worker that is gone); a contribution it
already made to an open step stays and is applied whole with that step. A worker added
is waited for from the step of its first contribution on, so a newcomer that is still
starting (loading its program, its data) holds no step back: the steps before it
pushes are applied without it, the step it first pushes for waits for it (it is there),
and so does every later one.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Final

REASON_SCALED_UP: Final = "WorkersScaledUp"
REASON_SCALED_DOWN: Final = "WorkersScaledDown"
REASON_SCALE_REFUSED: Final = "ScaleRefused"
WORKER_REPLICAS_PATH: Final = "spec.replicas.worker.replicas"
# The bounds' rules, in these words here, in `pstrain validate` and in the CRD's CEL.
# They name the bound, not its number: Kubernetes 1.28 refuses a CEL message that names
# two numbers (pstrain_api.rules).
AT_LEAST_MIN: Final = "it must be at least minReplicas"
AT_MOST_MAX: Final = "it must be at most maxReplicas"


def bounds_problem(replicas: int, min_replicas: int | None,
                   max_replicas: int | None) -> str | None:
    """Why `replicas` workers break the bounds, as "PATH is VALUE; RULE", or None."""
    if min_replicas is not None and max_replicas is not None and min_replicas > max_replicas:
        return f"spec.replicas.worker.minReplicas is {min_replicas}; {AT_MOST_MAX}"
    if min_replicas is not None and replicas < min_replicas:
        return f"{WORKER_REPLICAS_PATH} is {replicas}; {AT_LEAST_MIN}"
    if max_replicas is not None and replicas > max_replicas:
        return f"{WORKER_REPLICAS_PATH} is {replicas}; {AT_MOST_MAX}"
    return None


def scale_problem(replicas: int, min_replicas: int | None,
                  max_replicas: int | None) -> str | None:
    """Why a scale to `replicas` workers is refused, or None: the model's rule (at
    least 1) and the bounds, in the words the CRD's rules use."""
    if replicas < 1:
        return f"{WORKER_REPLICAS_PATH} is {replicas}; it must be at least 1"
    return bounds_problem(replicas, min_replicas, max_replicas)


def trainer_index(worker: int, separate_chief: bool) -> int:
    """The trainer index of worker replica `worker`: a separate chief is trainer 0 and
    worker k is trainer k + 1; without one, worker k is trainer k (worker 0 the chief)."""
    return worker + 1 if separate_chief else worker


def trainer_set(workers: int, separate_chief: bool) -> tuple[int, ...]:
    """The parameter servers' worker set (trainer indices) for `workers` worker replicas."""
    return tuple(sorted({0, *(trainer_index(w, separate_chief) for w in range(workers))}))


@dataclass(frozen=True)
class ScalePlan:
    """What a scale does to the live worker indices: start `add`, stop `remove`."""

    add: tuple[int, ...] = ()
    remove: tuple[int, ...] = ()

    @property
    def is_noop(self) -> bool:
        return not self.add and not self.remove

    @property
    def reason(self) -> str:
        return REASON_SCALED_UP if self.add else REASON_SCALED_DOWN

    def message(self, before: int, after: int) -> str:
        """One line for the Event that records the change."""
        parts = []
        if self.add:
            parts.append(f"adds worker {', '.join(map(str, self.add))}")
        if self.remove:
            parts.append(f"removes worker {', '.join(map(str, self.remove))}")
        return f"workers {before} -> {after}: " + " and ".join(parts)


def plan_scale(live: Iterable[int], desired: int) -> ScalePlan:
    """The workers to add and remove so that exactly indices 0..desired-1 run.

    `live` are the indices running now (any order, gaps allowed: a lost worker is
    replaced under the restart policy, which is not a scale and not planned here)."""
    if desired < 1:
        raise ValueError(scale_problem(desired, None, None))
    running = set(live)
    wanted = set(range(desired))
    return ScalePlan(add=tuple(sorted(wanted - running)),
                     remove=tuple(sorted(running - wanted, reverse=True)))


@dataclass(frozen=True)
class WorkerSet:
    """The live workers of one job and, per worker, the first step it is waited for.

    Immutable: a change returns a new set (`changed`), so a reader holding one sees a
    consistent membership."""

    # worker -> the first step that waits for it; None: a newcomer, until its first push
    since: Mapping[int, int | None] = field(default_factory=dict)

    @classmethod
    def initial(cls, num_workers: int) -> WorkerSet:
        """Init's default: workers 0..num_workers-1, all waited for from step 0."""
        return cls({w: 0 for w in range(num_workers)})

    @property
    def live(self) -> frozenset[int]:
        return frozenset(self.since)

    @property
    def span(self) -> int:
        """One more than the highest live index: the size of per-worker tables."""
        return max(self.since, default=-1) + 1

    def __contains__(self, worker: object) -> bool:
        return worker in self.since

    def changed(self, workers: Iterable[int]) -> WorkerSet:
        """The set after a change to `workers`: kept workers keep their `since`; new
        ones are waited for once they push (`joined`)."""
        wanted = set(workers)
        if not wanted:
            raise ValueError("the worker set is empty; a job keeps at least one worker")
        if any(w < 0 for w in wanted):
            raise ValueError(f"worker indices are {sorted(wanted)}; they must be >= 0")
        return WorkerSet({w: self.since.get(w) for w in sorted(wanted)})

    def joined(self, worker: int, step: int) -> WorkerSet:
        """The set after `worker` contributed to sync step `step`: a newcomer is waited
        for from that step on; anyone else is unchanged."""
        if worker in self.since and self.since[worker] is None:
            return WorkerSet({**self.since, worker: step})
        return self

    def expected(self, step: int) -> frozenset[int]:
        """The workers sync step `step` waits for."""
        return frozenset(w for w, first in self.since.items()
                         if first is not None and first <= step)

    def is_complete(self, step: int, contributors: set[int]) -> bool:
        """Sync: step `step` may be applied with these contributors. At least one
        contribution is needed: a step of only newcomers is never applied empty."""
        return bool(contributors) and self.expected(step) <= contributors
