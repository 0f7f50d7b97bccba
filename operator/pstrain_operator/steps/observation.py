"""The observe step: what a reconcile pass starts from.

Pods of an earlier job of the same name (deleted, not yet garbage-collected) hold their
names but are not ours: they count as already going away. The status to build on is
the one written last, with this generation observed, no stale InvalidSpec condition,
and the progress just read merged into the last one (`stall.merged_progress`).
"""

from __future__ import annotations

from dataclasses import replace

from pstrain_api.model import TrainingJobStatus

from .. import stall
from ..plan import Observed
from .invalid_spec import spec_valid_again
from .state import Pass


def ours(obs: Observed) -> Observed:
    """`obs` with the pods another job of the same name owns marked as going away."""
    uid = obs.job.metadata.uid
    return replace(obs, pods=tuple(
        replace(p, deleting=True) if uid and p.owner_uid and p.owner_uid != uid else p
        for p in obs.pods))


def begin(obs: Observed) -> Pass:
    """The pass before any decision."""
    obs = ours(obs)
    job = obs.job
    old = job.status or TrainingJobStatus()
    st = old.model_copy(deep=True, update={"observed_generation": job.metadata.generation})
    st.conditions = spec_valid_again(st, [p for p in obs.pods if not p.deleting], obs.now)
    progress = (stall.merged_progress(old.progress, obs.progress, obs.now)
                if obs.progress is not None else st.progress)
    return Pass(obs=obs, job=job, old=old, st=st, progress=progress)
