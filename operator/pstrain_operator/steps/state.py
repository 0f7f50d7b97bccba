"""One reconcile pass in progress: what the steps before have worked out.

Each step is a pure function of a `Pass`. It returns a new one (`Pass.then`), or the
pass's final `Plan`. Nothing is mutated in place: a step copies the status before it
changes it, so a step can be tested alone and run twice with the same result.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from datetime import datetime
from functools import cached_property
from typing import Any

from pstrain_api.cluster import ClusterSpec, kubernetes_cluster_spec
from pstrain_api.model import Progress, RunPolicy, TrainingJob, TrainingJobStatus

from ..conditions import Event
from ..observe import ObservedPod
from ..plan import Action, CreatePod, DeletePod, Observed, Plan
from .counts import with_counts


@dataclass(frozen=True)
class Pass:
    """The pass so far. `obs.pods` has pods of an earlier job of the same name marked
    as going away; `job` is the job as its pods were built (its spec, unless a change
    was refused); `st` is the status this pass writes, `old` the one written last."""

    obs: Observed
    job: TrainingJob
    old: TrainingJobStatus
    st: TrainingJobStatus
    progress: Progress | None = None  # the freshest progress, merged with the last one
    actions: tuple[Action, ...] = ()
    events: tuple[Event, ...] = ()
    hold: bool = False  # neither create nor scale this pass
    backoff: float = 0.0  # seconds before a refused create may be tried again
    restarted: frozenset[str] = frozenset()  # pods deleted this pass to be recreated

    @property
    def now(self) -> datetime:
        return self.obs.now

    @property
    def policy(self) -> RunPolicy:
        return self.job.spec.run_policy

    @property
    def live(self) -> list[ObservedPod]:
        """The pods not going away."""
        return [p for p in self.obs.pods if not p.deleting]

    @cached_property
    def cluster(self) -> ClusterSpec:
        return kubernetes_cluster_spec(self.job)

    @property
    def by_name(self) -> dict[str, ObservedPod]:
        return {p.name: p for p in self.obs.pods}

    @property
    def wanted(self) -> set[str]:
        """The pod names of the replicas of the spec."""
        return {self.cluster.replica_name(t) for t in self.cluster.tasks()}

    @property
    def chief(self) -> ObservedPod | None:
        return self.by_name.get(self.cluster.replica_name(self.cluster.chief))

    @property
    def chief_done(self) -> bool:
        chief = self.chief
        return chief is not None and not chief.deleting and chief.phase == "Succeeded"

    def then(self, *, actions: Iterable[Action] = (), events: Iterable[Event] = (),
             **changes: Any) -> Pass:
        """The pass with `actions` and `events` added and the fields in `changes` set."""
        return replace(self, actions=(*self.actions, *actions),
                       events=(*self.events, *events), **changes)

    def plan(self, requeue: float | None) -> Plan:
        """The pass's plan: its actions and events, the status with its counts."""
        return Plan(self.actions, with_counts(self.job, self.st, self.obs.pods, self.actions),
                    self.events, requeue)


def names(items: Sequence[ObservedPod | CreatePod | DeletePod]) -> str:
    return ", ".join(p.name for p in items)
