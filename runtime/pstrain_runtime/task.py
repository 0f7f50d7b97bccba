"""The entry-point contract: how a user's `module:function` hands pstrain a model, its
data, its loss and its evaluation.

`spec.training.entrypoint` names a function; `spec.training.args` are its keyword
arguments. The function returns a `Task` (or any object with the same attributes):

- `model`: a `torch.nn.Module`. Every replica calls the function, so it must build the
  same parameter names and shapes everywhere; the chief's initial values are the ones
  installed on the parameter servers.
- `batches(worker, num_workers, batch_size, seed)`: an iterator of `(inputs, targets)`
  for this worker, endless or long enough for the job. Workers should see different
  data (shard by `worker`), deterministically from `seed`.
- `loss(outputs, targets)`: a scalar tensor; it should be a mean over the batch (sync
  mode averages gradients over workers).
- `evaluate(model)`: returns a dict of metrics, with `accuracy` (0..1) when the task
  has one and optionally `loss`. Only the chief calls it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from pstrain_api.entrypoint import resolve_entrypoint

Batch = tuple[torch.Tensor, torch.Tensor]


@dataclass
class Task:
    model: torch.nn.Module
    batches: Callable[[int, int, int, int], Iterator[Batch]]
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    evaluate: Callable[[torch.nn.Module], Mapping[str, float]]


REQUIRED = ("model", "batches", "loss", "evaluate")


def load_task(entrypoint: str, args: Mapping[str, Any] | None = None) -> Task:
    """Import `module:function`, call it with `args`, and check what it returned.
    EntrypointError (a ValueError) when it cannot be imported."""
    func = resolve_entrypoint(entrypoint)
    try:
        task = func(**dict(args or {}))
    except TypeError as exc:
        raise ValueError(f"spec.training.args {dict(args or {})} do not fit "
                         f"{entrypoint}: {exc}") from exc
    missing = [name for name in REQUIRED if not hasattr(task, name)]
    if missing:
        raise ValueError(f"{entrypoint} returned {type(task).__name__}, which lacks "
                         f"{missing}; see pstrain_runtime.task.Task")
    if not isinstance(task.model, torch.nn.Module):
        raise ValueError(f"{entrypoint} returned a model of type "
                         f"{type(task.model).__name__}; it must be a torch.nn.Module")
    return task  # type: ignore[no-any-return]
