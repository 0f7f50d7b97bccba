"""The local runner with real processes, running FAKE replicas (fake_replica.py), so
ordering, prefixing, restarts, health, signals and the CLI are tested without the
training runtime."""

from __future__ import annotations

import io
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from .local_builders import make_job
from pstrain_runtime.local.keys import remove_stale
from pstrain_runtime.local.runner import RunOptions, run_job

FAKE = str(Path(__file__).with_name("fake_replica.py"))
FAKE_COMMAND = (sys.executable, FAKE)
FAST = {"backoff_base": 0.05, "success_grace": 5.0, "kill_grace": 2.0,
        "health_timeout": 60.0}

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def fake(tmp_path, monkeypatch):
    """Run a job on fake replicas; returns (result, output lines, start records)."""
    state = tmp_path / "state"
    state.mkdir()
    monkeypatch.setenv("FAKE_STATE_DIR", str(state))

    def run(builder, plan, **options):
        monkeypatch.setenv("FAKE_PLAN", json.dumps(plan))
        out, err = io.StringIO(), io.StringIO()
        opts = RunOptions(replica_command=FAKE_COMMAND, handle_signals=False,
                          checkpoint_dir=str(tmp_path / "ckpt"), **{**FAST, **options})
        result = run_job(builder.model(), opts, stdout=out, stderr=err)
        return result, (out.getvalue() + err.getvalue()).splitlines(), read_starts(state)

    return run


def read_starts(state: Path) -> list[dict]:
    path = state / "starts.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines()]


def is_alive(pid: int) -> bool:
    """Alive and not a zombie (a container's pid 1 may never reap orphans)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def all_pids(result) -> list[int]:
    return [pid for pids in result.pids.values() for pid in pids]


def wait_until(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.05)


# --------------------------------------------------------------------------- happy path


def test_order_health_gate_prefixes_and_summary(fake):
    chief_events = [["progress", {"step": 50, "loss": 0.9, "samples_per_sec": 100.0}],
                    ["eval", {"step": 100, "accuracy": 0.97, "loss": 0.1}],
                    ["done", {"step": 100, "loss": 0.2, "accuracy": 0.97,
                              "samples_per_sec": 120.0, "wall_seconds": 1.0}]]
    result, lines, starts = fake(
        make_job("j").ps(2).workers(3),
        {"j-ps-0": {"serve_delay": 0.5, "lines": ["ps zero booting"]},
         "j-worker-0": {"events": chief_events, "lines": ["chief says hi"]},
         "*": {}})

    assert result.exit_code == 0
    spawned = [line.split()[2] for line in lines if line.startswith("pstrain: started ")]
    assert spawned == ["j-ps-0", "j-ps-1", "j-worker-1", "j-worker-2", "j-worker-0"]
    recorded = [s["name"] for s in starts]
    assert sorted(recorded[:2]) == ["j-ps-0", "j-ps-1"], "parameter servers start first"
    for record in starts[2:]:
        assert record["ps_serving"] == [True, True], f"{record['name']} started too early"
    assert "[j-ps-0]     ps zero booting" in lines
    assert "[j-worker-0] chief says hi" in lines
    assert "pstrain: j-worker-0: eval at step 100: accuracy 0.9700, loss 0.1000" in lines
    summary = result.summary
    assert {k: summary[k] for k in ("phase", "steps", "loss", "accuracy", "samples_per_sec",
                                    "restarts", "lost_steps")} == {
        "phase": "Succeeded", "steps": 100, "loss": 0.2, "accuracy": 0.97,
        "samples_per_sec": 120.0, "restarts": 0, "lost_steps": 0}
    assert {n: r["exit_code"] for n, r in summary["replicas"].items()} == {
        "j-ps-0": 0, "j-ps-1": 0, "j-worker-1": 0, "j-worker-2": 0, "j-worker-0": 0}
    assert not any(is_alive(p) for p in all_pids(result))


# --------------------------------------------------------------------------- restart policy


@pytest.mark.parametrize(
    ("policy", "backoff", "codes", "phase", "reason", "restarts"),
    [
        pytest.param("OnFailure", 3, [1, 0], "Succeeded", "ChiefSucceeded", 1,
                     id="onfailure-restarts-then-succeeds"),
        pytest.param("Never", 3, [1], "Failed", "RestartPolicyNever", 0, id="never"),
        pytest.param("ExitCode", 3, [2], "Failed", "PermanentExitCode", 0,
                     id="exitcode-permanent"),
        pytest.param("ExitCode", 3, [143, 0], "Succeeded", "ChiefSucceeded", 1,
                     id="exitcode-retryable"),
        pytest.param("OnFailure", 2, [1, 1, 1], "Failed", "BackoffLimitExceeded", 2,
                     id="backoff-limit"),
    ],
)
def test_restart_policy(fake, policy, backoff, codes, phase, reason, restarts):
    # The chief runs until worker 1 has exited its last attempt by itself (or forever,
    # when the job is expected to fail), so the outcome never depends on timing.
    chief = {"wait_exit": ["j-worker-1", len(codes)]} if phase == "Succeeded" else {
        "hang": True}
    result, lines, starts = fake(
        make_job("j").ps(1).workers(2).policy(policy, backoff),
        {"j-worker-1": {"codes": codes, "run": 0.05}, "j-worker-0": chief, "*": {}})
    summary = result.summary
    assert (summary["phase"], summary["reason"], summary["restarts"]) == (
        phase, reason, restarts)
    assert result.exit_code == (0 if phase == "Succeeded" else 1)
    assert [s["attempt"] for s in starts if s["name"] == "j-worker-1"] == list(
        range(1, restarts + 2))
    assert summary["replicas"]["j-worker-1"]["restarts"] == restarts
    if phase == "Failed":
        assert summary["failed_replica"] == "j-worker-1"
        assert any(line.startswith("pstrain: error: j-worker-1 ") for line in lines)
        assert "    last output of j-worker-1:" in lines
    if restarts:
        assert any("restarting j-worker-1 (exit code" in line for line in lines)
    assert not any(is_alive(p) for p in all_pids(result)), "a replica outlived the run"


def test_restarted_replica_keeps_address_and_environment(fake):
    result, lines, starts = fake(
        make_job("j").ps(1).workers(1),
        # Each attempt serves for a while: the runner must see attempt 1 serving (its
        # health check) before it crashes, however loaded the machine.
        {"j-ps-0": {"codes": [137, 0], "wait_done": False, "run": 2.0},
         "j-worker-0": {"wait_exit": ["j-ps-0", 2]}})
    assert result.summary["phase"] == "Succeeded"
    ps_starts = [s for s in starts if s["name"] == "j-ps-0"]
    assert [s["attempt"] for s in ps_starts] == [1, 2]
    assert ps_starts[0]["env"] == ps_starts[1]["env"], "a restart must get the same env"
    assert ps_starts[0]["env"]["OMP_NUM_THREADS"] is not None
    # Attempt 2 bound the same cluster-spec address (the fake serves on it) and served.
    assert "[j-ps-0]     serving attempt 2" in lines
    assert result.summary["replicas"]["j-ps-0"] == {
        "role": "ps", "index": 0, "exit_code": 0, "restarts": 1}


# --------------------------------------------------------------------------- startup failures


def test_ps_that_never_serves_fails_with_its_last_lines(fake):
    result, lines, starts = fake(make_job("j").ps(1).workers(1),
                                 {"j-ps-0": {"serve": False, "hang": True,
                                             "lines": ["binding failed: boom"]}},
                                 health_timeout=1.5)
    assert (result.summary["phase"], result.summary["reason"]) == (
        "Failed", "ParameterServerNotServing")
    assert any(line.startswith("pstrain: error: j-ps-0 did not report SERVING on 127.0.0.1:")
               for line in lines)
    assert "    binding failed: boom" in lines
    assert [s["name"] for s in starts] == ["j-ps-0"], "no worker may start"
    assert result.exit_code == 1


def test_ps_exiting_early_fails_with_its_last_lines(fake):
    result, lines, starts = fake(make_job("j").ps(1).workers(1).policy("Never"),
                                 {"j-ps-0": {"serve": False, "codes": [5], "wait_done": False,
                                             "lines": ["Traceback: bad config"]}})
    assert (result.summary["phase"], result.summary["reason"]) == (
        "Failed", "RestartPolicyNever")
    assert "    Traceback: bad config" in lines
    assert [s["name"] for s in starts] == ["j-ps-0"]


def test_missing_replica_command_fails_clearly(tmp_path):
    result = run_job(make_job("j").model(),
                     RunOptions(replica_command=["/nonexistent/pstrain-replica"],
                                handle_signals=False, checkpoint_dir=str(tmp_path)),
                     stdout=io.StringIO())
    assert (result.summary["phase"], result.summary["reason"]) == (
        "Failed", "CannotStartReplica")
    assert result.summary["message"] == ("cannot start j-ps-0: /nonexistent/pstrain-replica: "
                                         "not an executable file or a program on PATH")


# --------------------------------------------------------------------------- stopping


def test_straggler_after_success_is_terminated_then_killed(fake):
    result, lines, _ = fake(make_job("j").ps(1).workers(1),
                            {"j-ps-0": {"hang": True, "ignore_term": True}},
                            success_grace=0.5, kill_grace=0.5)
    assert result.summary["phase"] == "Succeeded"
    assert result.exit_code == 0
    assert result.summary["replicas"]["j-ps-0"]["exit_code"] == 137
    assert any("did not exit within 0.5s after the chief finished" in line for line in lines)
    assert any("ignored SIGTERM for 0.5s; sending SIGKILL" in line for line in lines)


def test_children_left_behind_are_cleaned_up(fake, tmp_path):
    # Worker 1 exits but leaves a child holding its stdout pipe open: the runner must
    # still see the exit, and must not leave the child running after the job.
    result, _, starts = fake(make_job("j").ps(1).workers(2),
                             {"j-worker-1": {"orphan": True},
                              "j-worker-0": {"wait_exit": ["j-worker-1", 1]}})
    assert result.summary["phase"] == "Succeeded"
    assert result.summary["replicas"]["j-worker-1"]["exit_code"] == 0
    orphans = [json.loads(x) for x in
               (tmp_path / "state" / "orphans.jsonl").read_text().splitlines()]
    assert len(orphans) == 1
    wait_until(lambda: not is_alive(orphans[0]), 5, "the left-behind child to be killed")


def test_deadline_fails_the_job(fake):
    result, _, _ = fake(make_job("j").ps(1).workers(1), {"j-worker-0": {"hang": True}},
                        timeout=1.5)
    assert (result.summary["phase"], result.summary["reason"]) == (
        "Failed", "DeadlineExceeded")
    assert not any(is_alive(p) for p in all_pids(result))


def test_stalled_job_is_restarted_then_fails_with_reason_stalled(fake):
    """A chief that reports step 3 and then hangs: the watchdog restarts the trainers
    once (backoffLimit 1), the restarted chief hangs too, and the job fails Stalled.
    (How far a fake got before the watchdog fired depends on the machine's load, so
    only the decisions are checked.)"""
    builder = make_job("j").ps(1).workers(1)
    builder.run_policy(stallTimeoutSeconds=2, backoffLimit=1)
    result, lines, _ = fake(builder, {"j-worker-0": {
        "hang": True, "events": [["progress", {"step": 3, "loss": 1.0}]]}})
    assert (result.summary["phase"], result.summary["reason"]) == ("Failed", "Stalled")
    assert result.summary["restarts"] == 1
    restarted = [line for line in lines if "restarting the workers and the chief" in line]
    assert len(restarted) == 1 and "stallTimeoutSeconds is 2" in restarted[0]
    assert any("backoffLimit is 1" in line for line in lines)
    assert not any(is_alive(p) for p in all_pids(result))


# --------------------------------------------------------------------------- the CLI


def run_cli(args, tmp_path, plan, **kwargs):
    env = {**os.environ, "FAKE_STATE_DIR": str(tmp_path), "FAKE_PLAN": json.dumps(plan)}
    return subprocess.Popen(
        [sys.executable, "-m", "pstrain_api.cli", "run", *args,
         "--replica-command", f"{sys.executable} {FAKE}"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs)


def test_cli_json_prints_exactly_one_line_on_stdout(tmp_path):
    job = make_job("j").ps(1).workers(2).write(tmp_path / "job.yaml")
    done = [["done", {"step": 100, "loss": 0.25, "accuracy": 0.96, "samples_per_sec": 50.0,
                      "wall_seconds": 0.5}]]
    proc = run_cli([str(job), "--json"], tmp_path, {"j-worker-0": {"events": done}})
    stdout, stderr = proc.communicate(timeout=90)
    assert proc.returncode == 0, stderr
    lines = stdout.splitlines()
    assert len(lines) == 1, stdout
    summary = json.loads(lines[0])
    assert {k: summary[k] for k in ("phase", "steps", "loss", "accuracy", "restarts",
                                    "lost_steps")} == {
        "phase": "Succeeded", "steps": 100, "loss": 0.25, "accuracy": 0.96, "restarts": 0,
        "lost_steps": 0}
    assert summary["wall_seconds"] > 0 and "samples_per_sec" in summary
    assert "[j-ps-0]     serving attempt 1" in stderr.splitlines()


def test_cli_invalid_manifest_prints_problems_without_traceback(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("apiVersion: pstrain.io/v1alpha1\nkind: TrainingJob\nmetadata:\n"
                   "  name: j\nspec:\n  replicas:\n    ps:\n      replicas: 0\n")
    proc = run_cli([str(bad)], tmp_path, {})
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 1
    assert "spec.replicas.ps.replicas is 0; it must be at least 1." in stderr
    assert "Traceback" not in stderr and stdout == ""


@pytest.mark.parametrize(("sig", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)],
                         ids=["ctrl-c", "sigterm"])
def test_cli_signal_stops_every_replica(tmp_path, sig, code):
    job = make_job("j").ps(1).workers(2).write(tmp_path / "job.yaml")
    proc = run_cli([str(job), "--json"], tmp_path,
                   {"j-worker-0": {"hang": True}, "j-worker-1": {"hang": True}})
    wait_until(lambda: len(read_starts(tmp_path)) == 3, 60, "three replicas to start")
    proc.send_signal(sig)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == code, stderr
    summary = json.loads(stdout)
    assert (summary["phase"], summary["reason"]) == ("Failed", "Interrupted")
    pids = [s["pid"] for s in read_starts(tmp_path)]
    assert not [p for p in pids if is_alive(p)], "replicas outlived the runner"


def test_replicas_die_with_a_killed_runner(tmp_path):
    job = make_job("j").ps(1).workers(2).write(tmp_path / "job.yaml")
    proc = run_cli([str(job)], tmp_path,
                   {"j-worker-0": {"hang": True}, "j-worker-1": {"hang": True}})
    wait_until(lambda: len(read_starts(tmp_path)) == 3, 60, "three replicas to start")
    proc.kill()
    proc.communicate(timeout=30)
    pids = [s["pid"] for s in read_starts(tmp_path)]
    wait_until(lambda: not any(is_alive(p) for p in pids), 10,
               "replicas to die with the runner (PR_SET_PDEATHSIG)")
    # SIGKILL gave the runner no chance to clean up: its keys are still on disk until
    # the next run removes them (`remove_stale`, as `pstrain run` does when it starts);
    # its checkpoint and last-words folders are only removed here.
    temp = Path(tempfile.gettempdir())
    (keys,) = [p for p in temp.iterdir() if p.name.startswith("pstrain-j-auth-")]
    assert [p.name for p in keys.iterdir() if p.is_dir()], "the run wrote no replica keys"
    assert remove_stale() == [keys] and not keys.exists()
    for left in temp.glob("pstrain-j-*"):
        shutil.rmtree(left)


def test_closed_output_pipe_stops_every_replica_quietly(tmp_path):
    """`pstrain run job.yaml | head`: once the reader is gone the runner stops the
    replicas and exits 141 (SIGPIPE's code) without a traceback."""
    job = make_job("j").ps(1).workers(2).write(tmp_path / "job.yaml")
    proc = run_cli([str(job)], tmp_path,
                   {"j-worker-0": {"hang": True}, "j-worker-1": {"hang": True}})
    proc.stdout.close()
    _, stderr = proc.communicate(timeout=90)
    assert proc.returncode == 141, stderr
    assert "Traceback" not in stderr
    pids = [s["pid"] for s in read_starts(tmp_path)]
    wait_until(lambda: not any(is_alive(p) for p in pids), 10, "replicas to stop")


def test_more_replicas_than_memory_holds_are_warned_about_first(fake, monkeypatch):
    from pstrain_runtime.local import runner

    monkeypatch.setattr(runner, "available_memory", lambda: 2**30)
    result, lines, _ = fake(make_job("j").ps(1).workers(4), {"*": {}})
    assert result.exit_code == 0
    warning = ("pstrain: warning: this job starts 5 processes of about 250 MB each (1.2 GiB) "
               "and this machine has 1.0 GiB available")
    (index,) = [i for i, line in enumerate(lines) if line.startswith(warning)]
    assert index < min(i for i, line in enumerate(lines) if line.startswith("pstrain: started"))


def test_ctrl_c_after_a_checkpoint_keeps_it_and_says_how_to_resume(tmp_path):
    """Issue "rough edges" 3: what happened, where the checkpoint is, the command."""
    job = make_job("j").ps(1).workers(2).write(tmp_path / "job.yaml")
    events = [["checkpoint", {"step": 30, "path": "ckpt-30.pt"}],
              ["progress", {"step": 37, "loss": 0.5, "samples_per_sec": 90.0}]]
    proc = run_cli([str(job), "--json"], tmp_path,
                   {"j-worker-0": {"hang": True, "events": events},
                    "j-worker-1": {"hang": True}})
    assert proc.stderr is not None
    for line in proc.stderr:  # the runner has read the progress line: stop it now
        if line.startswith("pstrain: step 37/100"):
            break
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=60)
    summary = json.loads(stdout)
    kept = summary["checkpoint_dir"]
    try:
        assert proc.returncode == 130, stderr
        assert kept.startswith(tempfile.gettempdir()) and Path(kept).is_dir()
        resume = f"pstrain run {job} --checkpoint-dir {kept}"
        assert (summary["stopped_by"], summary["resume"]) == ("SIGINT", resume)
        assert stderr.splitlines()[-4:] == [
            f"job j stopped by you (Ctrl-C) at step 37 of 100 after "
            f"{summary['wall_seconds']:.1f}s: loss 0.5000, accuracy -, 90 samples/s",
            "restarts: 0, steps lost to restores: 0",
            f"last checkpoint: step 30, in {kept}",
            f"resume with: {resume}"]
    finally:
        shutil.rmtree(kept, ignore_errors=True)


def test_a_job_that_cannot_scale_gets_no_scale_hint(fake):
    _, fixed, _ = fake(make_job("j").ps(1).workers(2, minReplicas=2, maxReplicas=2),
                       {"*": {}})
    _, free, _ = fake(make_job("j").ps(1).workers(2), {"*": {}})
    assert not [line for line in fixed if "pstrain scale" in line]
    assert ("pstrain: change the worker count while it runs (1 or more workers): pstrain "
            "scale j --replicas N") in free
