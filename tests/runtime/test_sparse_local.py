"""Sparse tables on a local, in-process table: the id rule, initial values, the hash
map, and the row-wise optimizers against torch.optim on nn.Embedding(sparse=True)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch
from torch import nn

from pstrain_runtime.optim import OptimizerConfig
from pstrain_runtime.ps.store import PSError
from pstrain_runtime.sparse import (SparseEmbedding, SparseEmbeddingBag, SparseEmbeddingCollection,
                                    apply_sparse_gradients, initial_rows, owner_of, stream_of)
from pstrain_runtime.sparse.spec import TableSpec, optimizer_from_dict
from pstrain_runtime.sparse.index import DirectIndex, IdIndex
from pstrain_runtime.sparse.table import RowTable

pytestmark = pytest.mark.timeout(60)

OPTIMIZERS = {
    "sgd": ({"name": "sgd", "learningRate": 0.05},
            lambda p: torch.optim.SGD(p, lr=0.05)),
    "adagrad": ({"name": "adagrad", "learningRate": 0.3, "initialAccumulatorValue": 0.1},
                lambda p: torch.optim.Adagrad(p, lr=0.3, initial_accumulator_value=0.1)),
    "adam": ({"name": "adam", "learningRate": 0.05},
             lambda p: torch.optim.SparseAdam(p, lr=0.05)),
}


def checked(step: Callable[[], object]) -> Callable[[], object]:
    """`step` of a torch optimizer on sparse gradients, which builds sparse tensors from
    them: with their invariants checked, as torch asks to be told (it warns otherwise)."""
    def run() -> object:
        with torch.sparse.check_sparse_tensor_invariants():
            return step()
    return run


def zipf_ids(n: int, space: int, seed: int = 0) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    return torch.from_numpy((rng.zipf(1.2, n) - 1) % space).to(torch.int64)


def test_owner_rule_is_deterministic_and_balanced_for_skewed_ids() -> None:
    ids = torch.unique(zipf_ids(200_000, 1 << 40))
    owners = owner_of(ids, 3)
    assert torch.equal(owners, owner_of(ids.clone(), 3))
    counts = torch.bincount(owners, minlength=3).double()
    assert float(counts.max() / counts.mean()) < 1.05
    # Consecutive ids (a vocabulary) spread too.
    counts = torch.bincount(owner_of(torch.arange(10_000), 2), minlength=2)
    assert abs(int(counts[0]) - 5000) < 200


@pytest.mark.parametrize("num_ps", [1, 2, 3, 7, 300])
def test_split_by_owner_keeps_each_servers_ids_in_input_order(num_ps: int) -> None:
    """Each server's positions: exactly the ids the owner rule gives it, in the order
    the ids came (the replies are written back by position)."""
    from pstrain_runtime.sparse.ids import split_by_owner

    ids = torch.cat([zipf_ids(5000, 1 << 40), torch.tensor([0, 1 << 62], dtype=torch.int64)])
    parts = split_by_owner(ids, num_ps)
    owners = owner_of(ids, num_ps)
    assert len(parts) == num_ps
    assert torch.equal(torch.sort(torch.cat(parts)).values, torch.arange(ids.numel()))
    for ps, positions in enumerate(parts):
        assert positions.dtype == torch.int64
        assert bool((owners[positions] == ps).all())
        assert bool((positions[1:] > positions[:-1]).all())
    assert [p.numel() for p in split_by_owner(torch.empty(0, dtype=torch.int64),
                                              num_ps)] == [0] * num_ps


@pytest.mark.parametrize("n", [0, 1, 2, 13_312])
def test_unique_inverse_is_torch_unique(n: int) -> None:
    """A layer's ids per step: numpy's unique, the same values and positions as
    torch.unique(sorted, return_inverse) gives (repeats, ids at the int64 extremes)."""
    from pstrain_runtime.sparse.ids import unique_inverse

    ids = zipf_ids(n, 1000)
    if n > 2:
        ids[:2] = torch.tensor([-(1 << 63), (1 << 63) - 1])
    unique, inverse = unique_inverse(ids)
    want_unique, want_inverse = torch.unique(ids, sorted=True, return_inverse=True)
    assert unique.dtype == inverse.dtype == torch.int64
    assert torch.equal(unique, want_unique) and torch.equal(inverse, want_inverse)
    assert torch.equal(unique[inverse], ids)


def test_splitmix64_is_the_published_mix_bit_for_bit() -> None:
    """Owners and initial rows (so every checkpoint's unwritten rows) rest on it: the
    reference generator's first outputs from state 0, and Python's exact integers."""
    from pstrain_runtime.sparse.ids import splitmix64

    mask, golden = (1 << 64) - 1, 0x9E3779B97F4A7C15

    def plain(x: int) -> int:
        z = (x + golden) & mask
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
        return z ^ (z >> 31)

    states = np.array([0, golden, 2 * golden & mask], dtype=np.uint64)
    assert [int(v) for v in splitmix64(states)] == [
        0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4, 0x06C45D188009454F]
    values = np.random.default_rng(3).integers(0, 1 << 63, 1000, dtype=np.int64)
    values = np.concatenate([values.view(np.uint64), np.array([0, mask], dtype=np.uint64)])
    before = values.copy()
    assert [int(v) for v in splitmix64(values.reshape(-1, 2)).reshape(-1)] == [
        plain(int(v)) for v in values]
    assert np.array_equal(values, before)  # the input is left as it was


def test_initial_rows_depend_only_on_seed_table_and_id() -> None:
    stream = stream_of(7, "t")
    a = initial_rows(torch.tensor([5, 9, 1 << 50]), 9, 0.1, stream)
    b = initial_rows(torch.tensor([1 << 50, 5]), 9, 0.1, stream)
    torch.testing.assert_close(a[[2, 0]], b, rtol=0, atol=0)
    assert not torch.equal(a, initial_rows(torch.tensor([5, 9, 1 << 50]), 9, 0.1,
                                           stream_of(8, "t")))
    big = initial_rows(torch.arange(4000), 16, 0.1, stream)
    assert abs(float(big.std()) - 0.1) < 0.005 and abs(float(big.mean())) < 0.005


def test_id_index_matches_a_dict() -> None:
    rng = np.random.default_rng(1)
    index, expected = IdIndex(), {}
    for _ in range(30):
        keys = np.unique(rng.integers(0, 1 << 62, 300))
        vals = rng.integers(0, 1000, len(keys))
        index.put(keys, vals)
        expected.update(zip(keys.tolist(), vals.tolist(), strict=True))
    probe = np.array(list(expected)[:500] + [3, 4, 5])
    got = index.get(probe)
    assert got.tolist() == [expected.get(k, -1) for k in probe.tolist()]
    assert index.size == len(expected)


@pytest.mark.parametrize("make", [IdIndex, lambda: DirectIndex(5000)], ids=["hash", "direct"])
def test_dropping_ids_from_either_map_matches_a_dict(make) -> None:
    rng = np.random.default_rng(2)
    index, expected = make(), {}
    for _ in range(20):
        keys = np.unique(rng.integers(0, 5000, 200))
        vals = rng.integers(0, 1000, len(keys))
        index.put(keys, vals)
        expected.update(zip(keys.tolist(), vals.tolist(), strict=True))
        gone = rng.integers(0, 5000, 150)  # some held, some not, some twice
        index.drop(gone)
        for key in gone.tolist():
            expected.pop(key, None)
    probe = np.arange(5000)
    assert index.get(probe).tolist() == [expected.get(k, -1) for k in range(5000)]
    assert index.size == len(expected)


def reference_weight(spec_layer, num: int) -> torch.Tensor:
    spec = spec_layer.spec
    weight = initial_rows(torch.arange(num), spec.embedding_dim, spec.init_std,
                          stream_of(spec.seed, spec.name))
    if spec_layer.padding_idx is not None:
        weight[spec_layer.padding_idx] = 0
    return weight


BATCHES = [torch.tensor([[1, 2, 2, 7], [7, 7, 0, 3]]), torch.tensor([[5, 5, 5, 5], [1, 0, 0, 2]]),
           torch.tensor([[3, 9, 1, 1], [8, 2, 6, 6]])]


@pytest.mark.parametrize("name", list(OPTIMIZERS))
@pytest.mark.parametrize("padding_idx", [None, 0])
def test_embedding_equals_torch_with_repeated_ids(name: str, padding_idx: int | None) -> None:
    options, make_opt = OPTIMIZERS[name]
    layer = SparseEmbedding("e", 10, 6, padding_idx, optimizer=options, init_std=0.5)
    ref = nn.Embedding(10, 6, padding_idx=padding_idx, sparse=True)
    with torch.no_grad():
        ref.weight.copy_(reference_weight(layer, 10))
    opt = make_opt(list(ref.parameters()))
    target = torch.linspace(-1, 1, 6)
    for step in range(6):
        ids = BATCHES[step % len(BATCHES)]
        for model, apply in ((layer, lambda: apply_sparse_gradients(layer)),
                             (ref, checked(opt.step))):
            if model is ref:
                opt.zero_grad()
            loss = ((model(ids) - target) ** 2).sum()
            loss.backward()
            apply()
    rows = torch.arange(1 if padding_idx == 0 else 0, 10)  # the padding row is never read
    torch.testing.assert_close(layer.local_source().table.read(rows),
                               ref.weight.detach()[rows], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(layer(BATCHES[1]), ref(BATCHES[1]), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("mode", ["sum", "mean"])
@pytest.mark.parametrize("name", ["sgd", "adagrad"])
def test_embedding_bag_equals_torch(mode: str, name: str) -> None:
    options, make_opt = OPTIMIZERS[name]
    layer = SparseEmbeddingBag("b", 10, 4, mode=mode, padding_idx=0, optimizer=options)
    ref = nn.EmbeddingBag(10, 4, mode=mode, padding_idx=0, sparse=True)
    with torch.no_grad():
        ref.weight.copy_(reference_weight(layer, 10))
    opt = make_opt(list(ref.parameters()))
    flat = torch.tensor([1, 2, 2, 0, 7, 7, 7, 3, 0])
    offsets = torch.tensor([0, 3, 5])
    for step in range(4):
        ids = flat if step % 2 else BATCHES[step % 3].reshape(-1)
        offs = offsets if step % 2 else torch.tensor([0, 4])
        for model, apply in ((layer, lambda: apply_sparse_gradients(layer)),
                             (ref, checked(opt.step))):
            if model is ref:
                opt.zero_grad()
            (model(ids, offs) * torch.arange(4.0)).sum().backward()
            apply()
        # 2-D input: fixed bags, like nn.EmbeddingBag
        torch.testing.assert_close(layer(BATCHES[0]), ref(BATCHES[0]), rtol=1e-6, atol=1e-6)
        layer.clear_gradients()
    torch.testing.assert_close(layer.local_source().table.read(torch.arange(1, 10)),
                               ref.weight.detach()[1:], rtol=1e-6, atol=1e-6)


def test_gradients_of_repeated_ids_are_summed() -> None:
    layer = SparseEmbedding("e", None, 3, init_std=0.0, optimizer={"name": "sgd",
                                                                   "learningRate": 1.0})
    layer(torch.tensor([4, 4, 4, 9])).sum().backward()
    ids, grads = layer.take_gradients()
    assert ids.tolist() == [4, 9]
    assert grads.tolist() == [[3.0] * 3, [1.0] * 3]
    # the table sums repeats it is given, too
    table = layer.local_source().table
    table.apply(torch.tensor([4, 4, 9]), torch.ones(3, 3), t=1, now=1)
    assert table.read(torch.tensor([4, 9])).tolist() == [[-2.0] * 3, [-1.0] * 3]


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_updates_through_kept_blocks_equal_fresh_ones_bit_for_bit(name: str) -> None:
    """An update gathers into blocks the table keeps (`Scratch`) when it fits them:
    the same values as an update that allocates (a limit of 0 rows: every update
    does), over updates of growing and shrinking size and both sides of the limit."""
    spec = TableSpec("t", 500, 8, 0.1, optimizer=optimizer_from_dict(OPTIMIZERS[name][0], "t"))
    kept, fresh = RowTable(spec, scratch_bytes=32 * 4 * 8), RowTable(spec, scratch_bytes=0)
    gen = torch.Generator().manual_seed(3)
    blocks = []
    for step, n in enumerate([5, 20, 3, 32, 40, 7, 32, 1], start=1):
        ids = torch.randperm(500, generator=gen)[:n]
        grads = torch.randn(n, 8, generator=gen)
        for table in (kept, fresh):
            table.apply(ids, grads, t=step, now=step)
        blocks.append(kept.scratch.blocks[0].data_ptr() if kept.scratch.blocks else None)
    every = torch.arange(500)
    assert torch.equal(kept.read(every), fresh.read(every))
    for slot in kept.slots:
        assert torch.equal(kept.slots[slot][:kept.used], fresh.slots[slot][:fresh.used])
    assert fresh.scratch.blocks == []  # every update of `fresh` allocated
    # Grown to 20 rows, reused for 3; grown to the limit (32) and reused from then on,
    # also past an update above the limit (40 rows), which allocated its own.
    assert blocks[2] == blocks[1] != blocks[3]
    assert blocks[3] == blocks[4] == blocks[5] == blocks[6] == blocks[7]
    assert kept.scratch.blocks[0].shape[0] == 32


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_one_update_of_new_and_held_rows_is_the_row_optimizers_update_bit_for_bit(
        name: str) -> None:
    """New rows are created already updated (their initial value and state, updated in
    one block, written once) and held rows are updated in place, in one call: each
    row as `apply_rows` on its value before gives it, bit for bit, the optimizer
    state too, and every updated row's version counts one more update."""
    from pstrain_runtime.sparse.rowopt import apply_rows

    config = optimizer_from_dict(OPTIMIZERS[name][0], "t")
    table = RowTable(TableSpec("t", 100, 8, 0.1, optimizer=config))
    gen = torch.Generator().manual_seed(5)
    table.apply(torch.arange(0, 40, 2), torch.randn(20, 8, generator=gen), t=1, now=1)
    ids = torch.arange(30, 60)  # 30..38 even: held; the rest new
    grads = torch.randn(30, 8, generator=gen)
    rows = table.read(ids)
    where = table._where(ids)
    held = torch.nonzero(where >= 0).reshape(-1)
    slots = {}  # the held rows' state; new rows start from the initial one
    for n in table.slot_names:
        slots[n] = torch.full((30, 8), config.initial_accumulator_value if n == "sum" else 0.0)
        slots[n][held] = table.slots[n][where[held]]
    before = table.versions(ids)
    apply_rows(config, rows, grads, slots, 2)
    assert table.apply(ids, grads, t=2, now=2) == 30
    assert torch.equal(table.read(ids), rows)
    where = table._where(ids)
    for n in table.slot_names:
        assert torch.equal(table.slots[n][where], slots[n])
    assert torch.equal(table.versions(ids), before + 1)
    assert table.last[where].tolist() == [2] * 30


@pytest.mark.parametrize(("ids", "grads", "message"), [
    (torch.tensor([1, 10]), torch.ones(2, 3), "ids must be in 0..9"),
    (torch.tensor([-1, 2]), torch.ones(2, 3), "ids must be >= 0"),
    (torch.tensor([1, 2]), torch.ones(2, 4), "rows must have 3 values"),
    (torch.tensor([1, 2]), torch.tensor([[1.0, float("nan"), 0], [0, 0, 0]]), "NaN"),
    (torch.tensor([1, 2, 3]), torch.ones(2, 3), "must match one to one"),
], ids=["out-of-range", "negative", "wrong-width", "nan", "count-mismatch"])
def test_bad_input_is_refused_and_leaves_the_table_unchanged(ids, grads, message) -> None:
    layer = SparseEmbedding("e", 10, 3)
    source = layer.local_source()
    source.apply(torch.tensor([1, 2]), torch.ones(2, 3))
    before = source.table.read(torch.arange(10)).clone()
    with pytest.raises(PSError, match=message) as info:
        source.apply(ids, grads)
    assert info.value.code == "INVALID_ARGUMENT"
    assert torch.equal(source.table.read(torch.arange(10)), before)
    assert source.table.stats().rows == 2


def test_admission_after_n_updates() -> None:
    spec = TableSpec("t", None, 2, init_std=0.1, admit_after=3,
                     optimizer=OptimizerConfig(name="sgd", learning_rate=1.0))
    table = RowTable(spec)
    init = table.read(torch.tensor([42]))
    for step in (1, 2):
        table.apply(torch.tensor([42]), torch.ones(1, 2), t=step, now=step)
        assert table.stats().rows == 0
        assert torch.equal(table.read(torch.tensor([42])), init)
    table.apply(torch.tensor([42, 42]), torch.ones(2, 2), t=3, now=3)  # one sighting
    assert table.stats().rows == 1
    torch.testing.assert_close(table.read(torch.tensor([42])), init - 2.0)


def test_eviction_of_rows_not_updated_for_k_steps() -> None:
    spec = TableSpec("t", None, 2, init_std=0.1, evict_after_steps=4,
                     optimizer=OptimizerConfig(name="adagrad", learning_rate=0.5))
    table = RowTable(spec)
    init = table.read(torch.tensor([1, 2]))
    table.apply(torch.tensor([1, 2]), torch.ones(2, 2), t=1, now=1)
    for now in range(2, 8):
        table.apply(torch.tensor([2]), torch.ones(1, 2), t=now, now=now)
    assert table.stats().rows == 1  # id 1 was last updated at step 1
    assert torch.equal(table.read(torch.tensor([1])), init[:1])
    assert not torch.equal(table.read(torch.tensor([2])), init[1:])
    # A returning id starts fresh: its row is recreated from the initial value.
    table.apply(torch.tensor([1]), torch.ones(1, 2), t=8, now=8)
    fresh = RowTable(spec)
    fresh.apply(torch.tensor([1]), torch.ones(1, 2), t=1, now=1)
    torch.testing.assert_close(table.read(torch.tensor([1])), fresh.read(torch.tensor([1])))


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"embedding_dim": 0}, "embedding_dim is 0; it must be at least 1"),
    ({"num_embeddings": 0}, "num_embeddings is 0; it must be at least 1"),
    ({"admit_after": 0}, "admit_after is 0; it must be at least 1"),
    ({"evict_after_steps": 0}, "evict_after_steps is 0"),
    ({"init_std": float("nan")}, "init_std is nan"),
    ({"padding_idx": 12}, "padding_idx is 12"),
    ({"optimizer": {"name": "momentum"}}, "optimizer 'momentum' has no row-wise form"),
    ({"optimizer": {"name": "adagrad", "learningRate": -1}}, "optimizer.learningRate"),
], ids=["dim", "rows", "admit", "evict", "init-std", "padding", "momentum", "lr"])
def test_bad_table_definitions_are_refused_with_a_message(kwargs, message) -> None:
    args = {"num_embeddings": 10, "embedding_dim": 4, **kwargs}
    with pytest.raises(ValueError, match=message):
        SparseEmbedding("t", args.pop("num_embeddings"), args.pop("embedding_dim"), **args)


def test_a_collection_equals_its_layers_called_one_by_one() -> None:
    def layers() -> list:
        return [SparseEmbedding("a", 10, 3, optimizer={"name": "adagrad"}),
                SparseEmbeddingBag("b", None, 2, mode="sum", padding_idx=0),
                SparseEmbeddingBag("c", 20, 4, mode="mean")]

    together, alone = SparseEmbeddingCollection(layers()), layers()
    ids_a = torch.tensor([[1, 2, 2], [3, 1, 9]])
    ids_b = torch.tensor([[0, 1 << 45], [7, 7]])
    flat_c, offsets_c = torch.tensor([4, 4, 19, 0, 2]), torch.tensor([0, 2])
    for _ in range(3):
        out = together([ids_a, ids_b, (flat_c, offsets_c)])
        ref = [alone[0](ids_a), alone[1](ids_b), alone[2](flat_c, offsets_c)]
        for got, want in zip(out, ref, strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
        sum(o.sum() for o in out).backward()
        sum(r.sum() for r in ref).backward()
        apply_sparse_gradients(together)
        for layer in alone:
            apply_sparse_gradients(layer)
    with pytest.raises(ValueError, match="2 inputs for 3 sparse layers"):
        together([ids_a, ids_b])
