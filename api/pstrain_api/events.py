"""Replica events: the one-line JSON records a replica prints on stdout so that whoever
started it (the local runner, a log reader, a test) can follow the job without parsing
free text.

A line is `PSTRAIN_EVENT {"event": "<kind>", ...}`. Kinds and their fields:

- `progress`: step, loss, samples_per_sec, staleness (the chief, every few seconds;
  sparse_rows and sparse_bytes for a model with sparse tables)
- `loss`: step, loss (the chief: a point of the loss curve, every 1/200 of the job's
  steps, the loss averaged since the previous point; TensorBoard's `train/loss`)
- `eval`: step, accuracy, loss
- `checkpoint`: step, path
- `restored`: step, path, lost_steps (the chief after restoring a checkpoint; lost_steps
  is how many global steps of progress were thrown away), and `warning` when the
  checkpoint is past the job's target step or newer, damaged checkpoints were skipped
- `done`: step, loss, accuracy, samples_per_sec, wall_seconds (the chief, at the end)
- `ready`: role, index, address (a parameter server that serves)
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from typing import Any, TextIO

PREFIX = "PSTRAIN_EVENT "
KINDS = frozenset({"progress", "loss", "eval", "checkpoint", "restored", "done",
                   "ready"})


def format_event(kind: str, **fields: Any) -> str:
    """The line (without newline) for one event."""
    if kind not in KINDS:
        raise ValueError(f"event kind {kind!r} is not one of {sorted(KINDS)}")
    return PREFIX + json.dumps({"event": kind, "time": round(time.time(), 3), **fields},
                               separators=(",", ":"), default=str)


def emit(kind: str, stream: TextIO | None = None, **fields: Any) -> None:
    """Print one event line and flush, so a reader sees it at once."""
    import sys

    out = stream or sys.stdout
    out.write(format_event(kind, **fields) + "\n")
    out.flush()


def parse_event(line: str) -> Mapping[str, Any] | None:
    """The event on `line`, or None when the line is ordinary output."""
    start = line.find(PREFIX)
    if start < 0:
        return None
    try:
        data = json.loads(line[start + len(PREFIX):])
    except ValueError:
        return None
    if not isinstance(data, dict) or data.get("event") not in KINDS:
        return None
    return data
