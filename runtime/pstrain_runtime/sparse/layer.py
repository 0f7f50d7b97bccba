"""The user-facing layers: `SparseEmbedding` and `SparseEmbeddingBag`.

They behave like `nn.Embedding` / `nn.EmbeddingBag`, but hold no weights: forward
deduplicates the batch's ids, fetches just those rows from the layer's row source
(the parameter servers when a `Trainer` runs the model, else a local in-process
table), makes them one leaf tensor that requires grad, and gathers (or pools) from
it. After backward, the leaf's gradient holds one summed row per unique id: that is
what is pushed (`take_gradients`).

Outside a trainer, call `apply_sparse_gradients(model)` after `loss.backward()` to
update the local tables (the dense parameters keep their own torch optimizer).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from ..optim import OptimizerConfig
from .checks import check_grads, check_ids
from .ids import unique_inverse
from .rowopt import coalesce
from .spec import TableSpec, optimizer_from_dict
from .table import RowTable


@dataclass(frozen=True)
class Lookup:
    """One layer's ids, prepared for a pull: unique ids, and where each id's row is."""

    ids: torch.Tensor
    unique: torch.Tensor
    inverse: torch.Tensor
    pad_local: int | None


class RowSource(Protocol):
    """Where a layer's rows live: `pull` the rows of unique ids, `push` their gradients."""

    def pull(self, spec: TableSpec, ids: torch.Tensor) -> torch.Tensor: ...


class LocalSource:
    """An in-process table (the same `RowTable` the parameter servers use); each
    `apply` is one update step."""

    def __init__(self, spec: TableSpec) -> None:
        self.table = RowTable(spec)
        self.steps = 0

    def pull(self, spec: TableSpec, ids: torch.Tensor) -> torch.Tensor:
        check_ids(spec, ids, "pull")
        return self.table.read(ids)

    def apply(self, ids: torch.Tensor, grads: torch.Tensor) -> None:
        check_grads(self.table.spec, ids, grads, "push")
        self.steps += 1
        self.table.apply(ids, grads, t=self.steps, now=self.steps)


class _SparseLayer(nn.Module):
    def __init__(self, name: str, num_embeddings: int | None, embedding_dim: int,
                 padding_idx: int | None, init_std: float | None, admit_after: int,
                 evict_after_steps: int | None, optimizer: dict[str, Any] | None,
                 seed: int) -> None:
        super().__init__()
        config = (optimizer_from_dict(optimizer, f"sparse table {name!r}")
                  if optimizer is not None else None)
        self.spec = TableSpec(
            name=name, num_embeddings=num_embeddings, embedding_dim=embedding_dim,
            init_std=(1.0 / math.sqrt(embedding_dim) if init_std is None and embedding_dim > 0
                      else float(init_std if init_std is not None else 0.0)),
            admit_after=admit_after, evict_after_steps=evict_after_steps,
            optimizer=config, seed=seed)
        if padding_idx is not None:
            if num_embeddings is not None and padding_idx < 0:
                padding_idx += num_embeddings
            if padding_idx < 0 or (num_embeddings is not None and padding_idx >= num_embeddings):
                raise ValueError(f"sparse table {name!r}: padding_idx is {padding_idx}; it "
                                 "must be a valid id of the table")
        self.padding_idx = padding_idx
        self.source: RowSource | None = None  # bound by a Trainer, else a LocalSource
        self._pending: list[tuple[torch.Tensor, torch.Tensor]] = []
        # Set by a SparseEmbeddingCollection that fused this table with others: the
        # fused table and this table's id offset in it (a tuple: not a submodule).
        self.fused_into: tuple[_SparseLayer, int] | None = None

    # ------------------------------------------------------------------ rows
    def local_source(self) -> LocalSource:
        """The layer's in-process table (made on first use, with SGD lr 0.1 unless the
        layer names an optimizer)."""
        if self.fused_into is not None:
            return self.fused_into[0].local_source()
        if not isinstance(self.source, LocalSource):
            if self.source is not None:
                raise RuntimeError(f"sparse table {self.spec.name!r} is bound to the "
                                   "parameter servers; it has no local table")
            self.source = LocalSource(self.spec.with_defaults(
                self.spec.optimizer or OptimizerConfig(), self.spec.seed))
        return self.source

    def _source(self) -> RowSource:
        if self.fused_into is not None:
            return self.fused_into[0]._source()
        return self.source if self.source is not None else self.local_source()

    def fused_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """A fused member's ids as ids of the fused table (checked against this table's
        size: an id past it would read another table's row)."""
        table, offset = self.fused_into  # type: ignore[misc]
        if ids.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"sparse table {self.spec.name!r}: ids must be an integer "
                            f"tensor, got {ids.dtype}")
        if ids.numel():
            low, high = int(ids.min()), int(ids.max())
            n = self.spec.num_embeddings
            if low < 0 or high >= n:  # type: ignore[operator]
                raise ValueError(f"sparse table {self.spec.name!r} got id "
                                 f"{low if low < 0 else high}; it has {n} rows, so ids "
                                 f"must be in 0..{n - 1}")  # type: ignore[operator]
        return ids.to(torch.int64) + offset

    def _prepare(self, ids: torch.Tensor) -> Lookup:
        """The batch's unique ids (the padding id left out) and where each id's row
        will be among them."""
        if ids.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"sparse table {self.spec.name!r}: ids must be an integer "
                            f"tensor, got {ids.dtype}")
        flat = ids.reshape(-1).to("cpu", torch.int64)
        unique, inverse = unique_inverse(flat)
        pad_local = None
        if self.padding_idx is not None:
            keep = unique != self.padding_idx
            if not bool(keep.all()):
                pad_pos = int(torch.nonzero(~keep)[0])
                unique = unique[keep]
                pad_local = int(unique.numel())  # the zero row appended in _finish
                inverse = torch.where(inverse == pad_pos, pad_local,
                                      inverse - (inverse > pad_pos).to(torch.int64))
        return Lookup(ids, unique, inverse, pad_local)

    def _finish(self, lookup: Lookup, rows: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, int | None]:
        """(weight, local index of each id, local padding index): the pulled rows as one
        leaf tensor (remembered for the push when training), and where each id is."""
        ids = lookup.ids
        weight = rows.to(ids.device)
        if self.training and torch.is_grad_enabled():
            weight.requires_grad_(True)
            self._pending.append((lookup.unique, weight))
        if lookup.pad_local is not None:
            weight = torch.cat([weight, weight.new_zeros((1, self.spec.embedding_dim))])
        return weight, lookup.inverse.to(ids.device).reshape(ids.shape), lookup.pad_local

    def _lookup(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int | None]:
        if self.fused_into is not None:
            return self.fused_into[0]._lookup(self.fused_ids(ids))
        lookup = self._prepare(ids)
        return self._finish(lookup, self._source().pull(self.spec, lookup.unique))

    def _compute(self, weight: torch.Tensor, local: torch.Tensor, pad: int | None,
                 offsets: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError

    # ------------------------------------------------------------------ gradients
    def take_gradients(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The unique ids of this step's lookups and their summed gradient rows (float32
        CPU), and forget the lookups; None when nothing was looked up with grad."""
        pending, self._pending = self._pending, []
        parts = [(ids, leaf.grad) for ids, leaf in pending if leaf.grad is not None]
        if not parts:
            return None
        if len(parts) == 1:  # the usual case: the one lookup's rows, no copy
            return parts[0][0], parts[0][1].detach().to("cpu", torch.float32)
        ids = torch.cat([p[0] for p in parts])
        grads = torch.cat([p[1].detach().to("cpu", torch.float32) for p in parts])
        return coalesce(ids, grads)

    def clear_gradients(self) -> None:
        self._pending = []

    def extra_repr(self) -> str:
        rows = "dynamic" if self.spec.num_embeddings is None else self.spec.num_embeddings
        return f"{self.spec.name!r}, {rows}, {self.spec.embedding_dim}"


def gathered(weight: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """weight[local] with one trailing dim: an index_select, whose backward is one
    index_add_ into the unique rows' gradient (F.embedding's and F.embedding_bag's
    backward sort the indices first, which costs more than the whole gather)."""
    return weight.index_select(0, local.reshape(-1)).view(*local.shape, weight.shape[1])


class SparseEmbedding(_SparseLayer):
    """`nn.Embedding` whose rows live on the parameter servers (see the module doc)."""

    def __init__(self, name: str, num_embeddings: int | None, embedding_dim: int,
                 padding_idx: int | None = None, *, init_std: float | None = None,
                 admit_after: int = 1, evict_after_steps: int | None = None,
                 optimizer: dict[str, Any] | None = None, seed: int = 0) -> None:
        super().__init__(name, num_embeddings, embedding_dim, padding_idx, init_std,
                         admit_after, evict_after_steps, optimizer, seed)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self._compute(*self._lookup(ids), None)

    def _compute(self, weight: torch.Tensor, local: torch.Tensor, pad: int | None,
                 offsets: torch.Tensor | None) -> torch.Tensor:
        # The padding id's row is the zero row appended in `_finish`, outside the leaf.
        return gathered(weight, local)


class SparseEmbeddingBag(_SparseLayer):
    """`nn.EmbeddingBag` (sum or mean pooling) whose rows live on the parameter servers."""

    def __init__(self, name: str, num_embeddings: int | None, embedding_dim: int,
                 mode: Literal["sum", "mean"] = "mean", padding_idx: int | None = None, *,
                 init_std: float | None = None, admit_after: int = 1,
                 evict_after_steps: int | None = None,
                 optimizer: dict[str, Any] | None = None, seed: int = 0) -> None:
        if mode not in ("sum", "mean"):
            raise ValueError(f"sparse table {name!r}: mode is {mode!r}; it must be sum or "
                             "mean")
        super().__init__(name, num_embeddings, embedding_dim, padding_idx, init_std,
                         admit_after, evict_after_steps, optimizer, seed)
        self.mode = mode

    def forward(self, input: torch.Tensor, offsets: torch.Tensor | None = None
                ) -> torch.Tensor:  # noqa: A002 - nn.EmbeddingBag's name
        self.check_input(input, offsets)
        return self._compute(*self._lookup(input), offsets)

    @staticmethod
    def check_input(input: torch.Tensor, offsets: torch.Tensor | None) -> None:  # noqa: A002
        if input.dim() == 2:
            if offsets is not None:
                raise ValueError("offsets must be None when input is 2-D (fixed-size bags)")
        elif input.dim() == 1:
            if offsets is None:
                raise ValueError("offsets are required when input is 1-D")
        else:
            raise ValueError(f"input has {input.dim()} dimensions; it must be 1-D (with "
                             "offsets) or 2-D")

    def _compute(self, weight: torch.Tensor, local: torch.Tensor, pad: int | None,
                 offsets: torch.Tensor | None) -> torch.Tensor:
        if local.dim() == 2 and (pad is None or self.mode == "sum"):
            # Fixed-size bags: gather and reduce (the padding row is zero, so a sum
            # needs no mask; a mean with padding excludes it from the count: below).
            rows = gathered(weight, local)
            if rows.shape[1] == 1:
                return rows.squeeze(1)
            return rows.sum(1) if self.mode == "sum" else rows.mean(1)
        return F.embedding_bag(local, weight, offsets, mode=self.mode, padding_idx=pad)


def sparse_layers(model: nn.Module) -> Iterator[tuple[str, _SparseLayer]]:
    """The tables of `model`: its sparse layers (a fused collection's fused table in
    place of its members) with their module paths."""
    for path, module in model.named_modules():
        if isinstance(module, _SparseLayer) and module.fused_into is None:
            yield path, module


def apply_sparse_gradients(model: nn.Module) -> None:
    """Outside a trainer: apply this step's gradients to every local table (call after
    `loss.backward()`, beside the dense optimizer's `step()`)."""
    for _, layer in sparse_layers(model):
        taken = layer.take_gradients()
        if taken is not None:
            layer.local_source().apply(*taken)
