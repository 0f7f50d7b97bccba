"""Builders for the local runner's tests: jobs, cluster specs and supervisor scripts."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml

from pstrain_api.cluster import ClusterSpec, local_cluster_spec, task_count
from pstrain_api.model import TrainingJob
from pstrain_runtime.local.supervisor import (
    Action, Observation, RunState, Settings, Start, decide, initial_state)
from tests.api.job_builder import JobBuilder


class LocalJob(JobBuilder):
    """The shared manifest builder (tests/api/job_builder.py), preset to 1 PS, 2 workers
    and 100 steps, plus what the runner's tests need: a validated model and a file.

        make_job("j").ps(2).workers(3).policy("Never", backoff=1).model()
    """

    def policy(self, restart: str = "OnFailure", backoff: int = 3) -> LocalJob:
        self.run_policy(restartPolicy=restart, backoffLimit=backoff)
        return self

    def model(self) -> TrainingJob:
        return TrainingJob.model_validate(self.build())

    def write(self, path: Path) -> Path:
        path.write_text(yaml.safe_dump(self.build()), encoding="utf-8")
        return path


def make_job(name: str = "j") -> LocalJob:
    builder = LocalJob(name)
    builder.ps(1).workers(2).training(steps=100)
    return builder


def spec_of(job: TrainingJob) -> ClusterSpec:
    return local_cluster_spec(job, range(20000, 20000 + task_count(job)))


def state_of(job: TrainingJob, **settings: Any) -> RunState:
    return initial_state(spec_of(job), Settings(policy=job.spec.run_policy, **settings))


def play(state: RunState, observations: Iterable[Observation]
         ) -> tuple[RunState, list[Action]]:
    """Feed observations in order; return the final state and every action taken."""
    actions: list[Action] = []
    for obs in observations:
        state, more = decide(state, obs)
        actions.extend(more)
    return state, actions


def starts(actions: Iterable[Action]) -> list[tuple[str, int]]:
    return [(a.name, a.attempt) for a in actions if isinstance(a, Start)]


def without_notices(actions: Iterable[Action]) -> list[Action]:
    from pstrain_runtime.local.supervisor import Notify
    return [a for a in actions if not isinstance(a, Notify)]
