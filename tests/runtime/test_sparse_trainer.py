"""Sparse tables through the real training loop and parameter-server stores: one
worker equals a plain PyTorch loop with nn.Embedding(sparse=True), in both modes and
over one or two servers; two workers train; bad pushes are refused on the server."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from pstrain_runtime.optim import OptimizerConfig, torch_optimizer
from pstrain_runtime.ps.server import PSServer
from pstrain_runtime.ps.store import ParameterStore, PSError
from pstrain_runtime.sparse import SparseEmbeddingCollection
from pstrain_runtime.sparse.client import RemoteSource, SparseClient
from pstrain_runtime.sparse.protocol import encode
from pstrain_runtime.status_client import status_to_dict
from pstrain_runtime.worker.client import LocalTransport, connect
from pstrain_runtime.worker.context import WorkerRole
from pstrain_runtime.worker.trainer import Trainer

from . import sparse_tasks
from .builders import training

pytestmark = pytest.mark.timeout(120)
STEPS, BATCH = 12, 16


@pytest.fixture(autouse=True)
def one_thread() -> None:
    torch.set_num_threads(1)


def run(job, transports, num_workers: int = 1, **kw: Any) -> list[Trainer]:
    return sparse_tasks.run_job(job, transports, num_workers, **kw)


def reference(config: OptimizerConfig, steps: int, seed: int,
              num_workers: int = 1) -> sparse_tasks.Net:
    """The plain loop; with several workers, each step's gradient is the mean of the
    workers' gradients (what sync mode computes)."""
    model = sparse_tasks.Net(reference=True, tag_ids=sparse_tasks.all_tag_ids(), seed=seed)
    opt = torch_optimizer(config, list(model.parameters()))
    data = [sparse_tasks.batches(w, num_workers, BATCH, seed) for w in range(num_workers)]
    for _ in range(steps):
        opt.zero_grad()
        losses = [sparse_tasks.loss(model(x), y) for x, y in (next(d) for d in data)]
        (sum(losses) / num_workers).backward()
        # torch.optim builds sparse tensors from the sparse gradients: say that their
        # invariants are checked (left unsaid, torch warns once per process).
        with torch.sparse.check_sparse_tensor_invariants():
            opt.step()
    return model


@pytest.mark.parametrize("optimizer", [{"name": "sgd", "learningRate": 0.1},
                                       {"name": "adagrad", "learningRate": 0.1}],
                         ids=lambda o: o["name"])
@pytest.mark.parametrize(("mode", "num_ps"), [("sync", 1), ("sync", 2), ("async", 2)])
def test_one_worker_equals_plain_pytorch_with_sparse_embeddings(optimizer, mode, num_ps) -> None:
    job = training(steps=STEPS, batchSize=BATCH, mode=mode, optimizer=optimizer, seed=3)
    chief = run(job, [LocalTransport(ParameterStore(i)) for i in range(num_ps)])[0]
    ref = reference(OptimizerConfig.from_model(job.optimizer), STEPS, seed=3)
    for name, value in ref.head.named_parameters():
        torch.testing.assert_close(chief.mirror[f"head.{name}"], value.detach(),
                                   rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(sparse_tasks.table_rows(chief, "items", torch.arange(sparse_tasks.ITEMS)),
                               ref.items.weight.detach(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(sparse_tasks.table_rows(chief, "tags", sparse_tasks.all_tag_ids()),
                               ref.tags.weight.detach(), rtol=1e-6, atol=1e-6)


def test_sync_mode_applies_the_mean_of_the_workers_rows() -> None:
    job = training(steps=STEPS, batchSize=BATCH, mode="sync", seed=3,
                   optimizer={"name": "sgd", "learningRate": 0.1})
    chief = run(job, [LocalTransport(ParameterStore(i)) for i in range(2)], num_workers=2)[0]
    ref = reference(OptimizerConfig.from_model(job.optimizer), STEPS, seed=3, num_workers=2)
    torch.testing.assert_close(sparse_tasks.table_rows(chief, "items", torch.arange(sparse_tasks.ITEMS)),
                               ref.items.weight.detach(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(sparse_tasks.table_rows(chief, "tags", sparse_tasks.all_tag_ids()),
                               ref.tags.weight.detach(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_two_workers_train_sparse_tables_over_two_servers(mode: str) -> None:
    job = training(steps=30, batchSize=BATCH, mode=mode,
                   optimizer={"name": "adagrad", "learningRate": 0.1}, stalenessBound=1)
    stores = [ParameterStore(i) for i in range(2)]
    events = sparse_tasks.Events()
    run(job, [LocalTransport(s) for s in stores], num_workers=2, emit=events)
    assert stores[0].info("ns").global_step == 30
    done = events.of("done")[0]  # the chief reports the tables' size
    assert done["sparse_tables"]["items"]["rows"] == sparse_tasks.ITEMS // 4
    assert done["sparse_rows"] == sum(t["rows"] for t in done["sparse_tables"].values())
    assert done["sparse_bytes"] > done["sparse_rows"] * 4 * (sparse_tasks.TAG_DIM * 2)
    assert all("sparse_rows" in e for e in events.of("progress"))
    status = status_to_dict(stores[0].job_status("ns"))  # what the operator reads
    assert (status["sparse_rows"], status["sparse_bytes"]) == (done["sparse_rows"],
                                                               done["sparse_bytes"])
    stats = SparseClient([LocalTransport(s) for s in stores], "ns").stats()
    assert stats["items"]["rows"] == sparse_tasks.ITEMS // 4  # only touched ids have rows
    assert stats["tags"]["rows"] == len(sparse_tasks.all_tag_ids())
    assert all(s.namespace("ns").sparse.tables["items"].stats().rows > 0 for s in stores)


def installed_client(num_ps: int = 1) -> tuple[SparseClient, list[ParameterStore], Trainer]:
    job = training(steps=1, batchSize=4, mode="async", optimizer={"name": "sgd"})
    stores = [ParameterStore(i) for i in range(num_ps)]
    chief = run(job, [LocalTransport(s) for s in stores])[0]
    return chief.sparse.client, stores, chief


def push_frames(table: str, ids: torch.Tensor, rows: torch.Tensor) -> list[bytes]:
    return encode({"op": "push", "namespace": "ns", "worker": 0, "step": 0,
                   "tables": [{"name": table, "count": int(ids.numel())}]}, [ids, rows])


@pytest.mark.parametrize(("table", "ids", "rows", "code", "message"), [
    ("items", torch.tensor([3, 40]), torch.ones(2, 8), "INVALID_ARGUMENT", "0..39"),
    ("items", torch.tensor([-2, 3]), torch.ones(2, 8), "INVALID_ARGUMENT", ">= 0"),
    ("items", torch.tensor([3, 4]), torch.ones(2, 5), "INVALID_ARGUMENT", "8 values"),
    ("items", torch.tensor([3, 4]), torch.full((2, 8), float("nan")), "INVALID_ARGUMENT",
     "NaN"),
    ("nope", torch.tensor([3]), torch.ones(1, 8), "NOT_FOUND", "not defined"),
], ids=["out-of-range", "negative", "wrong-width", "nan", "unknown-table"])
def test_the_server_refuses_bad_pushes_and_keeps_the_table(table, ids, rows, code,
                                                           message) -> None:
    client, stores, chief = installed_client()
    client = SparseClient(client.transports, "ns")
    tables = stores[0].namespace("ns").sparse.tables
    before = {name: t.read(torch.arange(40)).clone() for name, t in tables.items()}
    counts = {name: t.stats().rows for name, t in tables.items()}
    # one good table and one bad one in the same push: nothing is applied
    frames = encode({"op": "push", "namespace": "ns", "worker": 0, "step": 0, "tables": [
        {"name": "items", "count": 1}, {"name": table, "count": int(ids.numel())}]},
        [torch.tensor([1]), torch.ones(1, 8), ids, rows])
    with pytest.raises(PSError, match=message) as info:
        client.transports[0].sparse(frames)
    assert info.value.code == code
    for name, t in tables.items():
        assert torch.equal(t.read(torch.arange(40)), before[name])
        assert t.stats().rows == counts[name]
    with pytest.raises(PSError, match="ids must be|not defined"):
        client.transports[0].sparse(encode({"op": "pull", "namespace": "ns", "tables": [
            {"name": table, "count": int(ids.numel())}]}, [ids if table == "nope"
                                                            else torch.tensor([-1])]))


@pytest.mark.parametrize("transport", ["tcp", "grpc"])
def test_one_worker_over_real_servers_and_calls_split_by_size(transport: str) -> None:
    servers = [PSServer("127.0.0.1:0", ps_index=i) for i in range(2)]
    for server in servers:
        server.start()
    try:
        transports = [connect(s.address, transport) for s in servers]
        job = training(steps=STEPS, batchSize=BATCH, mode="sync", seed=3,
                       optimizer={"name": "adagrad", "learningRate": 0.1})
        chief = run(job, transports)[0]
        ref = reference(OptimizerConfig.from_model(job.optimizer), STEPS, seed=3)
        spec = chief.sparse.specs["items"]
        ids = torch.arange(sparse_tasks.ITEMS)
        fresh = [connect(s.address, transport) for s in servers]  # the trainer closed its own
        small = SparseClient(fresh, "ns", max_call_bytes=200)  # 5 rows per call
        try:
            torch.testing.assert_close(small.pull(spec, ids), ref.items.weight.detach(),
                                       rtol=1e-6, atol=1e-6)
        finally:
            small.close()
            for t in fresh:
                t.close()
    finally:
        for server in servers:
            server.stop(0)


def test_admission_and_eviction_on_the_servers() -> None:
    job = training(steps=1, batchSize=4, mode="async", optimizer={"name": "sgd"})
    stores = [ParameterStore(i) for i in range(2)]
    run(job, [LocalTransport(s) for s in stores],
        table_options={"admit_after": 2, "evict_after_steps": 4})
    for store in stores:  # reopen the finished job: pushes after its end are not applied
        store.namespace("ns").done = False
    client = SparseClient([LocalTransport(s) for s in stores], "ns")
    try:
        spec = table_spec(stores, "tags")
        before = client.stats()["tags"]["rows"]
        new = torch.tensor([(1 << 50) + 11, (1 << 50) + 12])  # ids never seen
        initial = client.pull(spec, new)
        client.push({"tags": (new, torch.ones(2, spec.embedding_dim))}, 0, [0, 0])
        assert client.stats()["tags"]["rows"] == before  # seen once: not admitted
        assert torch.equal(client.pull(spec, new), initial)
        client.push({"tags": (new, torch.ones(2, spec.embedding_dim))}, 0, [0, 0])
        assert client.stats()["tags"]["rows"] == before + 2  # admitted, and updated
        torch.testing.assert_close(client.pull(spec, new), initial - 0.1)
        # Ten steps later only rows updated since then are left.
        for store in stores:
            store.namespace("ns").global_step += 10
        client.push({"tags": (new, torch.ones(2, spec.embedding_dim))}, 0, [0, 0])
        assert client.stats()["tags"]["rows"] == 2
    finally:
        client.close()


def table_spec(stores: list[ParameterStore], name: str) -> Any:
    return stores[0].namespace("ns").sparse.tables[name].spec


def test_a_job_optimizer_without_a_row_wise_form_needs_a_table_optimizer() -> None:
    job = training(steps=1, optimizer={"name": "momentum", "learningRate": 0.1})
    with pytest.raises(ValueError, match="optimizer 'momentum' has no row-wise form; sparse "
                                         "tables use one of"):
        Trainer(job, WorkerRole("ns", 0, 1), [LocalTransport(ParameterStore())],
                task=sparse_tasks.make_task())
    trainer = Trainer(job, WorkerRole("ns", 0, 1), [LocalTransport(ParameterStore())],
                      task=sparse_tasks.make_task({"optimizer": {"name": "adagrad"}}))
    assert trainer.sparse.specs["items"].optimizer.name == "adagrad"
    trainer.close()


def test_export_pages_stay_under_the_call_size_limit() -> None:
    job = training(steps=3, batchSize=16, mode="sync")
    stores = [ParameterStore()]
    run(job, [LocalTransport(s) for s in stores])
    client = SparseClient([LocalTransport(stores[0])], "ns", max_call_bytes=(4 * 8 + 8) * 3)
    try:
        spec = table_spec(stores, "items")  # 8 values a row: 3 rows a page here
        pages = list(client.export(0, spec, ()))
    finally:
        client.close()
    assert len(pages) >= 3 and all(len(p.ids) <= 3 for p in pages)
    assert sum(len(p.ids) for p in pages) == stores[0].namespace("ns").sparse.tables[
        "items"].stats().rows


class CountingTransport(LocalTransport):
    def __init__(self, store: ParameterStore) -> None:
        super().__init__(store)
        self.sparse_calls: list[str] = []

    def sparse(self, frames: list[bytes]) -> list[bytes]:
        self.sparse_calls.append(json.loads(frames[0])["op"])
        return super().sparse(frames)


def test_a_collection_pulls_all_its_tables_in_one_call_per_server() -> None:
    job = training(steps=2, batchSize=16, mode="sync")
    stores = [ParameterStore(i) for i in range(2)]
    run(job, [LocalTransport(s) for s in stores])
    transports = [CountingTransport(s) for s in stores]
    client = SparseClient(transports, "ns")
    try:
        net = sparse_tasks.make_task().model
        for layer in (net.items, net.tags):
            layer.source = RemoteSource(client)
        both = SparseEmbeddingCollection([net.items, net.tags])
        x, _ = next(sparse_tasks.batches(0, 1, 64, 0))
        items, tags = both([x[:, :3], x[:, 3:]])
        assert [t.sparse_calls for t in transports] == [["pull"], ["pull"]]
        torch.testing.assert_close(items, net.items(x[:, :3]), rtol=0, atol=0)
        torch.testing.assert_close(tags, net.tags(x[:, 3:]), rtol=0, atol=0)
    finally:
        client.close()
