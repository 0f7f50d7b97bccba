"""Builders for the local runner's tests: jobs, cluster specs and supervisor scripts."""

from __future__ import annotations

import copy
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml

from pstrain_api.cluster import ClusterSpec, local_cluster_spec, task_count
from pstrain_api.model import TrainingJob
from pstrain_runtime.local.supervisor import (
    Action, Observation, RunState, Settings, Start, decide, initial_state)


class JobBuilder:
    """`make_job("j").ps(2).workers(3).policy("Never", backoff=1).build()`."""

    def __init__(self, name: str):
        self.data: dict[str, Any] = {
            "apiVersion": "pstrain.io/v1alpha1",
            "kind": "TrainingJob",
            "metadata": {"name": name},
            "spec": {
                "replicas": {"ps": {"replicas": 1}, "worker": {"replicas": 2}},
                "training": {"steps": 100},
                "runPolicy": {},
            },
        }

    def ps(self, n: int) -> JobBuilder:
        self.data["spec"]["replicas"]["ps"]["replicas"] = n
        return self

    def workers(self, n: int) -> JobBuilder:
        self.data["spec"]["replicas"]["worker"]["replicas"] = n
        return self

    def chief(self) -> JobBuilder:
        self.data["spec"]["replicas"]["chief"] = {"replicas": 1}
        return self

    def steps(self, n: int) -> JobBuilder:
        self.data["spec"]["training"]["steps"] = n
        return self

    def policy(self, restart: str = "OnFailure", backoff: int = 3,
               deadline: int | None = None) -> JobBuilder:
        run_policy = {"restartPolicy": restart, "backoffLimit": backoff}
        if deadline is not None:
            run_policy["activeDeadlineSeconds"] = deadline
        self.data["spec"]["runPolicy"] = run_policy
        return self

    def checkpoint(self, directory: str, interval: int = 100) -> JobBuilder:
        self.data["spec"]["training"]["checkpoint"] = {
            "directory": directory, "intervalSteps": interval}
        return self

    def build(self) -> TrainingJob:
        return TrainingJob.model_validate(copy.deepcopy(self.data))

    def write(self, path: Path) -> Path:
        path.write_text(yaml.safe_dump(self.data), encoding="utf-8")
        return path


def make_job(name: str = "j") -> JobBuilder:
    return JobBuilder(name)


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
