"""Row-wise optimizer updates: pure functions over a block of rows, their gradients
and their optimizer slots (lazy, per row: only the rows of the batch are touched).

They match torch.optim on `nn.Embedding(sparse=True)`:
- SGD: `torch.optim.SGD` with a sparse gradient (row -= lr * g).
- Adagrad: `torch.optim.Adagrad` with a sparse gradient (sum += g^2 on the touched
  rows, row -= lr * g / (sqrt(sum) + eps)).
- Adam: `torch.optim.SparseAdam` (moments of the touched rows only; bias correction
  with the step `t` of the update, the same for all rows of the update).
Weight decay, which torch refuses with sparse gradients, is applied to the touched
rows only (g += weight_decay * row), as TensorFlow's lazy optimizers do.
"""

from __future__ import annotations

import math

import torch

from ..optim import OptimizerConfig


def apply_rows(config: OptimizerConfig, rows: torch.Tensor, grads: torch.Tensor,
               slots: dict[str, torch.Tensor], t: int,
               scratch: torch.Tensor | None = None) -> None:
    """Update `rows` [n, dim] and `slots` (each [n, dim]) in place with `grads` [n, dim]
    (one coalesced gradient per row). `t` (>= 1) is the update's step, for Adam.
    `scratch`: a float32 [n, dim] block Adagrad may use for its denominator (else it
    allocates one); the values are the same either way."""
    if config.weight_decay:
        grads = grads.add(rows, alpha=config.weight_decay)
    lr = config.learning_rate
    if config.name == "sgd":
        rows.add_(grads, alpha=-lr)
    elif config.name == "adagrad":
        acc = slots["sum"]
        acc.addcmul_(grads, grads, value=1)
        denom = torch.sqrt(acc, out=scratch).add_(config.eps)
        rows.add_(torch.div(grads, denom, out=denom), alpha=-lr)
    elif config.name == "adam":
        exp_avg, exp_avg_sq = slots["exp_avg"], slots["exp_avg_sq"]
        # The operations of torch.optim.SparseAdam, in its order.
        exp_avg.add_(grads.sub(exp_avg).mul_(1 - config.beta1))
        exp_avg_sq.add_(grads.pow(2).sub_(exp_avg_sq).mul_(1 - config.beta2))
        bias_correction1 = 1 - config.beta1 ** t
        bias_correction2 = 1 - config.beta2 ** t
        step_size = lr * math.sqrt(bias_correction2) / bias_correction1
        rows.add_(exp_avg.div(exp_avg_sq.sqrt().add_(config.eps)).mul_(-step_size))
    else:
        raise ValueError(f"optimizer {config.name!r} has no row-wise form")


def coalesce(ids: torch.Tensor, grads: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Unique ids (sorted) and the sum of the gradient rows of each (repeats summed)."""
    if ids.numel() < 2 or bool((ids[1:] > ids[:-1]).all()):
        return ids, grads  # already sorted and unique (what workers send)
    unique, inverse = torch.unique(ids, sorted=True, return_inverse=True)
    if unique.numel() == ids.numel():
        order = torch.argsort(ids)
        return unique, grads[order]
    summed = torch.zeros((unique.numel(), grads.shape[1]), dtype=grads.dtype)
    summed.index_add_(0, inverse, grads)
    return unique, summed
