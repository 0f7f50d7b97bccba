"""The entry-point contract: how a user's `module:function` hands pstrain a model, its
data, its loss and its evaluation.

`spec.training.entrypoint` names a function; `spec.training.args` are its keyword
arguments. The function returns a `Task` (or any object with the same attributes):

- `model`: a `torch.nn.Module`. Every replica calls the function, so it must build the
  same parameter names and shapes everywhere; the chief's initial values are the ones
  installed on the parameter servers.
- `batches(worker, num_workers, batch_size, seed, start=0)`: an iterator of
  `(inputs, targets)` for this worker, endless or long enough for the job. Workers
  should see different data (shard by `worker`), deterministically from `seed`.
  `start` is where to resume: the iterator begins with the batch that would be number
  `start` (from 0) of the stream it yields with `start=0`. pstrain keeps each worker's
  count of drawn batches in every checkpoint and on the parameter servers, so after a
  restore or a restart a worker continues where it left off. A `batches` without a
  `start` parameter still works: pstrain draws and drops the first `start` batches.
  When the worker set changes size while the job runs (elastic workers), the trainer
  calls `batches` again with the new `num_workers` and `start=0`: its shard of the new
  partition, from the beginning.
- `loss(outputs, targets)`: a scalar tensor; it should be a mean over the batch (sync
  mode averages gradients over workers).
- `evaluate(model)`: returns a dict of metrics, with `accuracy` (0..1) when the task
  has one and optionally `loss`; a ranking task returns `auc` and `logloss` instead
  (see examples/ctr.py). Only the chief calls it; every metric reaches the job's status,
  and `accuracy`, `auc` and `logloss` the progress and `pstrain run --json`.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from pstrain_api.entrypoint import EntrypointError, resolve_entrypoint
from pstrain_api.quote import describe, one_line

from .failure import ConfigurationError

Batch = tuple[torch.Tensor, torch.Tensor]


@dataclass
class Task:
    model: torch.nn.Module
    batches: Callable[..., Iterator[Batch]]
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    evaluate: Callable[[torch.nn.Module], Mapping[str, float]]


REQUIRED = ("model", "batches", "loss", "evaluate")


def load_task(entrypoint: str, args: Mapping[str, Any] | None = None) -> Task:
    """Import `module:function`, call it with `args`, and check what it returned.

    Every way this can go wrong is the job's configuration, not a passing fault, so
    each raises `ConfigurationError` with one line that names the entry point and the
    cause (no traceback): the replica exits with the configuration-error code and the
    job fails at once.
    """
    kwargs = dict(args or {})
    try:
        func = resolve_entrypoint(entrypoint)
    except EntrypointError as exc:
        raise ConfigurationError(str(exc)) from exc.__cause__
    where, func_name = f"spec.training.entrypoint {entrypoint!r}", entrypoint.partition(":")[2]
    try:
        inspect.signature(func).bind(**kwargs)
    except TypeError as exc:
        raise ConfigurationError(f"spec.training.args {sorted(kwargs)} do not fit the "
                                 f"signature of {entrypoint}: {one_line(str(exc))}") from exc
    except ValueError:
        pass  # no signature to check (a builtin): the call below tells
    try:
        task = func(**kwargs)
    except Exception as exc:  # the user's function may raise anything
        raise ConfigurationError(f"{where}: calling {func_name}(**spec.training.args) "
                                 f"raised {describe(exc)}") from exc
    missing = [name for name in REQUIRED if not hasattr(task, name)]
    if missing:
        raise ConfigurationError(f"{where} returned {type(task).__name__}, which lacks "
                                 f"{missing}; it must return a pstrain_runtime.task.Task")
    if not isinstance(task.model, torch.nn.Module):
        raise ConfigurationError(f"{where} returned a model of type "
                                 f"{type(task.model).__name__}; it must be a torch.nn.Module")
    not_callable = [name for name in REQUIRED[1:] if not callable(getattr(task, name))]
    if not_callable:
        raise ConfigurationError(f"{where} returned a Task whose {not_callable} are not "
                                 "callable")
    return task  # type: ignore[no-any-return]


def takes_start(batches: Callable[..., Iterator[Batch]]) -> bool:
    """Whether `batches` accepts the `start` keyword (or any keyword)."""
    try:
        params = inspect.signature(batches).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.name == "start" or p.kind is p.VAR_KEYWORD for p in params)


def open_batches(task: Task, worker: int, num_workers: int, batch_size: int, seed: int,
                 start: int = 0) -> Iterator[Batch]:
    """This worker's batches, from number `start` of its stream on (see the contract
    above). Raises ValueError when a finite stream ends before `start`."""
    if takes_start(task.batches):
        return iter(task.batches(worker, num_workers, batch_size, seed, start=start))
    stream = iter(task.batches(worker, num_workers, batch_size, seed))
    if start:
        print(f"pstrain: batches() takes no `start`; drawing and dropping {start} batches "
              "to resume where this worker left off (accept `start` to resume at once)",
              flush=True)
    for drawn in range(start):
        if next(stream, None) is None:
            raise ValueError(f"batches() ran out after {drawn} batches while resuming at "
                             f"batch {start}; it must be endless or long enough for the job")
    return stream
