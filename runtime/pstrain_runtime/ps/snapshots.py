"""Copies of a parameter server's shard taken at checkpoint steps.

The chief writes a checkpoint once it sees the global step reach a multiple of
`intervalSteps`; by the time it reads the servers, other workers' asynchronous pushes
have moved the step on (checkpoints used to land at 101, 202, 302, ...). So a server
keeps a copy of its shard, parameters and optimizer state, taken under its apply lock
at the moment its step reaches each multiple; the chief asks for the copy at that step
(`PullRequest.at_step`) and the checkpoint holds exactly step 100, 200, 300, ...

One copy is kept, the latest: it costs one shard's memory, and only when the job
writes checkpoints.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from ..optim import OptimizerState


@dataclass(frozen=True)
class StepSnapshot:
    step: int
    params: dict[str, torch.Tensor]
    states: dict[str, OptimizerState]
    positions: tuple[int, ...] = ()  # per worker, where its data stood (see store)


def snapshot_if_due(step: int, every: int, params: Mapping[str, torch.Tensor],
                    states: Mapping[str, OptimizerState]) -> StepSnapshot | None:
    """A copy of the shard when `step` is a multiple of `every` (> 0), else None."""
    if every <= 0 or step % every:
        return None
    return StepSnapshot(
        step=step,
        params={key: p.clone() for key, p in params.items()},
        states={key: OptimizerState(step=s.step,
                                    slots={n: v.clone() for n, v in s.slots.items()})
                for key, s in states.items()})
