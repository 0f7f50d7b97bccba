"""A small model with sparse tables, and its plain-PyTorch twin, for the sparse tests."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from torch import nn

from pstrain_runtime.sparse import SparseEmbedding, SparseEmbeddingBag, initial_rows, stream_of
from pstrain_runtime.sparse.client import SparseClient
from pstrain_runtime.task import Task
from pstrain_runtime.worker.context import WorkerRole
from pstrain_runtime.worker.trainer import Trainer

from .builders import Events, run_trainers

__all__ = ["Events", "Net", "all_tag_ids", "batches", "loss", "make_task", "run_job",
           "table_rows"]

ITEMS, ITEM_DIM, TAG_DIM, TAG_SPACE = 40, 8, 4, 1 << 40


class Net(nn.Module):
    """Items (fixed table, 3 ids per sample, ids repeat inside a batch) and tags (a
    dynamic table of huge ids, bags of 4 pooled by sum) into a linear head."""

    def __init__(self, reference: bool = False, tag_ids: torch.Tensor | None = None,
                 seed: int = 0, table_options: dict | None = None) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.head = nn.Linear(ITEM_DIM + TAG_DIM, 1)
        opts = dict(table_options or {})
        if not reference:
            self.items = SparseEmbedding("items", ITEMS, ITEM_DIM, init_std=0.3, **opts)
            self.tags = SparseEmbeddingBag("tags", None, TAG_DIM, mode="sum", init_std=0.2,
                                           **opts)
            self.tag_index = None
            return
        # The twin: nn.Embedding(sparse=True) initialised with the tables' initial rows.
        self.items = nn.Embedding(ITEMS, ITEM_DIM, sparse=True)
        self.tags = nn.EmbeddingBag(len(tag_ids), TAG_DIM, mode="sum", sparse=True)
        with torch.no_grad():
            self.items.weight.copy_(initial_rows(torch.arange(ITEMS), ITEM_DIM, 0.3,
                                                 stream_of(seed, "items")))
            self.tags.weight.copy_(initial_rows(tag_ids, TAG_DIM, 0.2, stream_of(seed, "tags")))
        self.tag_index = tag_ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        items, tags = x[:, :3], x[:, 3:]
        if self.tag_index is not None:  # huge tag ids -> rows of the twin's table
            tags = torch.searchsorted(self.tag_index, tags.contiguous())
        features = torch.cat([self.items(items).mean(1), self.tags(tags)], dim=1)
        return self.head(features).squeeze(1)


def batches(worker: int, num_workers: int, batch_size: int, seed: int
            ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1000 + worker)
    tag_pool = all_tag_ids()
    while True:
        items = torch.randint(0, ITEMS // 4, (batch_size, 3), generator=gen)  # repeats
        tags = tag_pool[torch.randint(0, len(tag_pool), (batch_size, 4), generator=gen)]
        y = torch.randn(batch_size, generator=gen)
        yield torch.cat([items, tags], dim=1), y


def all_tag_ids() -> torch.Tensor:
    gen = torch.Generator().manual_seed(7)
    return torch.unique(torch.randint(0, TAG_SPACE, (30,), generator=gen))


def loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((out - y) ** 2).mean()


def make_task(table_options: dict | None = None) -> Task:
    def evaluate(model: nn.Module) -> dict[str, float]:
        device = next(model.parameters()).device  # the trainer's: CPU or CUDA
        x, y = (t.to(device) for t in next(batches(99, 1, 64, 0)))
        with torch.no_grad():
            return {"loss": float(loss(model(x), y))}

    return Task(model=Net(table_options=table_options), batches=batches, loss=loss,
                evaluate=evaluate)


def run_job(job, transports, num_workers: int = 1,
            emit: Callable[..., None] | None = None, table_options: dict | None = None,
            progress_interval: float = 0.05) -> list[Trainer]:
    """Run a job of `make_task` models (bounded, see `run_trainers`), then close it."""
    trainers = [Trainer(job, WorkerRole("ns", w, num_workers), transports,
                        emit=emit if (emit is not None and w == 0) else lambda *a, **k: None,
                        progress_interval=progress_interval,
                        task=make_task(table_options))
                for w in range(num_workers)]
    run_trainers(trainers, transports)
    for trainer in trainers:
        trainer.close()
    return trainers


def table_rows(trainer: Trainer, name: str, ids: torch.Tensor) -> torch.Tensor:
    """A finished trainer's table rows, read from its servers (its own client is closed)."""
    client = SparseClient(trainer.sparse.client.transports, "ns")
    try:
        return client.pull(trainer.sparse.specs[name], ids)
    finally:
        client.close()
