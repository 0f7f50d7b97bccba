"""Elastic workers (issue 14): training throughput before and after a scale-up, and the
time from the scale request to the first applied push of the new worker.

One parameter store in this process and real trainers (threads, LocalTransport) on the
digits task, async: one worker trains alone, then `set_workers` admits a second one and
its trainer starts. samples/s is counted from the store's applied steps (one batch
each) over a window before the request and a window after the newcomer's first push.
The time to first push includes building the newcomer's trainer (model, data) and its
first pull. On the 2-core development machine both trainers share the cores and the
GIL, so the after figure says what scaling costs here, not what a cluster gains.

Then the same with processes, as a user does it: `pstrain run` with the chief as the
only worker, `pstrain scale JOB --replicas 2` through the run's control socket, and the
newcomer in a process of its own (`_with_processes`).
"""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import yaml

from .core import Config, Figure

WINDOW_STEPS = 150  # applied steps per measurement window
BATCH = 64


def _once(steps_before: int) -> tuple[float, float, float]:
    from pstrain_api.model import Training
    from pstrain_runtime.examples.digits import make_task
    from pstrain_runtime.ps.store import ParameterStore
    from pstrain_runtime.worker.client import LocalTransport
    from pstrain_runtime.worker.context import WorkerRole
    from pstrain_runtime.worker.trainer import Trainer

    total = steps_before + 3 * WINDOW_STEPS
    training = Training(entrypoint="pstrain_runtime.examples.digits:make_task",
                        steps=total, batch_size=BATCH, mode="async")
    store = ParameterStore(max_wait=10)
    transports = [LocalTransport(store)]
    quiet: Any = lambda *a, **k: None  # noqa: E731
    trainers: list[Trainer] = []
    threads: list[threading.Thread] = []

    def start(worker: int, count: int) -> None:
        trainer = Trainer(training, WorkerRole("bench", worker, count), transports,
                          emit=quiet, progress_interval=60.0, task=make_task())
        trainers.append(trainer)
        thread = threading.Thread(target=trainer.run, daemon=True)
        threads.append(thread)
        thread.start()

    try:
        start(0, 1)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                ns = store.namespace("bench")
                break
            except Exception:  # noqa: BLE001 - not created yet
                time.sleep(0.01)
        else:
            raise RuntimeError("the chief did not initialise the store within 60 s")
        with ns.cond:
            ns.cond.wait_for(lambda: ns.global_step >= steps_before, timeout=60)
            t0, s0 = time.perf_counter(), ns.global_step
            ns.cond.wait_for(lambda: ns.global_step >= s0 + WINDOW_STEPS, timeout=60)
            t1, s1 = time.perf_counter(), ns.global_step
        before = (s1 - s0) * BATCH / (t1 - t0)
        asked = time.perf_counter()
        store.set_workers("bench", {0, 1})
        joined = ns.worker_pushes.get(1, 0)
        start(1, 2)
        with ns.cond:
            ns.cond.wait_for(lambda: ns.worker_pushes.get(1, 0) > joined or ns.done,
                             timeout=60)
            first_push = time.perf_counter() - asked
            t2, s2 = time.perf_counter(), ns.global_step
            ns.cond.wait_for(lambda: ns.global_step >= s2 + WINDOW_STEPS or ns.done,
                             timeout=60)
            t3, s3 = time.perf_counter(), ns.global_step
        after = (s3 - s2) * BATCH / (t3 - t2)
        for thread in threads:
            thread.join(60)
        return before, after, first_push
    finally:
        store.stop()
        for trainer in trainers:
            trainer.close()


PROGRESS = re.compile(r"^pstrain: step (\d+)/")
JOINS = re.compile(r"pstrain: worker 1 joins at step (\d+)")
WINDOW_LINES = 4  # progress lines (one a second) per measurement window


def _with_processes(tmp: Path, time_limit: float) -> tuple[float, float, float]:
    """`pstrain run` of digits (async) with the chief as its only worker; after a few
    progress lines `pstrain scale JOB --replicas 2` (the control socket) adds worker 1.
    samples/s from the chief's progress lines (steps between the first and the last line
    of a window, one batch a step); the time from the request to the newcomer's
    "joins at step" line, printed when it is admitted, just before its first pull and
    push: process start, imports, model and data included."""
    from pstrain_runtime.local.control import ENV_RUN_DIR, request_scale

    tmp.mkdir(parents=True, exist_ok=True)
    job = tmp / "elastic.yaml"
    job.write_text(yaml.safe_dump({
        "apiVersion": "pstrain.io/v1alpha1", "kind": "TrainingJob",
        "metadata": {"name": "bench-elastic"},
        "spec": {"replicas": {"ps": {"replicas": 1},
                              "worker": {"replicas": 1, "maxReplicas": 2}},
                 "training": {"entrypoint": "pstrain_runtime.examples.digits:make_task",
                              "steps": 10_000_000, "batchSize": BATCH, "mode": "async",
                              "optimizer": {"name": "sgd", "learningRate": 0.05},
                              "evalIntervalSteps": 10_000_000,
                              "checkpoint": {"intervalSteps": 10_000_000}}}}))
    env = {**os.environ, ENV_RUN_DIR: str(tmp / "run")}
    proc = subprocess.Popen([sys.executable, "-m", "pstrain_api.cli", "run", str(job)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env)
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout or ()],
                     daemon=True).start()
    deadline = time.monotonic() + time_limit

    def next_line() -> str:
        return lines.get(timeout=max(deadline - time.monotonic(), 0.01))

    def window() -> float:
        marks: list[tuple[float, int]] = []
        while len(marks) < WINDOW_LINES:
            m = PROGRESS.match(next_line())
            if m:
                marks.append((time.perf_counter(), int(m.group(1))))
        (t0, s0), (t1, s1) = marks[0], marks[-1]
        return (s1 - s0) * BATCH / (t1 - t0)

    try:
        before = window()
        asked = time.perf_counter()
        answer = request_scale("bench-elastic", 2, directory=tmp / "run")
        if not answer.ok:
            raise RuntimeError(f"pstrain scale was refused: {answer.message}")
        while not JOINS.search(next_line()):
            pass
        joined = time.perf_counter() - asked
        after = window()
        return before, after, joined
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def _figures(key: str, runs: list[tuple[float, float, float]], note: str,
             after: str, timed: tuple[str, str, str]) -> list[Figure]:
    """samples/s before and after the scale-up, and the time the scale took."""
    before_s, after_s, took = ([r[i] for r in runs] for i in range(3))
    timed_key, timed_label, timed_note = timed
    return [
        Figure.of(f"{key}.samples_per_s.before", "samples/s with 1 worker, before the "
                  "scale-up", "samples/s", before_s, note),
        Figure.of(f"{key}.samples_per_s.after", f"samples/s with 2 workers, {after}",
                  "samples/s", after_s, note),
        Figure.of(f"{key}.{timed_key}", timed_label, "s", took, timed_note),
    ]


def run(cfg: Config) -> list[Figure]:
    runs = [_once(50 if cfg.quick else 100) for _ in range(1 if cfg.quick else cfg.repeats)]
    figures = _figures(
        "elastic", runs, "digits, async, 1 -> 2 trainers in one process (shared cores and "
        "GIL)", "after the newcomer's first push",
        ("first_push_s", "scale request to the new worker's first applied push",
         "includes building its trainer and its first pull"))
    with tempfile.TemporaryDirectory(prefix="pstrain-bench-elastic-") as tmp:
        procs = [_with_processes(Path(tmp) / str(i), cfg.item_time_limit_s / 4)
                 for i in range(1 if cfg.quick else 3)]
    return figures + _figures(
        "elastic.local", procs, "digits, async, `pstrain run` processes: the chief alone, "
        "then `pstrain scale --replicas 2`", "after the newcomer joined",
        ("join_s", "pstrain scale to the new worker's join (just before its first push)",
         "a new process: Python, torch, the model and the data"))
