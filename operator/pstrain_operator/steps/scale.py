"""The scale step: elastic workers in a pass. A scale down removes worker pods (highest
index first); a pod of no replica of the spec (left from another spec) goes too; and
once the job runs, the parameter servers learn the new worker set. Which workers go and
when the set is sent is `scaling`; this step applies it to a pass."""

from __future__ import annotations

from pstrain_api.readiness import runs_pstrain_runtime

from .. import scaling
from ..conditions import Event
from ..plan import DeletePod, SetWorkers
from .constants import R_UNEXPECTED_POD
from .state import Pass


def remove_extra(p: Pass) -> Pass:
    """Delete the workers a scale down removes (no scale while the pass holds) and pods
    that are no replica of the spec."""
    scale = scaling.decide_scale(p.job, p.old, p.live) if not p.hold else scaling.Scale()
    actions = [DeletePod(name, uid, why) for name, uid, why in scale.remove]
    events = list(scale.events)
    scaled_away = {name for name, _, _ in scale.remove}
    wanted = p.wanted
    for q in p.live:
        if q.name not in wanted and q.name not in scaled_away:
            actions.append(DeletePod(q.name, q.uid, "not a replica of the current spec"))
            events.append(Event("Normal", R_UNEXPECTED_POD,
                                f"deleting pod {q.name}: it is not a replica of the spec"))
    return p.then(actions=actions, events=events)


def worker_set(p: Pass) -> SetWorkers | None:
    """The worker set to send the parameter servers after a scale, when they run the
    pstrain runtime (a program of its own reads TF_CONFIG and is not told)."""
    if not runs_pstrain_runtime(p.job.spec.replicas.ps):
        return None
    ps_addresses = [str(p.cluster.addresses[t]) for t in p.cluster.ps_tasks()]
    return scaling.decide_worker_set(p.job, p.old, p.live, ps_addresses,
                                     p.obs.server_workers)
