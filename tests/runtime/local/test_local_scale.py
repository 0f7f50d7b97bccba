"""`pstrain scale` against a local run: the supervisor's scaling rules (pure, no
processes) and the control channel (a real Unix socket, a fake runner behind it)."""

from __future__ import annotations

import json
import socket
import threading
from pathlib import Path

import pytest

from pstrain_runtime.local import control
from pstrain_runtime.local.control import Answer, ControlServer, Inbox, request_scale
from pstrain_runtime.local.supervisor import (
    Begin, Exited, Healthy, Kill, Notify, Reply, Respec, ScaleRequest, SetWorkers,
    Terminate, Tick, decide)

from .local_builders import make_job, play, starts, state_of, without_notices

PS, CHIEF = "j-ps-0", "j-worker-0"
RUNNING = [Begin(0.0), Healthy(PS, 1, 1.0)]
NEW = {i: f"127.0.0.1:{30000 + i}" for i in range(2, 8)}  # the runner's free addresses


def running(builder=None, **settings):
    state, _ = play(state_of((builder or make_job().workers(2)).model(), **settings),
                    RUNNING)
    return state


def scale(state, replicas, now=5.0, ticket=7):
    return decide(state, ScaleRequest(replicas, now, ticket, NEW))


def reply_of(actions) -> Reply:
    (reply,) = [a for a in actions if isinstance(a, Reply)]
    return reply


def worker_status(state) -> dict[str, str]:
    return {r.name: r.status for r in state.replicas if r.role == "worker"}


# --------------------------------------------------------------------------- supervisor


def test_scale_up_starts_newcomers_with_the_new_spec_and_sends_the_set():
    state, actions = scale(running(), 4)
    assert without_notices(actions) == [
        Respec(4), *[a for a in actions if a.__class__.__name__ == "Start"],
        SetWorkers((0, 1, 2, 3)), reply_of(actions)]
    assert starts(actions) == [("j-worker-2", 1), ("j-worker-3", 1)]
    assert reply_of(actions) == Reply(7, True, "WorkersScaledUp: workers 2 -> 4: adds worker "
                                               "2, 3")
    assert state.replica("j-worker-3").address == NEW[3]
    assert state.members == (0, 1, 2, 3)
    assert all(r.status == "running" for r in state.replicas)
    # worker 0 is the chief; the newcomers are not: one that finishes first ends nothing
    assert [r.name for r in state.replicas if r.is_chief] == [CHIEF]
    state, actions = decide(state, Exited("j-worker-3", 1, 0, 6.0))
    assert state.phase == "Running" and without_notices(actions) == []


@pytest.mark.parametrize(("replicas", "message"), [
    (5, "spec.replicas.worker.replicas is 5; it must be at most maxReplicas"),
    (1, "spec.replicas.worker.replicas is 1; it must be at least minReplicas"),
    (0, "spec.replicas.worker.replicas is 0; it must be at least 1"),
    (-3, "spec.replicas.worker.replicas is -3; it must be at least 1"),
])
def test_a_scale_beyond_the_bounds_is_refused_and_changes_nothing(replicas, message):
    state = running(min_workers=2, max_workers=4)
    after, actions = scale(state, replicas)
    assert after == state
    assert actions == [Reply(7, False, message)]


def test_scale_down_sends_the_set_then_stops_the_highest_workers():
    state, _ = scale(running(), 4)
    state, actions = scale(state, 1, now=10.0)
    assert without_notices(actions) == [
        Respec(1), SetWorkers((0,)), Terminate(("j-worker-3", "j-worker-2", "j-worker-1")),
        Reply(7, True, "WorkersScaledDown: workers 4 -> 1: removes worker 3, 2, 1")]
    assert state.replica("j-worker-1").retiring
    # their exits are expected: stopped, neither restarted nor counted, job running
    state, actions = play(state, [Exited("j-worker-3", 1, 143, 10.5),
                                  Exited("j-worker-1", 1, 137, 10.6)])
    assert worker_status(state)["j-worker-3"] == "stopped"
    assert worker_status(state)["j-worker-1"] == "stopped"
    assert state.restarts == 0 and state.stage == "running"
    assert all(a.level == "info" for a in actions if isinstance(a, Notify))
    # one that ignores SIGTERM is killed after the grace (kill_grace 5 s)
    state, actions = decide(state, Tick(15.1))
    assert Kill(("j-worker-2",)) in actions
    state, _ = decide(state, Tick(40.0))  # and nothing restarts it
    assert starts(_) == []


def test_a_worker_killed_during_a_scale_down_is_restarted_and_the_removed_are_not():
    """Scale 4 -> 2 while worker 1 (kept) dies of SIGKILL and worker 3 (removed) too:
    worker 1 is a lost worker, restarted under the restart policy; 3 stays stopped."""
    state, _ = scale(running(make_job().workers(2).policy("OnFailure", backoff=3)), 4)
    state, actions = scale(state, 2, now=10.0)
    assert Terminate(("j-worker-3", "j-worker-2")) in actions
    state, _ = play(state, [Exited("j-worker-1", 1, 137, 10.2),
                            Exited("j-worker-3", 1, 137, 10.3),
                            Exited("j-worker-2", 1, 143, 10.4)])
    assert state.restarts == 1
    assert worker_status(state) == {"j-worker-0": "running", "j-worker-1": "waiting_restart",
                                    "j-worker-2": "stopped", "j-worker-3": "stopped"}
    state, actions = decide(state, Tick(20.0))
    assert starts(actions) == [("j-worker-1", 2)]


def test_a_worker_scaled_away_and_back_starts_again_at_its_old_address():
    state, _ = scale(running(), 3)
    address = state.replica("j-worker-2").address
    state, _ = scale(state, 2, now=6.0)
    state, _ = decide(state, Exited("j-worker-2", 1, 143, 6.5))
    state, actions = decide(state, ScaleRequest(3, 7.0, 8, {}))  # no new address needed
    assert starts(actions) == [("j-worker-2", 2)]
    assert state.replica("j-worker-2").address == address
    # the exit of its first process, reported late, changes nothing
    assert decide(state, Exited("j-worker-2", 1, 143, 7.5))[0] == state


def test_scale_while_the_servers_start_changes_which_workers_start():
    state, _ = play(state_of(make_job().workers(3).model()), [Begin(0.0)])
    state, actions = decide(state, ScaleRequest(2, 0.5, 1, NEW))
    assert without_notices(actions) == [
        Respec(2), Reply(1, True, "WorkersScaledDown: workers 3 -> 2: removes worker 2")]
    state, actions = decide(state, ScaleRequest(4, 0.6, 2, NEW))
    assert starts(actions) == []  # nothing starts before the servers serve
    state, actions = decide(state, Healthy(PS, 1, 1.0))
    assert starts(actions) == [("j-worker-1", 1), ("j-worker-2", 1), ("j-worker-3", 1),
                               (CHIEF, 1)]


def test_a_separate_chief_is_trainer_0_and_never_scaled():
    state = running(make_job().workers(2).chief())
    state, actions = scale(state, 3)
    assert SetWorkers((0, 1, 2, 3)) in actions  # chief 0, workers 0..2 are trainers 1..3
    state, actions = scale(state, 1)
    assert SetWorkers((0, 1)) in actions
    assert Terminate(("j-worker-2", "j-worker-1")) in actions
    assert state.replica("j-chief-0").status == "running"


def test_no_scale_once_the_chief_finished_and_a_noop_is_answered():
    state = running()
    assert reply_of(scale(state, 2)[1]) == Reply(7, True, "job j already has 2 workers")
    state, _ = decide(state, Exited(CHIEF, 1, 0, 3.0))
    after, actions = scale(state, 4)
    assert after == state
    assert actions == [Reply(7, False, "job j is finishing (Succeeded); it cannot be "
                                       "scaled now")]


# --------------------------------------------------------------------------- channel


@pytest.fixture
def run_dir(tmp_path, monkeypatch):
    monkeypatch.setenv(control.ENV_RUN_DIR, str(tmp_path / "run"))
    return tmp_path / "run"


def test_request_reaches_the_runner_and_its_answer_comes_back(run_dir):
    asked: list[int] = []

    def ask(replicas: int) -> Answer:
        asked.append(replicas)
        return Answer(replicas <= 4, f"asked for {replicas}")

    server = ControlServer("job-a", ask)
    assert server.start() is None
    try:
        assert (run_dir / "job-a.sock").exists()
        assert oct((run_dir).stat().st_mode & 0o777) == "0o700"
        assert request_scale("job-a", 3) == Answer(True, "asked for 3")
        assert request_scale("job-a", 9) == Answer(False, "asked for 9")
        assert asked == [3, 9]
        # a second run of the same job does not take the socket over
        second = ControlServer("job-a", ask)
        why = second.start()
        assert why is not None and "another `pstrain run` of this job" in why
    finally:
        server.close()
    assert not (run_dir / "job-a.sock").exists()
    answer = request_scale("job-a", 3)
    assert not answer.ok and "no `pstrain run` of job 'job-a' is running" in answer.message


@pytest.mark.parametrize(("raw", "message"), [
    (b"not json\n", "the request is not JSON"),
    (b'{"scale": "3"}\n', 'the request must be {"scale": <whole number>}'),
    (b'{"scale": true}\n', 'the request must be {"scale": <whole number>}'),
    (b'[1, 2]\n', 'the request must be {"scale": <whole number>}'),
    (b"x" * 10000, "the request is not JSON"),
])
def test_a_bad_request_is_answered_in_one_line_and_asks_nothing(run_dir, raw, message):
    asked: list[int] = []
    server = ControlServer("job-b", lambda n: asked.append(n) or Answer(True, "?"))
    assert server.start() is None
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(10)
            sock.connect(str(run_dir / "job-b.sock"))
            sock.sendall(raw)
            reply = json.loads(sock.makefile("rb").readline())
        assert reply == {"ok": False, "message": message}
        assert asked == []
        assert request_scale("job-b", 2).ok  # the server still serves
    finally:
        server.close()


def test_a_socket_left_by_a_killed_run_is_replaced(run_dir):
    run_dir.mkdir(mode=0o700)
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(run_dir / "job-c.sock"))
    stale.close()  # the file stays, nobody listens
    server = ControlServer("job-c", lambda n: Answer(True, "fresh"))
    assert server.start() is None
    try:
        assert request_scale("job-c", 2) == Answer(True, "fresh")
    finally:
        server.close()


def test_inbox_hands_the_request_to_the_loop_and_the_answer_back():
    posted: list[object] = []
    inbox = Inbox(posted.append)
    result: list[Answer] = []
    thread = threading.Thread(target=lambda: result.append(
        inbox.ask(lambda ticket: ("scale", 3, ticket))))
    thread.start()
    for _ in range(200):
        if posted:
            break
        threading.Event().wait(0.01)
    (_, replicas, ticket), = posted
    inbox.answer(ticket, Answer(True, "done"))
    thread.join(10)
    assert result == [Answer(True, "done")]
    inbox.answer(ticket, Answer(True, "late"))  # nobody waits any more: dropped


def test_cli_scale_exit_codes_and_messages(run_dir, tmp_path, capsys):
    server = ControlServer("job-d", lambda n: Answer(n < 5, f"to {n}"))
    assert server.start() is None
    manifest = make_job("job-d").write(tmp_path / "job.yaml")
    try:
        assert control.scale_main(["job-d", "--replicas", "3"]) == 0
        assert capsys.readouterr().out == "pstrain scale: to 3\n"
        assert control.scale_main(["trainingjob/job-d", "--replicas", "9"]) == 1
        assert capsys.readouterr().err == "pstrain scale: to 9\n"
        assert control.scale_main([str(manifest), "--replicas", "2"]) == 0
        assert capsys.readouterr().out == "pstrain scale: to 2\n"
    finally:
        server.close()
    assert control.scale_main(["job-d", "--replicas", "2"]) == 1
    assert "no `pstrain run` of job 'job-d'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as usage:
        control.scale_main(["job-d", "--replicas", "two"])
    assert usage.value.code == 2
    assert "'two' is not a whole number" in capsys.readouterr().err
    bad = tmp_path / "bad.yaml"
    bad.write_text("kind: TrainingJob\n")
    assert control.scale_main([str(bad), "--replicas", "2"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("pstrain scale: ") and "Traceback" not in err


def test_a_long_job_name_gets_a_socket_path_that_fits(run_dir, monkeypatch):
    monkeypatch.setenv(control.ENV_RUN_DIR, str(run_dir / ("d" * 60)))
    name = "a" * 63
    path = control.socket_path(name)
    assert len(str(path)) <= 100 and path.name.endswith(".sock")
    server = ControlServer(name, lambda n: Answer(True, "ok"))
    assert server.start() is None
    try:
        assert request_scale(name, 2).ok
    finally:
        server.close()


def test_a_request_can_name_the_run_directory_instead_of_the_environment(run_dir,
                                                                        monkeypatch):
    """A caller that started the run with its own PSTRAIN_RUN_DIR (a test, the bench)
    reaches it by `directory`, whatever this process's environment says."""
    server = ControlServer("job-e", lambda n: Answer(True, f"to {n}"))
    assert server.start() is None
    monkeypatch.setenv(control.ENV_RUN_DIR, str(run_dir / "elsewhere"))
    try:
        assert control.socket_path("job-e", run_dir) == run_dir / "job-e.sock"
        assert request_scale("job-e", 3, directory=run_dir) == Answer(True, "to 3")
        missed = request_scale("job-e", 3)  # the environment's directory: nobody there
        assert not missed.ok and str(run_dir / "elsewhere" / "job-e.sock") in missed.message
    finally:
        server.close()


def test_the_runner_refuses_a_scale_the_machine_cannot_start(monkeypatch):
    """Beyond the shared rules, two of this machine's: the cluster spec must fit one
    environment variable, and the new processes must fit in memory."""
    import time

    from pstrain_runtime.local import runner

    job = make_job("j").workers(2).model()
    state = running()
    executor = runner._Executor(None, None, time.monotonic, job=job)  # type: ignore[arg-type]
    settings = state.settings
    huge = executor.scale_request(10**9, 3, state, settings)
    assert isinstance(huge, Reply) and not huge.ok and huge.ticket == 3
    assert "spec.replicas asks for" in huge.message and "Argument list too long" in huge.message
    monkeypatch.setattr(runner, "available_memory", lambda: 600 * 2**20)
    heavy = executor.scale_request(5, 4, state, settings)  # 3 more processes of 250 MB
    assert isinstance(heavy, Reply) and not heavy.ok
    assert heavy.message.startswith("refused: this job starts 3 processes")
    monkeypatch.setattr(runner, "available_memory", lambda: None)
    fine = executor.scale_request(3, 5, state, settings)
    assert isinstance(fine, ScaleRequest) and list(fine.addresses) == [2]
    below = executor.scale_request(0, 6, state, settings)  # the supervisor refuses it
    assert isinstance(below, ScaleRequest) and below.addresses == {}


# --------------------------------------------------------------------------- cores


def test_more_workers_than_cores_are_warned_about_by_the_run_and_the_caller(
        monkeypatch, run_dir, capsys):
    """Issue "rough edges" 4: a scale past the cores is made, with one line of warning
    in the run's output and in `pstrain scale`'s."""
    import time

    from pstrain_runtime.local import runner

    monkeypatch.setattr(runner, "usable_cores", lambda: 2)
    monkeypatch.setattr(runner, "available_memory", lambda: None)
    state = running()
    executor = runner._Executor(None, None, time.monotonic,  # type: ignore[arg-type]
                                job=make_job("j").workers(2).model())
    request = executor.scale_request(9, 3, state, state.settings)
    warning = ("9 workers on 2 CPU cores: the workers take turns on the cores, so more "
               "workers than cores train no faster here (spec.replicas.worker.maxReplicas "
               "bounds a scale)")
    assert isinstance(request, ScaleRequest) and request.warning == warning
    assert executor.scale_request(2, 4, state, state.settings).warning == ""
    _, actions = decide(state, request)
    assert Notify("warning", warning) in actions
    assert reply_of(actions) == Reply(3, True, "WorkersScaledUp: workers 2 -> 9: adds "
                                               "worker 2, 3, 4, 5, 6, 7, 8", warning)
    server = ControlServer("job-w", lambda n: Answer(True, f"to {n}", warning))
    assert server.start() is None
    try:
        assert control.scale_main(["job-w", "--replicas", "9"]) == 0
    finally:
        server.close()
    out, err = capsys.readouterr()
    assert (out, err) == ("pstrain scale: to 9\n", f"pstrain scale: warning: {warning}\n")
