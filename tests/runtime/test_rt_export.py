"""`pstrain export`: a trained job's checkpoint, exported and loaded into a fresh model
(with `load_exported`, and with plain torch / safetensors), predicts what the trained
model predicts, for the dense digits MLP and for a model with sparse tables; the
command's one-line errors; the snippets of docs/export.md; and `pstrain run
--checkpoint-dir` then `pstrain export` end to end."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file
from torch import nn

from pstrain_api.cli import main
from pstrain_runtime.checkpoint import (CheckpointCorrupt, CheckpointStore, load_checkpoint,
                                        sparse_dirs)
from pstrain_runtime.examples.digits import build_model, load_digits_split
from pstrain_runtime.export import (ExportedTable, ExportError, export_checkpoint,
                                    load_exported, read_table)
from pstrain_runtime.ps.store import ParameterStore
from pstrain_runtime.sparse.files import write_rows
from pstrain_runtime.sparse.ids import owner_of
from pstrain_runtime.sparse.layer import sparse_layers
from pstrain_runtime.sparse.spec import TableSpec
from pstrain_runtime.sparse.table import RowBlock
from pstrain_runtime.worker.client import LocalTransport
from pstrain_runtime.worker.context import WorkerRole
from pstrain_runtime.worker.trainer import Trainer

from . import sparse_tasks
from .builders import Events, digits_training, run_trainers, training

pytestmark = pytest.mark.timeout(240)
ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "export.md"


@pytest.fixture(autouse=True)
def one_thread() -> None:
    torch.set_num_threads(1)


# ---------------------------------------------------------------------- trained jobs
class Trained:
    def __init__(self, ckpt_dir: Path, model: nn.Module, stores: list[ParameterStore]):
        self.ckpt_dir, self.model, self.stores = ckpt_dir, model, stores


@pytest.fixture(scope="module")
def dense_job(tmp_path_factory: pytest.TempPathFactory) -> Trained:
    """The digits MLP trained 20 sync steps with checkpoints at 10 and 20; the trained
    model is the chief's mirror at step 20."""
    ckpt_dir = tmp_path_factory.mktemp("dense") / "ckpts"
    job = digits_training(steps=20, batchSize=32, mode="sync",
                          checkpoint={"directory": str(ckpt_dir), "intervalSteps": 10})
    store = ParameterStore()
    chief = Trainer(job, WorkerRole("ns", 0, 1), [LocalTransport(store)], emit=Events())
    run_trainers([chief], [])
    chief.close()
    trained = build_model()
    trained.load_state_dict(chief.mirror, strict=True)
    return Trained(ckpt_dir, trained.eval(), [store])


class ServerRows:
    """The trained sparse tables as the servers hold them: each id read from its
    owner's table (an id without a row reads as its initial value there)."""

    def __init__(self, stores: list[ParameterStore]) -> None:
        self.stores = stores

    def pull(self, spec, ids: torch.Tensor) -> torch.Tensor:
        owners = owner_of(ids, len(self.stores))
        out = torch.empty((ids.numel(), spec.embedding_dim))
        for ps, store in enumerate(self.stores):
            mine = owners == ps
            if bool(mine.any()):
                out[mine] = store.namespace("ns").sparse.tables[spec.name].read(ids[mine])
        return out


@pytest.fixture(scope="module")
def sparse_job(tmp_path_factory: pytest.TempPathFactory) -> Trained:
    """sparse_tasks' model (a fixed and a dynamic table) trained 20 sync steps on two
    servers; the trained model is the chief's mirror plus the servers' tables."""
    ckpt_dir = tmp_path_factory.mktemp("sparse") / "ckpts"
    job = training(steps=20, batchSize=16, mode="sync",
                   optimizer={"name": "adam", "learningRate": 0.05},
                   checkpoint={"directory": str(ckpt_dir), "intervalSteps": 10})
    stores = [ParameterStore(i) for i in range(2)]
    (chief,) = sparse_tasks.run_job(job, [LocalTransport(s) for s in stores])
    trained = sparse_tasks.Net()
    trained.load_state_dict(chief.mirror, strict=True)
    for _, layer in sparse_layers(trained):
        layer.source = ServerRows(stores)
    return Trained(ckpt_dir, trained.eval(), stores)


def predict(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(x)


DIGITS_X = load_digits_split()[2][:64]


def sparse_inputs(unseen: bool) -> torch.Tensor:
    """Fixed inputs whose ids all have rows (items 0..9, the tag pool), or with ids
    that training never updated (items 30..39, new tags) in every sample."""
    x, _ = next(sparse_tasks.batches(99, 1, 32, 0))
    if unseen:
        x = x.clone()
        x[:, 0] = torch.arange(32) % 10 + 30
        x[:, 3] = torch.arange(32) + (1 << 41)
    return x


# ---------------------------------------------------------------------- dense
def test_the_exported_digits_model_predicts_as_the_trained_one(dense_job: Trained,
                                                               tmp_path: Path) -> None:
    out = tmp_path / "exported"
    result = export_checkpoint(dense_job.ckpt_dir, out)
    assert result.global_step == 20 and result.tables == {}
    assert sorted(p.name for p in out.iterdir()) == ["manifest.json", "model.pt",
                                                     "model.safetensors"]
    expected = predict(dense_job.model, DIGITS_X)

    loaded = build_model(seed=5)  # other initial values: all must be replaced
    assert load_exported(out, loaded) == {}
    plain = build_model(seed=6)
    plain.load_state_dict(load_file(str(out / "model.safetensors")), strict=True)
    pickled = build_model(seed=7)
    pickled.load_state_dict(torch.load(out / "model.pt", weights_only=True), strict=True)
    for model in (loaded, plain, pickled):
        assert torch.equal(predict(model, DIGITS_X), expected)

    manifest = json.loads((out / "manifest.json").read_text())
    ckpt = load_checkpoint(CheckpointStore(dense_job.ckpt_dir).path_for(20))
    assert manifest["global_step"] == 20
    assert manifest["source"] == str(CheckpointStore(dense_job.ckpt_dir).path_for(20).resolve())
    assert manifest["fingerprint"] == ckpt.fingerprint
    assert manifest["dense"]["parameters"]["0.weight"] == {"shape": [64, 64],
                                                           "dtype": "float32"}
    assert manifest["tables"] == {} and manifest["pstrain_version"]


def test_a_checkpoint_file_exports_that_step(dense_job: Trained, tmp_path: Path) -> None:
    path = CheckpointStore(dense_job.ckpt_dir).path_for(10)
    result = export_checkpoint(path, tmp_path / "out")
    assert result.global_step == 10 and result.source == path
    exported = load_file(str(tmp_path / "out" / "model.safetensors"))
    params = load_checkpoint(path).params
    assert exported.keys() == params.keys()
    assert all(torch.equal(exported[n], params[n]) for n in params)


def test_a_model_of_another_shape_is_refused_by_the_loader(dense_job: Trained,
                                                           tmp_path: Path) -> None:
    export_checkpoint(dense_job.ckpt_dir, tmp_path / "out")
    with pytest.raises(ExportError, match=r"parameters \['head.bias', 'head.weight'\] "
                       r"are missing; parameters \['0.bias', '0.weight', '2.bias', "
                       r"'2.weight'\] are not in the model"):
        load_exported(tmp_path / "out", sparse_tasks.Net())
    with pytest.raises(ExportError, match=r"parameter '0.weight' is \[64, 64\] float32 "
                       r"in the export, but \[32, 64\] float32 in the model"):
        load_exported(tmp_path / "out", build_model(hidden=32))


# ---------------------------------------------------------------------- sparse
def test_the_exported_sparse_model_predicts_as_the_trained_one(sparse_job: Trained,
                                                               tmp_path: Path) -> None:
    out = tmp_path / "exported"
    result = export_checkpoint(sparse_job.ckpt_dir, out)
    ckpt = load_checkpoint(CheckpointStore(sparse_job.ckpt_dir).path_for(20))
    assert result.tables == {n: e["rows"] for n, e in ckpt.sparse["tables"].items()}
    assert result.tables["items"] == sparse_tasks.ITEMS // 4
    assert sorted(p.name for p in (out / "tables").iterdir()) == ["items.safetensors",
                                                                  "tags.safetensors"]
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["tables"] == {
        "items": {"file": "tables/items.safetensors", "dim": sparse_tasks.ITEM_DIM,
                  "rows": result.tables["items"]},
        "tags": {"file": "tables/tags.safetensors", "dim": sparse_tasks.TAG_DIM,
                 "rows": result.tables["tags"]}}
    items = load_file(str(out / "tables" / "items.safetensors"))
    assert items.keys() == {"ids", "rows"}  # no optimizer state
    assert items["ids"].tolist() == list(range(sparse_tasks.ITEMS // 4))

    seen, unseen = sparse_inputs(False), sparse_inputs(True)
    # Ids with rows: the export alone reproduces the trained model.
    loaded = sparse_tasks.Net()
    tables = load_exported(out, loaded)
    assert sorted(tables) == ["items", "tags"]
    assert torch.equal(predict(loaded, seen), predict(sparse_job.model, seen))
    # Ids without rows read as zero rows, unless the job's seed is given: then as the
    # initial values the trained model reads.
    assert not torch.allclose(predict(loaded, unseen), predict(sparse_job.model, unseen))
    assert torch.equal(tables["items"].lookup(torch.tensor([30, 31])),
                       torch.zeros(2, sparse_tasks.ITEM_DIM))
    exact = sparse_tasks.Net()
    load_exported(out, exact, seed=0)
    for x in (seen, unseen):
        assert torch.equal(predict(exact, x), predict(sparse_job.model, x))


def test_a_serving_model_of_plain_torch_modules_predicts_as_the_trained_one(
        sparse_job: Trained, tmp_path: Path) -> None:
    out = tmp_path / "exported"
    export_checkpoint(sparse_job.ckpt_dir, out)
    items = ExportedTable.load(out / "tables" / "items.safetensors")
    tags = ExportedTable.load(out / "tables" / "tags.safetensors")
    item_emb, tag_bag = items.to_embedding(), tags.to_embedding_bag("sum")
    head = nn.Linear(sparse_tasks.ITEM_DIM + sparse_tasks.TAG_DIM, 1)
    head.load_state_dict({k.removeprefix("head."): v for k, v in
                          load_file(str(out / "model.safetensors")).items()})
    x = sparse_inputs(False)
    with torch.no_grad():
        features = torch.cat([item_emb(items.index(x[:, :3])).mean(1),
                              tag_bag(tags.index(x[:, 3:]))], dim=1)
        served = head(features).squeeze(1)
    torch.testing.assert_close(served, predict(sparse_job.model, x), rtol=1e-6, atol=1e-6)
    # An unknown id is the zero row at the end.
    assert items.index(torch.tensor([3, 99])).tolist() == [3, len(items)]


def test_a_model_without_a_table_of_the_export_is_refused(sparse_job: Trained,
                                                          tmp_path: Path) -> None:
    export_checkpoint(sparse_job.ckpt_dir, tmp_path / "out")
    model = sparse_tasks.Net()
    model.tags = nn.Identity()
    with pytest.raises(ExportError, match=r"holds sparse tables \['tags'\], which this "
                       "model does not declare"):
        load_exported(tmp_path / "out", model)


# ---------------------------------------------------------------------- the command
def run_cli(*args: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(["export", *args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_the_command_prints_what_it_wrote(sparse_job: Trained, tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    code, stdout, stderr = run_cli(str(sparse_job.ckpt_dir), "--out", str(out), capsys=capsys)
    assert (code, stderr) == (0, "")
    source = CheckpointStore(sparse_job.ckpt_dir).path_for(20)
    items, tags = (json.loads((out / "manifest.json").read_text())["tables"][n]["rows"]
                   for n in ("items", "tags"))
    assert stdout.splitlines() == [
        f"exported step 20 of {source} to {out}: 2 dense parameters; sparse tables "
        f"items ({items} rows), tags ({tags} rows)",
        f"  {out}/model.safetensors", f"  {out}/model.pt",
        f"  {out}/tables/items.safetensors", f"  {out}/tables/tags.safetensors",
        f"  {out}/manifest.json"]


def _garbage(directory: Path) -> Path:
    path = directory / "ckpt-000000000005.pt"
    path.write_bytes(b"not a checkpoint at all")
    return path


def _truncated_rows(directory: Path, sparse_dir: Path) -> Path:
    """A copy of the sparse job's step-20 checkpoint (its file and the row directories
    of its chain) whose first rows file of step 20 is short."""
    import shutil
    store = CheckpointStore(sparse_dir)
    path = store.path_for(20)
    shutil.copy(path, directory / path.name)
    for name in sparse_dirs(load_checkpoint(path).sparse):
        shutil.copytree(sparse_dir / name, directory / name)
    first = sorted((directory / "ckpt-000000000020.sparse").glob("*.rows"))[0]
    first.write_bytes(first.read_bytes()[:-9])
    return directory / path.name


@pytest.mark.parametrize(("make", "message"), [
    pytest.param(lambda d, s: d / "nope.pt", r"checkpoint \S+/nope.pt does not exist",
                 id="missing"),
    pytest.param(lambda d, s: _garbage(d), r"checkpoint \S+ is corrupt or unreadable",
                 id="garbage-file"),
    pytest.param(lambda d, s: _garbage(d).parent,
                 r"no usable checkpoint: checkpoint \S+ is corrupt or unreadable",
                 id="directory-of-damaged"),
    pytest.param(lambda d, s: d, r"\S+ holds no checkpoint \(no ckpt-<step>.pt files\)",
                 id="empty-directory"),
    pytest.param(lambda d, s: _truncated_rows(d, s),
                 r"sparse rows \S+table0-ps\d.rows have \d+ bytes; \d+ were written",
                 id="truncated-rows"),
])
def test_an_unusable_checkpoint_is_one_line_and_writes_nothing(
        make, message: str, sparse_job: Trained, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    source = tmp_path / "src"
    source.mkdir()
    checkpoint = make(source, sparse_job.ckpt_dir)
    code, stdout, stderr = run_cli(str(checkpoint), "--out", str(tmp_path / "out"),
                                   capsys=capsys)
    assert (code, stdout) == (1, "")
    assert len(stderr.splitlines()) == 1 and re.fullmatch(f"pstrain export: {message}.*\n",
                                                          stderr), stderr
    assert not (tmp_path / "out").exists()


def test_a_non_empty_out_is_refused_unless_forced(dense_job: Trained, sparse_job: Trained,
                                                 tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    assert run_cli(str(sparse_job.ckpt_dir), "--out", str(out), capsys=capsys)[0] == 0
    code, stdout, stderr = run_cli(str(dense_job.ckpt_dir), "--out", str(out), capsys=capsys)
    assert (code, stdout) == (1, "")
    assert stderr == (f"pstrain export: --out {out} is not empty; choose an empty or new "
                      "directory, or pass --force to overwrite the export there\n")
    assert json.loads((out / "manifest.json").read_text())["tables"]  # untouched
    # Forced: the dense export replaces it, and no table of the old one stays.
    code, _, stderr = run_cli(str(dense_job.ckpt_dir), "--out", str(out), "--force",
                              capsys=capsys)
    assert (code, stderr) == (0, "")
    assert sorted(p.name for p in out.iterdir()) == ["manifest.json", "model.pt",
                                                     "model.safetensors"]
    load_exported(out, build_model())


def test_an_out_that_is_a_file_is_refused(dense_job: Trained, tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    out.write_text("x")
    code, _, stderr = run_cli(str(dense_job.ckpt_dir), "--out", str(out), "--force",
                              capsys=capsys)
    assert (code, stderr) == (1, f"pstrain export: --out {out} is a file; it must be a "
                                 "directory (created when missing)\n")


# ---------------------------------------------------------------------- the doc
def doc_python_blocks() -> list[str]:
    return re.findall(r"^```python\n(.*?)^```$", DOC.read_text(encoding="utf-8"),
                      re.M | re.S)


def test_the_docs_snippets_run(dense_job: Trained, sparse_job: Trained, tmp_path: Path,
                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The loader and the plain-safetensors snippets on the digits export; the serving
    snippet on the sparse one (its table `tags`)."""
    load, plain, serve = doc_python_blocks()
    monkeypatch.chdir(tmp_path)
    export_checkpoint(dense_job.ckpt_dir, tmp_path / "exported")
    scope: dict[str, object] = {}
    exec(load, scope)  # noqa: S102 - the doc's own code
    exec(plain, scope)  # noqa: S102
    assert torch.equal(scope["predictions"],
                       predict(dense_job.model, torch.zeros(8, 64)).argmax(1))

    export_checkpoint(sparse_job.ckpt_dir, tmp_path / "exported", force=True)
    scope = {}
    exec(serve, scope)  # noqa: S102
    tags = ExportedTable.load(tmp_path / "exported" / "tables" / "tags.safetensors")
    assert torch.equal(scope["vectors"], tags.lookup(scope["query"]))
    assert torch.equal(scope["vectors"][1], torch.zeros(sparse_tasks.TAG_DIM))


# ---------------------------------------------------------------------- end to end
def test_pstrain_run_then_pstrain_export(tmp_path: Path) -> None:
    """`pstrain run --checkpoint-dir` on the digits example, then `pstrain export` of
    its directory: the export predicts as the model restored from the checkpoint."""
    manifest = yaml.safe_load((ROOT / "examples" / "digits-sync.yaml").read_text())
    manifest["spec"]["replicas"]["worker"]["replicas"] = 1
    manifest["spec"]["training"].update(steps=30, evalIntervalSteps=30)
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(manifest))
    ckpts, out = tmp_path / "ckpts", tmp_path / "exported"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    cli = [sys.executable, "-m", "pstrain_api.cli"]
    run = subprocess.run([*cli, "run", str(job), "--quiet", "--checkpoint-dir", str(ckpts)],
                         capture_output=True, text=True, timeout=180, env=env, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    export = subprocess.run([*cli, "export", str(ckpts), "--out", str(out)],
                            capture_output=True, text=True, timeout=60, env=env, cwd=ROOT)
    assert export.returncode == 0, export.stderr
    assert export.stdout.startswith(f"exported step 30 of {ckpts / 'ckpt-000000000030.pt'}")

    restored = build_model()
    restored.load_state_dict(load_checkpoint(ckpts / "ckpt-000000000030.pt").params,
                             strict=True)
    loaded = build_model(seed=3)
    load_exported(out, loaded)
    assert torch.equal(predict(loaded, DIGITS_X), predict(restored, DIGITS_X))


def _rows_file(path: Path, spec: TableSpec, blocks: list[tuple[list[int], float]]) -> dict:
    """A rows file of `blocks` (ids, the value of their rows); its manifest check."""
    written = write_rows(path, spec, ("sum",), [
        RowBlock(ids=torch.tensor(ids), rows=torch.full((len(ids), spec.embedding_dim), v),
                 slots={"sum": torch.zeros(len(ids), spec.embedding_dim)},
                 last=torch.ones(len(ids), dtype=torch.int64)) for ids, v in blocks])
    return written.check()


def test_an_id_read_twice_by_an_async_export_exports_its_later_row(tmp_path: Path) -> None:
    """An async export may read an id evicted and created again elsewhere in its shard
    twice (a restore upserts the later); `pstrain export` takes the later row too. An id
    in two shard files is still corrupt."""
    spec = TableSpec("t", 100, 2, 0.1)
    checks = {"table0-ps0.rows": _rows_file(tmp_path / "table0-ps0.rows", spec,
                                            [([5, 9, 3], 1.0), ([9, 7], 2.0)]),
              "table0-ps1.rows": _rows_file(tmp_path / "table0-ps1.rows", spec,
                                            [([4], 3.0)])}
    entry = {"files": ["table0-ps0.rows", "table0-ps1.rows"], "checks": checks}
    ids, rows, dim = read_table(tmp_path, "t", entry)
    assert ids.tolist() == [3, 4, 5, 7, 9] and dim == 2
    assert rows[:, 0].tolist() == [1.0, 3.0, 1.0, 2.0, 2.0]  # 9: the later block's row
    checks["table0-ps1.rows"] = _rows_file(tmp_path / "table0-ps1.rows", spec,
                                           [([4, 9], 3.0)])
    with pytest.raises(CheckpointCorrupt, match="holds an id in two shard files"):
        read_table(tmp_path, "t", entry)
