"""Elastic workers (issue 14): training throughput before and after a scale-up, and the
time from the scale request to the first applied push of the new worker.

One parameter store in this process and real trainers (threads, LocalTransport) on the
digits task, async: one worker trains alone, then `set_workers` admits a second one and
its trainer starts. samples/s is counted from the store's applied steps (one batch
each) over a window before the request and a window after the newcomer's first push.
The time to first push includes building the newcomer's trainer (model, data) and its
first pull. On the 2-core development machine both trainers share the cores and the
GIL, so the after figure says what scaling costs here, not what a cluster gains.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from .core import Config, Figure

WINDOW_STEPS = 150  # applied steps per measurement window
BATCH = 64


def _once(steps_before: int) -> tuple[float, float, float]:
    from pstrain_api.model import Training
    from pstrain_runtime.client import LocalTransport
    from pstrain_runtime.examples.digits import make_task
    from pstrain_runtime.store import ParameterStore
    from pstrain_runtime.trainer import Trainer, WorkerRole

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


def run(cfg: Config) -> list[Figure]:
    runs = [_once(50 if cfg.quick else 100) for _ in range(1 if cfg.quick else cfg.repeats)]
    before, after, first = ([r[i] for r in runs] for i in range(3))
    note = "digits, async, 1 -> 2 trainers in one process (shared cores and GIL)"
    return [
        Figure.of("elastic.samples_per_s.before", "samples/s with 1 worker, before the "
                  "scale-up", "samples/s", before, note),
        Figure.of("elastic.samples_per_s.after", "samples/s with 2 workers, after the "
                  "newcomer's first push", "samples/s", after, note),
        Figure.of("elastic.first_push_s", "scale request to the new worker's first "
                  "applied push", "s", first, "includes building its trainer and its "
                  "first pull"),
    ]
