"""The chief's TensorBoard log: the scalars of its events, written as TensorBoard event
files in `tensorboard/` beside the checkpoints (`<checkpoint.directory>/tensorboard`), so
that `tensorboard --logdir <checkpoint.directory>/tensorboard` shows the loss curve.

Only the chief writes (it alone emits `progress` and `eval`), and only when the job has a
checkpoint directory: that is the storage that outlives the pod (on Kubernetes the
user's mounted volume); without one there are no event files. `pstrain run` always has
one (a temporary one unless --checkpoint-dir), and it keeps `tensorboard/` when it
removes a temporary directory's checkpoints (`remove_checkpoints`).

What is written, by event (`build_scalars`, pure; the global step is the x axis):

- `loss` (every `progress.curve_every(steps)` global steps): `train/loss`, the chief's
  loss averaged since the previous point;
- `progress`: `train/samples_per_sec`,
  `train/staleness` (global steps applied between the chief's pull and its gradient's
  update, averaged), and for sparse tables `sparse/rows` and `sparse/bytes`;
- `eval`: every metric the task's evaluation reports, as `eval/<name>` (`eval/accuracy`,
  `eval/loss`, `eval/auc`, `eval/logloss`);
- `restored`: no scalar; the next writer purges what earlier runs wrote at or after the
  restored step, so a curve continues from the checkpoint instead of doubling back.

This module imports neither torch nor tensorboard at import time: the runner (torch-free)
uses its paths, and `TensorBoardLog` imports `SummaryWriter` when it is built. Writing
is best effort: a log that cannot be written is reported once and training goes on.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol

DIRECTORY = "tensorboard"
EVENT_FILE_PREFIX = "events.out.tfevents."

PROGRESS_TAGS = {  # progress event field -> tag (the loss curve: `loss` events)
    "samples_per_sec": "train/samples_per_sec",
    "staleness": "train/staleness",
    "sparse_rows": "sparse/rows",
    "sparse_bytes": "sparse/bytes",
}
EVAL_PREFIX = "eval/"


class ScalarWriter(Protocol):
    """What `TensorBoardLog` needs of torch's SummaryWriter (tests pass a fake)."""

    def add_scalar(self, tag: str, scalar_value: float, global_step: int) -> None: ...
    def flush(self) -> None: ...
    def close(self) -> None: ...


WriterFactory = Callable[[Path, int | None], ScalarWriter]  # (log dir, purge step)


def tensorboard_dir(checkpoint_dir: str | os.PathLike[str]) -> Path:
    """Where the chief of a job with this checkpoint directory writes its event files."""
    return Path(checkpoint_dir) / DIRECTORY


def has_event_files(directory: str | os.PathLike[str]) -> bool:
    """`directory` holds at least one TensorBoard event file."""
    path = Path(directory)
    return path.is_dir() and any(p.name.startswith(EVENT_FILE_PREFIX)
                                 for p in path.iterdir())


def remove_checkpoints(checkpoint_dir: str | os.PathLike[str]) -> None:
    """Remove a temporary checkpoint directory, except its event files: the directory
    goes when `tensorboard/` holds none, else everything in it but `tensorboard/`."""
    root = Path(checkpoint_dir)
    if not has_event_files(tensorboard_dir(root)):
        shutil.rmtree(root, ignore_errors=True)
        return
    for child in root.iterdir() if root.is_dir() else ():
        if child.name == DIRECTORY:
            continue
        if child.is_dir() and not child.is_symlink():
            shutil.rmtree(child, ignore_errors=True)
        else:
            child.unlink(missing_ok=True)


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def build_scalars(kind: str, fields: Mapping[str, Any]) -> dict[str, float]:
    """The scalars (tag -> value) one event carries; non-numeric fields are skipped."""
    if kind == "loss":
        pairs = iter([("train/loss", _number(fields.get("loss")))])
    elif kind == "progress":
        pairs = ((tag, _number(fields.get(name))) for name, tag in PROGRESS_TAGS.items())
    elif kind == "eval":
        pairs = ((EVAL_PREFIX + name, _number(value)) for name, value in fields.items()
                 if name not in ("step", "time"))
    else:
        return {}
    return {tag: value for tag, value in pairs if value is not None}


def summary_writer(directory: Path, purge_step: int | None) -> ScalarWriter:
    from torch.utils.tensorboard import SummaryWriter

    writer: ScalarWriter = SummaryWriter(log_dir=str(directory), purge_step=purge_step)
    return writer


class TensorBoardLog:
    """An emit callback (`log(kind, **fields)`) that writes the scalars of the chief's
    events; `tee` puts it beside the event lines. The writer is made at the first event
    (a `restored` one makes it purge from the restored step) and made again, purging,
    at a later `restored` (a recovery that went back)."""

    def __init__(self, directory: str | os.PathLike[str],
                 writer_factory: WriterFactory = summary_writer) -> None:
        self.directory = Path(directory)
        self.writer_factory = writer_factory
        self.writer: ScalarWriter | None = None
        self.failed = False

    def __call__(self, kind: str, **fields: Any) -> None:
        if self.failed:
            return
        step = fields.get("step")
        try:
            if kind == "restored" and isinstance(step, int):
                self._open(purge_step=step)
            scalars = build_scalars(kind, fields)
            if scalars and isinstance(step, int):
                writer = self.writer or self._open(purge_step=None)
                for tag, value in scalars.items():
                    writer.add_scalar(tag, value, step)
            if kind in ("eval", "checkpoint", "done") and self.writer is not None:
                self.writer.flush()
        except (OSError, RuntimeError, ValueError) as exc:
            self.failed = True
            print(f"pstrain: TensorBoard log in {self.directory} stopped: {exc}",
                  file=sys.stderr, flush=True)

    def _open(self, purge_step: int | None) -> ScalarWriter:
        self.close()
        self.writer = self.writer_factory(self.directory, purge_step)
        return self.writer

    def close(self) -> None:
        if self.writer is not None:
            writer, self.writer = self.writer, None
            writer.close()


def tee(*emitters: Callable[..., None]) -> Callable[..., None]:
    """One emit callback that calls each of `emitters` in turn."""
    def emit(kind: str, **fields: Any) -> None:
        for each in emitters:
            each(kind, **fields)
    return emit


__all__ = ["DIRECTORY", "TensorBoardLog", "build_scalars", "has_event_files",
           "remove_checkpoints", "tee", "tensorboard_dir"]
