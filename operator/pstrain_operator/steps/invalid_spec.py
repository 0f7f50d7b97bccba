"""The InvalidSpec condition: a spec the API model rejects gets `Created=False` and one
event, and no pods; once the spec is valid again the condition does not outlive it."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from pstrain_api import constants as c
from pstrain_api.model import Condition, TrainingJobStatus

from ..conditions import Event, condition_is, set_condition
from ..observe import ObservedPod
from ..plan import Plan
from .constants import R_INVALID_SPEC, R_SPEC_VALID


def decide_invalid(
    status: TrainingJobStatus, problems: Sequence[str], generation: int | None, now: datetime
) -> Plan:
    """A job whose spec the API model rejects: a condition and an event, no pods."""
    message = "The spec is invalid: " + " ".join(problems)
    was = condition_is(status, c.COND_CREATED, "False") and any(
        cond.reason == R_INVALID_SPEC and cond.message == message for cond in status.conditions
    )
    st = status.model_copy(update={
        "conditions": set_condition(status.conditions, c.COND_CREATED, "False",
                                    R_INVALID_SPEC, message, now),
        "observed_generation": generation,
    })
    events = () if was else (Event("Warning", R_INVALID_SPEC, message),)
    return Plan((), st, events, None)


def spec_valid_again(st: TrainingJobStatus, live: Sequence[ObservedPod],
                     now: datetime) -> list[Condition]:
    """The conditions of a job whose spec is valid (again): a `Created=False` of an
    earlier invalid spec (`decide_invalid`) does not outlive it. It becomes True when the
    job has pods or had started; else it goes (the first parameter servers set it)."""
    stale = any(cond.type == c.COND_CREATED and cond.reason == R_INVALID_SPEC
                for cond in st.conditions)
    if not stale:
        return st.conditions
    if live or st.start_time is not None or st.phase in c.TERMINAL_PHASES:
        return set_condition(st.conditions, c.COND_CREATED, "True", R_SPEC_VALID,
                             "The spec is valid again.", now)
    return [cond for cond in st.conditions if cond.type != c.COND_CREATED]
