"""The success step: the chief completed, so the job succeeded. The parameter servers
are stopped only once the final checkpoint is confirmed (ones that already exited did
so after the chief's Finish, which follows it); the last progress read is kept."""

from __future__ import annotations

from pstrain_api import constants as c

from .. import checkpointing
from ..plan import Plan
from .checkpoint_wait import wait_for_checkpoint
from .constants import R_CHIEF_SUCCEEDED
from .finished import finish
from .state import Pass


def on_chief_done(p: Pass) -> Plan | None:
    """The plan of a job whose chief completed (or that waits for its final
    checkpoint); None while the chief has not completed."""
    chief = p.chief
    if chief is None or not p.chief_done:
        return None
    st = p.st.model_copy()
    step = st.progress.global_step if st.progress else None
    if p.obs.progress is not None:
        st.progress = p.progress
        step = p.obs.progress.global_step
    if any(q.role == c.ROLE_PS and q.active for q in p.live):
        gate = checkpointing.gate(p.job, st, p.obs.checkpoint, p.now, "success", ask=False,
                                  step=p.job.spec.training.steps)
        p = p.then(st=gate.status, events=gate.events)
        if not gate.ready:
            return wait_for_checkpoint(p, gate)
    else:
        if p.obs.checkpoint is not None:
            st.last_checkpoint = p.obs.checkpoint
        p = p.then(st=st)
    at = f" at global step {step}" if step else ""
    return finish(p, "Succeeded", R_CHIEF_SUCCEEDED, f"the chief {chief.name} completed{at}")
