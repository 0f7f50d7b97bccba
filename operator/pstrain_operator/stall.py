"""The stall watchdog on Kubernetes: when did the global step last advance, and is the
job stalled. The decision itself is `pstrain_api.policy.decide_stall`, which the local
runner follows too.

Pure. The time of the last advance lives in `status.progress.advancedAt`, so the
watchdog survives operator restarts. It runs only while the job is Running and progress
has been read at least once; an unreachable PS 0 keeps the old progress, so a hung
parameter server shows up as a stall too.
"""

from __future__ import annotations

from datetime import datetime

from pstrain_api.model import Progress, RunPolicy
from pstrain_api.policy import RestartDecision, decide_stall, stalled_for


def merged_progress(old: Progress | None, new: Progress, now: datetime) -> Progress:
    """`new` progress with `advancedAt`: kept while the step is unchanged, now when it
    moved (forwards, or backwards after a restore)."""
    if old is not None and old.advanced_at is not None and new.global_step == old.global_step:
        return new.model_copy(update={"advanced_at": old.advanced_at})
    return new.model_copy(update={"advanced_at": now})


def check_stall(policy: RunPolicy, progress: Progress | None, restarts: int,
                now: datetime) -> RestartDecision | None:
    """The watchdog's decision when the job is stalled, else None."""
    if progress is None or progress.advanced_at is None:
        return None
    idle = stalled_for(policy, progress.advanced_at.timestamp(), now.timestamp())
    if idle is None:
        return None
    return decide_stall(policy, progress.global_step, idle, restarts)
