"""End to end with real processes: `pstrain replica` for every replica on loopback.

The one real path: parameter servers, workers and the chief as separate processes
talking gRPC, every replica exiting 0; then a worker and a parameter server killed
mid-training and restarted at the same address, with training still finishing.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.api.job_builder import job

from .builders import ProcessJob

pytestmark = pytest.mark.timeout(240)


def digits_job(name: str, steps: int, mode: str = "async", ps: int = 1, workers: int = 2,
               **training: object) -> dict:
    return (job(name).ps(ps).workers(workers)
            .training(entrypoint="pstrain_runtime.examples.digits:make_task", steps=steps,
                      batchSize=64, mode=mode,
                      optimizer={"name": "momentum", "learningRate": 0.05, "momentum": 0.9},
                      **training)
            .build())


def test_job_finishes_and_every_replica_exits_0() -> None:
    # 450 async steps with momentum: >= 0.9 even when load makes one worker much slower
    # than the other (300 steps reached 0.88 once on a machine at load average 10).
    run = ProcessJob(digits_job("e2e", steps=450, ps=2, workers=2))
    try:
        run.start()
        done = run.chief.wait_event(lambda e: e["event"] == "done", timeout=150)
        codes = run.wait_all(timeout=60)
    finally:
        run.stop_all()
    assert codes == {name: 0 for name in codes}
    assert done["step"] == 450  # servers apply nothing past the target
    assert done["accuracy"] >= 0.9
    assert any(e for e in [run.ps(0).lines, run.ps(1).lines] if any("ready" in x for x in e))


def test_killed_worker_is_restarted_and_training_finishes(tmp_path: Path) -> None:
    # Paced (10 ms a batch, so 600 sync steps take 6 s or more): plain digits finished
    # all 600 in 0.97 s on a fast CI machine, before the progress event at step >= 50.
    spec = digits_job("wkill", steps=600, mode="sync", checkpoint={"intervalSteps": 100})
    spec["spec"]["training"]["entrypoint"] = "tests.runtime.entrypoints.paced:make_task"
    run = ProcessJob(spec, tmp_path)
    try:
        run.start()
        run.chief.wait_event(lambda e: e["event"] == "progress" and e["step"] >= 50,
                             timeout=150)
        run.worker(1).kill()
        run.worker(1).start()  # the runner/operator restarts it, same env
        done = run.chief.wait_event(lambda e: e["event"] == "done", timeout=180)
        codes = run.wait_all(timeout=60)
    finally:
        run.stop_all()
    assert done["step"] == 600  # sync: exact
    assert set(codes.values()) == {0}
    joins = [int(line.rsplit(" ", 1)[1]) for line in run.worker(1).lines
             if line.startswith("pstrain: worker 1 joins at step ")]
    assert len(joins) == 2 and joins[1] >= 50  # killed and rejoined mid-training


def test_killed_ps_restores_from_checkpoint_and_reports_lost_steps(tmp_path: Path) -> None:
    run = ProcessJob(digits_job("pskill", steps=1500, checkpoint={"intervalSteps": 50}),
                     tmp_path)
    ended = run.kill_ps_after_checkpoint(0, step=100)
    restored, done, codes = ended["restored"], ended["done"], ended["codes"]
    assert restored["step"] >= ended["checkpoint"]["step"]
    assert restored["lost_steps"] >= 0
    assert restored["path"].endswith(f"ckpt-{restored['step']:012d}.pt")
    assert done["step"] == 1500
    assert done["accuracy"] >= 0.9
    assert set(codes.values()) == {0}
