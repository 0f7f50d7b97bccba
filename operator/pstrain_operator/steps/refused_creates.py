"""The refused-creates step: creates the API server keeps refusing back off (nothing is
created or removed until the back-off has passed) and, once refusals have lasted too
long, fail the job naming the refused pod. The rules and the bookkeeping are
`refusals`; this step applies them to a pass."""

from __future__ import annotations

from pstrain_api.cluster import ClusterSpec
from pstrain_api.model import CreateRefusal, FailureCause

from .. import refusals
from ..plan import Plan
from .finished import finish
from .state import Pass


def back_off(p: Pass) -> Pass:
    """While the last refusal's back-off lasts, the pass holds."""
    backoff = refusals.wait_left(p.old, p.job.metadata.generation, p.now)
    return p.then(backoff=backoff, hold=p.hold or backoff > 0)


def give_up(p: Pass) -> Plan | None:
    """The plan that fails a job whose creates were refused for too long, else None."""
    given_up = refusals.gave_up(p.old)
    refusal = p.old.create_refusal
    if not given_up or refusal is None:
        return None
    return finish(p, "Failed", refusals.R_CREATE_REJECTED, given_up,
                  refusal_cause(p.cluster, refusal))


def refusal_cause(cluster: ClusterSpec, refusal: CreateRefusal) -> FailureCause:
    """The root cause of a job failed by refused creates: the refused pod and its role
    (neither when what was refused is the job's Secret, Service or NetworkPolicy; the
    message names it)."""
    kind, _, refused = refusal.object.rpartition("/")
    pod = refused if kind in ("", "Pod") else ""
    role = next((t.role for t in cluster.tasks() if cluster.replica_name(t) == pod), "")
    return FailureCause(role=role, pod=pod, reason=refusals.R_CREATE_REJECTED,
                        message=refusal.message)
