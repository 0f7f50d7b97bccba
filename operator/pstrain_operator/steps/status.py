"""The status step, last in a pass: the phase (Running once every parameter server is
Ready and the chief is up, else Starting), the Running condition, the progress and the
last checkpoint, the worker set the parameter servers learn after a scale, and how
soon to look again. The replica counts are added by `Pass.plan` (`counts`)."""

from __future__ import annotations

from pstrain_api import constants as c

from .. import checkpointing, scaling
from ..conditions import Event, condition_is, set_condition
from ..plan import CreatePod, Plan
from .constants import (R_ALL_STARTED, R_WAITING_FOR_PS, R_WAITING_FOR_RESTART,
                        REQUEUE_STARTING_S)
from .deadline import within_deadline
from .scale import worker_set
from .start_order import PsReadiness, ps_readiness
from .state import Pass


def is_chief_up(p: Pass) -> bool:
    """The chief was created this pass, or runs and is not being restarted."""
    chief_name = p.cluster.replica_name(p.cluster.chief)
    if any(isinstance(a, CreatePod) and a.name == chief_name for a in p.actions):
        return True
    chief = p.chief
    return chief is not None and not chief.deleting and chief.name not in p.restarted


def decide_status(p: Pass, progress_interval: float) -> Plan:
    """The pass's plan, with its phase; `progress_interval`: how soon to look again
    while Running (progress refresh)."""
    ps = ps_readiness(p)
    if (ps.all_ready or ps.finished) and is_chief_up(p):
        p = running(p)
        requeue = REQUEUE_STARTING_S if ps.finished else progress_interval
    else:
        p = starting(p, ps)
        requeue = min(REQUEUE_STARTING_S, p.backoff) if p.backoff else REQUEUE_STARTING_S
    return p.plan(within_deadline(p, requeue))


def running(p: Pass) -> Pass:
    """Every replica is up: Running, with the progress and checkpoint just read."""
    st = p.st.model_copy()
    old = p.old
    if st.create_refusal is None and (old.phase != "Running"
                                      or not condition_is(old, c.COND_RUNNING)):
        st.conditions = set_condition(
            st.conditions, c.COND_RUNNING, "True", R_ALL_STARTED,
            "All parameter servers are Ready and every worker was started.", p.now)
    st.phase = "Running"
    # The stall watchdog's clock starts when the job (re)starts running.
    progress = p.progress
    st.progress = (progress if old.phase == "Running" or progress is None
                   else progress.model_copy(update={"advanced_at": p.now}))
    if p.obs.checkpoint is not None:
        st.last_checkpoint = p.obs.checkpoint
    # Elastic workers: the parameter servers learn the worker set after a scale.
    set_workers = worker_set(p)
    if set_workers is not None:
        st.workers = scaling.membership(p.job, p.live, st.workers).model_copy(
            update={"members": list(set_workers.workers)})
    st, settled = checkpointing.settle(st, p.now)
    return p.then(st=st, actions=[set_workers] if set_workers is not None else [],
                  events=settled)


def starting(p: Pass, ps: PsReadiness) -> Pass:
    """Not every replica is up: Starting, saying what the job waits for (while a
    refused create backs off, the Running condition quotes the refusal instead)."""
    message = f"waiting for parameter servers to be Ready ({ps.ready}/{ps.total})"
    events = []
    if not ps.all_ready and p.old.phase != "Starting" and not p.backoff:
        events.append(Event("Normal", R_WAITING_FOR_PS, message))
    st = p.st.model_copy()
    if not p.backoff:
        st.conditions = set_condition(st.conditions, c.COND_RUNNING, "False",
                                      R_WAITING_FOR_PS if not ps.all_ready
                                      else R_WAITING_FOR_RESTART,
                                      message if not ps.all_ready
                                      else "waiting for restarted replicas", p.now)
    st.phase = "Starting"
    return p.then(st=st, events=events)
