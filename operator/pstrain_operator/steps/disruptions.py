"""The disruptions step: pods deleted or evicted from outside the operator get an event
naming the cause and count as a restart (not against backoffLimit). A disruption
announced by a DisruptionTarget condition (an eviction, a preemption) asks the chief
for a checkpoint, once per pod; an eviction cannot be held up, so nothing waits for
it. The rules are `disruption`; this step applies them to a pass."""

from __future__ import annotations

from .. import checkpointing, disruption
from ..plan import RequestCheckpoint, ps0_address
from .state import Pass


def note(p: Pass) -> Pass:
    """Count the pods disrupted from outside; ask for a checkpoint for an announced one."""
    st = p.st.model_copy()
    uid, wanted = p.job.metadata.uid, p.wanted
    coming = disruption.announced(p.obs.pods, wanted, uid, st.counted_disruptions)
    events = disruption.count(st, disruption.from_outside(
        p.obs.pods, wanted, uid, st.counted_disruptions))
    if not coming or p.old.phase != "Running":
        return p.then(st=st, events=events)
    st.counted_disruptions = disruption.remembered(
        st.counted_disruptions, [disruption.ASKED + q.uid for q in coming if not q.deleting])
    if st.checkpoint_request is not None:
        return p.then(st=st, events=events)
    why = f"disruption of {coming[0].name}"
    gate = checkpointing.gate(p.job, st, p.obs.checkpoint, p.now, why)
    asks = [RequestCheckpoint(ps0_address(p.job), why)] if gate.ask else []
    return p.then(st=gate.status, actions=asks, events=[*events, *gate.events])
