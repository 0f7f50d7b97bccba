"""A sparse table's definition (`TableSpec`) and its row-wise optimizer settings.

A spec is frozen and validated up front; its JSON form travels to the parameter
servers (which create their shard of the table from it) and its canonical text enters
the model fingerprint, so a checkpoint is only restored into the same tables.
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Any

import numpy as np
import torch

from ..optim import OptimizerConfig, hyperparameter_problem
from . import ids as idrule

ROW_OPTIMIZERS = ("sgd", "adagrad", "adam")
ROW_SLOTS: dict[str, tuple[str, ...]] = {"sgd": (), "adagrad": ("sum",),
                                         "adam": ("exp_avg", "exp_avg_sq")}
ROW_DTYPE_BYTES = 4  # rows and optimizer slots are float32


def optimizer_from_dict(options: dict[str, Any], where: str) -> OptimizerConfig:
    """An `OptimizerConfig` from a dict with the job YAML's keys (camelCase or
    snake_case: `name`, `learningRate`, `weightDecay`, `beta1`, `beta2`, `eps`,
    `initialAccumulatorValue`), validated like `spec.training.optimizer`."""
    from pstrain_api.model import Optimizer
    from pydantic import ValidationError

    try:
        model = Optimizer.model_validate(options)
    except ValidationError as exc:
        first = exc.errors()[0]
        field = ".".join(str(p) for p in first["loc"])
        raise ValueError(f"{where}.optimizer.{field}: {first['msg']} "
                         f"(got {options!r})") from None
    return OptimizerConfig.from_model(model)


@dataclass(frozen=True)
class TableSpec:
    """One sparse table. `num_embeddings` None: a dynamic table (any id >= 0)."""

    name: str
    num_embeddings: int | None
    embedding_dim: int
    init_std: float
    admit_after: int = 1
    evict_after_steps: int | None = None
    optimizer: OptimizerConfig | None = None  # None: the job's optimizer
    seed: int = 0
    # A fused table (`SparseEmbeddingCollection`): the tables it holds, in order, as
    # (name, num_embeddings); table k's id i is id offset_k + i here, and its initial
    # row is the one table k alone would have (its own stream), so fusing changes no
    # value. Empty: a table of its own.
    parts: tuple[tuple[str, int], ...] = ()

    def __post_init__(self) -> None:
        where = f"sparse table {self.name!r}"
        if not self.name or not isinstance(self.name, str):
            raise ValueError(f"sparse table name is {self.name!r}; it must be a non-empty "
                             "string")
        if self.num_embeddings is not None and self.num_embeddings < 1:
            raise ValueError(f"{where}: num_embeddings is {self.num_embeddings}; it must be "
                             "at least 1, or None for a dynamic table")
        if self.embedding_dim < 1:
            raise ValueError(f"{where}: embedding_dim is {self.embedding_dim}; it must be at "
                             "least 1")
        if not (math.isfinite(self.init_std) and self.init_std >= 0):
            raise ValueError(f"{where}: init_std is {self.init_std}; it must be a finite "
                             "number >= 0")
        if self.admit_after < 1:
            raise ValueError(f"{where}: admit_after is {self.admit_after}; it must be at "
                             "least 1 (1 admits an id on its first update)")
        if self.evict_after_steps is not None and self.evict_after_steps < 1:
            raise ValueError(f"{where}: evict_after_steps is {self.evict_after_steps}; it "
                             "must be at least 1, or None to keep rows forever")
        if self.optimizer is not None:
            check_row_optimizer(self.optimizer, where)
        if self.parts and (self.num_embeddings != sum(n for _, n in self.parts)
                           or any(n < 1 for _, n in self.parts)):
            raise ValueError(f"{where}: parts {list(self.parts)} must have at least 1 row "
                             "each and num_embeddings their sum")

    @property
    def dynamic(self) -> bool:
        return self.num_embeddings is None

    def with_defaults(self, optimizer: OptimizerConfig, seed: int) -> TableSpec:
        """This spec with the job's optimizer (where it names none) and seed."""
        return replace(self, optimizer=self.optimizer or optimizer, seed=seed)

    def row_bytes(self) -> int:
        """Bytes of one row plus its optimizer state (the raw payload, no overhead)."""
        slots = len(ROW_SLOTS[self.optimizer.name]) if self.optimizer else 0
        return self.embedding_dim * ROW_DTYPE_BYTES * (1 + slots)

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["optimizer"] = asdict(self.optimizer) if self.optimizer else None
        if not self.parts:
            del data["parts"]  # a table of its own: the definition it always had
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> TableSpec:
        opt = data.get("optimizer")
        parts = tuple((str(name), int(n)) for name, n in data.get("parts") or ())
        return cls(**{**data, "optimizer": OptimizerConfig(**opt) if opt else None,
                      "parts": parts})

    def initializer(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """ids (int64) -> their initial rows (`ids.initial_rows`; in a fused table,
        each id's from its own table's stream)."""
        dim, std = self.embedding_dim, self.init_std
        if not self.parts:
            stream = idrule.stream_of(self.seed, self.name)
            return lambda ids: idrule.initial_rows(ids, dim, std, stream)
        sizes = [n for _, n in self.parts]
        starts = torch.tensor([0, *itertools.accumulate(sizes)][:-1])
        streams = np.array([idrule.stream_of(self.seed, name) for name, _ in self.parts],
                           dtype=np.uint64)

        def initial(ids: torch.Tensor) -> torch.Tensor:
            part = torch.searchsorted(starts, ids, right=True) - 1
            return idrule.initial_rows(ids - starts[part], dim, std, streams[part.numpy()])

        return initial

    def canonical(self) -> str:
        """The definition as one stable line (for fingerprints and comparisons)."""
        return json.dumps(self.to_json(), sort_keys=True, separators=(",", ":"))


def check_row_optimizer(config: OptimizerConfig, where: str) -> None:
    problem = hyperparameter_problem(config)
    if problem is not None:
        raise ValueError(f"{where}: {problem}")
    if config.name not in ROW_OPTIMIZERS:
        raise ValueError(f"{where}: optimizer {config.name!r} has no row-wise form; sparse "
                         f"tables use one of {list(ROW_OPTIMIZERS)} (give the table its "
                         "own optimizer=...)")
