"""A step's sparse push riding on its dense push_pull (`sparse.riding`, async mode):
the same training as two calls, one call per server per step on the data plane; the
rule (a server applies the rows only when it applied the dense push); refusals of the
sparse part raised after the dense part stands; rows above one call's size sent as
before."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch

from pstrain_runtime.optim import OptimizerConfig
from pstrain_runtime.proto import ps_pb2 as pb
from pstrain_runtime.ps.server import PSServer
from pstrain_runtime.ps.store import ParameterStore, PSError
from pstrain_runtime.sparse import riding
from pstrain_runtime.sparse.client import SparseClient
from pstrain_runtime.sparse.protocol import encode, header_of
from pstrain_runtime.sparse.session import SparseSession
from pstrain_runtime.transport import wire
from pstrain_runtime.worker import client as worker_client
from pstrain_runtime.worker.client import LocalTransport, ShardedClient, connect
from pstrain_runtime.worker.placement import build_placement, param_specs

from . import sparse_tasks
from .builders import training
from .test_sparse_trainer import BATCH, STEPS, reference

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(autouse=True)
def one_thread() -> None:
    torch.set_num_threads(1)


def counting(monkeypatch: pytest.MonkeyPatch, cls: type) -> Counter[str]:
    """Counts of the tensor calls the trainers' transports of class `cls` make."""
    calls: Counter[str] = Counter()
    # (The data plane's calls in two halves count as the calls they make.)
    names = ("push_pull_small", "push_pull_sparse", "sparse", "push_pull_sent",
             "sparse_sent")
    for name in (n for n in names if hasattr(cls, n)):
        original = getattr(cls, name)

        def counted(self: Any, *args: Any, _name: str = name, _f: Any = original) -> Any:
            if _name in ("sparse", "sparse_sent"):
                calls["sparse " + str(header_of(args[0]).get("op"))] += 1
            elif _name == "push_pull_sent":
                calls["push_pull_sparse" if args[1] is not None else "push_pull_small"] += 1
            else:
                calls[_name] += 1
            return _f(self, *args)

        monkeypatch.setattr(cls, name, counted)
    return calls


@pytest.mark.parametrize("transport", ["tcp", "grpc"])
def test_one_async_worker_rides_and_equals_plain_pytorch(
        servers: list[PSServer], transport: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Over the data plane every step's rows ride on the push_pull (no sparse push of
    their own); over gRPC, which has no riding call, they go as their own call after
    it. Both train exactly as the plain PyTorch loop."""
    calls = counting(monkeypatch, worker_client.TcpTransport if transport == "tcp"
                     else worker_client.GrpcTransport)
    transports = [connect(s.address, transport) for s in servers]
    job = training(steps=STEPS, batchSize=BATCH, mode="async", seed=3,
                   optimizer={"name": "adagrad", "learningRate": 0.1})
    chief = sparse_tasks.run_job(job, transports)[0]
    ref = reference(OptimizerConfig.from_model(job.optimizer), STEPS, seed=3)
    fresh = [connect(s.address, transport) for s in servers]
    try:
        client = SparseClient(fresh, "ns")
        for name, weight in (("items", ref.items.weight),
                             ("tags", ref.tags.weight)):
            ids = (torch.arange(sparse_tasks.ITEMS) if name == "items"
                   else sparse_tasks.all_tag_ids())
            torch.testing.assert_close(client.pull(chief.sparse.specs[name], ids),
                                       weight.detach(), rtol=1e-6, atol=1e-6)
        client.close()
    finally:
        for t in fresh:
            t.close()
    for name, value in ref.head.named_parameters():
        torch.testing.assert_close(chief.mirror[f"head.{name}"], value.detach(),
                                   rtol=1e-6, atol=1e-6)
    assert calls["push_pull_sparse"] == 2 * STEPS  # each step, each server
    if transport == "tcp":
        assert calls["sparse push"] == 0 and calls["push_pull_small"] == 0
    else:  # asked, answered None: the dense call, then the rows' own call
        assert calls["push_pull_small"] == 2 * STEPS
        assert calls["sparse push"] >= STEPS


def test_a_pull_or_push_sends_to_every_server_then_reads_every_reply_on_its_thread(
        servers: list[PSServer], monkeypatch: pytest.MonkeyPatch) -> None:
    """Over the data plane a pull's calls (one per server) are all in flight from the
    caller's thread, no thread hop; a refusal by one server raises, and every
    connection stays usable (the other reply is read or its connection closed). A push
    of its own (sync mode's) goes the same way."""
    transports = [connect(s.address, "tcp") for s in servers]
    job = training(steps=3, batchSize=BATCH, mode="async", seed=3,
                   optimizer={"name": "adagrad", "learningRate": 0.1})
    spec = sparse_tasks.run_job(job, transports)[0].sparse.specs["items"]
    fresh = [connect(s.address, "tcp") for s in servers]
    client = SparseClient(fresh, "ns")
    try:
        ids = torch.arange(sparse_tasks.ITEMS)
        want = client.pull(spec, ids)
        monkeypatch.setattr(client.pool, "submit", lambda *a, **k: pytest.fail("a hop"))
        for _ in range(3):
            assert torch.equal(client.pull(spec, ids), want)
        links = [len(t._data._idle) for t in fresh]
        outside = torch.tensor([0, 1, sparse_tasks.ITEMS + 1, sparse_tasks.ITEMS + 2])
        with pytest.raises(PSError, match="sparse pull"):
            client.pull(spec, outside)
        assert torch.equal(client.pull(spec, ids), want)
        assert [len(t._data._idle) for t in fresh] <= [n + 1 for n in links]
        # A push of its own (sync mode's) goes the same way.
        replies = client.push({spec.name: (ids, torch.zeros(ids.numel(), spec.embedding_dim))},
                              worker=0, steps=[0, 0], versions=True)
        assert [r["ps"] for r in replies] == [0, 1]
        assert sum(sum(v.numel() for _, _, v in r["versions"]) for r in replies) == ids.numel()
    finally:
        client.close()
        for t in [*fresh, *transports]:
            t.close()


def test_a_pull_over_grpc_still_calls_every_server_at_once(servers: list[PSServer]) -> None:
    """gRPC has no call in two halves: a pull's calls run on threads, all at once."""
    transports = [connect(s.address, "grpc") for s in servers]
    job = training(steps=2, batchSize=BATCH, mode="async", seed=3,
                   optimizer={"name": "adagrad", "learningRate": 0.1})
    spec = sparse_tasks.run_job(job, transports)[0].sparse.specs["items"]
    transports += [connect(s.address, "grpc") for s in servers]
    client = SparseClient(transports[2:], "ns")
    hops: list[object] = []
    real = client.pool.submit
    client.pool.submit = lambda *a, **k: hops.append(a) or real(*a, **k)  # type: ignore[method-assign]
    try:
        assert client.pull(spec, torch.arange(sparse_tasks.ITEMS)).shape[0] == sparse_tasks.ITEMS
        assert hops
    finally:
        client.close()
        for t in transports:
            t.close()


# ---------------------------------------------------------------------- the server


def installed(store: ParameterStore) -> tuple[ShardedClient, SparseClient, Any]:
    """One async worker's clients on `store`, with w = zeros(4) and a table "t" (dim 2,
    SGD lr 1, initial rows 0)."""
    from pstrain_runtime.sparse.spec import TableSpec

    transport = LocalTransport(store)
    dense = ShardedClient([transport], build_placement(param_specs({"w": (4,)}), 1), "ns")
    dense.init({"w": torch.zeros(4)}, OptimizerConfig(name="sgd", learning_rate=1.0),
               mode="async", num_workers=1, staleness_bound=None, fingerprint="ab" * 32)
    sparse = SparseClient([transport], "ns")
    spec = TableSpec("t", 10, 2, 0.0, optimizer=OptimizerConfig(name="sgd", learning_rate=1.0))
    sparse.configure([spec], reset=True)
    sparse.pull(spec, torch.tensor([1]))  # learns the generation
    return dense, sparse, spec


def rider(sparse: SparseClient, **header: Any) -> list[Any]:
    planned = sparse.riders({"t": (torch.tensor([1, 3]), torch.ones(2, 2))}, 0, [1])
    assert planned is not None and planned[0][0] is not None
    riders = planned[0]
    if not header:
        return riders[0]
    return encode({**header_of(riders[0]), **header}, [torch.tensor([1, 3]),
                                                       torch.ones(2, 2)])


def test_rows_ride_and_are_applied_with_the_dense_push() -> None:
    store = ParameterStore(0)
    dense, sparse, spec = installed(store)
    params = {"w": torch.empty(4)}
    replies = dense.push_pull({"w": torch.ones(4)}, params, riders=[rider(sparse)])
    assert replies[0].applied and torch.equal(params["w"], -torch.ones(4))
    reply = riding.reply_of(dense.rider_replies[0])  # type: ignore[arg-type]
    assert reply["applied"] is True
    assert sparse.pull(spec, torch.tensor([1, 2, 3])).tolist() == [[-1, -1], [0, 0], [-1, -1]]


def test_a_server_that_did_not_apply_the_dense_push_does_not_apply_the_rows() -> None:
    store = ParameterStore(0)
    dense, sparse, spec = installed(store)
    store.finish("ns")  # the job is done: pushes are answered, not applied
    params = {"w": torch.empty(4)}
    replies = dense.push_pull({"w": torch.ones(4)}, params, riders=[rider(sparse)])
    assert not replies[0].applied
    reply = riding.reply_of(dense.rider_replies[0])  # type: ignore[arg-type]
    assert reply["applied"] is False and "dense push was not applied" in reply["note"]
    assert sparse.pull(spec, torch.tensor([1, 3])).tolist() == [[0, 0], [0, 0]]


def test_a_refused_sparse_part_is_raised_after_the_dense_part_stands() -> None:
    store = ParameterStore(0)
    dense, sparse, spec = installed(store)
    params = {"w": torch.empty(4)}
    stale = rider(sparse, generation=sparse.generations[0] + 7)  # another generation
    dense.push_pull({"w": torch.ones(4)}, params, riders=[stale])
    assert torch.equal(params["w"], -torch.ones(4))  # read back: the dense push stands
    with pytest.raises(PSError) as info:
        SparseClient.riding_replies(dense.rider_replies, [[]], versions=False)
    assert info.value.code == "ABORTED"
    assert sparse.pull(spec, torch.tensor([1, 3])).tolist() == [[0, 0], [0, 0]]


def bad_rows(sparse: SparseClient, ids: torch.Tensor, rows: torch.Tensor,
             table: str = "t") -> list[Any]:
    return encode({"op": "push", "namespace": "ns", "worker": 0, "step": 1,
                   "generation": sparse.generations[0],
                   "tables": [{"name": table, "count": int(ids.numel())}]}, [ids, rows])


@pytest.mark.parametrize(("frames", "message"), [
    (lambda sparse: [], "holds 1 frames"),
    (lambda sparse: [encode({"op": "pull", "namespace": "ns", "tables": []})[0]],
     "op is 'pull'; it must be push"),
    (lambda sparse: [b"not json"], "the header is not JSON"),
    (lambda sparse: bad_rows(sparse, torch.tensor([1, 10]), torch.ones(2, 2)),
     "ids must be in 0..9"),
    (lambda sparse: bad_rows(sparse, torch.tensor([1]), torch.tensor([[float("nan"), 0]])),
     "NaN"),
    (lambda sparse: bad_rows(sparse, torch.tensor([1]), torch.ones(1, 3)),
     "rows must have 2 values"),
], ids=["no-rider", "not-a-push", "bad-header", "id-out-of-range", "nan", "wrong-width"])
def test_a_malformed_riding_call_is_refused_and_changes_nothing(frames, message) -> None:
    """Refused before the dense push is applied: neither part changes anything."""
    store = ParameterStore(0)
    dense, sparse, spec = installed(store)
    push = dense.push_frames(0, {"w": torch.ones(4)}, worker=0, step=0)
    with pytest.raises(PSError, match=message) as info:
        riding.serve(store, [wire.encode_batch(push), *frames(sparse)])
    assert info.value.code == "INVALID_ARGUMENT"
    assert store.info("ns").global_step == 0
    assert sparse.pull(spec, torch.tensor([1])).tolist() == [[0, 0]]


def test_rows_above_one_call_are_kept_and_pushed_after_the_push_pull() -> None:
    """When a server's rows need several calls they cannot ride: the session keeps the
    rows it took, and `push` sends them, in parts, as before."""
    store = ParameterStore(0)
    dense, sparse, _ = installed(store)
    model = sparse_tasks.Net(seed=0)
    session = SparseSession.attach(model, [LocalTransport(store)], "ns",
                                   OptimizerConfig(name="sgd", learning_rate=1.0), 0)
    assert session is not None
    session.install(None, None)
    session.client.generations = list(sparse.generations)
    session.client.max_call_bytes = 200  # a few rows per call
    spec, ids = session.specs["items"], torch.arange(sparse_tasks.ITEMS)
    before = session.client.pull(spec, ids)
    session.begin_step()
    x, y = next(sparse_tasks.batches(0, 1, 16, 0))
    sparse_tasks.loss(model(x), y).backward()
    assert session.riders(0, [1]) is None  # too large to ride: kept
    session.push(0, [1])
    changed = (session.client.pull(spec, ids) != before).any(1)
    assert set(torch.nonzero(changed).reshape(-1).tolist()) == set(
        torch.unique(x[:, :3]).tolist())
    session.push(0, [2])  # nothing kept any more, nothing looked up: nothing sent
    assert torch.equal(session.client.pull(spec, ids)[~changed], before[~changed])
    session.close()


def test_grpc_transports_have_no_riding_call() -> None:
    transport = worker_client.GrpcTransport("127.0.0.1:1")
    try:
        assert transport.push_pull_sparse(b"", []) is None
    finally:
        transport.close()


_ = pb  # the protobuf module stays importable for readers of the frames above
