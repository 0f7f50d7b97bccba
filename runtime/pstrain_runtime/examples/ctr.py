"""A click-through-rate model (DLRM style) on generated data, with its embedding tables
on the parameter servers.

`pstrain_runtime.examples.ctr:make_task`. Each sample has 13 dense features and 26
categorical features (one id each). The model:

- dense features -> bottom MLP -> a vector of `embedding_dim`;
- each categorical feature -> its own embedding table of `rows` rows -> a vector of
  `embedding_dim` (a `SparseEmbeddingBag`: inside pstrain's trainer its rows live only
  on the parameter servers, and a step moves only the rows of the batch's ids; the 26
  tables are stored as one, see `CTRModel`);
- the 27 vectors interact by pairwise dot products (351 values), which go with the
  dense vector through the top MLP to one logit (the click probability's log-odds).

The data is generated, deterministically from the seed, so every replica agrees on it
and nothing is downloaded. Ids follow a Zipf-like skew (exponent `zipf`, default 1.2)
over each table's `rows` ids, scrambled so that the hot ids are spread over the id
space; `zipf=0` draws them uniformly over [0, rows) instead (every id equally likely:
no hot rows). A
hidden teacher labels each sample: a logistic model over a per-id hidden weight of
every feature (a hash of table and id, so a teacher over 10^8 ids costs no memory), the
dense features, and one pairwise term; a click is drawn from its probability. The model
can learn most of this from the frequent ids; a model of the dense features alone
cannot.

The held-out set (`eval_size` samples, a stream no worker draws from) is generated at
the first `evaluate`, so a process that never evaluates never holds it.

A batch's input is one float64 tensor of shape (batch, 13 + 26): the dense features,
then the ids (exact in float64 below 2^53). `evaluate` returns `auc` (ROC AUC, from
scikit-learn) and `logloss` on `eval_size` held-out samples.

`tables` picks the embedding implementation: "ps" (the default, `SparseEmbeddingBag`),
"dense" (`nn.EmbeddingBag`: every row is a model parameter, as a plain PyTorch or DDP
model holds it), "torch_sparse" (`nn.EmbeddingBag(sparse=True)`: sparse gradients in
PyTorch), or "none" (no categorical features at all: the dense-only baseline).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from typing import Literal

import torch
from torch import nn

from ..task import Batch, Task

NUM_DENSE = 13
NUM_SPARSE = 26
TableKind = Literal["ps", "ps_tables", "ps_tables_apart", "dense", "torch_sparse", "none"]
TABLE_KINDS: tuple[str, ...] = ("ps", "ps_tables", "ps_tables_apart", "dense", "torch_sparse",
                                "none")
EVAL_SEED = 987_654_321  # held-out data: a stream no worker draws from
_MASK32 = (1 << 32) - 1
# Multipliers that scramble ids inside a table; the first one coprime with `rows` is used.
_SCRAMBLE = (1_000_003, 998_244_353, 2_147_483_647, 4_294_967_291)


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (the "lowbias32" finaliser) on int64 tensors, exact: every
    intermediate product stays below 2^63."""
    x = x & _MASK32
    x = ((x ^ (x >> 16)) * 0x7FEB352D) & _MASK32
    x = ((x ^ (x >> 15)) * 0x846CA68B) & _MASK32
    return x ^ (x >> 16)


def hidden_weight(table: torch.Tensor, ids: torch.Tensor, seed: int) -> torch.Tensor:
    """The teacher's weight of each (table, id), uniform in [-1, 1), a pure function."""
    h = _mix32(_mix32(ids ^ (ids >> 32)) + table * 0x9E3779B9 + seed)
    return h.to(torch.float64) / 2.0**31 - 1.0


def zipf_ids(gen: torch.Generator, shape: tuple[int, ...], rows: int,
             exponent: float) -> torch.Tensor:
    """Ids in [0, rows) with P(rank k) roughly proportional to k^-exponent (the
    continuous inverse CDF of a power law on [1, rows + 1)), rank 0 the most frequent.
    Exponent 0 is the uniform law: every id in [0, rows) equally likely. Either way the
    draw takes one uniform number per id from `gen`."""
    u = torch.rand(shape, generator=gen, dtype=torch.float64)
    if exponent == 0:
        return (u * rows).floor().to(torch.int64).clamp_(0, rows - 1)
    if abs(exponent - 1.0) < 1e-9:
        x = torch.exp(u * math.log(rows + 1.0))
    else:
        a = 1.0 - exponent
        x = (1.0 + u * ((rows + 1.0) ** a - 1.0)) ** (1.0 / a)
    return (x.floor().to(torch.int64) - 1).clamp_(0, rows - 1)


def scramble(ranks: torch.Tensor, rows: int) -> torch.Tensor:
    """Spread ranks over the id space by a bijection of [0, rows) per table: column t
    maps rank r to (r * P + (t + 1) * 7919) mod rows, P coprime with rows."""
    mult = next(p for p in _SCRAMBLE if math.gcd(p, rows) == 1)
    cols = torch.arange(1, ranks.shape[-1] + 1, dtype=torch.int64)
    return (ranks * mult + cols * 7919) % rows


class Teacher:
    """The hidden labelling rule; see the module docstring."""

    def __init__(self, seed: int, sparse_scale: float = 4.0, dense_scale: float = 1.0,
                 bias: float = -1.0) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.dense_w = torch.randn(NUM_DENSE, generator=gen, dtype=torch.float64)
        self.dense_w /= self.dense_w.norm()
        self.seed = seed
        self.sparse_scale = sparse_scale
        self.dense_scale = dense_scale
        self.bias = bias

    def logits(self, dense: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        tables = torch.arange(ids.shape[1], dtype=torch.int64)
        w = hidden_weight(tables, ids, self.seed)  # (batch, 26) in [-1, 1)
        per_id = w.sum(1) * (self.sparse_scale / math.sqrt(ids.shape[1] / 3.0))
        pair = w[:, 0] * w[:, 1] * self.sparse_scale
        return self.bias + self.dense_scale * (dense @ self.dense_w) + per_id + pair


def sample(gen: torch.Generator, n: int, rows: int, zipf: float,
           teacher: Teacher) -> Batch:
    dense = torch.randn(n, NUM_DENSE, generator=gen, dtype=torch.float64)
    ids = scramble(zipf_ids(gen, (n, NUM_SPARSE), rows, zipf), rows)
    p = torch.sigmoid(teacher.logits(dense, ids))
    clicks = (torch.rand(n, generator=gen, dtype=torch.float64) < p).to(torch.float32)
    return torch.cat([dense, ids.to(torch.float64)], 1), clicks


def mlp(sizes: list[int], last_relu: bool) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(sizes, sizes[1:])):
        layers.append(nn.Linear(a, b))
        if i < len(sizes) - 2 or last_relu:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def build_table(kind: TableKind, name: str, rows: int, dim: int, init_std: float,
                admit_after: int = 1, evict_after_steps: int | None = None) -> nn.Module:
    """One embedding table: the single place that picks the implementation."""
    if kind == "ps":
        from ..sparse import SparseEmbeddingBag

        return SparseEmbeddingBag(name, rows, dim, mode="sum", init_std=init_std,
                                  admit_after=admit_after,
                                  evict_after_steps=evict_after_steps)
    table = nn.EmbeddingBag(rows, dim, mode="sum", sparse=kind == "torch_sparse")
    nn.init.normal_(table.weight, std=init_std)
    return table


class Features(nn.Module):
    """The 26 features' embeddings, ids (batch, 26) -> (batch, 26, dim): one table with
    each feature's ids offset (`build_table`), or ("ps_tables", "ps_tables_apart") 26
    tables `f0`..`f25` in a `SparseEmbeddingCollection`, fused into one on the servers
    or kept apart."""

    def __init__(self, kind: TableKind, rows: int, dim: int, init_std: float,
                 admit_after: int, evict_after_steps: int | None) -> None:
        super().__init__()
        self.dim = dim
        self.register_buffer("id_offsets", torch.arange(NUM_SPARSE) * rows, persistent=False)
        if kind.startswith("ps_tables"):
            from ..sparse import SparseEmbeddingBag, SparseEmbeddingCollection

            self.table = None
            self.collection = SparseEmbeddingCollection(
                [SparseEmbeddingBag(f"f{t}", rows, dim, mode="sum", init_std=init_std,
                                    admit_after=admit_after,
                                    evict_after_steps=evict_after_steps)
                 for t in range(NUM_SPARSE)], fuse=kind == "ps_tables")
        else:
            self.table = build_table(kind, "ctr_features", NUM_SPARSE * rows, dim, init_std,
                                     admit_after, evict_after_steps)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.table is None:
            return torch.stack(self.collection(list(ids.split(1, dim=1))), 1)
        flat = (ids + self.id_offsets).reshape(-1, 1)
        return self.table(flat).view(len(ids), NUM_SPARSE, self.dim)


class CTRModel(nn.Module):
    """DLRM: bottom MLP, an embedding bag per categorical feature, pairwise dot
    products of all feature vectors, top MLP to one logit.

    The 26 features' tables are stored as one table of 26 x `rows` rows, feature t's
    ids offset by t x `rows` (as TorchRec groups features into one table): the same
    model as 26 tables, but one lookup per step, so one pull and one push per
    parameter server rather than 26."""

    def __init__(self, rows: int, embedding_dim: int, bottom: list[int], top: list[int],
                 tables: TableKind, init_std: float, admit_after: int = 1,
                 evict_after_steps: int | None = None) -> None:
        super().__init__()
        self.dim = embedding_dim
        self.rows = rows
        self.bottom = mlp([NUM_DENSE, *bottom, embedding_dim], last_relu=True)
        self.features = NUM_SPARSE if tables != "none" else 0
        self.embeddings = (Features(tables, rows, embedding_dim, init_std, admit_after,
                                    evict_after_steps) if self.features else None)
        n = 1 + self.features
        rows_i, cols_i = torch.triu_indices(n, n, offset=1)
        self.register_buffer("pairs_i", rows_i, persistent=False)
        self.register_buffer("pairs_j", cols_i, persistent=False)
        self.top = mlp([embedding_dim + n * (n - 1) // 2, *top, 1], last_relu=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dense = self.bottom(x[:, :NUM_DENSE].to(torch.float32))
        feats = dense.unsqueeze(1)
        if self.embeddings is not None:
            emb = self.embeddings(x[:, NUM_DENSE:].to(torch.int64))  # (batch, 26, dim)
            feats = torch.cat([feats, emb], 1)  # (batch, 27, dim)
        dots = torch.bmm(feats, feats.transpose(1, 2))[:, self.pairs_i, self.pairs_j]
        return self.top(torch.cat([dense, dots], 1)).squeeze(1)


def build_model(rows: int, embedding_dim: int = 16, bottom: tuple[int, ...] = (64,),
                top: tuple[int, ...] = (64,), tables: TableKind = "ps",
                init_std: float = 0.05, seed: int = 0, admit_after: int = 1,
                evict_after_steps: int | None = None) -> CTRModel:
    state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        return CTRModel(rows, embedding_dim, list(bottom), list(top), tables, init_std,
                        admit_after, evict_after_steps)
    finally:
        torch.random.set_rng_state(state)


def auc_logloss(logits: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
    from sklearn.metrics import roc_auc_score

    logits = logits.detach().to(torch.float64).cpu()
    labels = labels.to(torch.float64).cpu()
    logloss = float(nn.functional.binary_cross_entropy_with_logits(logits, labels))
    auc = float(roc_auc_score(labels.numpy(), logits.numpy()))
    return {"auc": auc, "logloss": logloss}


def make_task(rows: int = 100_000, embedding_dim: int = 16, zipf: float = 1.2,
              bottom: tuple[int, ...] | list[int] = (64,),
              top: tuple[int, ...] | list[int] = (64,), tables: TableKind = "ps",
              init_std: float = 0.05, eval_size: int = 8192, teacher_seed: int = 7,
              admit_after: int = 1, evict_after_steps: int | None = None) -> Task:
    """See the module docstring. `rows` is per table (26 tables); `zipf` is the ids'
    Zipf exponent, 0 for uniform ids."""
    if rows < 1 or embedding_dim < 1 or eval_size < 2 or not zipf >= 0:
        raise ValueError(f"rows is {rows}, embedding_dim {embedding_dim}, eval_size "
                         f"{eval_size}, zipf {zipf}; rows and embedding_dim must be at "
                         "least 1, eval_size at least 2 and zipf at least 0 (0: uniform "
                         "ids)")
    if tables not in TABLE_KINDS:
        raise ValueError(f"tables is {tables!r}; it must be one of {', '.join(TABLE_KINDS)}")
    teacher = Teacher(teacher_seed)
    held_out: list[Batch] = []  # generated at the first evaluate

    def eval_set() -> Batch:
        if not held_out:
            held_out.append(sample(torch.Generator().manual_seed(EVAL_SEED), eval_size, rows,
                                   zipf, teacher))
        return held_out[0]

    def batches(worker: int, num_workers: int, batch_size: int, seed: int) -> Iterator[Batch]:
        gen = torch.Generator().manual_seed(seed * 100_003 + worker + 1)
        while True:
            yield sample(gen, batch_size, rows, zipf, teacher)

    loss_fn = nn.BCEWithLogitsLoss()

    def evaluate(model: nn.Module) -> Mapping[str, float]:
        device = next(model.parameters()).device
        x_eval, y_eval = eval_set()
        with torch.no_grad():
            logits = torch.cat([model(chunk.to(device)).cpu()
                                for chunk in x_eval.split(4096)])
        metrics = auc_logloss(logits, y_eval)
        return {**metrics, "loss": metrics["logloss"]}

    return Task(model=build_model(rows, embedding_dim, tuple(bottom), tuple(top), tables,
                                  init_std, admit_after=admit_after,
                                  evict_after_steps=evict_after_steps),
                batches=batches, loss=loss_fn, evaluate=evaluate)
