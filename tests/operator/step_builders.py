"""Builders for the tests of single reconcile steps (`pstrain_operator.steps`): a pass as
`decide` begins it, and the actions a step is expected to add."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from pstrain_api.model import CheckpointStatus, Progress
from pstrain_operator.observe import ObservedPod
from pstrain_operator.plan import CreatePod, DeletePod, Observed
from pstrain_operator.steps import observation
from pstrain_operator.steps.state import Pass

from .op_builders import T0, JobBuilder, pod


def begin(job: JobBuilder, pods: Sequence[ObservedPod] = (), *, service: bool = True,
          now: datetime = T0, progress: Progress | None = None,
          checkpoint: CheckpointStatus | None = None,
          server_workers: tuple[int, ...] | None = None) -> Pass:
    """The pass `decide` starts from for this observation."""
    return observation.begin(Observed(job.build(), tuple(pods), service, now, progress,
                                      checkpoint, server_workers))


def running(j: JobBuilder, ps: int = 1, workers: int = 2, ready: bool = True,
            chief: bool = False) -> list[ObservedPod]:
    """Running pods of the job `j` builds: its parameter servers, workers (and chief)."""
    job = j.build()
    return ([pod(job, "ps", i, ready=ready) for i in range(ps)]
            + [pod(job, "worker", i, ready=True) for i in range(workers)]
            + ([pod(job, "chief", 0, ready=True)] if chief else []))


def create(*names: str) -> list[CreatePod]:
    return [CreatePod(f"j-{n}", n.rsplit("-", 1)[0], {}) for n in names]


def delete(*names: str) -> list[DeletePod]:
    return [DeletePod(f"j-{n}", f"u-{n}") for n in names]
