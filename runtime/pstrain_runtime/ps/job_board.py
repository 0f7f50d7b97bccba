"""The job board: what a namespace's job reports and is asked, beside training itself.

- `record_report`: the chief's StatusReport (loss, throughput, eval, the last
  checkpoint, the sparse tables' size), kept as the latest `JobReport`.
- `job_status`: what GetJobStatus answers (the operator's and the CLI's view).
- `request_checkpoint`: RequestCheckpoint raises a flag the chief sees in its next push
  reply or Info; it stands until a checkpoint at or after that step is reported.
- `finish`: the job is done; every wait ends and every push is answered "done".
- `workers_informed`: every worker of every finished namespace has heard it (so the
  server may stop).
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..proto import ps_pb2 as pb
from .errors import PSError

if TYPE_CHECKING:
    from .namespace import Namespace


@dataclass
class JobReport:
    loss: float | None = None
    samples_per_sec: float | None = None
    eval_accuracy: float | None = None
    eval_metrics: dict[str, float] = field(default_factory=dict)
    checkpoint_step: int | None = None
    checkpoint_path: str = ""
    checkpoint_time: float = 0.0
    target_steps: int = 0
    updated_time: float = 0.0
    sparse_rows: int = -1  # -1: no sparse tables
    sparse_bytes: int = 0


def finish(ns: Namespace) -> pb.StepInfo:
    with ns.cond:
        ns.done = True
        ns.told_done.add(0)
        ns.cond.notify_all()
        return ns.info()


def record_report(ns: Namespace, report: pb.StatusReport) -> None:
    with ns.cond:
        r = ns.report
        r.loss = report.loss if math.isfinite(report.loss) else r.loss
        r.samples_per_sec = report.samples_per_sec
        if report.has_eval:
            r.eval_accuracy = (report.eval_accuracy if math.isfinite(report.eval_accuracy)
                               else None)
            r.eval_metrics = dict(report.eval_metrics)
        if report.has_checkpoint:
            if 0 <= ns.checkpoint_wanted <= report.checkpoint_step:
                ns.checkpoint_wanted = -1  # the requested checkpoint is written
            r.checkpoint_step = report.checkpoint_step
            r.checkpoint_path = report.checkpoint_path
            r.checkpoint_time = report.checkpoint_time
        r.target_steps = report.target_steps or r.target_steps
        if report.sparse_rows >= 0 and (report.sparse_rows or report.sparse_bytes):
            r.sparse_rows, r.sparse_bytes = report.sparse_rows, report.sparse_bytes
        r.updated_time = time.time()


def latest_reported(candidates: list[Namespace]) -> Namespace:
    """The most recently reported of `candidates`."""
    if not candidates:
        raise PSError("NOT_FOUND", "this parameter server holds no namespace yet")
    return max(candidates, key=lambda n: n.report.updated_time)


def request_checkpoint(ns: Namespace) -> pb.StepInfo:
    """Returns the StepInfo, whose global_step is the step asked for."""
    with ns.cond:
        if ns.checkpoint_wanted < 0:
            ns.checkpoint_wanted = ns.global_step
        return ns.info()


def job_status(ns: Namespace) -> pb.JobStatus:
    with ns.cond:
        r = ns.report
        return pb.JobStatus(
            namespace=ns.name, global_step=ns.global_step,
            loss=r.loss if r.loss is not None else float("nan"),
            samples_per_sec=r.samples_per_sec or 0.0,
            eval_accuracy=r.eval_accuracy if r.eval_accuracy is not None else float("nan"),
            has_eval=r.eval_accuracy is not None or bool(r.eval_metrics),
            checkpoint_step=r.checkpoint_step if r.checkpoint_step is not None else -1,
            checkpoint_path=r.checkpoint_path, checkpoint_time=r.checkpoint_time,
            has_checkpoint=r.checkpoint_step is not None, done=ns.done,
            target_steps=r.target_steps, initialized=ns.initialized,
            updated_time=r.updated_time, eval_metrics=r.eval_metrics,
            sparse_rows=r.sparse_rows, sparse_bytes=r.sparse_bytes,
            workers=sorted(ns.members.live),
        )


def workers_informed(namespaces: Iterable[Namespace]) -> bool:
    """Every worker of every finished namespace has been told the job is done."""
    for ns in namespaces:
        with ns.cond:
            if ns.done and not ns.members.live <= ns.told_done:
                return False
    return True
