"""Elastic workers, as a trainer sees them: admission, removal, and how many examples
the applied steps stand for when the worker set changes size.

The rules of membership itself (who is added or removed, when a sync step waits for
whom) are `pstrain_api.membership`; the parameter servers apply them (`set_workers`) and
answer every Info and push asked as a worker with `member`: whether that worker is in
the live set. From that a trainer knows:

- a newcomer (started by a scale-up) is not a member until the operator or the local
  runner calls SetWorkers: it waits to be admitted before it pushes;
- a worker that a scale-down removed has its push in flight dropped whole and waits
  the same way, until the operator or the runner stops it (it never decides by itself
  that it is gone: a parameter server re-initialised with an older set says the same
  until the set is sent again).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .proto import ps_pb2 as pb


def admitted(infos: Sequence[pb.StepInfo]) -> bool:
    """Every server counts the asking worker among the live set."""
    return bool(infos) and all(i.member for i in infos)


def not_a_member(replies: Sequence[pb.PushReply]) -> bool:
    """A push was refused because its worker is not in the live set."""
    return any(not r.applied and r.HasField("info") and r.info.initialized
               and not r.info.member for r in replies)


@dataclass
class AppliedSamples:
    """Examples behind the global steps applied since counting began.

    A sync step applies one batch from each live worker, an async step one batch, and
    the live count may change while the job runs: each step is counted with the count
    seen when it was applied, so a rate over a scale is neither over nor under."""

    step: int  # the global step counted up to
    total: float = 0.0

    def advance(self, global_step: int, samples_per_step: float) -> None:
        if global_step > self.step:
            self.total += (global_step - self.step) * samples_per_step
        self.step = global_step  # a restore may take it back: count on from there
