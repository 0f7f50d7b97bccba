"""Restart decisions shared by the local runner and the operator.

Pure: given the run policy, how a replica ended and how many restarts the job has
used, say whether to restart it or fail the job, and why.

A replica that exits with `constants.EXIT_CONFIGURATION_ERROR` reported a mistake in
the job's configuration: no restart can fix it, so the job fails at once under every
restart policy, and the replica's one-line reason (`detail`) is the message.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from . import constants as c
from .model import RunPolicy

Action = Literal["restart", "fail"]

REASON_CONFIGURATION_ERROR = "ConfigurationError"
DETAIL_MAX_CHARS = 800  # of a replica's own reason, quoted in a message


@dataclass(frozen=True)
class RestartDecision:
    action: Action
    reason: str  # CamelCase, machine-readable
    message: str


def is_retryable_exit_code(exit_code: int | None) -> bool:
    """Exit codes that say the replica was stopped from outside (signal, OOM, eviction)."""
    return exit_code in c.RETRYABLE_EXIT_CODES


def decide_restart(
    policy: RunPolicy,
    replica: str,
    exit_code: int | None,
    restarts_used: int,
    reason: str = "",
    detail: str = "",
) -> RestartDecision:
    """What to do about `replica`, which failed with `exit_code` (None: evicted/lost).

    `detail`: the replica's own last error line (its termination message), if any."""
    how = f"exit code {exit_code}" if exit_code is not None else (reason or "lost")
    if exit_code == c.EXIT_CONFIGURATION_ERROR:
        why = shorten(detail) or (f"it exited with code {exit_code}, which means a "
                                  "configuration error")
        return RestartDecision(
            "fail", REASON_CONFIGURATION_ERROR,
            f"{replica} reported a configuration error, which no restart can fix: {why}",
        )
    if exit_code == c.EXIT_STARTUP_TIMEOUT:
        return RestartDecision(
            "fail", "StartupTimeout",
            f"{replica} exited with code {exit_code}: the parameter servers did not all "
            "answer their health check within the startup timeout (spec.runPolicy."
            "gangScheduling.startupTimeoutSeconds).",
        )
    if policy.restart_policy == "Never":
        return RestartDecision(
            "fail", "RestartPolicyNever",
            f"{replica} failed ({how}) and restartPolicy is Never.",
        )
    if policy.restart_policy == "ExitCode" and exit_code is not None and not is_retryable_exit_code(
        exit_code
    ):
        return RestartDecision(
            "fail", "PermanentExitCode",
            f"{replica} failed with exit code {exit_code}, which restartPolicy ExitCode "
            f"treats as permanent (retryable: {sorted(c.RETRYABLE_EXIT_CODES)}).",
        )
    if restarts_used >= policy.backoff_limit:
        return RestartDecision(
            "fail", "BackoffLimitExceeded",
            f"{replica} failed ({how}) after {restarts_used} restarts; backoffLimit is "
            f"{policy.backoff_limit}.",
        )
    return RestartDecision(
        "restart", "Restarting",
        f"restarting {replica} ({how}); restart {restarts_used + 1} of {policy.backoff_limit}.",
    )


REASON_PS_EXITED = "ParameterServerExited"


def decide_ps_exit(policy: RunPolicy, replica: str, restarts_used: int) -> RestartDecision:
    """What to do about parameter server `replica`, which exited with code 0 before the
    chief finished. A PS serves until the job ends, so this is a failure of that PS, as
    any other exit would be, whatever its code says: restart it or fail the job under
    the run policy, with a message that names the exit."""
    decision = decide_restart(policy, replica, 0, restarts_used)
    what = (f"parameter server {replica} exited with code 0 before the chief finished; "
            "a parameter server must serve until the job ends")
    if decision.action == "fail":
        return RestartDecision("fail", REASON_PS_EXITED, f"{what}. {decision.message}")
    return RestartDecision("restart", decision.reason, f"{what}: {decision.message}")


def shorten(text: str, limit: int = DETAIL_MAX_CHARS) -> str:
    """`text` on one line (the last non-empty one, where the replica states its error),
    cut to `limit` characters."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    line = lines[-1] if lines else ""
    return line if len(line) <= limit else line[: limit - 3] + "..."


REASON_STALLED = "Stalled"


def stalled_for(policy: RunPolicy, advanced_at: float | None, now: float) -> float | None:
    """Seconds the global step has not advanced, once that reaches
    `runPolicy.stallTimeoutSeconds`; None while it has not (or the watchdog is off, or
    no step was seen yet). Times are seconds on any one clock."""
    limit = policy.stall_timeout_seconds
    if limit is None or advanced_at is None:
        return None
    idle = now - advanced_at
    return idle if idle >= limit else None


def decide_stall(policy: RunPolicy, step: int, idle: float, restarts_used: int,
                 ) -> RestartDecision:
    """The stall watchdog's decision, shared by the local runner and the operator: the
    global step stayed at `step` for `idle` seconds. Restart the training replicas (the
    workers and the chief: the parameter servers keep the parameters) as one restart of
    the backoffLimit, or fail the job with reason Stalled when the restart policy allows
    no more. A stall is not the program's own exit, so restartPolicy ExitCode restarts it
    like a retryable one."""
    what = (f"the global step stayed at {step} for {idle:.0f}s (stallTimeoutSeconds is "
            f"{policy.stall_timeout_seconds})")
    if policy.restart_policy == "Never":
        return RestartDecision("fail", REASON_STALLED, f"{what}; restartPolicy is Never.")
    if restarts_used >= policy.backoff_limit:
        return RestartDecision(
            "fail", REASON_STALLED,
            f"{what}; {restarts_used} restarts used, backoffLimit is {policy.backoff_limit}.")
    return RestartDecision(
        "restart", "RestartingStalled",
        f"{what}; restarting the workers and the chief; restart {restarts_used + 1} of "
        f"{policy.backoff_limit}.")
