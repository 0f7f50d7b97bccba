"""Restart decisions shared by the runner and the operator; replica event lines."""

from __future__ import annotations

import io

import pytest

from pstrain_api.events import emit, format_event, parse_event
from pstrain_api.model import RunPolicy
from pstrain_api import constants as c
from pstrain_api.policy import RestartDecision, decide_restart


@pytest.mark.parametrize(
    ("policy", "exit_code", "used", "action", "reason"),
    [
        pytest.param("Never", 1, 0, "fail", "RestartPolicyNever", id="never"),
        pytest.param("Never", 137, 0, "fail", "RestartPolicyNever", id="never-even-oom"),
        pytest.param("OnFailure", 1, 0, "restart", "Restarting", id="onfailure-first"),
        pytest.param("OnFailure", 1, 2, "restart", "Restarting", id="onfailure-last-allowed"),
        pytest.param("OnFailure", 1, 3, "fail", "BackoffLimitExceeded", id="onfailure-exhausted"),
        pytest.param("OnFailure", None, 0, "restart", "Restarting", id="onfailure-evicted"),
        pytest.param("ExitCode", 137, 0, "restart", "Restarting", id="exitcode-sigkill"),
        pytest.param("ExitCode", 143, 1, "restart", "Restarting", id="exitcode-sigterm"),
        pytest.param("ExitCode", 1, 0, "fail", "PermanentExitCode", id="exitcode-permanent"),
        pytest.param("ExitCode", 137, 3, "fail", "BackoffLimitExceeded", id="exitcode-exhausted"),
    ],
)
def test_decide_restart(policy, exit_code, used, action, reason):
    decision = decide_restart(RunPolicy(restart_policy=policy, backoff_limit=3), "j-worker-1",
                              exit_code, used)
    assert (decision.action, decision.reason) == (action, reason)
    assert "j-worker-1" in decision.message


@pytest.mark.parametrize("policy", ["Never", "OnFailure", "ExitCode"])
def test_a_configuration_error_fails_at_once_under_every_restart_policy(policy):
    line = ("pstrain replica: worker 0: configuration error: spec.training.entrypoint "
            "'m:f': module 'm' cannot be imported: No module named 'm'")
    decision = decide_restart(RunPolicy(restart_policy=policy, backoff_limit=3), "j-worker-0",
                              c.EXIT_CONFIGURATION_ERROR, 0, detail=f"Traceback ...\n{line}\n")
    assert decision == RestartDecision(
        "fail", "ConfigurationError",
        f"j-worker-0 reported a configuration error, which no restart can fix: {line}")


def test_a_configuration_error_without_its_line_still_says_what_it_is():
    decision = decide_restart(RunPolicy(), "j-ps-0", c.EXIT_CONFIGURATION_ERROR, 0)
    assert (decision.action, decision.reason) == ("fail", "ConfigurationError")
    assert "exited with code 78, which means a configuration error" in decision.message


def test_backoff_limit_zero_fails_at_once():
    decision = decide_restart(RunPolicy(backoff_limit=0), "j-ps-0", 1, 0)
    assert decision.action == "fail"
    assert decision.message == "j-ps-0 failed (exit code 1) after 0 restarts; backoffLimit is 0."


def test_event_round_trip():
    line = format_event("done", step=600, loss=0.1, accuracy=0.97)
    event = parse_event("[digits-worker-0] " + line)
    assert event is not None
    assert (event["event"], event["step"], event["accuracy"]) == ("done", 600, 0.97)


@pytest.mark.parametrize("line", ["plain output", "PSTRAIN_EVENT {not json",
                                  'PSTRAIN_EVENT {"event": "unknown"}', "PSTRAIN_EVENT [1]"])
def test_non_events_are_ignored(line):
    assert parse_event(line) is None


def test_emit_writes_one_flushed_line():
    buf = io.StringIO()
    emit("progress", buf, step=1, loss=2.0, samples_per_sec=3.0)
    assert buf.getvalue().count("\n") == 1
    assert parse_event(buf.getvalue())["samples_per_sec"] == 3.0


def test_unknown_event_kind_is_refused():
    with pytest.raises(ValueError, match="event kind 'bogus'"):
        format_event("bogus")


@pytest.mark.parametrize("policy, advanced_at, now, idle", [
    ({}, 0.0, 10**6, None),                                   # off by default
    ({"stallTimeoutSeconds": 60}, None, 10**6, None),          # no step seen yet
    ({"stallTimeoutSeconds": 60}, 100.0, 159.0, None),         # not yet
    ({"stallTimeoutSeconds": 60}, 100.0, 160.0, 60.0),         # at the limit
], ids=["off", "no-step-yet", "not-yet", "stalled"])
def test_stalled_for(policy: dict, advanced_at: float | None, now: float,
                     idle: float | None) -> None:
    from pstrain_api.policy import stalled_for

    assert stalled_for(RunPolicy.model_validate(policy), advanced_at, now) == idle


@pytest.mark.parametrize("policy, used, action, reason", [
    ({"stallTimeoutSeconds": 60}, 0, "restart", "RestartingStalled"),
    ({"stallTimeoutSeconds": 60, "restartPolicy": "ExitCode"}, 2, "restart",
     "RestartingStalled"),
    ({"stallTimeoutSeconds": 60, "restartPolicy": "Never"}, 0, "fail", "Stalled"),
    ({"stallTimeoutSeconds": 60, "backoffLimit": 2}, 2, "fail", "Stalled"),
], ids=["restart", "exit-code-policy-restarts", "never-fails", "backoff-used-up"])
def test_decide_stall(policy: dict, used: int, action: str, reason: str) -> None:
    from pstrain_api.policy import decide_stall

    got = decide_stall(RunPolicy.model_validate(policy), 42, 61.0, used)
    assert (got.action, got.reason) == (action, reason)
    assert "the global step stayed at 42 for 61s (stallTimeoutSeconds is 60)" in got.message
