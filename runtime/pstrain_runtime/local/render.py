"""What the user sees during `pstrain run`: replica output prefixed with the replica
name, the runner's notices, and progress (a rich progress bar on a terminal, plain
lines otherwise).

The text of every line comes from the pure `format_*` functions; the reporters only
decide where and how it is drawn.
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, TextIO

from .metrics import Metrics, describe_restore, is_resume
from .supervisor import Level

LEVEL_MARK: Mapping[Level, str] = {"info": "", "warning": "warning: ", "error": "error: "}


def format_prefix(name: str, width: int) -> str:
    return f"[{name}]".ljust(width + 2)


def format_replica_line(name: str, text: str, width: int = 0) -> str:
    return f"{format_prefix(name, width)} {text}"


def format_notice(level: Level, text: str) -> str:
    return f"pstrain: {LEVEL_MARK[level]}{text}"


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def format_quality(accuracy: float | None, auc: float | None) -> str:
    """"accuracy 0.9700", or "auc 0.8500" for a task that reports AUC and no accuracy."""
    if accuracy is None and auc is not None:
        return f"auc {auc:.4f}"
    return f"accuracy {_fmt(accuracy, '.4f')}"


def format_progress(metrics: Metrics) -> str:
    line = (f"step {metrics.step}/{metrics.total_steps}  loss {_fmt(metrics.loss, '.4f')}  "
            f"{_fmt(metrics.samples_per_sec, '.0f')} samples/s")
    if metrics.auc is not None:
        line += f"  auc {metrics.auc:.4f}"
    if metrics.sparse_rows is not None:
        line += (f"  {metrics.sparse_rows} table rows "
                 f"({(metrics.sparse_bytes or 0) / 2**20:.1f} MiB on the ps)")
    return line


def format_event(replica: str, event: Mapping[str, Any], metrics: Metrics) -> str | None:
    """A line for an event worth a line of its own (not progress, which drives the bar)."""
    kind = event.get("event")
    if kind == "eval":
        return (f"{replica}: eval at step {event.get('step', '?')}: "
                f"{format_quality(metrics.accuracy, metrics.auc)}, "
                f"loss {_fmt(metrics.eval_loss, '.4f')}")
    if kind == "checkpoint":
        return (f"{replica}: checkpoint at step {event.get('step', '?')}"
                f" -> {event.get('path', '?')}")
    if kind == "restored" and metrics.restores:
        warning = f"; {event['warning']}" if event.get("warning") else ""
        return describe_restore(metrics.restores[-1]) + warning
    if kind == "done":
        return (f"{replica}: training done at step {metrics.step}: loss "
                f"{_fmt(metrics.loss, '.4f')}, "
                f"{format_quality(metrics.accuracy, metrics.auc)}, "
                f"{_fmt(metrics.samples_per_sec, '.0f')} samples/s")
    if kind == "ready":
        return f"{replica}: serving on {event.get('address', '?')}"
    return None


def event_level(event: Mapping[str, Any], metrics: Metrics) -> Level:
    """A restore is loud (a warning): training went back and lost steps; a resume the
    user asked for (a run pointed at a directory with checkpoints) is not."""
    if event.get("event") != "restored":
        return "info"
    quiet = (metrics.restores and is_resume(metrics.restores[-1])
             and not event.get("warning"))
    return "info" if quiet else "warning"


def format_result(summary: Mapping[str, Any]) -> list[str]:
    """The closing lines of a run, for humans (the --json line is for machines): what
    happened, where the checkpoints are, how to resume a job that stopped early, and
    how to open the chief's TensorBoard files."""
    lines = [_format_outcome(summary),
             f"restarts: {summary['restarts']}, steps lost to restores: "
             f"{summary['lost_steps']}"]
    if (summary["phase"] != "Succeeded" and summary.get("message")
            and not summary.get("stopped_by")):
        lines.append(summary["message"])
    lines += _format_checkpoints(summary)
    return lines


def _format_outcome(summary: Mapping[str, Any]) -> str:
    job, wall = summary["job"], f"{summary['wall_seconds']:.1f}s"
    figures = (f"loss {_fmt(summary['loss'], '.4f')}, "
               f"{format_quality(summary['accuracy'], summary.get('auc'))}, "
               f"{_fmt(summary['samples_per_sec'], '.0f')} samples/s")
    if summary["steps"] is None:  # a program of the user's own: no step events
        return (f"job {job} {summary['phase']} ({summary['reason']}) after {wall}; "
                "pstrain does not count the steps of this job's own program (it prints "
                "no PSTRAIN_EVENT lines)")
    if summary.get("stopped_by"):
        who = "you (Ctrl-C)" if summary["stopped_by"] == "SIGINT" else summary["stopped_by"]
        return (f"job {job} stopped by {who} at step {summary['steps']} of "
                f"{summary['total_steps']} after {wall}: {figures}")
    return (f"job {job} {summary['phase']} ({summary['reason']}) after {wall}: "
            f"{summary['steps']}/{summary['total_steps']} steps, {figures}")


def _format_checkpoints(summary: Mapping[str, Any]) -> list[str]:
    """Where the checkpoints are, once a job did not succeed (a succeeded one has
    nothing to resume), and what became of a temporary directory."""
    step, directory = summary.get("last_checkpoint_step"), summary.get("checkpoint_dir")
    lines = []
    if summary.get("resume"):
        lines += [f"last checkpoint: step {step}, in {directory}",
                  f"resume with: {summary['resume']}"]
    elif summary.get("stopped_by") and step is None:
        lines.append("no checkpoint was written before it stopped: a new run starts "
                     "from step 0")
    removed = summary.get("checkpoint_dir_removed")
    if removed and summary.get("tensorboard_dir"):
        lines.append(f"checkpoints: removed from the temporary directory {removed} (its "
                     "TensorBoard files stay); pass --checkpoint-dir DIR to keep them")
    elif removed:
        lines.append(f"checkpoints: the temporary directory {removed} was removed; pass "
                     "--checkpoint-dir DIR to keep them")
    if summary.get("tensorboard_dir"):
        lines.append("TensorBoard (loss, evaluation, samples/s): tensorboard --logdir "
                     f"{shlex.quote(summary['tensorboard_dir'])}")
    return lines


class Reporter(Protocol):
    def replica_line(self, name: str, text: str) -> None: ...
    def notice(self, level: Level, text: str, context: Sequence[str] = ()) -> None: ...
    def event(self, name: str, event: Mapping[str, Any], metrics: Metrics) -> None: ...
    def close(self) -> None: ...


class PlainReporter:
    """Line output: for pipes, CI logs, `--quiet`. Quiet drops replica output and
    progress lines, keeping notices, evals, checkpoints, restores and the result."""

    def __init__(self, stream: TextIO, names: Sequence[str], quiet: bool = False):
        self.stream = stream
        self.width = max((len(n) for n in names), default=0)
        self.quiet = quiet

    def _write(self, line: str) -> None:
        self.stream.write(line + "\n")
        self.stream.flush()

    def replica_line(self, name: str, text: str) -> None:
        if not self.quiet:
            self._write(format_replica_line(name, text, self.width))

    def notice(self, level: Level, text: str, context: Sequence[str] = ()) -> None:
        self._write(format_notice(level, text))
        for line in context:
            self._write(f"    {line}")

    def event(self, name: str, event: Mapping[str, Any], metrics: Metrics) -> None:
        if event.get("event") == "progress":
            if not self.quiet:
                self._write(format_notice("info", format_progress(metrics)))
            return
        line = format_event(name, event, metrics)
        if line is not None:
            self._write(format_notice(event_level(event, metrics), line))

    def close(self) -> None:
        self.stream.flush()


STAGE_WIDTH = 48


def format_stage(text: str) -> str:
    """A runner line shortened to fit the progress bar's stage column."""
    return text if len(text) <= STAGE_WIDTH else text[:STAGE_WIDTH - 3] + "..."


class RichReporter:
    """A live progress bar (step, loss, samples/s) with replica output scrolling above.

    Until the first step, the bar's stage column follows start-up as it happens (the
    runner's latest line: parameter servers starting and serving, workers started);
    from the first step on it says "training"."""

    def __init__(self, stream: TextIO, names: Sequence[str], total_steps: int | None,
                 job_name: str):
        from rich.console import Console
        from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                                   TimeElapsedColumn)

        self.console = Console(file=stream, highlight=False)
        self.width = max((len(n) for n in names), default=0)
        self.progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]}"),
            TextColumn("{task.fields[sps]} samples/s"),
            TextColumn("{task.fields[auc]}"),
            TimeElapsedColumn(),
            TextColumn("{task.fields[stage]}"),
            console=self.console,
            transient=False,
        )
        self.task = self.progress.add_task(job_name, total=total_steps, loss="-", sps="-",
                                           stage="starting", auc="")
        self.training = False
        self.progress.start()

    @property
    def stage(self) -> str:
        return str(self.progress.tasks[0].fields["stage"])

    def _follow(self, text: str) -> None:
        if not self.training:
            self.progress.update(self.task, stage=format_stage(text))

    def _print(self, text: str, style: str | None = None) -> None:
        self.console.print(text, style=style, markup=False, highlight=False,
                           soft_wrap=True)

    def replica_line(self, name: str, text: str) -> None:
        self._print(format_replica_line(name, text, self.width))

    def notice(self, level: Level, text: str, context: Sequence[str] = ()) -> None:
        style = {"info": "cyan", "warning": "bold yellow", "error": "bold red"}[level]
        self._print(format_notice(level, text), style)
        for line in context:
            self._print(f"    {line}", "dim")
        self._follow(text)

    def event(self, name: str, event: Mapping[str, Any], metrics: Metrics) -> None:
        self.progress.update(self.task, completed=metrics.step,
                             loss=_fmt(metrics.loss, ".4f"),
                             sps=_fmt(metrics.samples_per_sec, ".0f"),
                             auc=f"auc {metrics.auc:.4f}" if metrics.auc is not None else "")
        if metrics.step > 0 and not self.training:
            self.progress.update(self.task, stage="training")
            self.training = True
        if event.get("event") == "progress":
            return
        line = format_event(name, event, metrics)
        if line is not None:
            self._follow(line)
            loud = event_level(event, metrics) == "warning"
            self._print(format_notice("warning" if loud else "info", line),
                        "bold yellow" if loud else "green")

    def close(self) -> None:
        self.progress.stop()

