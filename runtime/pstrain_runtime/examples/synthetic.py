"""A large MLP on synthetic data, to stress the transport.

`pstrain_runtime.examples.synthetic:make_task` with args `hidden` and `layers`: an
input layer of `hidden` features, `layers` hidden Linear(hidden, hidden) blocks, and
a 10-class head, so the parameter count is about (layers + 1) * hidden**2: with
hidden=2048, layers=3 that is 16.8 M float32 values, 67 MB. The data is a fixed random
linear teacher, so the loss goes down and accuracy is meaningful.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch
from torch import nn

from ..task import Batch, Task

CLASSES = 10


def build_model(hidden: int, layers: int, seed: int = 0) -> nn.Module:
    state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    blocks: list[nn.Module] = [nn.Linear(hidden, hidden), nn.ReLU()]
    for _ in range(layers):
        blocks += [nn.Linear(hidden, hidden), nn.ReLU()]
    blocks.append(nn.Linear(hidden, CLASSES))
    model = nn.Sequential(*blocks)
    torch.random.set_rng_state(state)
    return model


def make_task(hidden: int = 2048, layers: int = 3, eval_size: int = 512) -> Task:
    if hidden < 1 or layers < 0:
        raise ValueError(f"hidden is {hidden} and layers is {layers}; hidden must be at "
                         "least 1 and layers at least 0")
    teacher = torch.randn(hidden, CLASSES, generator=torch.Generator().manual_seed(1234))

    def sample(gen: torch.Generator, n: int) -> Batch:
        x = torch.randn(n, hidden, generator=gen)
        return x, (x @ teacher).argmax(1)

    def batches(worker: int, num_workers: int, batch_size: int, seed: int) -> Iterator[Batch]:
        gen = torch.Generator().manual_seed(seed * 1000 + worker + 1)
        while True:
            yield sample(gen, batch_size)

    x_eval, y_eval = sample(torch.Generator().manual_seed(999), eval_size)
    loss_fn = nn.CrossEntropyLoss()

    def evaluate(model: nn.Module) -> Mapping[str, float]:
        with torch.no_grad():
            device = next(model.parameters()).device
            out = model(x_eval.to(device))
            return {"accuracy": float((out.argmax(1).cpu() == y_eval).float().mean()),
                    "loss": float(loss_fn(out, y_eval.to(device)))}

    return Task(model=build_model(hidden, layers), batches=batches, loss=loss_fn,
                evaluate=evaluate)
