"""Sparse pushes are fenced out as dense pushes are: a worker's rows computed on
another generation of the namespace (the chief initialised it again since the worker
pulled, as a restore does) or pushed by a worker removed by SetWorkers are refused and
change no row; a push of the current generation, or of a client that sends none, is
taken."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

from pstrain_runtime.optim import OptimizerConfig
from pstrain_runtime.ps.store import ParameterStore, PSError
from pstrain_runtime.sparse.client import SparseClient
from pstrain_runtime.sparse.protocol import encode, header_of
from pstrain_runtime.sparse.spec import TableSpec
from pstrain_runtime.worker.client import LocalTransport, ShardedClient
from pstrain_runtime.worker.placement import build_placement, param_specs

pytestmark = pytest.mark.timeout(60)

SGD = OptimizerConfig(name="sgd", learning_rate=0.5)
SPEC = TableSpec(name="items", num_embeddings=40, embedding_dim=4, init_std=0.1,
                 optimizer=SGD)
FP = "cd" * 32
IDS = torch.tensor([1, 7, 30])


@dataclass
class Job:
    """One parameter server holding a dense shard and the `items` table, its chief's
    dense client, and worker 1's sparse client."""

    store: ParameterStore
    chief: ShardedClient
    worker: SparseClient
    mode: str

    def init(self) -> None:
        params = {"w": torch.zeros(3, 4)}
        self.chief.init(params, SGD, mode=self.mode, num_workers=2, staleness_bound=None,
                        fingerprint=FP)

    def rows(self) -> torch.Tensor:
        return self.store.namespace("ns").sparse.tables["items"].read(IDS).clone()

    def pending(self) -> int:
        return sum(len(parts) for parts in self.store.namespace("ns").sparse.pending.values())


def make_job(mode: str) -> Job:
    store = ParameterStore()
    placement = build_placement(param_specs({"w": torch.Size([3, 4])}), 1)
    chief = ShardedClient([LocalTransport(store)], placement, "ns")
    SparseClient([LocalTransport(store)], "ns").configure([SPEC], reset=True)
    job = Job(store, chief, SparseClient([LocalTransport(store)], "ns"), mode)
    job.init()
    job.worker.pull(SPEC, IDS)  # the rows worker 1 computes its gradients on
    return job


def push(job: Job) -> dict:
    return job.worker.push({"items": (IDS, torch.ones(len(IDS), 4))}, worker=1,
                           steps=[0])[0]


FENCES: dict[str, tuple[Callable[[Job], object], str, str]] = {
    "initialised-again-since-the-pull": (Job.init, "ABORTED",
                                         "computed on parameters of generation"),
    "removed-by-set-workers": (lambda job: job.store.set_workers("ns", [0]),
                               "INVALID_ARGUMENT", "this job's workers are 0"),
}


@pytest.mark.parametrize("mode", ["async", "sync"])
@pytest.mark.parametrize("fence", list(FENCES))
def test_a_fenced_out_worker_writes_no_row(fence: str, mode: str) -> None:
    job = make_job(mode)
    before = job.rows()
    fence_out, code, message = FENCES[fence]
    fence_out(job)
    with pytest.raises(PSError, match=message) as info:
        push(job)
    assert info.value.code == code
    assert torch.equal(job.rows(), before)
    assert job.pending() == 0  # sync: nothing waits for its step either


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_a_push_of_the_current_generation_is_taken(mode: str) -> None:
    job = make_job(mode)
    before = job.rows()
    assert job.worker.generations == [job.store.namespace("ns").generation]
    assert push(job)["applied"] is True
    if mode == "async":
        assert not torch.equal(job.rows(), before)
    else:
        assert job.pending() == 1  # applied with its step's dense bucket


def test_a_push_without_a_generation_is_taken_as_before() -> None:
    job = make_job("async")
    before = job.rows()
    frames = encode({"op": "push", "namespace": "ns", "worker": 1, "step": 0,
                     "tables": [{"name": "items", "count": len(IDS)}]},
                    [IDS, torch.ones(len(IDS), 4)])
    assert header_of(LocalTransport(job.store).sparse(frames))["applied"] is True
    assert not torch.equal(job.rows(), before)
