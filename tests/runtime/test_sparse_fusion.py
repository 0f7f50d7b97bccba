"""A SparseEmbeddingCollection fuses its tables of the same kind into one: the values
are those of the separate tables (initial rows, updates, admission), the calls and the
storage are shared, and what cannot be fused is left alone."""

from __future__ import annotations

import pytest
import torch

from pstrain_runtime.ps.store import ParameterStore
from pstrain_runtime.sparse import (SparseEmbedding, SparseEmbeddingBag, SparseEmbeddingCollection,
                                    apply_sparse_gradients, sparse_layers)
from pstrain_runtime.sparse.client import RemoteSource, SparseClient
from pstrain_runtime.sparse.collection import FusedTable
from pstrain_runtime.sparse.spec import TableSpec
from pstrain_runtime.worker.client import LocalTransport

pytestmark = pytest.mark.timeout(60)

ADAGRAD = {"name": "adagrad", "learningRate": 0.2}


def tables(admit_after: int = 1) -> list:
    return [SparseEmbeddingBag("f0", 7, 4, mode="sum", optimizer=ADAGRAD, admit_after=admit_after),
            SparseEmbedding("f1", 5, 4, optimizer=ADAGRAD, admit_after=admit_after),
            SparseEmbeddingBag("f2", 9, 4, mode="mean", optimizer=ADAGRAD,
                               admit_after=admit_after)]


def inputs(step: int) -> list:
    g = torch.Generator().manual_seed(step)
    return [torch.randint(0, 7, (6, 3), generator=g), torch.randint(0, 5, (6, 2), generator=g),
            (torch.randint(0, 9, (10,), generator=g), torch.tensor([0, 3, 3, 8, 9, 9]))]


@pytest.mark.parametrize("admit_after", [1, 2])
def test_fused_tables_hold_the_values_of_separate_tables(admit_after: int) -> None:
    fused = SparseEmbeddingCollection(tables(admit_after))
    apart = SparseEmbeddingCollection(tables(admit_after), fuse=False)
    assert len(fused.fused) == 1 and not apart.fused
    for step in range(5):
        outs = [c(inputs(step)) for c in (fused, apart)]
        for got, want in zip(*outs, strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
        for out in outs:
            (sum((o * torch.linspace(-1, 1, o.numel()).view_as(o)).sum() for o in out)
             ).backward()
        apply_sparse_gradients(fused)
        apply_sparse_gradients(apart)
    # A member called alone reads the fused table: the same rows as its twin.
    ids = torch.tensor([[0, 4, 4]])
    torch.testing.assert_close(fused.layers[1](ids), apart.layers[1](ids), rtol=0, atol=0)


def test_the_model_has_one_table_where_it_had_three() -> None:
    collection = SparseEmbeddingCollection(tables())
    found = [(path, layer) for path, layer in sparse_layers(collection)]
    assert [path for path, _ in found] == ["fused.0"]
    spec = found[0][1].spec
    assert spec.name == "f0+f1+f2" and spec.num_embeddings == 21
    assert spec.parts == (("f0", 7), ("f1", 5), ("f2", 9))
    assert TableSpec.from_json(spec.to_json()) == spec
    assert "parts" not in collection.layers[0].spec.to_json()  # unfused: as before


def test_a_member_id_past_its_table_is_refused_not_read_from_the_next() -> None:
    collection = SparseEmbeddingCollection(tables())
    bad = inputs(0)
    bad[1] = torch.tensor([[5]])
    with pytest.raises(ValueError, match=r"sparse table 'f1' got id 5; it has 5 rows, so ids "
                                         r"must be in 0\.\.4"):
        collection(bad)
    with pytest.raises(ValueError, match="got id -1"):
        collection.layers[0](torch.tensor([[-1]]))


def test_what_cannot_be_fused_stays_apart() -> None:
    layers = [SparseEmbedding("a", 10, 4), SparseEmbedding("b", 10, 8),  # other dim
              SparseEmbedding("c", None, 4),  # dynamic
              SparseEmbedding("d", 10, 4, padding_idx=0),  # padding
              SparseEmbedding("e", 10, 4, optimizer=ADAGRAD),  # other optimizer
              SparseEmbedding("f", 10, 4, init_std=0.3),  # other init
              SparseEmbedding("g", 10, 4)]
    collection = SparseEmbeddingCollection(layers)
    assert [t.spec.name for t in collection.fused] == ["a+g"]
    assert [layer.spec.name for _, layer in sparse_layers(collection)] == [
        "b", "c", "d", "e", "f", "a+g"]


def test_fused_tables_are_one_table_and_one_call_per_server() -> None:
    stores = [ParameterStore(i) for i in range(2)]
    calls: list[str] = []

    class Counting(LocalTransport):
        def sparse(self, frames: list[bytes]) -> list[bytes]:
            calls.append(frames[0][:40].decode(errors="replace"))
            return super().sparse(frames)

    client = SparseClient([Counting(s) for s in stores], "ns")
    try:
        collection = SparseEmbeddingCollection(tables())
        table = collection.fused[0]
        assert isinstance(table, FusedTable)
        table.source = RemoteSource(client)
        spec = table.spec.with_defaults(table.spec.optimizer, 0)  # type: ignore[arg-type]
        client.configure([spec], reset=True)
        for store in stores:  # rows are pulled from an initialised namespace
            store.namespace("ns").initialized = True
        calls.clear()
        local = SparseEmbeddingCollection(tables())
        got, want = collection(inputs(1)), local(inputs(1))
        assert len(calls) == 2  # one pull per server, all three tables in it
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, rtol=0, atol=0)
        assert [list(ns.sparse.tables) for ns in (s.namespace("ns") for s in stores)] == [
            ["f0+f1+f2"], ["f0+f1+f2"]]
    finally:
        client.close()


def test_rows_created_after_a_read_reuse_its_initial_values_exactly() -> None:
    from pstrain_runtime.sparse.fresh import RecentReads

    spec = TableSpec(name="t", num_embeddings=None, embedding_dim=6, init_std=0.1)
    computed: list[int] = []
    initial = spec.initializer()

    def counting(ids: torch.Tensor) -> torch.Tensor:
        computed.append(ids.numel())
        return initial(ids)

    fresh = RecentReads(counting, keep=2)
    fresh.read(torch.tensor([3, 8, 40]))
    fresh.read(torch.tensor([9, 2]))  # not sorted: computed, not kept
    fresh.read(torch.tensor([1, 8]))
    computed.clear()
    ids = torch.tensor([1, 2, 3, 8, 40, 77])
    torch.testing.assert_close(fresh.create(ids), initial(ids), rtol=0, atol=0)
    assert computed == [2]  # 2 (never kept) and 77 (never read)
    fresh.read(torch.tensor([100]))  # pushes [3, 8, 40] out (keep=2)
    computed.clear()
    fresh.create(torch.tensor([3, 100]))
    assert computed == [1]


@pytest.mark.parametrize("mode", ["sum", "mean"])
def test_alike_members_are_gathered_at_once_with_the_same_values(mode: str) -> None:
    def bags() -> list:
        return [SparseEmbeddingBag(f"b{t}", 6 + t, 3, mode=mode, optimizer=ADAGRAD)
                for t in range(4)]

    fused, apart = SparseEmbeddingCollection(bags()), SparseEmbeddingCollection(bags(), fuse=False)
    g = torch.Generator().manual_seed(3)
    for _ in range(4):
        ids = [torch.randint(0, 6, (5, 2), generator=g) for _ in range(4)]
        outs = [c(ids) for c in (fused, apart)]
        for got, want in zip(*outs, strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
        for out in outs:
            sum((o * torch.arange(o.numel()).view_as(o)).sum() for o in out).backward()
        apply_sparse_gradients(fused)
        apply_sparse_gradients(apart)
    bad = [torch.zeros((5, 2), dtype=torch.int64) for _ in range(4)]
    bad[2][1, 1] = 8  # table b2 has 8 rows: ids 0..7
    with pytest.raises(ValueError, match=r"sparse table 'b2' got id 8; it has 8 rows"):
        fused(bad)


def test_an_export_loaded_with_the_seed_gives_a_fused_id_its_own_tables_initial_row() -> None:
    from pstrain_runtime.export import _initial_values
    from pstrain_runtime.sparse import initial_rows, stream_of

    table = SparseEmbeddingCollection(tables()).fused[0]
    spec = table.spec  # f0: ids 0..6, f1: 7..11, f2: 12..20
    got = _initial_values(spec, seed=4)(torch.tensor([2, 8, 20]))
    want = torch.cat([initial_rows(torch.tensor([i]), 4, spec.init_std,
                                   stream_of(spec.seed + 4, name))
                      for name, i in (("f0", 2), ("f1", 1), ("f2", 8))])
    torch.testing.assert_close(got, want, rtol=0, atol=0)
