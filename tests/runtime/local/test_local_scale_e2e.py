"""End to end: `pstrain scale` against a real `pstrain run` of the digits task. One
async and one sync job are scaled 2 -> 4 -> 1 -> 3 while they train, at fixed global
steps (the chief's progress lines), each scale-up's newcomers joining before the next;
each finishes at exactly its target step (every step counted once) with the usual
accuracy, and no replica is restarted. In the async
run a scale beyond maxReplicas is refused in between, and a removed worker is SIGKILLed
during the scale-down: its exit is expected too."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

pytest.importorskip("torch")
pytest.importorskip("sklearn")

from pstrain_runtime.local.control import ENV_RUN_DIR, request_scale  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]
RUN_LIMIT = 300  # seconds; a hung run fails the test instead of hanging the suite
STARTED = re.compile(r"^pstrain: started (\S+) \(pid (\d+)")
PROGRESS = re.compile(r"^pstrain: step (\d+)/")  # the chief's progress, every second
JOINS = re.compile(r"pstrain: worker (\d+) joins at step (\d+)")

pytestmark = pytest.mark.timeout(RUN_LIMIT + 60)


def manifest(tmp_path: Path, name: str, mode: str, steps: int) -> Path:
    """examples/digits-elastic.yaml (2 workers, 1 to 4), renamed, `steps` long; the sync
    job with plain SGD, as examples/digits-sync.yaml trains."""
    job = yaml.safe_load((ROOT / "examples" / "digits-elastic.yaml").read_text())
    job["metadata"]["name"] = name
    training = job["spec"]["training"]
    training.update(steps=steps, mode=mode, evalIntervalSteps=steps,
                    checkpoint={"intervalSteps": steps})
    if mode == "sync":
        training["optimizer"] = {"name": "sgd", "learningRate": 0.5}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(job), encoding="utf-8")
    return path


class ScaledRun:
    """`pstrain run FILE --json` in a subprocess, and a thread that scales it at the
    given global steps (from the progress lines), SIGKILLing the named workers right after."""

    def __init__(self, path: Path, name: str, plan: list[tuple[int, int, tuple[str, ...]]],
                 run_dir: Path):
        self.name, self.plan, self.run_dir = name, plan, run_dir
        env = {**os.environ, ENV_RUN_DIR: str(run_dir)}  # the run's control socket is there
        self.lines: list[str] = []
        self.pids: dict[str, int] = {}
        self.answers: list[tuple[int, int, bool, str]] = []  # at step, replicas, ok, text
        self.step = 0
        self.joins: list[tuple[int, int]] = []  # (worker, step) as each trainer joined
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pstrain_api.cli", "run", str(path), "--json"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env)
        watchdog = threading.Timer(RUN_LIMIT, self.proc.kill)
        watchdog.start()
        self.driver_error: BaseException | None = None  # the scaling thread's, if it broke
        driver = threading.Thread(target=self._drive, daemon=True)
        driver.start()
        try:
            assert self.proc.stderr is not None and self.proc.stdout is not None
            for line in self.proc.stderr:
                line = line.rstrip("\n")
                self.lines.append(line)
                if (m := STARTED.match(line)):
                    self.pids[m.group(1)] = int(m.group(2))
                if (m := PROGRESS.match(line)):
                    self.step = int(m.group(1))
                if (m := JOINS.search(line)):
                    self.joins.append((int(m.group(1)), int(m.group(2))))
            self.stdout = self.proc.stdout.read()
            self.returncode = self.proc.wait()
        finally:
            watchdog.cancel()
        driver.join(30)

    def _drive(self) -> None:
        try:
            self._follow_plan()
        except BaseException as error:  # noqa: BLE001 - reported by the test, not lost
            self.driver_error = error

    def _follow_plan(self) -> None:
        deadline = time.monotonic() + RUN_LIMIT
        live = 2
        for at_step, replicas, kill in self.plan:
            while time.monotonic() < deadline and self.proc.poll() is None:
                if self.step >= at_step:
                    break
                time.sleep(0.05)
            else:
                return
            before = len(self.joins)
            answer = request_scale(self.name, replicas, directory=self.run_dir)
            self.answers.append((at_step, replicas, answer.ok, answer.message))
            for name in kill:
                pid = self.pids.get(name)
                # The scale-down may have stopped it already (then there is nothing to kill).
                with contextlib.suppress(ProcessLookupError):
                    if pid is not None:
                        os.kill(pid, signal.SIGKILL)
            if answer.ok and replicas > live:  # the newcomers join before the next change
                while (time.monotonic() < deadline and self.proc.poll() is None
                       and len(self.joins) - before < replicas - live):
                    time.sleep(0.05)
            if answer.ok:
                live = replicas

    @property
    def summary(self) -> dict:
        lines = self.stdout.splitlines()
        assert len(lines) == 1, f"expected one JSON line on stdout, got {self.stdout!r}"
        return json.loads(lines[0])


@pytest.mark.parametrize(("mode", "steps", "plan", "bar"), [
    ("async", 24000, [(2000, 4, ()), (2000, 9, ()), (6000, 1, ("e-async-worker-3",)),
                      (8000, 3, ())], 0.95),
    ("sync", 12000, [(300, 4, ()), (1500, 1, ()), (2500, 3, ())], 0.95),
])
def test_scale_2_4_1_3_while_training(tmp_path, mode, steps, plan, bar):
    name = f"e-{mode}"
    run = ScaledRun(manifest(tmp_path, name, mode, steps), name, plan, tmp_path / "run")
    output = "\n".join(run.lines[-60:])
    assert run.driver_error is None, f"the scaling thread broke: {run.driver_error!r}\n{output}"
    assert run.returncode == 0, f"pstrain run exited {run.returncode}:\n{output}"
    refused = [(r, text) for _, r, ok, text in run.answers if not ok]
    assert [(r, ok) for _, r, ok, _ in run.answers if ok] == [(4, True), (1, True),
                                                             (3, True)], output
    if mode == "async":  # beyond maxReplicas: refused in one line, nothing changed
        assert refused == [(9, "spec.replicas.worker.replicas is 9; it must be at most "
                               "maxReplicas")]
    else:
        assert refused == []
    text = "\n".join(run.lines)
    for change in ("WorkersScaledUp: workers 2 -> 4: adds worker 2, 3",
                   "WorkersScaledDown: workers 4 -> 1: removes worker 3, 2, 1",
                   "WorkersScaledUp: workers 1 -> 3: adds worker 1, 2"):
        assert change in text, output
    assert f"{name}-worker-3 stopped (scale-down" in text
    assert ", attempt" not in text  # a worker scaled back in is not a restart
    # The newcomers (2 and 3, then 1 and 2) were admitted by the runner's SetWorkers (with
    # the chief's key) and trained: a worker joins once it is in the set (or when the job
    # is done, at its last step).
    newcomers = run.joins[1:]  # after worker 1's first start
    assert len(newcomers) == 4 and all(step < steps for _, step in newcomers), (
        f"{run.joins}\n{output}")
    summary = run.summary
    assert summary["phase"] == "Succeeded"
    assert summary["steps"] == steps  # every applied step counted once, none beyond
    assert summary["restarts"] == 0  # nobody was restarted for a scale (nor the kill)
    assert all(r["restarts"] == 0 for r in summary["replicas"].values())
    assert summary["accuracy"] >= bar, output
