"""Checks of ids and gradient rows, shared by the parameter server and the local table:
bad input raises `PSError` (INVALID_ARGUMENT) naming the table, the value and the rule,
before anything is changed."""

from __future__ import annotations

import torch

from ..ps.store import PSError, is_all_finite
from .spec import TableSpec


def _invalid(message: str) -> PSError:
    return PSError("INVALID_ARGUMENT", message)


def check_ids(spec: TableSpec, ids: torch.Tensor, call: str) -> None:
    if ids.dtype != torch.int64:
        raise _invalid(f"{call}: sparse table {spec.name!r} got ids of dtype "
                       f"{str(ids.dtype).removeprefix('torch.')}; ids must be int64")
    if not ids.numel():
        return
    low = int(ids.min())
    if low < 0:
        raise _invalid(f"{call}: sparse table {spec.name!r} got id {low}; ids must be >= 0")
    if spec.num_embeddings is not None:
        high = int(ids.max())
        if high >= spec.num_embeddings:
            raise _invalid(f"{call}: sparse table {spec.name!r} got id {high}; it has "
                           f"{spec.num_embeddings} rows, so ids must be in "
                           f"0..{spec.num_embeddings - 1}")


def check_grads(spec: TableSpec, ids: torch.Tensor, grads: torch.Tensor, call: str) -> None:
    check_ids(spec, ids, call)
    if grads.dim() != 2 or grads.shape[1] != spec.embedding_dim:
        raise _invalid(f"{call}: sparse table {spec.name!r} got gradient rows of shape "
                       f"{list(grads.shape)}; rows must have {spec.embedding_dim} values")
    if grads.shape[0] != ids.numel():
        raise _invalid(f"{call}: sparse table {spec.name!r} got {ids.numel()} ids and "
                       f"{grads.shape[0]} gradient rows; they must match one to one")
    if not is_all_finite(grads):
        raise _invalid(f"{call}: sparse table {spec.name!r}: a gradient row contains NaN "
                       "or inf; the push was rejected and not applied")
