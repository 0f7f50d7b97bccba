"""Reading a user's own files as a task's batches: CSV, TSV and Parquet, given as one
file, a glob, a folder of shards or a list of these (on a mounted volume, say).

    from pstrain_runtime.datasets import FileDataset

    train = FileDataset("/data/train/", label="label")          # every other column a feature
    Task(model=..., batches=train.batches, loss=..., evaluate=...)

`FileDataset.batches(worker, num_workers, batch_size, seed, start=0)` is the entry-point
contract's `batches` (pstrain_runtime.task); `file_batches(source, worker, ...)` is the
same in one call. pyarrow parses the files (`pyarrow.csv`, `pyarrow.parquet`); batches
are `(inputs, targets)` tensors made by `to_tensors`, the counterpart of a DataLoader's
`collate_fn`, from a `pyarrow.Table` of the batch's rows.

What a worker's stream is (the tests check each point):

- One epoch lays every row of every file out in one sequence: the data's blocks (a
  Parquet row group; `CSV_BLOCK_ROWS` rows of a CSV or TSV file) in an order drawn from
  `(seed, epoch)` alone, so every worker computes the same sequence. Worker `w` of `n`
  reads the `w`-th of `n` contiguous near-equal spans of it: each row is read by exactly
  one worker per epoch, and which rows a worker gets changes from epoch to epoch.
- A worker reads its span in windows of `shuffle_rows` rows and yields each window's
  rows in an order drawn from `(seed, epoch, worker, window)`; batches are consecutive
  runs of `batch_size` rows of that order. An epoch has `span // batch_size` batches
  (`drop_last`; or one batch of the whole span when it is shorter than a batch), the
  same number every epoch, and epochs follow one another without end.
- `start` is found by arithmetic (epoch, batch, window): the epochs and windows before
  it are never read. The stream from `start=k` is the stream from 0 without its first
  `k` batches, which is what pstrain's saved data positions need.
- Memory: Parquet is read one row group at a time, only the columns used. A CSV or TSV
  file is read whole, once per process; for data larger than memory, write Parquet
  (with row groups of some 10k-100k rows: a row group is the unit of the block shuffle).
- The files must not change while the job runs: every worker must see the same rows.

Mistakes in the files or the arguments (no file, a missing column, a label of text)
raise `ConfigurationError` with one line naming the value, so the job fails at once.
"""

from __future__ import annotations

import glob
import math
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from itertools import count
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

from pstrain_api.quote import one_line

from .failure import ConfigurationError
from .task import Batch

try:
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.csv as pa_csv
    import pyarrow.parquet as pq
except ImportError as exc:  # pragma: no cover - the message is the point
    raise ImportError("pstrain_runtime.datasets reads files with pyarrow, which is not "
                      "installed: pip install 'pstrain[data]' (or pip install "
                      "'pyarrow>=15')") from exc

Format = Literal["csv", "tsv", "parquet"]
Source = str | os.PathLike[str] | Sequence[str | os.PathLike[str]]

SUFFIXES: dict[str, Format] = {".csv": "csv", ".tsv": "tsv", ".parquet": "parquet",
                               ".pq": "parquet"}
COMPRESSED = (".gz", ".bz2", ".zst", ".lz4")  # pyarrow.csv decompresses these by name
CSV_BLOCK_ROWS = 128  # CSV rows are in memory: small blocks make a near-global shuffle
SHUFFLE_ROWS = 16384


@dataclass(frozen=True)
class Block:
    """Rows [lo, hi) of file `file` (Parquet: of its row group `group`)."""
    file: int
    group: int | None
    lo: int
    hi: int

    @property
    def rows(self) -> int:
        return self.hi - self.lo


class FileDataset:
    """The rows of `source`, read by workers without overlap (see the module docstring).

    - `label`: the target column; `features`: the input columns (default: every other
      column). Both become tensors by the default `to_tensors`: inputs float32 of shape
      (rows, features), a list-valued column counting as its length in features;
      targets int64 for an integer column, float32 otherwise.
    - `to_tensors(table) -> (inputs, targets)`: your own conversion of a batch's
      `pyarrow.Table`, which holds `columns` (default every column); `label` and
      `features` are then not used.
    - `format`: "csv", "tsv" or "parquet" when the names do not say it (then a folder's
      every visible file is a shard); `delimiter` overrides the CSV one.
    - `shuffle=False` keeps file order (blocks and rows); the split among workers is
      the same contiguous one. `drop_last=False` also yields each epoch's short batch.
    """

    def __init__(self, source: Source, *, label: str | None = None,
                 features: Sequence[str] | None = None,
                 to_tensors: Callable[[pa.Table], Batch] | None = None,
                 columns: Sequence[str] | None = None, format: Format | None = None,
                 delimiter: str | None = None, shuffle: bool = True, drop_last: bool = True,
                 shuffle_rows: int = SHUFFLE_ROWS) -> None:
        if format is not None and format not in ("csv", "tsv", "parquet"):
            raise ConfigurationError(f"format is {format!r}; it must be 'csv', 'tsv' or "
                                     "'parquet'")
        if shuffle_rows < 1:
            raise ConfigurationError(f"shuffle_rows is {shuffle_rows}; it must be at least 1")
        if to_tensors is None and label is None:
            raise ConfigurationError("label is not set; name the target column (label=...)"
                                     " or convert rows yourself (to_tensors=...)")
        self.source = describe_source(source)
        self.files, self.format = find_files(source, format)
        self.delimiter = delimiter or ("\t" if self.format == "tsv" else ",")
        self.shuffle, self.drop_last, self.shuffle_rows = shuffle, drop_last, shuffle_rows
        names = self._column_names(0)
        if to_tensors is None:
            feature_list = list(features) if features is not None else [
                n for n in names if n != label]
            self.columns: list[str] | None = [*feature_list, str(label)]
            self.to_tensors: Callable[[pa.Table], Batch] = ColumnsToTensors(
                feature_list, str(label))
        else:
            self.columns = list(columns) if columns is not None else None
            self.to_tensors = to_tensors
        for name in self.columns or ():
            if name not in names:
                what = ("label column" if name == label else "column")
                raise ConfigurationError(f"{what} {name!r} is not in {self.files[0]}; its "
                                         f"columns are {names}")
        self._lock = threading.Lock()
        self._blocks: list[Block] | None = None
        self._tables: dict[int, pa.Table] = {}  # CSV files, read whole

    # ------------------------------------------------------------------ the contract

    def batches(self, worker: int, num_workers: int, batch_size: int, seed: int,
                start: int = 0) -> Iterator[Batch]:
        """This worker's endless stream of `(inputs, targets)`, from batch `start` on."""
        if num_workers < 1 or not 0 <= worker < num_workers:
            raise ValueError(f"worker {worker} of {num_workers} workers: it must be in "
                             f"[0, {num_workers})")
        if batch_size < 1 or start < 0:
            raise ValueError(f"batch_size is {batch_size} and start {start}; batch_size "
                             "must be at least 1 and start at least 0")
        per_epoch = self.batches_per_epoch(worker, num_workers, batch_size)
        epoch, first = divmod(start, per_epoch)
        return self._stream(worker, num_workers, batch_size, seed, epoch, first)

    def batches_per_epoch(self, worker: int, num_workers: int, batch_size: int) -> int:
        """How many batches worker `worker` of `num_workers` yields per epoch."""
        lo, hi = self.span(worker, num_workers)
        rows = hi - lo
        if rows == 0:
            raise ConfigurationError(f"data source {self.source} has {self.num_rows} rows, "
                                     f"fewer than the {num_workers} workers; every worker "
                                     "needs at least one row")
        if rows <= batch_size:
            return 1
        return rows // batch_size if self.drop_last else math.ceil(rows / batch_size)

    def span(self, worker: int, num_workers: int) -> tuple[int, int]:
        """The rows [lo, hi) of each epoch's sequence that `worker` reads."""
        total = self.num_rows
        return worker * total // num_workers, (worker + 1) * total // num_workers

    @property
    def num_rows(self) -> int:
        return sum(block.rows for block in self.blocks())

    def read_all(self) -> Batch:
        """Every row, in file order, as one `(inputs, targets)`: an evaluation set."""
        reader = Reader(self)
        return self.to_tensors(concat([reader.rows(b, 0, b.rows) for b in self.blocks()]))

    # ------------------------------------------------------------------ the stream

    def _stream(self, worker: int, num_workers: int, batch_size: int, seed: int,
                epoch: int, first: int) -> Iterator[Batch]:
        lo, hi = self.span(worker, num_workers)
        rows = hi - lo
        count_ = self.batches_per_epoch(worker, num_workers, batch_size)
        reader = Reader(self)
        for e in count(epoch):
            order, ends = self._epoch_order(seed, e)
            windows: dict[int, pa.Table] = {}
            for b in range(first if e == epoch else 0, count_):
                a, z = b * batch_size, min((b + 1) * batch_size, rows)
                if rows <= batch_size:
                    a, z = 0, rows
                pieces = []
                while a < z:
                    w = a // self.shuffle_rows
                    if w not in windows:
                        windows.clear()  # one window in memory at a time
                        windows[w] = self._window(reader, order, ends, lo, rows, seed, e,
                                                  worker, w)
                    end = min(z, (w + 1) * self.shuffle_rows)
                    pieces.append(windows[w].slice(a - w * self.shuffle_rows, end - a))
                    a = end
                yield self.to_tensors(concat(pieces))

    def _epoch_order(self, seed: int, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """The epoch's block order (the same on every worker) and where each ends."""
        blocks = self.blocks()
        order = (rng(seed, epoch).permutation(len(blocks)) if self.shuffle
                 else np.arange(len(blocks)))
        ends = np.cumsum([blocks[i].rows for i in order])
        return order, ends

    def _window(self, reader: Reader, order: np.ndarray, ends: np.ndarray, lo: int,
                rows: int, seed: int, epoch: int, worker: int, window: int) -> pa.Table:
        """Window `window` of the worker's span: its rows of the epoch's sequence, in
        the window's own order."""
        a = lo + window * self.shuffle_rows
        z = lo + min((window + 1) * self.shuffle_rows, rows)
        blocks = self.blocks()
        pieces = []
        i = int(np.searchsorted(ends, a, side="right"))
        while a < z:
            block = blocks[order[i]]
            begin = int(ends[i]) - block.rows
            end = min(z, int(ends[i]))
            pieces.append(reader.rows(block, a - begin, end - begin))
            a, i = end, i + 1
        table = concat(pieces)
        if self.shuffle:
            table = table.take(rng(seed, epoch, worker, window).permutation(table.num_rows))
        return table

    # ------------------------------------------------------------------ the files

    def blocks(self) -> list[Block]:
        """Every file's blocks, in file order (read once: CSV files are parsed here)."""
        with self._lock:
            if self._blocks is None:
                self._blocks = [b for i in range(len(self.files)) for b in self._blocks_of(i)]
                if not self._blocks:
                    raise ConfigurationError(f"data source {self.source} has no rows")
            return self._blocks

    def _blocks_of(self, i: int) -> list[Block]:
        if self.format == "parquet":
            meta = self.parquet_file(i).metadata
            return [Block(i, g, 0, meta.row_group(g).num_rows)
                    for g in range(meta.num_row_groups) if meta.row_group(g).num_rows]
        rows = self.csv_table(i).num_rows
        return [Block(i, None, lo, min(lo + CSV_BLOCK_ROWS, rows))
                for lo in range(0, rows, CSV_BLOCK_ROWS)]

    def csv_table(self, i: int) -> pa.Table:
        table = self._tables.get(i)
        if table is None:
            table = self._tables[i] = self._read_csv(i, self.columns)
        return table

    def _read_csv(self, i: int, columns: Sequence[str] | None,
                  first_block_only: bool = False) -> pa.Table:
        path = self.files[i]
        parse = pa_csv.ParseOptions(delimiter=self.delimiter)
        convert = pa_csv.ConvertOptions(include_columns=list(columns or ()))
        try:
            if first_block_only:
                with pa_csv.open_csv(path, parse_options=parse,
                                     convert_options=convert) as reader:
                    return pa.Table.from_batches([], schema=reader.schema)
            return pa_csv.read_csv(path, parse_options=parse, convert_options=convert)
        except (pa.ArrowInvalid, OSError) as exc:
            raise ConfigurationError(f"{path} cannot be read as {self.format.upper()}: "
                                     f"{one_line(str(exc), 300)}") from exc

    def parquet_file(self, i: int) -> pq.ParquetFile:
        path = self.files[i]
        try:
            return pq.ParquetFile(path)
        except (pa.ArrowInvalid, OSError) as exc:
            raise ConfigurationError(f"{path} cannot be read as Parquet: "
                                     f"{one_line(str(exc), 300)}") from exc

    def _column_names(self, i: int) -> list[str]:
        if self.format == "parquet":
            return list(self.parquet_file(i).schema_arrow.names)
        return list(self._read_csv(i, None, first_block_only=True).column_names)


class Reader:
    """Rows of blocks, for one stream. It keeps the last Parquet row group read (one
    window often ends in the row group the next begins with) and its last few open
    Parquet files (opening one reads its footer)."""

    OPEN_FILES = 16

    def __init__(self, dataset: FileDataset) -> None:
        self.dataset = dataset
        self._group: tuple[tuple[int, int], pa.Table] | None = None
        self._open: dict[int, pq.ParquetFile] = {}

    def rows(self, block: Block, lo: int, hi: int) -> pa.Table:
        """Rows [lo, hi) of `block`."""
        d = self.dataset
        if block.group is None:
            return d.csv_table(block.file).slice(block.lo + lo, hi - lo)
        key = (block.file, block.group)
        if self._group is None or self._group[0] != key:
            try:
                table = self._file(block.file).read_row_group(block.group, columns=d.columns)
            except (pa.ArrowInvalid, OSError, KeyError) as exc:
                raise ConfigurationError(f"{d.files[block.file]} row group {block.group} "
                                         f"cannot be read: {one_line(str(exc), 300)}") from exc
            self._group = (key, table)
        return self._group[1].slice(block.lo + lo, hi - lo)

    def _file(self, i: int) -> pq.ParquetFile:
        file = self._open.pop(i, None) or self.dataset.parquet_file(i)
        self._open[i] = file  # the most recently used last
        while len(self._open) > self.OPEN_FILES:
            self._open.pop(next(iter(self._open))).close()
        return file


def file_batches(source: Source, worker: int, num_workers: int, batch_size: int, seed: int,
                 start: int = 0, **options: Any) -> Iterator[Batch]:
    """`FileDataset(source, **options).batches(worker, num_workers, batch_size, seed,
    start)` in one call. Build the FileDataset once (in your `make_task`) when you can:
    it keeps what it has read."""
    return FileDataset(source, **options).batches(worker, num_workers, batch_size, seed,
                                                  start)


# ---------------------------------------------------------------------- converting


class ColumnsToTensors:
    """The default `to_tensors`: feature columns to float32 inputs, the label column to
    int64 (integer column) or float32 targets."""

    def __init__(self, features: Sequence[str], label: str) -> None:
        if not features:
            raise ConfigurationError(f"no feature columns: the data has only the label "
                                     f"column {label!r}")
        self.features, self.label = list(features), label

    def __call__(self, table: pa.Table) -> Batch:
        inputs = np.column_stack([column_array(table, name, "feature column")
                                  for name in self.features])
        targets = column_array(table, self.label, "label column")
        if targets.ndim != 1:
            raise ConfigurationError(f"label column {self.label!r} holds lists; a label "
                                     "must be one number per row (or pass to_tensors)")
        y = torch.tensor(targets)
        y = y.long() if targets.dtype.kind in "iu" else y.float()
        return torch.from_numpy(inputs.astype(np.float32, copy=False)), y


def column_array(table: pa.Table, name: str, what: str) -> np.ndarray:
    """One column as numbers: (rows,) for a number per row, (rows, k) for lists of k."""
    column = table.column(name)
    kind = column.type
    if column.null_count:
        raise ConfigurationError(f"{what} {name!r} has {column.null_count} empty values "
                                 f"in a batch; fill them in, or convert rows yourself "
                                 "(to_tensors=...)")
    if pa.types.is_list(kind) or pa.types.is_large_list(kind) or \
            pa.types.is_fixed_size_list(kind):
        array = column.combine_chunks()
        lengths = set(pc.list_value_length(array).to_numpy().tolist())
        if len(lengths) > 1:
            raise ConfigurationError(f"{what} {name!r} holds lists of lengths "
                                     f"{sorted(lengths)[:3]}; they must all have one length")
        flat = array.flatten().to_numpy(zero_copy_only=False)
        return flat.astype(np.float32).reshape(len(array), lengths.pop() if lengths else 0)
    if not (pa.types.is_integer(kind) or pa.types.is_floating(kind)
            or pa.types.is_boolean(kind)):
        raise ConfigurationError(f"{what} {name!r} holds {kind}, not numbers; map it to "
                                 "numbers in the files, or convert rows yourself "
                                 "(to_tensors=...)")
    array = column.to_numpy()
    return array.astype(np.float32) if array.dtype == np.bool_ else array


# ---------------------------------------------------------------------- finding files


def find_files(source: Source, format: Format | None) -> tuple[list[str], Format]:
    """The files of `source` in a fixed order (sorted within each glob and folder), and
    their one format."""
    items = [source] if isinstance(source, str | os.PathLike) else list(source)
    if not items:
        raise ConfigurationError("data source is an empty list; give a file, a glob or a "
                                 "folder")
    files: list[str] = []
    for item in items:
        text = os.path.expanduser(os.fspath(item))
        if any(ch in text for ch in "*?["):
            found = sorted(p for p in glob.glob(text, recursive=True) if os.path.isfile(p))
            if not found:
                raise ConfigurationError(f"data source {text!r} matches no files")
            files += found
        elif os.path.isdir(text):
            found = sorted(str(p) for p in Path(text).rglob("*") if p.is_file()
                           and not is_hidden(p.relative_to(text))
                           and (format is not None or format_of(str(p)) is not None))
            if not found:
                raise ConfigurationError(f"data source {text!r} is a folder with no "
                                         f"{'visible' if format else 'CSV, TSV or Parquet'}"
                                         " files in it")
            files += found
        elif os.path.isfile(text):
            files.append(text)
        else:
            raise ConfigurationError(f"data source {text!r} does not exist")
    if format is not None:
        return files, format
    formats = {path: format_of(path) for path in files}
    unknown = [path for path, f in formats.items() if f is None]
    if unknown:
        raise ConfigurationError(f"data file {unknown[0]!r} is neither .csv, .tsv nor "
                                 ".parquet; name its format (format='csv', 'tsv' or "
                                 "'parquet')")
    kinds = sorted({f for f in formats.values() if f is not None})
    if len(kinds) > 1:
        raise ConfigurationError(f"data source {describe_source(source)} mixes formats "
                                 f"{kinds}; give files of one format")
    return files, kinds[0]  # type: ignore[return-value]


def format_of(path: str) -> Format | None:
    name = path.lower()
    for suffix in COMPRESSED:
        name = name.removesuffix(suffix)
    return SUFFIXES.get(os.path.splitext(name)[1])


def is_hidden(relative: Path) -> bool:
    """Names that start with '.' or '_' (a writer's temporary files, _SUCCESS)."""
    return any(part.startswith((".", "_")) for part in relative.parts)


def describe_source(source: Source) -> str:
    if isinstance(source, str | os.PathLike):
        return repr(os.fspath(source))
    return repr([os.fspath(s) for s in source])


# ---------------------------------------------------------------------- helpers


def rng(*key: int) -> np.random.Generator:
    """A generator drawn from `key` alone (seeds may be negative: taken mod 2**64)."""
    return np.random.default_rng(np.random.SeedSequence([k % 2**64 for k in key]))


def concat(pieces: list[pa.Table]) -> pa.Table:
    """Tables of several files as one; CSV files may infer int64 for a column that is
    double elsewhere, so types are promoted."""
    if len(pieces) == 1:
        return pieces[0]
    return pa.concat_tables(pieces, promote_options="permissive")
