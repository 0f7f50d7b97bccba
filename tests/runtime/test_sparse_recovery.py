"""Sparse tables across checkpoints and restarts: rows and optimizer state stream to
files beside the checkpoint and back, a restarted parameter server gets its rows back
and training finishes, a restarted server without checkpoints serves the same initial
rows, and a checkpoint of other tables is refused."""

from __future__ import annotations

import zlib
from pathlib import Path
from typing import Any

import google_crc32c
import pytest
import torch

from pstrain_runtime.checkpoint import (CheckpointCorrupt, CheckpointError, CheckpointStore,
                                        NoUsableCheckpoint, load_checkpoint)
from pstrain_runtime.failure import ConfigurationError
from pstrain_runtime.optim import OptimizerConfig
from pstrain_runtime.ps.store import ParameterStore
from pstrain_runtime.sparse import client as sparse_client
from pstrain_runtime.sparse import initial_rows, stream_of
from pstrain_runtime.sparse.files import read_rows, write_rows
from pstrain_runtime.sparse.spec import TableSpec
from pstrain_runtime.sparse.table import RowBlock
from pstrain_runtime.worker.client import LocalTransport

from . import sparse_tasks
from .builders import KillableTransport, training
from .sparse_tasks import Events, run_job

pytestmark = pytest.mark.timeout(120)
ADAM = {"name": "adam", "learningRate": 0.01}


@pytest.fixture(autouse=True)
def one_thread() -> None:
    torch.set_num_threads(1)


def shard_rows(stores: list[ParameterStore], table: str) -> dict[int, torch.Tensor]:
    """Every live row of `table` over `stores`, with its optimizer slots, by id."""
    out = {}
    for store in stores:
        t = store.namespace("ns").sparse.tables[table]
        block, _ = t.export(0, 1 << 30)
        for k, i in enumerate(block.ids.tolist()):
            out[i] = torch.cat([block.rows[k], *(block.slots[n][k] for n in t.slot_names)])
    return out


def test_checkpoint_streams_rows_and_state_and_restores_them(tmp_path: Path,
                                                             monkeypatch) -> None:
    monkeypatch.setattr(sparse_client, "EXPORT_ROWS", 3)  # many pages per shard
    job = training(steps=20, batchSize=16, mode="sync", optimizer=ADAM,
                   checkpoint={"directory": str(tmp_path), "intervalSteps": 10})
    stores = [ParameterStore(i) for i in range(2)]
    run_job(job, [LocalTransport(s) for s in stores])
    saved = {name: shard_rows(stores, name) for name in ("items", "tags")}

    ckpt = load_checkpoint(CheckpointStore(tmp_path).path_for(20))
    # A chain: the full write of step 10, then the rows changed since (step 20).
    chain = ckpt.sparse["chain"]
    assert [(link["dir"], link["full"]) for link in chain] == [
        ("ckpt-000000000010.sparse", True), ("ckpt-000000000020.sparse", False)]
    tables = ckpt.sparse["tables"]
    assert tables["items"]["rows"] == len(saved["items"]) == sparse_tasks.ITEMS // 4
    # Each shard file is a stream of pages (3 rows each here), read back block by block.
    first = tmp_path / chain[0]["dir"] / chain[0]["tables"]["items"]["files"][0]
    items_spec = TableSpec("items", sparse_tasks.ITEMS, sparse_tasks.ITEM_DIM, 0.3,
                           optimizer=OptimizerConfig(name="adam"))
    blocks = list(read_rows(first, items_spec, ("exp_avg", "exp_avg_sq")))
    assert len(blocks) >= 2 and all(len(b.ids) <= 3 for b in blocks)

    # A longer job on fresh servers (three of them now) resumes with the same rows.
    fresh = [ParameterStore(i) for i in range(3)]
    events = Events()
    at_restore: dict[str, Any] = {}
    events.hooks.append(lambda kind, fields: at_restore.update(
        {name: shard_rows(fresh, name) for name in ("items", "tags")})
        if kind == "restored" else None)
    run_job(job.model_copy(update={"steps": 25}), [LocalTransport(s) for s in fresh],
            emit=events)
    assert events.of("restored")[0]["step"] == 20
    for name in ("items", "tags"):
        assert at_restore[name].keys() == saved[name].keys()
        for i, value in saved[name].items():
            assert torch.equal(at_restore[name][i], value)
    assert events.of("done")[0]["step"] == 25


def test_a_truncated_rows_file_is_refused(tmp_path: Path) -> None:
    spec = TableSpec("t", None, 3, 0.1, optimizer=OptimizerConfig(name="sgd"))
    path = tmp_path / "t.rows"
    block = RowBlock(ids=torch.arange(5), rows=torch.ones(5, 3), slots={},
                     last=torch.zeros(5, dtype=torch.int64))
    written = write_rows(path, spec, (), [block, block])
    assert written.rows == 10 and written.size == path.stat().st_size
    assert [len(b.ids) for b in read_rows(path, spec, (), written.check())] == [5, 5]
    path.write_bytes(path.read_bytes()[:-20])
    with pytest.raises(CheckpointCorrupt, match="truncated"):
        list(read_rows(path, spec, ()))
    with pytest.raises(CheckpointCorrupt, match=f"have {written.size - 20} bytes; "
                                                f"{written.size} were written"):
        list(read_rows(path, spec, (), written.check()))


def test_a_rows_file_that_is_not_the_bytes_written_is_damage(tmp_path: Path) -> None:
    spec = TableSpec("t", None, 3, 0.1, optimizer=OptimizerConfig(name="sgd"))
    path = tmp_path / "t.rows"
    block = RowBlock(ids=torch.arange(5), rows=torch.ones(5, 3), slots={},
                     last=torch.zeros(5, dtype=torch.int64))
    written = write_rows(path, spec, (), [block])
    data = bytearray(path.read_bytes())
    data[-30] ^= 0xFF  # a row value: same size, other bytes
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointCorrupt, match="not the bytes written"):
        list(read_rows(path, spec, (), written.check()))
    path.unlink()
    with pytest.raises(CheckpointCorrupt, match="are missing"):
        list(read_rows(path, spec, (), written.check()))


def test_a_rows_file_records_its_crc32c_and_one_written_with_a_crc32_still_reads(
        tmp_path: Path) -> None:
    spec = TableSpec("t", None, 3, 0.1, optimizer=OptimizerConfig(name="sgd"))
    path = tmp_path / "t.rows"
    block = RowBlock(ids=torch.arange(5), rows=torch.rand(5, 3), slots={},
                     last=torch.zeros(5, dtype=torch.int64))
    check = write_rows(path, spec, (), [block]).check()
    data = path.read_bytes()
    assert check == {"bytes": len(data), "crc32c": google_crc32c.value(data)}
    # A checkpoint written before CRC-32C recorded zlib's CRC-32: checked with that.
    older = {"bytes": len(data), "crc32": zlib.crc32(data)}
    assert torch.equal(next(read_rows(path, spec, (), older)).rows, block.rows)
    path.write_bytes(data[:-30] + bytes([data[-30] ^ 0xFF]) + data[-29:])
    for recorded in (check, older):
        with pytest.raises(CheckpointCorrupt, match="not the bytes written"):
            list(read_rows(path, spec, (), recorded))


def _sparse_file(directory: Path, step: int) -> Path:
    """The first rows file of table `items` in the newest link of `step`'s chain."""
    newest = load_checkpoint(CheckpointStore(directory).path_for(step)).sparse["chain"][-1]
    return directory / newest["dir"] / newest["tables"]["items"]["files"][0]


def test_a_damaged_rows_file_falls_back_or_fails_at_once(tmp_path: Path) -> None:
    job = training(steps=20, batchSize=16, mode="sync",
                   checkpoint={"directory": str(tmp_path), "intervalSteps": 10})
    run_job(job, [LocalTransport(ParameterStore(i)) for i in range(2)])
    store = CheckpointStore(tmp_path)
    assert store.steps() == [10, 20]

    # A short file is found before the restore picks its checkpoint: step 10 is used.
    newest = _sparse_file(tmp_path, 20)
    intact = newest.read_bytes()
    newest.write_bytes(intact[:-7])
    found = store.latest()
    assert found is not None
    ckpt, _, problems = found
    assert ckpt.global_step == 10
    assert problems == [f"sparse rows {newest} have {len(intact) - 7} bytes; "
                        f"{len(intact)} were written"]

    # Bytes changed in place are found while the rows stream back: the job fails at
    # once (a configuration error, no restart), naming the file and what to do.
    damaged = bytearray(intact)
    damaged[-30] ^= 0xFF
    newest.write_bytes(bytes(damaged))
    with pytest.raises(NoUsableCheckpoint) as caught:
        run_job(job.model_copy(update={"steps": 25}),
                [LocalTransport(ParameterStore(i)) for i in range(2)])
    assert isinstance(caught.value, ConfigurationError)
    message = str(caught.value)
    assert message.startswith(f"sparse rows {newest} are not the bytes written")
    assert message.endswith(f"remove ckpt-000000000020.sparse and its checkpoint file from "
                            f"{tmp_path} to restore the previous checkpoint")


def test_a_checkpoint_of_other_tables_is_refused(tmp_path: Path) -> None:
    job = training(steps=4, batchSize=8, mode="sync", checkpoint={"directory": str(tmp_path)})
    run_job(job, [LocalTransport(ParameterStore())])
    with pytest.raises(CheckpointError, match="written for a different model"):
        run_job(job, [LocalTransport(ParameterStore())], table_options={"admit_after": 2})


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("with_checkpoints", [True, False], ids=["checkpoint", "no-checkpoint"])
def test_a_killed_server_gets_its_rows_back_and_training_finishes(tmp_path: Path, mode: str,
                                                                   with_checkpoints: bool) -> None:
    ckpt = {"directory": str(tmp_path), "intervalSteps": 10} if with_checkpoints else {}
    job = training(steps=60, batchSize=16, mode=mode, checkpoint=ckpt,
                   optimizer={"name": "adagrad", "learningRate": 0.1})
    transports = [KillableTransport(0), KillableTransport(1)]
    probe = sparse_tasks.all_tag_ids()
    events = Events()
    seen: dict[str, Any] = {}

    def kill_ps1(kind: str, fields: dict[str, Any]) -> None:
        # (a checkpoint's rows are written off the training thread: it is on disk, and
        # reported, some steps after its step)
        seen["checkpointed"] = seen.get("checkpointed") or kind == "checkpoint"
        if (kind == "progress" and fields["step"] >= 25 and "killed" not in seen
                and (seen["checkpointed"] or not with_checkpoints)):
            seen["killed"] = fields["step"]
            seen["rows"] = transports[1].store.namespace("ns").sparse.tables["tags"].stats().rows
            transports[1].kill()
            transports[1].restart()  # same address, empty
        if kind == "restored":
            table = transports[1].store.namespace("ns").sparse.tables["tags"]
            seen["restored_rows"] = table.stats().rows
            seen["initial"] = table.read(probe)

    events.hooks.append(kill_ps1)
    run_job(job, transports, num_workers=2, emit=events, progress_interval=0.0)
    restored = events.of("restored")
    assert seen.get("killed") and len(restored) == 1
    assert events.of("done")[0]["step"] == 60
    if with_checkpoints:
        assert restored[0]["step"] >= 10 and seen["restored_rows"] > 0
        assert seen["restored_rows"] <= seen["rows"]
    else:
        # No checkpoint: the server's rows start again from their initial values,
        # which are the same as before the restart (they depend on seed, table, id).
        assert seen["restored_rows"] == 0
        spec = next(layer.spec for layer in sparse_tasks.make_task().model.modules()
                    if getattr(layer, "spec", None) is not None and layer.spec.name == "tags")
        expected = initial_rows(probe, spec.embedding_dim, spec.init_std,
                                stream_of(job.seed, "tags"))
        torch.testing.assert_close(seen["initial"], expected, rtol=0, atol=0)
