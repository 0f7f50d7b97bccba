"""The trainer's CUDA path: the model, its batches and its gradients on the GPU, the
parameters pulled into and the gradients pushed from pinned host buffers. A job trained
on CUDA ends where the same job trained on the CPU ends: dense (sync, async, async
pipelined) and sparse (rows pulled to the GPU, their gradients pushed from it).

Skipped without a GPU (CI has none): `bench/cuda_check.sh` runs it on a machine that
has one, with the other trainer tests (which then pick CUDA by themselves)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from pstrain_runtime.examples.digits import make_task as digits_task
from pstrain_runtime.ps.store import ParameterStore
from pstrain_runtime.task import Task
from pstrain_runtime.worker.client import LocalTransport
from pstrain_runtime.worker.context import WorkerRole
from pstrain_runtime.worker.trainer import Trainer

from . import sparse_tasks
from .builders import Events, digits_training, run_chief, training

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
              pytest.mark.timeout(180)]
# float32 on two devices: matrix products sum in another order, so the runs agree to
# rounding, not bit for bit (TF32 stays off: torch's default for float32 products).
TOLERANCE = {"rtol": 1e-4, "atol": 1e-5}


def train(job: Any, device: str, make: Callable[[], Task], num_ps: int = 2) -> Trainer:
    transports = [LocalTransport(ParameterStore(i)) for i in range(num_ps)]
    chief = Trainer(job, WorkerRole("ns", 0, 1), transports, emit=Events(),
                    device=torch.device(device), task=make())
    assert chief.device.type == device
    assert next(chief.ctx.model.parameters()).device.type == device
    run_chief(chief, limit=120.0)
    return chief


@pytest.mark.parametrize(("mode", "pipeline"), [("sync", False), ("async", False),
                                                ("async", True)],
                         ids=["sync", "async", "async-pipeline"])
def test_a_dense_job_on_cuda_ends_where_the_cpu_job_ends(mode: str, pipeline: bool) -> None:
    job = digits_training(steps=40, batchSize=32, mode=mode, pipeline=pipeline,
                          optimizer={"name": "adam", "learningRate": 0.01})
    on_cpu = train(job, "cpu", digits_task)
    on_gpu = train(job, "cuda", digits_task)
    assert on_gpu.pipeline is pipeline
    for name, value in on_cpu.mirror.items():
        torch.testing.assert_close(on_gpu.mirror[name], value, **TOLERANCE)
    # What the transport reads and writes on CUDA: pinned host buffers.
    assert all(t.device.type == "cpu" and t.is_pinned() for t in on_gpu.mirror.values())


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_sparse_job_on_cuda_ends_where_the_cpu_job_ends(mode: str) -> None:
    job = training(steps=12, batchSize=16, mode=mode, seed=3,
                   optimizer={"name": "adagrad", "learningRate": 0.1})
    on_cpu = train(job, "cpu", sparse_tasks.make_task)
    on_gpu = train(job, "cuda", sparse_tasks.make_task)
    for name, value in on_cpu.mirror.items():
        torch.testing.assert_close(on_gpu.mirror[name], value, **TOLERANCE)
    ids = {"items": torch.arange(sparse_tasks.ITEMS), "tags": sparse_tasks.all_tag_ids()}
    for table, rows in ids.items():
        torch.testing.assert_close(sparse_tasks.table_rows(on_gpu, table, rows),
                                   sparse_tasks.table_rows(on_cpu, table, rows), **TOLERANCE)

