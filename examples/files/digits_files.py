"""The digits MLP trained from files, as a user with their own data would: the entry
point of examples/digits-files.yaml.

    pstrain run examples/digits-files.yaml     # from the repository's root

`make_task(data_dir=..., format="csv" | "tsv" | "parquet")` reads `data_dir/train/`, a
folder of shards, with `pstrain_runtime.datasets.FileDataset`: each worker reads its own
rows, reshuffled every epoch, and a restarted worker resumes where it left off. The
held-out rows (`data_dir/test.<format>`) are read whole for `evaluate`.

Real data would already be on a mounted volume. So that the example needs no download,
it writes its files at first use from scikit-learn's bundled 8x8 digits (64 pixel
columns scaled to [0, 1] and an integer `label`), through a temporary folder renamed
into place, so replicas that start together never read half-written files.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping
from pathlib import Path

import torch
from torch import nn

from pstrain_runtime.datasets import FileDataset
from pstrain_runtime.examples.digits import build_model, load_digits_split
from pstrain_runtime.task import Task

SHARDS = 4


def make_task(data_dir: str = "examples/files/data", format: str = "csv",
              hidden: int = 64) -> Task:
    root = Path(data_dir) / format
    if not (root / "train").is_dir():
        write_digits(root, format)
    train = FileDataset(root / "train", label="label")
    x_test, y_test = FileDataset(root / f"test.{format}", label="label").read_all()
    loss_fn = nn.CrossEntropyLoss()

    def evaluate(model: nn.Module) -> Mapping[str, float]:
        with torch.no_grad():
            out = model(x_test)
            return {"accuracy": float((out.argmax(1) == y_test).float().mean()),
                    "loss": float(loss_fn(out, y_test))}

    return Task(model=build_model(hidden), batches=train.batches, loss=loss_fn,
                evaluate=evaluate)


def write_digits(root: Path, format: str) -> None:
    """`root/train/part-0000.<format>` ... and `root/test.<format>`, all at once."""
    import pyarrow as pa
    import pyarrow.csv as pa_csv
    import pyarrow.parquet as pq

    def write(table: pa.Table, path: Path) -> None:
        if format == "parquet":
            pq.write_table(table, path, row_group_size=128)
        else:
            pa_csv.write_csv(table, path, pa_csv.WriteOptions(
                delimiter="\t" if format == "tsv" else ","))

    def as_table(x: torch.Tensor, y: torch.Tensor) -> pa.Table:
        columns = {f"pixel_{i}": x[:, i].numpy() for i in range(x.shape[1])}
        return pa.table({**columns, "label": y.numpy()})

    x_train, y_train, x_test, y_test = load_digits_split()
    root.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{root.name}-", dir=root.parent))
    (staging / "train").mkdir()
    train = as_table(x_train, y_train)
    per_shard = -(-train.num_rows // SHARDS)
    for shard in range(SHARDS):
        write(train.slice(shard * per_shard, per_shard),
              staging / "train" / f"part-{shard:04d}.{format}")
    write(as_table(x_test, y_test), staging / f"test.{format}")
    try:
        os.rename(staging, root)
    except OSError:  # another replica was first: its files are the same
        for path in sorted(staging.rglob("*"), reverse=True):
            path.rmdir() if path.is_dir() else path.unlink()
        staging.rmdir()
