"""`pstrain run` with programs of the user's own (the TF_CONFIG contract alone): the
readiness check fits the program, and servers that never exit are stopped when the
chief succeeds."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from pstrain_api import constants as c
from pstrain_runtime.local.processes import wait_listening
from pstrain_runtime.local.supervisor import (
    Begin, Exited, Finish, Healthy, Notify, Settings, Terminate, Tick, decide, initial_state)

from .local_builders import make_job, play, spec_of, starts, without_notices

ROOT = Path(__file__).resolve().parents[3]
EXAMPLE = ROOT / "examples" / "tf-config-program.yaml"
TF = ["python", "-m", "pstrain_runtime.examples.tf_config_program"]
PS, W1, CHIEF = "j-ps-0", "j-worker-1", "j-worker-0"


def state_for(builder, **settings):
    job = builder.model()
    return initial_state(spec_of(job), Settings(policy=job.spec.run_policy, **settings), job)


def user_program(readiness: str | None = None):
    builder = make_job().ps(1, **({"readiness": readiness} if readiness else {}))
    for role in ("ps", "worker"):
        builder.template(role, command=TF)
    return builder


@pytest.mark.timeout(10)
def test_a_ps_without_gate_lets_workers_start_at_once() -> None:
    state, actions = play(state_for(user_program("None")), [Begin(0.0)])
    assert starts(actions) == [(PS, 1), (W1, 1), (CHIEF, 1)]
    assert (state.phase, state.stage) == ("Running", "running")


@pytest.mark.timeout(10)
def test_a_user_program_is_held_to_a_tcp_check() -> None:
    state = state_for(user_program(), health_timeout=5.0)
    assert state.replica(PS).check == c.GATE_TCP
    state, actions = play(state, [Begin(0.0), Tick(5.0)])
    assert (state.phase, state.reason) == ("Failed", "ParameterServerNotServing")
    assert actions[-2] == Notify("error", "j-ps-0 did not accept TCP connections on "
                                 "127.0.0.1:20000 within 5s.", replica=PS)


@pytest.mark.timeout(10)
def test_servers_are_stopped_when_the_chief_succeeds() -> None:
    state = state_for(user_program(), success_grace=20.0, kill_grace=3.0)
    state, _ = play(state, [Begin(0.0), Healthy(PS, 1, 1.0)])
    state, actions = decide(state, Exited(CHIEF, 1, 0, 2.0))
    assert without_notices(actions) == [Terminate((PS, W1))]
    assert (state.phase, state.stage, state.kill_at) == ("Succeeded", "stopping", 5.0)
    state, _ = decide(state, Exited(PS, 1, 143, 2.1))
    state, actions = decide(state, Exited(W1, 1, 143, 2.2))
    assert actions == [Finish("Succeeded", "ChiefSucceeded",
                              "the chief finished training and exited 0.")]


@pytest.mark.timeout(10)
def test_runtime_replicas_still_get_the_grace_to_exit() -> None:
    """Only the user's servers are stopped at once; the runtime's workers drain."""
    builder = make_job().ps(1).template("ps", command=TF)
    state = state_for(builder, success_grace=20.0)
    state, _ = play(state, [Begin(0.0), Healthy(PS, 1, 1.0)])
    state, actions = decide(state, Exited(CHIEF, 1, 0, 2.0))
    assert without_notices(actions) == [Terminate((PS,))]
    assert (state.stage, state.drain_until) == ("draining", 22.0)


@pytest.mark.timeout(10)
def test_wait_listening() -> None:
    stop = threading.Event()
    with socket.create_server(("127.0.0.1", 0)) as server:
        address = f"127.0.0.1:{server.getsockname()[1]}"
        assert wait_listening(address, stop, 0.01)
    threading.Timer(0.2, stop.set).start()
    assert not wait_listening(address, stop, 0.01)  # closed port: until stopped


@pytest.mark.timeout(60)
def test_pstrain_run_runs_a_tf_config_program() -> None:
    """The example end to end: PS and workers serve until stopped, the chief trains and
    exits 0, and the job succeeds."""
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    proc = subprocess.run(
        [sys.executable, "-m", "pstrain_api.cli", "run", str(EXAMPLE), "--json",
         "--timeout", "40"],
        capture_output=True, text=True, cwd=ROOT, env=env, timeout=50, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout)
    assert (summary["phase"], summary["reason"]) == ("Succeeded", "ChiefSucceeded")
    codes = {name: r["exit_code"] for name, r in summary["replicas"].items()}
    assert codes["tf-config-program-chief-0"] == 0
    # The servers never exit by themselves: they were stopped (SIGTERM).
    assert {codes[f"tf-config-program-{n}"] for n in ("ps-0", "ps-1", "worker-0",
                                                      "worker-1")} == {143}
    assert "trained 200 steps; parameter server totals [100, 100]" in proc.stderr
    assert "did not exit within" not in proc.stderr  # stopped at once, not after a grace
    # Honest: pstrain counts no steps of a program of its own, and it cannot be scaled.
    assert (summary["steps"], summary["total_steps"]) == (None, None)
    assert "pstrain does not count the steps of this job's own program" in proc.stderr
    assert "pstrain scale" not in proc.stderr
