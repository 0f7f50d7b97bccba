"""Fluent builders for jobs and observed pods, shared by the operator tests."""

from __future__ import annotations

import copy
import json
from datetime import UTC, datetime, timedelta
from typing import Any

from pstrain_api import constants as c
from pstrain_api.model import Progress, TrainingJob, TrainingJobStatus
from pstrain_operator.build import applied_spec, spec_hash
from pstrain_operator.reconcile import ObservedPod
from tests.api.job_builder import pod_template

T0 = datetime(2026, 1, 1, 12, 0, 0, tzinfo=UTC)


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


class JobBuilder:
    def __init__(self, name: str = "j", namespace: str = "ns"):
        self.data: dict[str, Any] = {
            "apiVersion": c.API_VERSION,
            "kind": c.KIND,
            "metadata": {"name": name, "namespace": namespace, "uid": f"uid-{name}",
                         "generation": 1},
            "spec": {"replicas": {"ps": {"replicas": 1}, "worker": {"replicas": 2}},
                     "training": {"steps": 10}, "runPolicy": {}},
        }
        self._status: dict[str, Any] | None = None

    def ps(self, n: int) -> JobBuilder:
        self.data["spec"]["replicas"]["ps"]["replicas"] = n
        return self

    def workers(self, n: int) -> JobBuilder:
        self.data["spec"]["replicas"]["worker"]["replicas"] = n
        return self

    def chief(self) -> JobBuilder:
        self.data["spec"]["replicas"]["chief"] = {"replicas": 1}
        return self

    def gpus(self, n: int) -> JobBuilder:
        self.data["spec"]["replicas"]["worker"]["gpus"] = n
        return self

    def template(self, role: str, **tpl: Any) -> JobBuilder:
        """The role's PodTemplateSpec from short fields (tests/api/job_builder.py)."""
        self.data["spec"]["replicas"][role]["template"] = pod_template(**tpl)
        return self

    def policy(self, **kw: Any) -> JobBuilder:
        self.data["spec"]["runPolicy"].update(kw)
        return self

    def checkpoint(self, **kw: Any) -> JobBuilder:
        """Checkpoints in /ckpt (and `kw`, e.g. intervalSteps)."""
        self.data["spec"]["training"]["checkpoint"] = {"directory": "/ckpt", **kw}
        return self

    def steps(self, n: int) -> JobBuilder:
        self.data["spec"]["training"]["steps"] = n
        return self

    def security(self, **kw: Any) -> JobBuilder:
        self.data["spec"]["security"] = kw
        return self

    def status(self, **kw: Any) -> JobBuilder:
        self._status = {**(self._status or {}), **kw}
        return self

    def body(self) -> dict[str, Any]:
        out = copy.deepcopy(self.data)
        if self._status is not None:
            out["status"] = copy.deepcopy(self._status)
        return out

    def build(self) -> TrainingJob:
        job = TrainingJob.model_validate(self.body())
        if self._status is None:
            return job.model_copy(update={"status": None})
        return job.model_copy(update={"status": TrainingJobStatus.model_validate(self._status)})


def make_job(name: str = "j", namespace: str = "ns") -> JobBuilder:
    return JobBuilder(name, namespace)


def pod(job: TrainingJob, role: str, index: int = 0, phase: str = "Running",
        ready: bool = False, **kw: Any) -> ObservedPod:
    """An observed pod of `job`, built from the job's current spec unless told."""
    kw.setdefault("spec_hash", spec_hash(job))
    kw.setdefault("applied_spec", json.dumps(applied_spec(job)))
    return ObservedPod(name=f"{job.name}-{role}-{index}", role=role, index=index,
                       phase=phase, ready=ready, uid=f"u-{role}-{index}", **kw)


def progress_status(**given: Any) -> dict[str, Any]:
    """`status.progress` as the operator's merge patch writes it: every Progress field by
    its wire name, null unless `given` (a field added to Progress needs no test edits)."""
    names = [f.alias or name for name, f in Progress.model_fields.items()]
    return {name: given.get(name) for name in names}
