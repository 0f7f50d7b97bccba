"""A parameter server with a disk tier (`spec.training.sparseStorage`) that dies and comes
back on a new node: its directory is a fresh, empty volume (an emptyDir), yet the chief
restores it from the last checkpoint, the rows beyond its memory budget go to the new
disk, every row equals the checkpoint's, and the job trains on to its last step.

The servers are in-process stores behind `KillableTransport` (the restart a runner or
the operator does, at the same address, empty), with their real tiered tables on disk;
`test_sparse_processes` restarts a server process, `test_sparse_disk` covers restores
into fresh tables one by one."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

pytest.importorskip("rocksdict")

from pstrain_runtime.checkpoint import load_checkpoint, sparse_links  # noqa: E402
from pstrain_runtime.export import read_chain_table  # noqa: E402
from pstrain_runtime.optim import OptimizerConfig  # noqa: E402
from pstrain_runtime.sparse import SparseEmbedding  # noqa: E402
from pstrain_runtime.sparse.ids import split_by_owner  # noqa: E402
from pstrain_runtime.sparse.spec import TableSpec  # noqa: E402
from pstrain_runtime.task import Task  # noqa: E402
from pstrain_runtime.worker.context import WorkerRole  # noqa: E402
from pstrain_runtime.worker.trainer import Trainer  # noqa: E402

from .builders import Events, KillableTransport, run_trainers, training  # noqa: E402
from .test_sparse_disk import budget_for, pages, rows_of  # noqa: E402

pytestmark = pytest.mark.timeout(60)
DIM, POOL, HOT = 4, 8000, 1024  # row size, ids in use, rows in RAM per server
ADAGRAD = {"name": "adagrad", "learningRate": 0.1}


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.rows = SparseEmbedding("rows", None, DIM, init_std=0.2)
        self.head = nn.Linear(DIM, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.rows(x).mean(1)).squeeze(1)


def make_task() -> Task:
    ids = torch.unique(torch.randint(0, 1 << 40, (POOL,), generator=torch.Generator()
                                     .manual_seed(7)))

    def batches(worker: int, num_workers: int, batch_size: int, seed: int):  # noqa: ANN202
        gen = torch.Generator().manual_seed(100 + worker)
        while True:
            x = ids[torch.randint(0, len(ids), (batch_size, 4), generator=gen)]
            yield x, torch.randn(batch_size, generator=gen)

    def loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return ((out - y) ** 2).mean()

    return Task(model=Net(), batches=batches, loss=loss, evaluate=lambda model: {})


def live_rows(transports: list[KillableTransport]) -> dict[int, tuple[torch.Tensor, ...]]:
    out: dict[int, tuple[torch.Tensor, ...]] = {}
    for ps, transport in enumerate(transports):
        rows = rows_of(pages(transport.store.namespace("ns").sparse.tables["rows"]))
        ids = torch.tensor(sorted(rows), dtype=torch.int64)
        assert len(split_by_owner(ids, 2)[ps]) == len(ids)  # each id on its own server
        out.update(rows)
    return out


def test_a_server_restarted_on_a_new_node_restores_its_disk_tier_from_the_checkpoint(
        tmp_path: Path) -> None:
    spec = TableSpec("rows", None, DIM, 0.2, optimizer=OptimizerConfig.from_model(
        training(optimizer=ADAGRAD).optimizer))
    volume, checkpoints = tmp_path / "rows", tmp_path / "ckpt"
    volume.mkdir()
    job = training(steps=40, batchSize=64, mode="sync", optimizer=ADAGRAD,
                   checkpoint={"directory": str(checkpoints), "intervalSteps": 10},
                   sparseStorage={"serverMemory": str(budget_for(spec, HOT)),
                                  "directory": str(volume)})
    transports = [KillableTransport(0), KillableTransport(1)]
    events, seen = Events(), {}  # type: ignore[var-annotated]

    def kill_ps1_then_read_the_restore(kind: str, fields: dict[str, Any]) -> None:
        seen["checkpointed"] = seen.get("checkpointed") or kind == "checkpoint"
        if kind == "progress" and fields["step"] >= 25 and seen["checkpointed"] \
                and "killed" not in seen:
            seen["killed"] = fields["step"]
            transports[1].kill()
            # A new node: the old disk stays behind, the volume is new and empty.
            (volume / "pstrain-ps1").rename(tmp_path / "the-old-node")
            transports[1].restart()
        if kind == "restored":
            table = transports[1].store.namespace("ns").sparse.tables["rows"]
            seen.update(restored=fields, rows=live_rows(transports), tiers=table.tier_stats(),
                        folder=[p.name for p in (volume / "pstrain-ps1").iterdir()])

    events.hooks.append(kill_ps1_then_read_the_restore)
    trainer = Trainer(job, WorkerRole("ns", 0, 1), transports, emit=events,
                      progress_interval=0.0, task=make_task())
    try:
        run_trainers([trainer], transports, bound=45.0)
    finally:
        trainer.close()

    restored = seen["restored"]
    assert restored["servers"] == [1] and 10 <= restored["step"] <= seen["killed"], restored
    ckpt = load_checkpoint(Path(restored["path"]))
    ids, rows, _ = read_chain_table(checkpoints, sparse_links(ckpt.sparse), "rows")
    got = seen["rows"]
    assert sorted(got) == ids.tolist()
    for i, row in zip(ids.tolist(), rows, strict=True):
        assert torch.equal(got[i][0], row), i
    # The new server's rows beyond its budget went to its new disk.
    tiers = seen["tiers"]
    assert tiers["hot_rows"] <= HOT < tiers["hot_rows"] + tiers["disk_rows"], tiers
    assert [name.startswith("rows-") for name in seen["folder"]] == [True], seen["folder"]
    assert events.of("done")[0]["step"] == 40
