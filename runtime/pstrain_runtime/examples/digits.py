"""An MLP on scikit-learn's bundled 8x8 digits (1797 images, no download).

`pstrain_runtime.examples.digits:make_task` with optional args `hidden` (default 64)
and `test_fraction` (default 0.25). Features are scaled to [0, 1]; the split is fixed
(seed 0) so every replica agrees on it.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from functools import lru_cache

import torch
from torch import nn

from ..task import Batch, Task


@lru_cache(maxsize=4)
def load_digits_split(test_fraction: float = 0.25) -> tuple[torch.Tensor, ...]:
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    data = load_digits()
    x = torch.tensor(data.data, dtype=torch.float32) / 16.0
    y = torch.tensor(data.target, dtype=torch.int64)
    idx_train, idx_test = train_test_split(
        torch.arange(len(y)).numpy(), test_size=test_fraction, random_state=0,
        stratify=y.numpy())
    return x[idx_train], y[idx_train], x[idx_test], y[idx_test]


def build_model(hidden: int = 64, seed: int = 0) -> nn.Module:
    gen_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, 10))
    torch.random.set_rng_state(gen_state)
    return model


def batches(x: torch.Tensor, y: torch.Tensor, worker: int, num_workers: int,
            batch_size: int, seed: int, start: int = 0) -> Iterator[Batch]:
    """Endless epochs over this worker's slice of the data, reshuffled every epoch;
    from batch number `start` on (whole epochs skipped by their shuffle alone)."""
    own = torch.arange(worker, len(y), max(1, num_workers))
    gen = torch.Generator().manual_seed(seed * 1000 + worker)
    per_epoch = max(1, len(own) // batch_size)
    skip_epochs, skip = divmod(start, per_epoch)
    for _ in range(skip_epochs):
        torch.randperm(len(own), generator=gen)  # the same shuffles as without `start`
    while True:
        order = own[torch.randperm(len(own), generator=gen)]
        if len(order) < batch_size:
            yield x[order], y[order]
            continue
        for first in range(skip * batch_size, len(order) - batch_size + 1, batch_size):
            pick = order[first:first + batch_size]
            yield x[pick], y[pick]
        skip = 0


def make_task(hidden: int = 64, test_fraction: float = 0.25) -> Task:
    x_train, y_train, x_test, y_test = load_digits_split(test_fraction)
    loss_fn = nn.CrossEntropyLoss()

    def evaluate(model: nn.Module) -> Mapping[str, float]:
        with torch.no_grad():
            device = next(model.parameters()).device
            out = model(x_test.to(device))
            loss = float(loss_fn(out, y_test.to(device)))
            acc = float((out.argmax(1).cpu() == y_test).float().mean())
        return {"accuracy": acc, "loss": loss}

    return Task(
        model=build_model(hidden),
        batches=lambda w, n, b, s, start=0: batches(x_train, y_train, w, n, b, s, start),
        loss=loss_fn,
        evaluate=evaluate,
    )
