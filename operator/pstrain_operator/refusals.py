"""The API server refused to create one of the job's objects (an invalid pod template, a
missing ServiceAccount or PriorityClass, a quota, an admission webhook): back off, say
it once, and give up in bounded time.

Pure. Everything is read from and written to the job's status (`status.createRefusal`
and the `CreateRejected` condition), so the rules hold across operator restarts:

- retries back off exponentially (`RetryPolicy.delay`), whatever wakes the job (pod
  events, its own status patch); a spec change (a new generation) retries at once;
- one Warning event per distinct refusal (object and message), not per attempt;
- the condition quotes the API server's message;
- once refusals have lasted `give_up_after_s` across attempts, the job fails with
  reason CreateRejected (`decide` asks `gave_up`).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from pstrain_api import constants as c
from pstrain_api.model import CreateRefusal, TrainingJobStatus

from .conditions import Event, set_condition

R_CREATE_REJECTED = "CreateRejected"
R_CREATED = "Created"


@dataclass(frozen=True)
class RetryPolicy:
    """Back-off of refused creates: first retry after `first_delay_s`, doubling up to
    `max_delay_s`; the job fails once refusals have lasted `give_up_after_s`."""

    first_delay_s: float = 5.0
    max_delay_s: float = 160.0
    give_up_after_s: float = 600.0

    def delay(self, attempts: int) -> float:
        """Seconds to wait after the `attempts`-th refusal in a row."""
        return min(self.first_delay_s * 2 ** max(0, min(attempts - 1, 30)), self.max_delay_s)


DEFAULT_RETRY = RetryPolicy()


def wait_left(status: TrainingJobStatus, generation: int | None, now: datetime,
              policy: RetryPolicy = DEFAULT_RETRY) -> float:
    """Seconds before creating may be tried again; 0 when it may be tried now. A spec
    edit since the last refusal (a new generation) may have fixed the cause: retry now."""
    refusal = status.create_refusal
    if refusal is None or refusal.last_time is None:
        return 0.0
    if generation is not None and status.observed_generation not in (None, generation):
        return 0.0
    due = refusal.last_time + timedelta(seconds=policy.delay(refusal.attempts))
    return max(0.0, (due - now).total_seconds())


def gave_up(status: TrainingJobStatus, policy: RetryPolicy = DEFAULT_RETRY) -> str | None:
    """The failure message once refusals have lasted `give_up_after_s` (measured between
    the first and the latest refused attempt, so time without attempts does not count),
    else None."""
    refusal = status.create_refusal
    if refusal is None or refusal.first_time is None or refusal.last_time is None:
        return None
    lasted = (refusal.last_time - refusal.first_time).total_seconds()
    if lasted < policy.give_up_after_s:
        return None
    return (f"the API server refused to create {refusal.object} {refusal.attempts} times "
            f"over {lasted:.0f}s (giving up after {policy.give_up_after_s:.0f}s): "
            f"{refusal.message}")


def record_refusal(status: TrainingJobStatus, obj: str, code: int | None, message: str,
                   now: datetime, policy: RetryPolicy = DEFAULT_RETRY,
                   ) -> tuple[TrainingJobStatus, Event | None, float]:
    """The status after a refused create of `obj` ("Pod/j-ps-0"), the event to post
    (None when this exact refusal was already reported) and the seconds to wait before
    the next attempt."""
    old = status.create_refusal
    same = old is not None and old.object == obj and old.message == message
    attempts = old.attempts + 1 if old is not None else 1
    refusal = CreateRefusal(object=obj, code=code, message=message, attempts=attempts,
                            first_time=old.first_time if old is not None else now,
                            last_time=now)
    delay = policy.delay(attempts)
    quoted = f"the API server refused to create {obj}" + (f" ({code})" if code else "")
    conditions = set_condition(status.conditions, c.COND_CREATE_REJECTED, "True",
                               R_CREATE_REJECTED, f"{quoted}: {message}", now)
    conditions = set_condition(conditions, c.COND_RUNNING, "False", R_CREATE_REJECTED,
                               f"{quoted}; retrying with back-off.", now)
    st = status.model_copy(update={"create_refusal": refusal, "conditions": conditions})
    event = None if same else Event(
        "Warning", R_CREATE_REJECTED,
        f"{quoted}: {message}; retrying with back-off (next in {delay:g}s), the job fails "
        f"if it is still refused after {policy.give_up_after_s:g}s")
    return st, event, delay


def cleared(status: TrainingJobStatus, now: datetime) -> TrainingJobStatus:
    """The status once every planned create went through: the refusal is over."""
    if status.create_refusal is None:
        return status
    obj = status.create_refusal.object
    return status.model_copy(update={
        "create_refusal": None,
        "conditions": set_condition(status.conditions, c.COND_CREATE_REJECTED, "False",
                                    R_CREATED, f"{obj} was created.", now),
    })
