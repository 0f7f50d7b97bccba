"""The stall-watchdog step (`spec.runPolicy.stallTimeoutSeconds`): a running job whose
global step has not advanced for that long has its workers and chief restarted (one
restart of the backoffLimit; the parameter servers keep the parameters), or fails once
the backoffLimit is spent. When the step last advanced, and the decision, are `stall`."""

from __future__ import annotations

from pstrain_api import constants as c

from .. import disruption, stall
from ..conditions import Event
from ..plan import DeletePod, Plan
from .constants import R_RESTARTING_STALLED
from .finished import finish
from .state import Pass


def watch(p: Pass) -> tuple[Pass, Plan | None]:
    """The pass with a stalled job's trainers deleted for a restart; or, with the plan
    that fails it. Unchanged while running well, or when a replica restarts anyway."""
    if p.old.phase != "Running" or p.restarted:
        return p, None
    stalled = stall.check_stall(p.policy, p.progress, p.st.restarts - p.st.disruptions,
                                p.now)
    if stalled is None:
        return p, None
    if stalled.action == "fail":
        return p, finish(p, "Failed", stalled.reason, stalled.message)
    gone = {a.name for a in p.actions if isinstance(a, DeletePod)}
    victims = [q for q in p.live if q.role != c.ROLE_PS and q.active and q.name not in gone]
    st = p.st.model_copy()
    st.counted_disruptions = disruption.remembered(st.counted_disruptions,
                                                   [q.uid for q in victims])
    st.restarts += 1
    # The watchdog's clock starts again with the restart.
    progress = p.progress.model_copy(update={"advanced_at": p.now}) if p.progress else None
    return p.then(st=st, actions=[DeletePod(q.name, q.uid, stalled.message) for q in victims],
                  events=[Event("Warning", R_RESTARTING_STALLED, stalled.message)],
                  restarted=p.restarted | {q.name for q in victims},
                  progress=progress), None
