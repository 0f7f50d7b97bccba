"""Restart decisions shared by the local runner and the operator.

Pure: given the run policy, how a replica ended and how many restarts the job has
used, say whether to restart it or fail the job, and why.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from . import constants as c
from .model import RunPolicy

Action = Literal["restart", "fail"]


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
) -> RestartDecision:
    """What to do about `replica`, which failed with `exit_code` (None: evicted/lost)."""
    how = f"exit code {exit_code}" if exit_code is not None else (reason or "lost")
    if exit_code == c.EXIT_CONFIG_ERROR:
        return RestartDecision(
            "fail", "ConfigurationError",
            f"{replica} exited with code {exit_code}: its configuration is wrong (such as "
            "an entry point that cannot be imported; see its log), so restarting it "
            "cannot help.",
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
