"""Entry points that fail when called, take other arguments, or return no Task."""

from __future__ import annotations

from typing import Any

import torch

from pstrain_runtime.task import Task


def raises_when_called() -> Task:
    raise KeyError("feature_columns")


def needs_arguments(width: int, depth: int) -> Task:
    raise AssertionError("never called: the arguments do not fit")


def returns_a_dict() -> Any:
    return {"model": torch.nn.Linear(2, 1)}


def returns_a_task_with_a_bad_loss() -> Task:
    def batches(worker: int, num_workers: int, batch_size: int, seed: int) -> Any:
        while True:
            yield torch.zeros(batch_size, 2), torch.zeros(batch_size, 1)

    return Task(model=torch.nn.Linear(2, 1), batches=batches, loss="mse",  # type: ignore[arg-type]
                evaluate=lambda model: {})


not_a_function = 42
