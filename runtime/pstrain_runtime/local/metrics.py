"""Training progress of a local run, folded from replica events, and the final summary.

Pure: `fold(metrics, replica, event)` reads one parsed `PSTRAIN_EVENT` line (see
`pstrain_api.events`) and returns the updated metrics; `build_summary` turns the end
state into the one JSON object that `pstrain run --json` prints.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from .supervisor import RunState


@dataclass(frozen=True)
class Restore:
    """One `restored` event: who restored which step, and the steps thrown away."""

    replica: str
    step: int
    lost_steps: int
    path: str = ""
    servers: tuple[int, ...] = ()  # the parameter servers that had lost their state


@dataclass(frozen=True)
class Metrics:
    total_steps: int
    step: int = 0
    loss: float | None = None
    samples_per_sec: float | None = None
    accuracy: float | None = None
    eval_loss: float | None = None
    auc: float | None = None  # tasks that report them (the CTR example): ROC AUC and
    logloss: float | None = None  # log loss on held-out data
    checkpoint_step: int | None = None
    checkpoint_path: str | None = None
    restores: tuple[Restore, ...] = ()
    done: bool = False
    train_seconds: float | None = None
    sparse_rows: int | None = None  # live rows of the sparse tables, over all servers
    sparse_bytes: int | None = None  # their memory on the servers
    sparse_disk_rows: int | None = None  # of the live rows, those on the servers' disks

    @property
    def lost_steps(self) -> int:
        return sum(r.lost_steps for r in self.restores)


def _num(event: Mapping[str, Any], key: str) -> float | None:
    value = event.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def _int(event: Mapping[str, Any], key: str) -> int | None:
    value = _num(event, key)
    return int(value) if value is not None else None


def _later(known: int | None, step: int | None) -> int | None:
    """The chief's step as an eval or a checkpoint at `step` shows it (progress events
    come at an interval: a short run's last one may be far behind)."""
    if step is None:
        return known
    return step if known is None else max(known, step)


def fold(metrics: Metrics, replica: str, event: Mapping[str, Any]) -> Metrics:
    """Metrics after `event` from `replica`. Unknown or malformed fields are ignored:
    a replica's output must never crash the runner."""
    kind = event.get("event")
    step = _int(event, "step")
    if kind == "progress":
        return replace(
            metrics,
            step=step if step is not None else metrics.step,
            loss=_num(event, "loss") if "loss" in event else metrics.loss,
            samples_per_sec=_num(event, "samples_per_sec") or metrics.samples_per_sec,
            **_table_sizes(metrics, event),
        )
    if kind == "loss":  # a point of the loss curve, between progress events
        return replace(metrics, step=_later(metrics.step, step),
                       loss=_num(event, "loss") if "loss" in event else metrics.loss)
    if kind == "eval":
        return replace(
            metrics,
            step=_later(metrics.step, step),
            accuracy=_num(event, "accuracy"),
            eval_loss=_num(event, "loss"),
            auc=_num(event, "auc"),
            logloss=_num(event, "logloss"),
        )
    if kind == "checkpoint":
        return replace(metrics, step=_later(metrics.step, step), checkpoint_step=step,
                       checkpoint_path=str(event.get("path", "")) or None)
    if kind == "restored":
        servers = event.get("servers")
        restore = Restore(replica=replica, step=step or 0,
                          lost_steps=max(_int(event, "lost_steps") or 0, 0),
                          path=str(event.get("path") or ""),
                          servers=tuple(int(s) for s in servers if isinstance(s, int))
                          if isinstance(servers, list) else ())
        # The chief's step counter goes back to the restored step.
        return replace(metrics, restores=(*metrics.restores, restore),
                       step=step if step is not None else metrics.step)
    if kind == "done":
        return replace(
            metrics,
            done=True,
            step=step if step is not None else metrics.step,
            loss=_num(event, "loss") if "loss" in event else metrics.loss,
            accuracy=_num(event, "accuracy") if "accuracy" in event else metrics.accuracy,
            samples_per_sec=_num(event, "samples_per_sec") or metrics.samples_per_sec,
            train_seconds=_num(event, "wall_seconds"),
            **_table_sizes(metrics, event),
        )
    return metrics


def _table_sizes(metrics: Metrics, event: Mapping[str, Any]) -> dict[str, int | None]:
    rows, size = _int(event, "sparse_rows"), _int(event, "sparse_bytes")
    disk = _int(event, "sparse_disk_rows")  # with spec.training.sparseStorage
    return {"sparse_rows": rows if rows is not None else metrics.sparse_rows,
            "sparse_bytes": size if size is not None else metrics.sparse_bytes,
            "sparse_disk_rows": disk if disk is not None else metrics.sparse_disk_rows}


def is_resume(restore: Restore) -> bool:
    """The chief started from the latest checkpoint of its directory, as asked (no
    parameter server had lost its state): a resume, not a recovery."""
    return not restore.servers and restore.lost_steps == 0 and bool(restore.path)


def describe_restore(restore: Restore) -> str:
    """The line a restore deserves: a resume says where it starts from; a recovery,
    loud, what came back, from which step, and what was lost."""
    if is_resume(restore):
        return (f"{restore.replica}: resumed from the checkpoint at step {restore.step} "
                f"({restore.path})")
    steps = "step" if restore.lost_steps == 1 else "steps"
    if restore.servers:
        shards = ", ".join(str(s) for s in restore.servers)
        what = f"restored ps shard{'s' if len(restore.servers) > 1 else ''} {shards}"
    else:
        what = "restored checkpoint"
    return (f"{restore.replica}: {what} from step {restore.step}; "
            f"{restore.lost_steps} {steps} lost")


def build_summary(state: RunState, metrics: Metrics, wall_seconds: float,
                  job_name: str, checkpoint_dir: str | None, *,
                  checkpoint_removed: bool = False, resume: str | None = None,
                  stopped_by: str | None = None, counts_steps: bool = True,
                  tensorboard_dir: str | None = None) -> dict[str, Any]:
    """The `--json` line: phase, steps, loss, accuracy (auc and logloss), timing,
    restarts, lost steps, and how every replica ended (exit code, restarts); for a model
    with sparse tables, their live rows and server memory.

    It never names what is gone or unknown: `checkpoint_dir` is null once the run
    removed it (`checkpoint_dir_removed` names it), `steps` and `total_steps` are null
    for a program whose steps pstrain does not count. Keys present only when they
    apply: `stopped_by` (the signal that stopped the job), `resume` (the command that
    resumes it from its checkpoint), `tensorboard_dir` (the chief's TensorBoard event
    files, kept even when the temporary checkpoint directory around them was emptied)."""
    replicas = {
        r.name: {"role": r.role, "index": r.index, "exit_code": r.exit_code,
                 "restarts": max(r.attempt - 1 - r.rejoined, 0)}
        for r in state.replicas
    }
    summary = {
        "job": job_name,
        "phase": state.phase,
        "reason": state.reason,
        "message": state.message,
        "steps": metrics.step,
        "total_steps": metrics.total_steps,
        "loss": metrics.loss,
        "accuracy": metrics.accuracy,
        "wall_seconds": round(wall_seconds, 3),
        "train_seconds": metrics.train_seconds,
        "samples_per_sec": metrics.samples_per_sec,
        "restarts": state.restarts,
        "lost_steps": metrics.lost_steps,
        "restores": [
            {"replica": r.replica, "step": r.step, "lost_steps": r.lost_steps,
             "servers": list(r.servers)}
            for r in metrics.restores
        ],
        "checkpoint_dir": checkpoint_dir,
        "last_checkpoint_step": metrics.checkpoint_step,
        "failed_replica": state.culprit,
        "replicas": replicas,
    }
    if not counts_steps:
        summary["steps"] = summary["total_steps"] = None
    if checkpoint_removed:
        summary["checkpoint_dir"] = None
        summary["checkpoint_dir_removed"] = checkpoint_dir
    extras = {"stopped_by": stopped_by, "resume": resume,
              "tensorboard_dir": tensorboard_dir}
    summary.update({key: value for key, value in extras.items() if value is not None})
    for name in ("auc", "logloss"):  # only a model whose evaluation reports them
        if getattr(metrics, name) is not None:
            summary[name] = getattr(metrics, name)
    summary.update(_sparse_fields(metrics))
    return summary


def _sparse_fields(metrics: Metrics) -> dict[str, int | None]:
    """A model with sparse tables: their rows and server memory, and the rows on the
    servers' disks (with `spec.training.sparseStorage`)."""
    fields: dict[str, int | None] = {}
    if metrics.sparse_rows is not None:
        fields.update(sparse_rows=metrics.sparse_rows, sparse_bytes=metrics.sparse_bytes)
    if metrics.sparse_disk_rows is not None:
        fields["sparse_disk_rows"] = metrics.sparse_disk_rows
    return fields
