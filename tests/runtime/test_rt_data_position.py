"""Where each worker is in its data is part of the job's state: the parameter servers
keep it, checkpoints save it, and a worker that starts opens its `batches` where it
left off, instead of reading the early batches again."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest
import torch

from pstrain_runtime.checkpoint import (
    Checkpoint,
    CheckpointError,
    CheckpointStore,
    load_checkpoint,
)
from pstrain_runtime.examples import digits
from pstrain_runtime.optim import OptimizerConfig
from pstrain_runtime.ps.server import PSServer
from pstrain_runtime.ps.store import ParameterStore
from pstrain_runtime.task import Task, open_batches
from pstrain_runtime.worker.client import LocalTransport, ShardedClient, connect
from pstrain_runtime.worker.context import WorkerRole
from pstrain_runtime.worker.placement import build_placement, param_specs
from pstrain_runtime.worker.trainer import Trainer

from .builders import digits_training, run_chief
from .test_rt_store import good_grads, push_frames, ready_store

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(autouse=True)
def one_thread() -> None:
    torch.set_num_threads(1)


# --------------------------------------------------------------------------- the contract


def counting(takes_start: bool, length: int | None = None) -> Task:
    """A task whose batches are (index, index): which batch came is plain to see."""
    def stream(start: int) -> Any:
        for i in itertools.count(start) if length is None else range(start, length):
            yield torch.tensor([float(i)]), torch.tensor([i])

    if takes_start:
        def batches(worker: int, num_workers: int, batch_size: int, seed: int,
                    start: int = 0) -> Any:
            return stream(start)
    else:
        def batches(worker: int, num_workers: int, batch_size: int, seed: int) -> Any:
            return stream(0)
    return Task(model=torch.nn.Linear(1, 1), batches=batches, loss=torch.nn.MSELoss(),
                evaluate=lambda model: {})


@pytest.mark.parametrize("takes_start", [True, False], ids=["takes-start", "old-signature"])
def test_open_batches_resumes_at_start(takes_start, capsys) -> None:
    stream = open_batches(counting(takes_start), 0, 1, 1, 0, start=7)
    assert [int(next(stream)[1]) for _ in range(3)] == [7, 8, 9]
    dropped = "drawing and dropping 7 batches" in capsys.readouterr().out
    assert dropped is not takes_start


def test_open_batches_refuses_a_stream_too_short_to_resume() -> None:
    with pytest.raises(ValueError, match="batches\\(\\) ran out after 4 batches while "
                                         "resuming at batch 9"):
        open_batches(counting(False, length=4), 0, 1, 1, 0, start=9)


@pytest.mark.parametrize(("num_workers", "batch_size"), [(1, 64), (3, 7), (2, 1000)])
@pytest.mark.parametrize("start", [1, 5, 17, 40])
def test_the_digits_example_resumes_without_replaying(num_workers, batch_size, start) -> None:
    x, y = torch.arange(300.0).unsqueeze(1), torch.arange(300)
    whole = list(itertools.islice(digits.batches(x, y, 1, num_workers, batch_size, 3), 60))
    resumed = list(itertools.islice(
        digits.batches(x, y, 1, num_workers, batch_size, 3, start=start), 60 - start))
    assert [b[1].tolist() for b in resumed] == [b[1].tolist() for b in whole[start:]]


# --------------------------------------------------------------------------- the servers


def test_async_server_keeps_each_workers_position_from_its_pushes() -> None:
    store, client = ready_store(num_workers=2)
    store.push(iter(push_frames(good_grads(), worker=1, step=41)))
    assert store.info("ns", 1).position == 42
    assert store.info("ns", 0).position == 0
    state = client.pull_state()
    assert state.positions == [0, 42]


def test_a_checkpoints_positions_are_installed_by_init() -> None:
    store, client = ready_store(num_workers=2)
    client.init({n: t for n, t in store.namespace("ns").params.items()},
                store.namespace("ns").config, mode="async", num_workers=2,
                staleness_bound=None, fingerprint="ab" * 32, positions=[5, 9])
    assert [store.info("ns", w).position for w in (0, 1)] == [5, 9]


def test_in_sync_mode_the_global_step_is_every_workers_position() -> None:
    store, client = ready_store(mode="sync")
    store.push(iter(push_frames(good_grads(), step=0)))
    store.push(iter(push_frames(good_grads(), step=1)))
    assert store.info("ns", 0).position == 2
    assert client.pull_state().positions == [2]


# --------------------------------------------------------------------------- checkpoints


def test_positions_round_trip_and_older_files_still_load(tmp_path: Path) -> None:
    ckpt = Checkpoint(global_step=3, fingerprint="f", optimizer="sgd",
                      params={"w": torch.zeros(2)}, positions=[3, 4])
    path = CheckpointStore(tmp_path).save(ckpt)
    assert load_checkpoint(path).positions == [3, 4]
    data = ckpt.to_dict()
    del data["positions"]  # as written before positions existed
    assert Checkpoint.from_dict(data, "old.pt").positions == []
    with pytest.raises(CheckpointError, match="positions holds -1"):
        Checkpoint.from_dict({**data, "positions": [-1]}, "bad.pt")


class Recording:
    """The digits task, recording the `start` each opening of `batches` asked for."""

    def __init__(self) -> None:
        self.task = digits.make_task()
        self.starts: list[int] = []
        inner = self.task.batches

        def batches(w: int, n: int, b: int, s: int, start: int = 0) -> Any:
            self.starts.append(start)
            return inner(w, n, b, s, start=start)

        self.task.batches = batches


def chief_of(training, store: ParameterStore, task: Task) -> Trainer:
    chief = Trainer(training, WorkerRole("ns", 0, 1), [LocalTransport(store)], task=task,
                    emit=lambda *a, **k: None)
    run_chief(chief)
    return chief


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_a_restored_job_continues_its_data_where_it_left_off(tmp_path: Path, mode) -> None:
    training = digits_training(steps=30, mode=mode, batchSize=32,
                               checkpoint={"directory": str(tmp_path), "intervalSteps": 100})
    first = Recording()
    chief_of(training, ParameterStore(), first.task)
    assert first.starts == [0]
    assert load_checkpoint(CheckpointStore(tmp_path).path_for(30)).positions == [30]

    second = Recording()
    chief = chief_of(training.model_copy(update={"steps": 40}), ParameterStore(),
                      second.task)
    assert second.starts == [30]  # not 0: the first 30 batches are not read again
    assert chief.position == 40


def test_positions_travel_over_the_real_transports() -> None:
    """Init, push, Info and the checkpoint pull carry positions over gRPC and the TCP data
    plane, as between processes."""
    server = PSServer("127.0.0.1:0", ps_index=0)
    server.start()
    try:
        shapes = {"w": (3, 4)}
        placement = build_placement(param_specs(shapes), 1)
        clients = [ShardedClient([connect(server.address, transport)], placement, "ns")
                   for transport in ("grpc", "tcp")]
        clients[0].init({"w": torch.zeros(3, 4)}, OptimizerConfig(name="sgd"), mode="async",
                        num_workers=2, staleness_bound=None, fingerprint="12" * 32,
                        positions=[3, 7])
        assert [clients[1].info(0, w).position for w in (0, 1)] == [3, 7]
        for client, step in zip(clients, (7, 8), strict=True):
            client.push({"w": torch.ones(3, 4)}, worker=1, step=step)
        assert clients[0].info(0, 1).position == 9
        assert clients[1].pull_state().positions == [3, 9]
        for client in clients:
            client.close()
    finally:
        server.stop(0)


def test_a_checkpoint_at_a_kept_step_has_the_positions_of_that_step() -> None:
    """The servers keep a copy of their shard at each checkpoint step; the positions in
    a checkpoint read from that copy are those of that step, not of now."""
    store, client = ready_store()
    ns = store.namespace("ns")
    client.init(dict(ns.params), ns.config, mode="async", num_workers=1,
                staleness_bound=None, fingerprint="ab" * 32, checkpoint_every=2)
    for step in range(3):
        store.push(iter(push_frames(good_grads(), step=step)))
    assert store.info("ns", 0).position == 3
    assert client.pull_state(2).positions == [2]
    assert client.pull_state().positions == [3]
