"""`pstrain_runtime.datasets`: a user's CSV, TSV and Parquet files as a task's batches.
Each worker reads its own rows (every row once per epoch), reshuffled per epoch, from
`start` on exactly; bad paths and columns fail in one line; and the files example
trains under `pstrain run` and continues its data after a restore."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import yaml

pa = pytest.importorskip("pyarrow")
pa_csv = pytest.importorskip("pyarrow.csv")
pq = pytest.importorskip("pyarrow.parquet")

from pstrain_runtime.checkpoint import CheckpointStore, load_checkpoint  # noqa: E402
from pstrain_runtime.datasets import FileDataset, file_batches  # noqa: E402
from pstrain_runtime.failure import ConfigurationError  # noqa: E402
from pstrain_runtime.ps.store import ParameterStore  # noqa: E402
from pstrain_runtime.task import Task  # noqa: E402
from pstrain_runtime.worker.client import LocalTransport  # noqa: E402
from pstrain_runtime.worker.context import WorkerRole  # noqa: E402
from pstrain_runtime.worker.trainer import Trainer  # noqa: E402

from .builders import digits_training, run_chief  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "digits-files.yaml"
ROWS = 103  # prime: no split comes out even

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(autouse=True)
def one_thread() -> None:
    torch.set_num_threads(1)


# --------------------------------------------------------------------------- data files


def rows_table(first: int, rows: int, *, integral: bool = False) -> Any:
    """Rows whose `label` is their number: which row came is plain to see."""
    ids = np.arange(first, first + rows)
    a = ids if integral else ids * 0.5
    return pa.table({"a": a, "b": -ids * 1.0, "label": ids})


def write(table: Any, path: Path) -> Path:
    if path.name.endswith(".parquet"):
        pq.write_table(table, path, row_group_size=10)
    else:
        options = pa_csv.WriteOptions(delimiter="\t" if ".tsv" in path.name else ",")
        if path.name.endswith(".gz"):
            with pa.CompressedOutputStream(str(path), "gzip") as out:
                pa_csv.write_csv(table, out, options)
        else:
            pa_csv.write_csv(table, path, options)
    return path


def shards(folder: Path, suffix: str, sizes: tuple[int, ...] = (40, 1, 37, 25)) -> Path:
    """A folder of shards of the given sizes (ROWS rows in all), plus what writers
    leave beside them and a reader must skip."""
    folder.mkdir()
    first = 0
    for i, size in enumerate(sizes):
        write(rows_table(first, size), folder / f"part-{i:04d}{suffix}")
        first += size
    (folder / "_SUCCESS").write_text("")
    (folder / ".part-0009.tmp").write_text("garbage")
    return folder


SOURCES: dict[str, Callable[[Path], Any]] = {
    "csv": lambda d: write(rows_table(0, ROWS), d / "data.csv"),
    "tsv": lambda d: write(rows_table(0, ROWS), d / "data.tsv"),
    "csv-gzip": lambda d: write(rows_table(0, ROWS), d / "data.csv.gz"),
    "parquet": lambda d: write(rows_table(0, ROWS), d / "data.parquet"),
    "parquet-shards": lambda d: shards(d / "train", ".parquet"),
    "csv-shards": lambda d: shards(d / "train", ".csv"),
    "csv-glob": lambda d: str(shards(d / "train", ".csv") / "part-*.csv"),
    "list": lambda d: [write(rows_table(0, 50), d / "one.parquet"),
                       write(rows_table(50, ROWS - 50), d / "two.parquet")],
}


def labels(stream: Iterator[Any], batches: int) -> list[list[int]]:
    return [b[1].tolist() for b in itertools.islice(stream, batches)]


def epoch_rows(data: FileDataset, worker: int, num_workers: int, batch_size: int,
               seed: int, epoch: int) -> list[int]:
    """The rows one worker reads in one epoch."""
    per = data.batches_per_epoch(worker, num_workers, batch_size)
    batches = labels(data.batches(worker, num_workers, batch_size, seed, start=epoch * per),
                     per)
    return [row for batch in batches for row in batch]


# --------------------------------------------------------------------------- the split


@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("num_workers", [1, 3, 4])
def test_every_row_is_read_by_exactly_one_worker_in_every_epoch(tmp_path, source,
                                                                 num_workers) -> None:
    data = FileDataset(SOURCES[source](tmp_path), label="label", drop_last=False,
                       shuffle_rows=16)
    for epoch in range(3):
        read = [row for w in range(num_workers)
                for row in epoch_rows(data, w, num_workers, 8, 7, epoch)]
        assert sorted(read) == list(range(ROWS)), epoch


@pytest.mark.parametrize("batch_size", [1, 8, 34, 500])
def test_drop_last_yields_only_full_batches_and_no_row_twice(tmp_path, batch_size) -> None:
    data = FileDataset(SOURCES["parquet"](tmp_path), label="label")
    read: list[int] = []
    for w in range(3):
        per = data.batches_per_epoch(w, 3, batch_size)
        got = labels(data.batches(w, 3, batch_size, 0), per)
        span = len(range(*data.span(w, 3)))
        assert [len(b) for b in got] == [min(batch_size, span)] * per
        read += [row for batch in got for row in batch]
    assert len(read) == len(set(read))


def test_each_epoch_has_its_own_order_drawn_from_the_seed(tmp_path) -> None:
    data = FileDataset(SOURCES["csv-shards"](tmp_path), label="label")
    epochs = [epoch_rows(data, 0, 2, 5, 11, e) for e in range(3)]
    assert len({tuple(rows) for rows in epochs}) == 3, "every epoch is shuffled anew"
    assert len({frozenset(rows) for rows in epochs}) > 1, "workers get other rows"
    again = FileDataset(tmp_path / "train", label="label")
    assert [epoch_rows(again, 0, 2, 5, 11, e) for e in range(3)] == epochs
    assert epoch_rows(data, 0, 2, 5, 12, 0) != epochs[0], "another seed, another order"


def test_without_shuffle_rows_come_in_file_order(tmp_path) -> None:
    data = FileDataset(SOURCES["parquet-shards"](tmp_path), label="label", shuffle=False)
    assert labels(data.batches(0, 1, 10, 3), 11)[:3] == [
        list(range(0, 10)), list(range(10, 20)), list(range(20, 30))]
    assert epoch_rows(data, 1, 2, 10, 3, 0) == list(range(51, 101))


# --------------------------------------------------------------------------- resuming


@pytest.mark.parametrize("source", ["csv", "parquet-shards", "list"])
@pytest.mark.parametrize(("num_workers", "batch_size", "shuffle_rows"),
                         [(1, 8, 16384), (3, 7, 5), (2, 64, 30), (4, 3, 4)])
@pytest.mark.parametrize("start", [1, 4, 5, 17, 40])
def test_start_resumes_at_exactly_that_batch(tmp_path, source, num_workers, batch_size,
                                             shuffle_rows, start) -> None:
    data = FileDataset(SOURCES[source](tmp_path), label="label", shuffle_rows=shuffle_rows)
    worker = num_workers - 1
    whole = labels(data.batches(worker, num_workers, batch_size, 3), 60)
    resumed = labels(data.batches(worker, num_workers, batch_size, 3, start=start),
                     60 - start)
    assert resumed == whole[start:]


class CountingFile:
    """A Parquet file that counts the row groups read from it."""

    def __init__(self, file: Any, reads: list[int]) -> None:
        self.file, self.reads = file, reads

    def read_row_group(self, group: int, **options: Any) -> Any:
        self.reads.append(group)
        return self.file.read_row_group(group, **options)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.file, name)


class CountingReads(FileDataset):
    """The row groups its streams read, in order."""

    def parquet_file(self, i: int) -> Any:
        self.__dict__.setdefault("reads", [])
        return CountingFile(super().parquet_file(i), self.reads)


def test_resuming_many_epochs_in_reads_only_what_it_yields(tmp_path) -> None:
    data = CountingReads(SOURCES["parquet"](tmp_path), label="label")  # 11 row groups
    next(data.batches(0, 1, 8, 0, start=10 * data.batches_per_epoch(0, 1, 8)))
    assert sorted(data.reads) == list(range(11)), "one window's row groups, not ten epochs'"


def test_file_batches_is_the_same_stream_in_one_call(tmp_path) -> None:
    source = SOURCES["tsv"](tmp_path)
    ours = labels(file_batches(source, 1, 2, 6, 9, start=3, label="label"), 20)
    assert ours == labels(FileDataset(source, label="label").batches(1, 2, 6, 9, 3), 20)


# --------------------------------------------------------------------------- conversion


def test_default_tensors_are_float_features_and_integer_labels(tmp_path) -> None:
    x, y = next(FileDataset(SOURCES["csv"](tmp_path), label="label",
                            shuffle=False).batches(0, 1, 3, 0))
    assert x.dtype == torch.float32 and y.dtype == torch.int64
    assert x.tolist() == [[0.0, -0.0], [0.5, -1.0], [1.0, -2.0]]
    assert y.tolist() == [0, 1, 2]


def test_features_pick_columns_and_list_columns_count_as_several(tmp_path) -> None:
    table = pa.table({"pixels": pa.array([[i, i + 1.0] for i in range(6)],
                                         pa.list_(pa.float32(), 2)),
                      "noise": [9.0] * 6, "target": [0.5] * 6})
    path = write(table, tmp_path / "lists.parquet")
    x, y = FileDataset(path, label="target", features=["pixels"], shuffle=False).read_all()
    assert x.tolist() == [[i, i + 1.0] for i in range(6)]
    assert y.dtype == torch.float32


def test_to_tensors_converts_rows_your_way(tmp_path) -> None:
    def to_tensors(table: Any) -> tuple[torch.Tensor, torch.Tensor]:
        assert table.column_names == ["a", "label"]
        return (torch.tensor(table.column("a").to_numpy()).unsqueeze(1),
                torch.tensor(table.column("label").to_numpy() % 2))

    data = FileDataset(SOURCES["parquet"](tmp_path), columns=["a", "label"],
                       to_tensors=to_tensors, shuffle=False)
    x, y = next(data.batches(0, 1, 4, 0))
    assert x.tolist() == [[0.0], [0.5], [1.0], [1.5]] and y.tolist() == [0, 1, 0, 1]


def test_csv_shards_whose_types_were_inferred_differently_read_as_one(tmp_path) -> None:
    write(rows_table(0, 5, integral=True), tmp_path / "ints.csv")  # a: int64
    write(rows_table(5, 5), tmp_path / "floats.csv")  # a: double
    x, _ = next(FileDataset(tmp_path, label="label").batches(0, 1, 10, 0))
    assert x.shape == (10, 2)


def test_format_names_shards_without_a_suffix(tmp_path) -> None:
    for i in range(2):
        write(rows_table(i * 10, 10), tmp_path / f"part-{i}.parquet").rename(
            tmp_path / f"part-{i}")
    assert FileDataset(tmp_path, label="label", format="parquet").num_rows == 20


# --------------------------------------------------------------------------- mistakes


def mixed(d: Path) -> Path:
    write(rows_table(0, 3), d / "a.csv")
    write(rows_table(3, 3), d / "b.parquet")
    return d


def text_label(d: Path) -> Path:
    return write(pa.table({"a": [1.0, 2.0], "label": ["cat", "dog"]}), d / "t.csv")


def with_gaps(d: Path) -> Path:
    (d / "gaps.csv").write_text("a,label\n1.0,0\n,1\n")
    return d / "gaps.csv"


MISTAKES = [
    pytest.param(lambda d: d / "nope.csv", {},
                 r"data source '.*nope\.csv' does not exist", id="no-such-file"),
    pytest.param(lambda d: str(d / "*.parquet"), {},
                 r"data source '.*\*\.parquet' matches no files", id="glob-matches-nothing"),
    pytest.param(lambda d: d, {}, r"is a folder with no CSV, TSV or Parquet files",
                 id="empty-folder"),
    pytest.param(mixed, {}, r"mixes formats \['csv', 'parquet'\]", id="mixed-formats"),
    pytest.param(lambda d: (d / "x.json").write_text("{}") and d / "x.json", {},
                 r"data file '.*x\.json' is neither \.csv, \.tsv nor \.parquet",
                 id="unknown-suffix"),
    pytest.param(SOURCES["csv"], {"label": "target"},
                 r"label column 'target' is not in .*data\.csv; its columns are "
                 r"\['a', 'b', 'label'\]", id="no-such-label"),
    pytest.param(SOURCES["parquet"], {"features": ["a", "c"]},
                 r"column 'c' is not in .*data\.parquet", id="no-such-feature"),
    pytest.param(SOURCES["csv"], {"label": None},
                 r"label is not set; name the target column", id="no-label"),
    pytest.param(SOURCES["csv"], {"format": "json"}, r"format is 'json'; it must be",
                 id="bad-format"),
    pytest.param(lambda d: (d / "bad.parquet").write_text("not parquet") and
                 d / "bad.parquet", {}, r"bad\.parquet cannot be read as Parquet",
                 id="not-parquet"),
]


@pytest.mark.parametrize(("make", "options", "message"), MISTAKES)
def test_mistakes_fail_at_once_in_one_line_naming_the_value(tmp_path, make, options,
                                                            message) -> None:
    with pytest.raises(ConfigurationError, match=message) as caught:
        FileDataset(make(tmp_path), **{"label": "label", **options})
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize(("make", "message"), [
    pytest.param(text_label, r"label column 'label' holds string, not numbers", id="text"),
    pytest.param(with_gaps, r"feature column 'a' has 1 empty values", id="empty-values"),
])
def test_rows_that_are_not_numbers_fail_at_the_first_batch(tmp_path, make, message) -> None:
    stream = FileDataset(make(tmp_path), label="label").batches(0, 1, 2, 0)
    with pytest.raises(ConfigurationError, match=message):
        next(stream)


def test_more_workers_than_rows_is_refused(tmp_path) -> None:
    data = FileDataset(write(rows_table(0, 2), tmp_path / "two.csv"), label="label")
    with pytest.raises(ConfigurationError, match=r"has 2 rows, fewer than the 3 workers"):
        data.batches(0, 3, 1, 0)  # worker 0's share of 2 rows among 3 is empty


# --------------------------------------------------------------------------- the example


def example_task(data_dir: Path, fmt: str) -> Task:
    from examples.files.digits_files import make_task

    return make_task(data_dir=str(data_dir), format=fmt)


class Recording:
    """The example's task, recording each opening's `start` and every batch drawn."""

    def __init__(self, task: Task) -> None:
        self.task, self.starts, self.drawn = task, [], []
        inner = task.batches

        def batches(w: int, n: int, b: int, s: int, start: int = 0) -> Iterator[Any]:
            self.starts.append(start)
            for batch in inner(w, n, b, s, start=start):
                self.drawn.append(batch[1].tolist())
                yield batch

        task.batches = batches


@pytest.mark.parametrize("fmt", ["csv", "tsv", "parquet"])
def test_the_example_writes_its_files_once_and_learns(tmp_path, fmt) -> None:
    task = example_task(tmp_path, fmt)
    assert sorted(p.name for p in (tmp_path / fmt / "train").iterdir()) == [
        f"part-{i:04d}.{fmt}" for i in range(4)]
    assert FileDataset(tmp_path / fmt / "train", label="label").num_rows == 1347
    assert example_task(tmp_path, fmt).evaluate(task.model)["accuracy"] < 0.5
    assert [p.name for p in tmp_path.iterdir()] == [fmt], "no staging folder is left"


def test_a_restored_job_reads_its_files_on_from_where_it_stopped(tmp_path) -> None:
    training = digits_training(steps=30, batchSize=32, checkpoint={
        "directory": str(tmp_path / "ckpt"), "intervalSteps": 100})

    def chief(steps: int) -> Recording:
        recording = Recording(example_task(tmp_path / "data", "parquet"))
        trainer = Trainer(training.model_copy(update={"steps": steps}),
                          WorkerRole("ns", 0, 1), [LocalTransport(ParameterStore())],
                          task=recording.task, emit=lambda *a, **k: None)
        run_chief(trainer)
        return recording

    first = chief(30)
    assert load_checkpoint(CheckpointStore(tmp_path / "ckpt").path_for(30)).positions == [30]
    second = chief(40)
    assert second.starts == [30]
    uninterrupted = labels(FileDataset(tmp_path / "data" / "parquet" / "train",
                                       label="label").batches(0, 1, 32, training.seed), 40)
    assert first.drawn[:30] == uninterrupted[:30]
    assert second.drawn[:10] == uninterrupted[30:40], "neither repeated nor skipped"


@pytest.mark.timeout(300)
def test_the_example_trains_under_pstrain_run(tmp_path) -> None:
    job = yaml.safe_load(EXAMPLE.read_text(encoding="utf-8"))
    job["spec"]["training"]["args"]["data_dir"] = str(tmp_path / "data")
    manifest = tmp_path / "digits-files.yaml"
    manifest.write_text(yaml.safe_dump(job), encoding="utf-8")
    run = subprocess.run([sys.executable, "-m", "pstrain_api.cli", "run", str(manifest),
                          "--json", "--checkpoint-dir", str(tmp_path / "ckpt")],
                         capture_output=True, text=True, cwd=ROOT, timeout=240)
    assert run.returncode == 0, run.stderr[-3000:]
    summary = json.loads(run.stdout)
    assert summary["phase"] == "Succeeded" and summary["restarts"] == 0, summary
    assert summary["accuracy"] >= 0.93, summary
    assert (tmp_path / "data" / "parquet" / "test.parquet").is_file()
