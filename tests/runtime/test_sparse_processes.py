"""End to end with real processes over the TCP data plane: a model with sparse tables
on two parameter servers and two workers; a parameter server killed mid-run comes back
with its rows from the checkpoint and training finishes."""

from __future__ import annotations

from pathlib import Path

import pytest

from pstrain_runtime.checkpoint import load_checkpoint, sparse_dirs
from tests.api.job_builder import job

from .builders import ProcessJob

pytestmark = pytest.mark.timeout(240)


def test_killed_ps_gets_its_table_rows_back_and_the_job_finishes(tmp_path: Path) -> None:
    manifest = (job("sparse").ps(2).workers(2)
                .training(entrypoint="tests.runtime.sparse_tasks:make_task", steps=200,
                          batchSize=32, mode="sync",
                          optimizer={"name": "adagrad", "learningRate": 0.1},
                          checkpoint={"intervalSteps": 20})
                .build())
    ended = ProcessJob(manifest, tmp_path).kill_ps_after_checkpoint(1, step=40)
    restored, done, codes = ended["restored"], ended["done"], ended["codes"]
    assert restored["step"] >= ended["checkpoint"]["step"]
    # every kept checkpoint has its rows beside it (the directories of its chain: its
    # own and those it builds on), and no other rows are left
    kept = sorted(tmp_path.glob("ckpt-*.pt"))
    named = set().union(*(sparse_dirs(load_checkpoint(p).sparse) for p in kept))
    assert {p.with_suffix(".sparse").name for p in kept} <= named
    assert sorted(p.name for p in tmp_path.glob("ckpt-*.sparse")) == sorted(named)
    assert kept[-1].name == "ckpt-000000000200.pt"
    assert done["step"] == 200
    assert done["sparse_tables"]["items"]["rows"] == 10 and done["sparse_rows"] == 40
    assert set(codes.values()) == {0}
