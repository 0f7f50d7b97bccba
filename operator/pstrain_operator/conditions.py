"""What the decisions say about a job: status conditions and Kubernetes events.

Pure helpers shared by `reconcile` and the small decision modules beside it
(`refusals`, `disruption`, `stall`), so none of them imports another's internals.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Literal

from pstrain_api.model import Condition, TrainingJobStatus


@dataclass(frozen=True)
class Event:
    """A Kubernetes Event to post on the job. `about`: the objects whose creation it
    reports; the executor drops it when one of those creations was refused."""

    type: Literal["Normal", "Warning"]
    reason: str
    message: str
    about: tuple[str, ...] = field(default=(), compare=False)


def set_condition(
    conditions: Sequence[Condition],
    type_: str,
    status: Literal["True", "False", "Unknown"],
    reason: str,
    message: str,
    now: datetime,
) -> list[Condition]:
    """Conditions with `type_` set; lastTransitionTime changes only when status does."""
    out: list[Condition] = []
    found = False
    for cond in conditions:
        if cond.type != type_:
            out.append(cond)
            continue
        found = True
        when = cond.last_transition_time if cond.status == status else now
        out.append(Condition(type=type_, status=status, reason=reason, message=message,
                             last_transition_time=when))
    if not found:
        out.append(Condition(type=type_, status=status, reason=reason, message=message,
                             last_transition_time=now))
    return out


def condition_is(status: TrainingJobStatus, type_: str, value: str = "True") -> bool:
    return any(cond.type == type_ and cond.status == value for cond in status.conditions)
