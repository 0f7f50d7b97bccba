"""Table tests of the local run's pure lifecycle decisions (no processes)."""

from __future__ import annotations

import signal
from dataclasses import replace

import pytest

from .local_builders import make_job, play, starts, state_of, without_notices
from pstrain_runtime.local.supervisor import (
    Begin, Exited, Finish, Healthy, Interrupt, Kill, Notify, Settings, SpawnFailed, Start,
    Terminate, Tick, decide, effective_deadline, normalize_exit_code, restart_delay)

PS, W1, CHIEF = "j-ps-0", "j-worker-1", "j-worker-0"
ALL_STARTED = [Begin(0.0), Healthy(PS, 1, 1.0)]


# --------------------------------------------------------------------------- start order


@pytest.mark.parametrize(
    ("builder", "observations", "expected"),
    [
        pytest.param(make_job().ps(2).workers(2), [Begin(0.0)],
                     [("j-ps-0", 1), ("j-ps-1", 1)], id="begin-starts-only-ps"),
        pytest.param(make_job().ps(2).workers(2), [Begin(0.0), Healthy("j-ps-0", 1, 1.0)],
                     [("j-ps-0", 1), ("j-ps-1", 1)], id="one-of-two-ps-serving-waits"),
        pytest.param(make_job().ps(2).workers(3),
                     [Begin(0.0), Healthy("j-ps-1", 1, 1.0), Healthy("j-ps-0", 1, 2.0)],
                     [("j-ps-0", 1), ("j-ps-1", 1), ("j-worker-1", 1), ("j-worker-2", 1),
                      ("j-worker-0", 1)], id="all-ps-serving-then-workers-then-chief"),
        pytest.param(make_job().ps(1).workers(2).chief(),
                     [Begin(0.0), Healthy("j-ps-0", 1, 1.0)],
                     [("j-ps-0", 1), ("j-worker-0", 1), ("j-worker-1", 1), ("j-chief-0", 1)],
                     id="separate-chief-last"),
        pytest.param(make_job().ps(1).workers(2),
                     [Begin(0.0), Healthy("j-ps-0", 2, 1.0), Healthy("j-ps-0", 0, 1.0)],
                     [("j-ps-0", 1)], id="health-of-another-attempt-ignored"),
        pytest.param(make_job().ps(1).workers(2),
                     [Begin(0.0), Healthy("j-ps-0", 1, 1.0), Healthy("j-ps-0", 1, 2.0)],
                     [("j-ps-0", 1), ("j-worker-1", 1), ("j-worker-0", 1)],
                     id="repeated-health-starts-workers-once"),
    ],
)
def test_start_order(builder, observations, expected):
    _, actions = play(state_of(builder.model()), observations)
    assert starts(actions) == expected


def test_phases_follow_the_start():
    state = state_of(make_job().model())
    assert state.phase == "Pending"
    state, _ = decide(state, Begin(0.0))
    assert (state.phase, state.stage) == ("Starting", "starting_ps")
    state, _ = decide(state, Healthy(PS, 1, 1.0))
    assert (state.phase, state.stage) == ("Running", "running")
    assert [r.status for r in state.replicas] == ["running"] * 3


# --------------------------------------------------------------------------- success


def test_chief_success_waits_for_others_then_finishes():
    state, _ = play(state_of(make_job().model()), ALL_STARTED)
    state, actions = decide(state, Exited(CHIEF, 1, 0, 5.0))
    assert (state.phase, state.stage, state.drain_until) == ("Succeeded", "draining", 25.0)
    assert without_notices(actions) == []
    state, actions = play(state, [Exited(W1, 1, 0, 5.5), Exited(PS, 1, 0, 6.0)])
    assert actions == [Finish("Succeeded", "ChiefSucceeded",
                              "the chief finished training and exited 0.", None, False)]
    assert state.stage == "done"


def test_stragglers_after_success_get_sigterm_then_sigkill():
    settings = {"success_grace": 10.0, "kill_grace": 3.0}
    state, _ = play(state_of(make_job().model(), **settings),
                    [*ALL_STARTED, Exited(CHIEF, 1, 0, 5.0), Exited(W1, 1, 0, 5.0)])
    state, actions = play(state, [Tick(14.9)])
    assert actions == []
    state, actions = play(state, [Tick(15.0)])
    assert without_notices(actions) == [Terminate((PS,))]
    state, actions = play(state, [Tick(17.9)])
    assert actions == []
    state, actions = play(state, [Tick(18.0)])
    assert without_notices(actions) == [Kill((PS,))]
    state, actions = play(state, [Tick(19.0)])
    assert actions == []  # SIGKILL is sent once
    state, actions = play(state, [Exited(PS, 1, 137, 18.1)])
    assert without_notices(actions) == [Finish("Succeeded", "ChiefSucceeded",
                                               "the chief finished training and exited 0.")]
    assert state.replica(PS).exit_code == 137


def test_worker_finishing_before_chief_is_not_restarted():
    state, actions = play(state_of(make_job().model()), [*ALL_STARTED, Exited(W1, 1, 0, 3.0),
                                                         Tick(100.0)])
    assert starts(actions) == [(PS, 1), (W1, 1), (CHIEF, 1)]
    assert state.replica(W1).status == "exited"
    assert state.phase == "Running"


def test_restart_pending_when_chief_succeeds_is_dropped():
    state, _ = play(state_of(make_job().model()), [*ALL_STARTED, Exited(W1, 1, 1, 3.0)])
    state, actions = play(state, [Exited(CHIEF, 1, 0, 3.1), Tick(10.0)])
    assert starts(actions) == []
    assert state.replica(W1).status == "stopped"


# --------------------------------------------------------------------------- restarts


@pytest.mark.parametrize(
    ("restart_policy", "backoff", "failures", "expected_reason", "expected_restarts"),
    [
        pytest.param("OnFailure", 3, [(W1, 1)], None, 1, id="onfailure-restarts"),
        pytest.param("OnFailure", 3, [(W1, 137)], None, 1, id="onfailure-restarts-sigkill"),
        pytest.param("Never", 3, [(W1, 137)], "RestartPolicyNever", 0, id="never-fails"),
        pytest.param("ExitCode", 3, [(W1, 1)], "PermanentExitCode", 0,
                     id="exitcode-permanent-fails"),
        pytest.param("ExitCode", 3, [(W1, 143)], None, 1, id="exitcode-sigterm-restarts"),
        pytest.param("ExitCode", 3, [(PS, 137)], None, 1, id="exitcode-ps-sigkill-restarts"),
        pytest.param("OnFailure", 0, [(PS, 1)], "BackoffLimitExceeded", 0,
                     id="backoff-zero-fails-first"),
        pytest.param("OnFailure", 1, [(W1, 1), (CHIEF, 1)], "BackoffLimitExceeded", 1,
                     id="backoff-counts-job-wide"),
        pytest.param("OnFailure", 2, [(W1, 1), (PS, 137)], None, 2,
                     id="two-restarts-within-limit"),
    ],
)
def test_restart_policy(restart_policy, backoff, failures, expected_reason,
                        expected_restarts):
    state, _ = play(state_of(make_job().policy(restart_policy, backoff).model()),
                    ALL_STARTED)
    actions = []
    for name, code in failures:
        state, more = decide(state, Exited(name, state.replica(name).attempt, code, 2.0))
        actions += more
    assert state.restarts == expected_restarts
    if expected_reason is None:
        assert state.phase == "Running"
        assert all(state.replica(n).status == "waiting_restart" for n, _ in failures)
    else:
        assert (state.phase, state.reason, state.stage) == ("Failed", expected_reason,
                                                            "stopping")
        failed = failures[-1][0]
        assert state.culprit == failed
        live = tuple(r.name for r in state.replicas if r.status == "running")
        assert without_notices(actions)[-1] == Terminate(live)
        assert any(isinstance(a, Notify) and a.level == "error" and a.replica == failed
                   for a in actions)


def test_restart_happens_after_backoff_with_next_attempt():
    state, _ = play(state_of(make_job().model(), backoff_base=0.5), ALL_STARTED)
    state, actions = decide(state, Exited(W1, 1, 137, 10.0))
    assert actions == [Notify("warning", "restarting j-worker-1 (exit code 137); restart 1 "
                                         "of 3; in 0.5s.", replica=W1)]
    state, actions = decide(state, Tick(10.4))
    assert actions == []
    state, actions = decide(state, Tick(10.5))
    assert actions == [Start(W1, 2)]
    assert (state.replica(W1).status, state.replica(W1).attempt) == ("running", 2)
    state, actions = decide(state, Exited(W1, 2, 1, 11.0))
    assert state.replica(W1).restart_at == 12.0  # second restart of W1 backs off longer


def test_a_configuration_error_fails_the_run_at_once_with_the_replicas_line():
    state, _ = play(state_of(make_job().model()), ALL_STARTED)
    line = "pstrain replica: worker 1: configuration error: spec.training.entrypoint ..."
    state, actions = decide(state, Exited(W1, 1, 78, 5.0, message=line))
    assert (state.phase, state.reason, state.restarts) == ("Failed", "ConfigurationError", 0)
    assert state.message == ("j-worker-1 reported a configuration error, which no restart "
                             f"can fix: {line}")
    assert starts(actions) == []


def test_ps_restart_mid_training_keeps_workers_running():
    state, _ = play(state_of(make_job().model(), backoff_base=0.0), ALL_STARTED)
    state, actions = play(state, [Exited(PS, 1, 137, 5.0), Tick(5.0)])
    assert starts(actions) == [(PS, 2)]
    assert state.stage == "running"
    assert [r.status for r in state.replicas] == ["running"] * 3


@pytest.mark.parametrize(("restart_policy", "phase", "reason", "ps_status"), [
    pytest.param("OnFailure", "Running", "", "waiting_restart", id="onfailure-restarts"),
    pytest.param("ExitCode", "Failed", "ParameterServerExited", "exited", id="exitcode-fails"),
    pytest.param("Never", "Failed", "ParameterServerExited", "exited", id="never-fails"),
])
def test_a_ps_exiting_0_while_the_chief_trains_is_a_failure_of_that_ps(
        restart_policy, phase, reason, ps_status):
    state, _ = play(state_of(make_job().policy(restart_policy, 3).model(), ps_exit_grace=15.0),
                    ALL_STARTED)
    state, actions = play(state, [Exited(PS, 1, 0, 5.0), Tick(19.9)])
    assert actions == [] and state.phase == "Running"  # the chief's success may follow
    state, actions = decide(state, Tick(20.0))
    assert (state.phase, state.reason, state.replica(PS).status) == (phase, reason, ps_status)
    notice = next(a for a in actions if isinstance(a, Notify))
    assert notice.replica == PS
    assert notice.text.startswith("parameter server j-ps-0 exited with code 0 before the "
                                  "chief finished")


def test_a_ps_told_to_stop_by_the_chief_exits_just_before_it():
    state, _ = play(state_of(make_job().model(), ps_exit_grace=15.0), ALL_STARTED)
    state, actions = play(state, [Exited(PS, 1, 0, 5.0), Tick(10.0), Exited(CHIEF, 1, 0, 11.0),
                                  Tick(30.0)])
    assert (state.phase, state.reason) == ("Succeeded", "ChiefSucceeded")
    assert state.restarts == 0 and starts(actions) == []


def test_exit_of_a_stale_attempt_is_ignored():
    state, _ = play(state_of(make_job().model(), backoff_base=0.0), ALL_STARTED)
    state, _ = play(state, [Exited(W1, 1, 1, 2.0), Tick(2.0)])
    before = state
    state, actions = decide(state, Exited(W1, 1, 1, 3.0))
    assert (state, actions) == (before, [])


# --------------------------------------------------------------------------- startup failures


def test_ps_exit_zero_before_serving_fails():
    state, actions = play(state_of(make_job().model()), [Begin(0.0), Exited(PS, 1, 0, 1.0)])
    assert (state.phase, state.reason, state.culprit) == (
        "Failed", "ParameterServerExitedBeforeServing", PS)
    assert without_notices(actions)[-1] == Finish(
        "Failed", "ParameterServerExitedBeforeServing",
        "j-ps-0 exited with code 0 before it served on 127.0.0.1:20000; a parameter server "
        "must serve until the job ends.", PS)


def test_ps_crashing_before_serving_is_restarted_and_waited_for_again():
    state, actions = play(state_of(make_job().model(), backoff_base=0.0),
                          [Begin(0.0), Exited(PS, 1, 1, 1.0), Tick(1.0),
                           Healthy(PS, 1, 1.1), Healthy(PS, 2, 2.0)])
    assert starts(actions) == [(PS, 1), (PS, 2), (W1, 1), (CHIEF, 1)]


def test_health_timeout_names_the_ps():
    state, actions = play(state_of(make_job().model(), health_timeout=5.0),
                          [Begin(0.0), Tick(4.9)])
    assert state.phase == "Starting"
    state, actions = decide(state, Tick(5.0))
    assert (state.phase, state.reason) == ("Failed", "ParameterServerNotServing")
    assert actions[0] == Notify("error", "j-ps-0 did not report SERVING on 127.0.0.1:20000 "
                                         "within 5s.", replica=PS)
    assert actions[1:] == [Terminate((PS,))]


def test_spawn_failure_fails_the_job():
    state, actions = play(state_of(make_job().model()),
                          [Begin(0.0), SpawnFailed(PS, 1, "no such file", 0.1)])
    assert (state.phase, state.reason) == ("Failed", "CannotStartReplica")
    assert without_notices(actions)[-1] == Finish("Failed", "CannotStartReplica",
                                                  "cannot start j-ps-0: no such file", PS)


@pytest.mark.parametrize(
    ("deadline", "tick", "phase"),
    [pytest.param(10.0, 9.9, "Running", id="before-deadline"),
     pytest.param(10.0, 10.0, "Failed", id="at-deadline"),
     pytest.param(None, 1e6, "Running", id="no-deadline")],
)
def test_deadline(deadline, tick, phase):
    # checkpoint_wait 0: no checkpoint is asked for first (see the tests below)
    state, _ = play(state_of(make_job().model(), deadline_seconds=deadline,
                             checkpoint_wait=0.0), [*ALL_STARTED, Tick(tick)])
    assert state.phase == phase
    if phase == "Failed":
        assert state.reason == "DeadlineExceeded"


# --------------------------------------------------------------------------- interrupts


def test_interrupt_stops_everything_then_finishes_interrupted():
    state, _ = play(state_of(make_job().model()), ALL_STARTED)
    state, actions = decide(state, Interrupt(3.0, signal.SIGINT))
    assert without_notices(actions) == [Terminate((PS, W1, CHIEF))]
    assert (state.phase, state.reason, state.interrupted) == ("Failed", "Interrupted", True)
    state, actions = decide(state, Interrupt(3.5, signal.SIGINT))
    assert actions == [Kill((PS, W1, CHIEF))]
    state, actions = play(state, [Exited(n, 1, 137, 3.6) for n in (PS, W1, CHIEF)])
    assert actions == [Finish("Failed", "Interrupted",
                              "interrupted by SIGINT; stopped every replica.", None, True)]


def test_interrupt_cancels_pending_restart():
    state, _ = play(state_of(make_job().model()), [*ALL_STARTED, Exited(W1, 1, 1, 2.0)])
    state, actions = play(state, [Interrupt(2.1), Tick(100.0)])
    assert starts(actions) == []
    assert state.replica(W1).status == "stopped"


def test_interrupt_after_chief_success_keeps_phase():
    state, _ = play(state_of(make_job().model()), [*ALL_STARTED, Exited(CHIEF, 1, 0, 2.0)])
    state, actions = decide(state, Interrupt(2.5, signal.SIGTERM))
    assert (state.phase, state.interrupted) == ("Succeeded", True)
    assert without_notices(actions) == [Terminate((PS, W1))]


def test_nothing_happens_after_done():
    state, _ = play(state_of(make_job().ps(1).workers(1).model()),
                    [Begin(0.0), Healthy(PS, 1, 0.5), Exited("j-worker-0", 1, 0, 1.0),
                     Exited(PS, 1, 0, 1.1)])
    assert state.stage == "done"
    assert play(state, [Tick(5.0), Interrupt(6.0), Exited(PS, 1, 1, 7.0)]) == (state, [])


# --------------------------------------------------------------------------- small rules


@pytest.mark.parametrize(("returncode", "expected"),
                         [(0, 0), (1, 1), (-9, 137), (-15, 143), (-2, 130)])
def test_normalize_exit_code(returncode, expected):
    assert normalize_exit_code(returncode) == expected


@pytest.mark.parametrize(("previous", "expected"), [(0, 0.5), (1, 1.0), (3, 4.0), (10, 10.0)])
def test_restart_delay(previous, expected):
    assert restart_delay(Settings(backoff_base=0.5, backoff_max=10.0), previous) == expected


@pytest.mark.parametrize(("active", "timeout", "expected"),
                         [(None, None, None), (30, None, 30.0), (None, 5.0, 5.0),
                          (30, 5.0, 5.0), (3, 5.0, 3.0)])
def test_effective_deadline(active, timeout, expected):
    assert effective_deadline(active, timeout) == expected


@pytest.mark.parametrize(("field", "value", "message"), [
    ("health_timeout", -1.0, "health_timeout is -1.0; it must be at least 0."),
    ("deadline_seconds", 0.0, "deadline_seconds is 0.0; it must be greater than 0."),
])
def test_settings_reject_bad_values(field, value, message):
    with pytest.raises(ValueError) as err:
        replace(Settings(), **{field: value})
    assert str(err.value) == message


# --------------------------------------------------------------------------- stall watchdog


def stalling(**policy: object):
    job = make_job()
    job.run_policy(stallTimeoutSeconds=30, **policy)
    return state_of(job.model(), kill_grace=3.0, backoff_base=0.5)


def test_stall_watchdog_restarts_workers_and_chief_once_then_runs_on():
    from pstrain_runtime.local.supervisor import Progressed

    state, _ = play(stalling(), [*ALL_STARTED, Progressed(5, 2.0), Progressed(7, 10.0),
                                 Tick(39.9)])
    assert state.restarts == 0  # 29.9 s since step 7
    state, actions = decide(state, Tick(40.0))
    notices = [a for a in actions if isinstance(a, Notify)]
    assert notices[0].level == "warning"
    assert notices[0].text.startswith(
        "the global step stayed at 7 for 30s (stallTimeoutSeconds is 30); restarting the "
        "workers and the chief; restart 1 of 3")
    assert without_notices(actions) == [Terminate((W1, CHIEF))]
    assert state.restarts == 1
    # Their exits (143, or 0 from a graceful chief) are the watchdog's restart: not a
    # failure, not a success, not counted twice; they start again after the back-off.
    state, actions = play(state, [Exited(W1, 1, 143, 41.0), Exited(CHIEF, 1, 0, 41.0)])
    assert (state.phase, state.restarts) == ("Running", 1)
    state, actions = play(state, [Tick(41.5)])
    assert starts(actions) == [(W1, 2), (CHIEF, 2)]
    # The clock restarted with the restart: no second restart until 30 s later.
    state, actions = play(state, [Tick(69.0)])
    assert state.restarts == 1 and without_notices(actions) == []


def test_stall_watchdog_kills_a_replica_that_ignores_sigterm():
    state, _ = play(stalling(), [*ALL_STARTED, Tick(31.0)])
    state, actions = play(state, [Exited(W1, 1, 143, 32.0), Tick(33.9)])
    assert starts(actions) == [(W1, 2)] and not any(isinstance(a, Kill) for a in actions)
    state, actions = play(state, [Tick(34.0)])
    assert actions == [Kill((CHIEF,))]
    state, actions = play(state, [Tick(35.0)])
    assert actions == []  # killed once; its exit will restart it
    state, actions = play(state, [Exited(CHIEF, 1, 137, 35.1), Tick(36.0)])
    assert starts(actions) == [(CHIEF, 2)] and state.restarts == 1


@pytest.mark.parametrize("policy, says", [
    ({"restartPolicy": "Never"}, "restartPolicy is Never"),
    ({"backoffLimit": 0}, "backoffLimit is 0"),
], ids=["never", "backoff-used-up"])
def test_stall_watchdog_fails_the_job_with_reason_stalled(policy, says):
    state, actions = play(stalling(**policy), [*ALL_STARTED, Tick(31.0)])
    assert (state.phase, state.reason) == ("Failed", "Stalled")
    assert says in state.message
    assert Terminate((PS, W1, CHIEF)) in actions


def test_stall_watchdog_is_off_by_default():
    state, _ = play(state_of(make_job().model()), ALL_STARTED)
    state, actions = play(state, [Tick(10.0**6)])
    assert (state.phase, state.restarts) == ("Running", 0) and without_notices(actions) == []


# --------------------------------------------------------------------------- deadline checkpoint


def at_deadline(**settings: object):
    from pstrain_runtime.local.supervisor import Progressed

    state, _ = play(state_of(make_job().model(), deadline_seconds=100.0, checkpoint_wait=30.0,
                             **settings), [*ALL_STARTED, Progressed(40, 50.0)])
    return state


def test_deadline_asks_for_a_checkpoint_then_fails_once_it_is_written():
    from pstrain_runtime.local.supervisor import AskCheckpoint, Checkpointed

    state, actions = decide(at_deadline(), Tick(100.0))
    assert state.phase == "Running" and AskCheckpoint() in actions
    state, actions = play(state, [Tick(110.0), Checkpointed(39, 111.0)])
    assert state.phase == "Running" and actions == []  # an older checkpoint does not count
    state, actions = decide(state, Checkpointed(41, 112.0))
    assert (state.phase, state.reason) == ("Failed", "DeadlineExceeded")
    assert "A checkpoint at step 41 was written first." in state.message
    assert Terminate((PS, W1, CHIEF)) in actions


@pytest.mark.parametrize("answer", ["unanswered", "timeout"])
def test_deadline_checkpoint_wait_is_bounded(answer):
    from pstrain_runtime.local.supervisor import CheckpointUnanswered

    state, _ = decide(at_deadline(), Tick(100.0))
    last = CheckpointUnanswered(100.5) if answer == "unanswered" else Tick(130.0)
    state, actions = play(state, [Tick(129.9), last])
    assert (state.phase, state.reason) == ("Failed", "DeadlineExceeded")
    assert "checkpoint" not in state.message


def test_deadline_before_the_workers_run_fails_at_once():
    state, _ = play(state_of(make_job().model(), deadline_seconds=10.0), [Begin(0.0)])
    state, _ = decide(state, Tick(10.0))
    assert (state.phase, state.reason) == ("Failed", "DeadlineExceeded")
