"""The reconcile decision: observed job + observed pods -> actions + new status + events.

Pure and level-based. Nothing here remembers past calls: everything comes from the job
(spec and the status written last time) and the pods that exist now, so the operator
may restart at any moment and a repeated event yields the same plan. One executor
(`controller.py`) applies a plan and writes the status once.

`decide` is the script of one pass; each step is a pure function in a module of
`steps/` named for it (see `steps/__init__.py`). What a pass reads and hands on
(`Observed`, the actions, `Plan`) is `plan.py`.
"""

from __future__ import annotations

from .conditions import Event
from .observe import ObservedPod
from .plan import (
    Action,
    CreateObject,
    CreatePod,
    CreateService,
    DeleteJob,
    DeletePod,
    Observed,
    Plan,
    RequestCheckpoint,
    SetWorkers,
    ps0_address,
    status_to_api,
    unapplied,
)
from .settings import PodSettings
from .steps import (
    deadline,
    disruptions,
    failures,
    finished,
    observation,
    refused_creates,
    scale,
    spec_change,
    stall_watchdog,
    start_order,
    status,
    success,
    suspended,
)
from .steps.constants import REQUEUE_CLEANUP_S, REQUEUE_RUNNING_S, REQUEUE_STARTING_S
from .steps.failures import PS_EXIT_GRACE_S
from .steps.finished import cleanup_actions
from .steps.invalid_spec import decide_invalid

__all__ = [
    "Action", "CreateObject", "CreatePod", "CreateService", "DeleteJob", "DeletePod",
    "Event", "Observed", "ObservedPod", "PS_EXIT_GRACE_S", "Plan", "REQUEUE_CLEANUP_S",
    "REQUEUE_RUNNING_S", "REQUEUE_STARTING_S",
    "RequestCheckpoint", "SetWorkers", "cleanup_actions", "decide", "decide_invalid",
    "ps0_address", "status_to_api", "unapplied",
]


def decide(obs: Observed, settings: PodSettings,
           progress_interval: float = REQUEUE_RUNNING_S) -> Plan:
    """The one reconcile decision, as the script the operator follows.

    `progress_interval`: how soon to look again while Running (progress refresh)."""
    # Observe: pods of an earlier job of the same name are not ours; build on the last
    # status, with the progress just read.
    p = observation.begin(obs)
    # A finished job only cleans up and, after its TTL, deletes itself.
    if finished.is_finished(p):
        return finished.decide_finished(p)
    # Suspended: no pods, the job stays; a running job checkpoints first.
    if suspended.is_suspended(p):
        return suspended.decide_suspended(p)
    p = suspended.resume(p)
    # A spec change that cannot be applied live is refused; the pods keep the old one.
    p = spec_change.refuse_live_change(p)
    # activeDeadlineSeconds passed: the job fails (a running one checkpoints first).
    if (end := deadline.enforce(p)) is not None:
        return end
    # Creates the API server keeps refusing: back off, and fail in bounded time.
    p = refused_creates.back_off(p)
    if (end := refused_creates.give_up(p)) is not None:
        return end
    # A scale removes workers (highest index first); pods of no replica go too.
    p = scale.remove_extra(p)
    # Pods deleted or evicted from outside: name the cause, count the replacement, and
    # ask for a checkpoint when a DisruptionTarget announces one.
    p = disruptions.note(p)
    # Failed replicas: restart within the run policy, or fail the job.
    p, end = failures.restart_or_fail(p)
    if end is not None:
        return end
    # The chief completed: the job succeeded (after its final checkpoint).
    if (end := success.on_chief_done(p)) is not None:
        return end
    # No step for stallTimeoutSeconds: restart the trainers, or fail the job.
    p, end = stall_watchdog.watch(p)
    if end is not None:
        return end
    # Create what is missing, in order: Service, PS, workers once PS are Ready, chief.
    p = start_order.create_missing(p, settings)
    # Phase, progress, the worker set, and when to look again.
    return status.decide_status(p, progress_interval)
