"""The spec-change step: a change that cannot be applied to running pods is refused.

Replicas, training and security cannot change under running pods (pods with and
without the job's keys cannot talk); the run policy, and the worker count within its
bounds (a scale), can. A refused change sets the SpecChangeNotApplicable condition, and
the pass goes on with the job as its pods were built, so a lost pod comes back as it
was. When that cannot be read back, the pass neither creates nor scales (`hold`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from pstrain_api import constants as c
from pstrain_api.model import Replicas, Security, Training, TrainingJob

from .. import scaling
from ..build import applied_spec, spec_hash
from ..conditions import Event, condition_is, set_condition
from ..observe import ObservedPod
from .constants import R_SPEC_APPLIED, R_SPEC_REJECTED
from .state import Pass, names


def effective_job(
    job: TrainingJob, pods: Sequence[ObservedPod]
) -> tuple[TrainingJob | None, str]:
    """The job as its existing pods were built (None when that cannot be read back), and
    why it differs from the spec ("" when it does not)."""
    want, current = spec_hash(job), applied_spec(job)
    stale = [p for p in pods if not p.deleting and p.spec_hash and p.spec_hash != want
             and not scaling.is_scale_only(p.applied_spec, current)]
    if not stale:
        return job, ""
    old: TrainingJob | None
    try:
        applied = json.loads(stale[0].applied_spec)
        old = job.model_copy(update={"spec": job.spec.model_copy(update={
            "replicas": Replicas.model_validate(applied["replicas"]),
            "training": Training.model_validate(applied["training"]),
            "security": Security.model_validate(applied.get("security", {})),
        })})
    except (ValueError, KeyError, TypeError):
        old = None
    changed = [part for part in ("replicas", "training", "security")
               if old is not None and getattr(old.spec, part) != getattr(job.spec, part)]
    what = " and ".join(f"spec.{p}" for p in changed) or "spec"
    return old, (
        f"{what} changed while pods built from the previous spec are running "
        f"({names(stale)}); such a change cannot be applied live, so it was not applied. "
        "Revert it, or suspend the job (spec.runPolicy.suspend: true), change it and resume."
    )


def refuse_live_change(p: Pass) -> Pass:
    """Go on with the job as its pods were built; say so while the spec differs."""
    effective, rejected = effective_job(p.job, p.live)
    st = p.st.model_copy()
    events = []
    if rejected:
        if not condition_is(p.old, c.COND_SPEC_REJECTED):
            events.append(Event("Warning", R_SPEC_REJECTED, rejected))
        st.conditions = set_condition(st.conditions, c.COND_SPEC_REJECTED, "True",
                                      R_SPEC_REJECTED, rejected, p.now)
    elif condition_is(p.old, c.COND_SPEC_REJECTED):
        st.conditions = set_condition(st.conditions, c.COND_SPEC_REJECTED, "False",
                                      R_SPEC_APPLIED, "The spec matches the running pods.",
                                      p.now)
    return p.then(st=st, events=events, job=effective or p.job, hold=effective is None)
