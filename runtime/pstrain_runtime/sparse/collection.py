"""`SparseEmbeddingCollection`: several sparse layers looked up together, and tables
of the same kind fused into one.

A model with tens of tables (a CTR model's 26 categorical features) would otherwise
pay per table, per step: a unique, a request per server, a lookup and an update on
each server. The collection instead

- fuses its fixed-size tables that agree on everything but their name and size (same
  dim, init_std, admission, eviction, optimizer, seed; no padding id; not yet bound to
  servers) into one table whose ids are the tables' ids offset one after the other
  (as TorchRec groups tables; `TableSpec.parts` records them). Each id keeps the
  initial row of its own table and rows are updated one by one, so the values are
  those of the separate tables: only the storage and the calls are shared;
- pulls the rows of every table in one call per server (`pull_many`).

A member layer called on its own still works (through the fused table). Checkpoints
and `pstrain export` name the fused table: `"+".join(member names)`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from .layer import Lookup, SparseEmbeddingBag, _SparseLayer, gathered

Input = torch.Tensor | tuple[torch.Tensor, torch.Tensor | None]


def _fusion_key(layer: _SparseLayer) -> tuple[Any, ...] | None:
    spec = layer.spec
    if (spec.num_embeddings is None or layer.padding_idx is not None
            or layer.source is not None or layer.fused_into is not None):
        return None
    return (spec.embedding_dim, spec.init_std, spec.admit_after, spec.evict_after_steps,
            spec.optimizer, spec.seed)


class FusedTable(_SparseLayer):
    """The one table behind several fused layers (it computes nothing itself)."""

    def __init__(self, members: Sequence[_SparseLayer]) -> None:
        first = members[0].spec
        super().__init__(first.name, first.num_embeddings, first.embedding_dim, None,
                         first.init_std, first.admit_after, first.evict_after_steps, None,
                         first.seed)
        parts = tuple((m.spec.name, int(m.spec.num_embeddings)) for m in members)  # type: ignore[arg-type]
        self.spec = replace(first, name="+".join(name for name, _ in parts),
                            num_embeddings=sum(n for _, n in parts), parts=parts)
        offset = 0
        for member, (_, n) in zip(members, parts, strict=True):
            member.fused_into = (self, offset)
            offset += n


def fuse_layers(layers: Sequence[_SparseLayer]) -> list[FusedTable]:
    """Fuse the layers that can share a table (see the module doc), at least two per
    table; a name given twice (layers sharing a table) is left alone."""
    names = [layer.spec.name for layer in layers]
    groups: dict[tuple[Any, ...], list[_SparseLayer]] = {}
    for layer in layers:
        key = _fusion_key(layer)
        if key is not None and names.count(layer.spec.name) == 1:
            groups.setdefault(key, []).append(layer)
    return [FusedTable(members) for members in groups.values() if len(members) > 1]


class SparseEmbeddingCollection(nn.Module):
    """Several sparse layers looked up together (see the module doc). `forward(inputs)`
    takes one input per layer, in order (ids, or `(input, offsets)` for a bag), and
    returns one output per layer, the same as calling each layer. `fuse=False` keeps
    every table separate (still one call per server)."""

    def __init__(self, layers: Sequence[_SparseLayer], fuse: bool = True) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.fused = nn.ModuleList(fuse_layers(layers) if fuse else [])

    def forward(self, inputs: Sequence[Input]) -> list[torch.Tensor]:
        if len(inputs) != len(self.layers):
            raise ValueError(f"{len(inputs)} inputs for {len(self.layers)} sparse layers; "
                             "give one per layer, in order")
        items = []
        for layer, item in zip(self.layers, inputs, strict=True):
            ids, offsets = item if isinstance(item, tuple) else (item, None)
            if isinstance(layer, SparseEmbeddingBag):
                layer.check_input(ids, offsets)
            items.append((ids, offsets))
        # The tables to pull: each unfused layer's own, each fused table once.
        tables: list[tuple[_SparseLayer, Lookup, list[int], bool]] = []
        for table in self.fused:
            members = [k for k, layer in enumerate(self.layers)
                       if layer.fused_into is not None and layer.fused_into[0] is table]
            flat, alike = self._fused_ids(members, items)
            tables.append((table, table._prepare(flat), members, alike))
        for k, layer in enumerate(self.layers):
            if layer.fused_into is None:
                tables.append((layer, layer._prepare(items[k][0]), [k], False))
        rows = _pull_all([(table, lookup.unique) for table, lookup, _, _ in tables])
        out: list[torch.Tensor | None] = [None] * len(self.layers)
        for (table, lookup, members, alike), pulled in zip(tables, rows, strict=True):
            weight, local, pad = table._finish(lookup, pulled)
            if not isinstance(table, FusedTable):
                out[members[0]] = table._compute(weight, local, pad, items[members[0]][1])
            elif alike:  # one gather for every member
                first = self.layers[members[0]]
                local = local.view(len(members), *items[members[0]][0].shape)
                for k, value in zip(members, _gathered_all(first, weight, local), strict=True):
                    out[k] = value
            else:
                sizes = [items[k][0].numel() for k in members]
                for k, part in zip(members, local.split(sizes), strict=True):
                    ids, offsets = items[k]
                    out[k] = self.layers[k]._compute(weight, part.reshape(ids.shape), None,
                                                     offsets)
        return out  # type: ignore[return-value]

    def _fused_ids(self, members: list[int], items: list[tuple[torch.Tensor, Any]]
                   ) -> tuple[torch.Tensor, bool]:
        """The members' ids as ids of their fused table, flat, and whether the members
        are alike (the same kind of layer, inputs of one shape, no offsets): then their
        ids are checked and offset in one go, and gathered in one."""
        layers = [self.layers[k] for k in members]
        ids = [items[k][0] for k in members]
        alike = (all(items[k][1] is None for k in members)
                 and len({tuple(i.shape) for i in ids}) == 1
                 and len({_kind(layer) for layer in layers}) == 1
                 and ids[0].dtype in (torch.int64, torch.int32)
                 and len({i.dtype for i in ids}) == 1 and ids[0].numel() > 0)
        if not alike:
            return torch.cat([layer.fused_ids(i).reshape(-1)
                              for layer, i in zip(layers, ids, strict=True)]), False
        stacked = torch.stack(ids).to(torch.int64).reshape(len(ids), -1)
        sizes = torch.tensor([layer.spec.num_embeddings for layer in layers])
        bad = (stacked.amin(1) < 0) | (stacked.amax(1) >= sizes)
        if bool(bad.any()):
            k = int(torch.nonzero(bad)[0])
            layers[k].fused_ids(ids[k])  # raises, naming the table and the id
        offsets = torch.tensor([layer.fused_into[1] for layer in layers])  # type: ignore[index]
        return (stacked + offsets[:, None]).reshape(-1), True


def _kind(layer: _SparseLayer) -> tuple[str, ...]:
    return ("bag", layer.mode) if isinstance(layer, SparseEmbeddingBag) else ("one",)


def _gathered_all(first: _SparseLayer, weight: torch.Tensor, local: torch.Tensor
                  ) -> tuple[torch.Tensor, ...]:
    """Alike members' outputs from one gather: local [members, *input shape]."""
    rows = gathered(weight, local)  # [members, *shape, dim]
    if isinstance(first, SparseEmbeddingBag):  # 2-D inputs: fixed-size bags
        rows = rows.squeeze(2) if rows.shape[2] == 1 else (
            rows.sum(2) if first.mode == "sum" else rows.mean(2))
    return rows.unbind(0)


def _pull_all(wanted: Sequence[tuple[_SparseLayer, torch.Tensor]]) -> list[torch.Tensor]:
    """The rows of each (table, unique ids): one `pull_many` per row source (one call
    per server), else a pull per table."""
    rows: list[torch.Tensor | None] = [None] * len(wanted)
    groups: dict[int, list[int]] = {}  # tables reading from the same servers
    for k, (table, _) in enumerate(wanted):
        source = table._source()
        groups.setdefault(id(getattr(source, "client", source)), []).append(k)
    for members in groups.values():
        source = wanted[members[0]][0]._source()
        specs = [wanted[k][0].spec for k in members]
        ids = [wanted[k][1] for k in members]
        pull_many = getattr(source, "pull_many", None)
        pulled = (pull_many(specs, ids) if pull_many is not None
                  else [source.pull(spec, i) for spec, i in zip(specs, ids, strict=True)])
        for k, value in zip(members, pulled, strict=True):
            rows[k] = value
    return rows  # type: ignore[return-value]
