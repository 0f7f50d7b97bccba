"""A pass that waits for a checkpoint before a disruption (suspend, the deadline, the
parameter servers stopping after success): the plan asks the chief for it when the
gate says so (`checkpointing.gate`), and looks again when the gate says."""

from __future__ import annotations

from ..checkpointing import Gate
from ..plan import Plan, RequestCheckpoint, ps0_address
from .state import Pass


def wait_for_checkpoint(p: Pass, gate: Gate) -> Plan:
    """The plan of `p` (which carries the gate's status and events) while it waits."""
    request = p.st.checkpoint_request
    asks = ([RequestCheckpoint(ps0_address(p.job), request.reason)]
            if gate.ask and request is not None else [])
    return p.then(actions=asks).plan(gate.requeue)
