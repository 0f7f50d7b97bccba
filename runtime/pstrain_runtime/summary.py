"""The chief's final summary as its container's termination message.

When the chief exits, the parameter servers follow within seconds and the operator's
last progress read may come too late, so the job would end showing an older step than
it trained. The chief therefore writes what it ended with (global step, loss, samples/s,
eval accuracy, last checkpoint) to Kubernetes' termination-message file; the kubelet
puts it in the pod's `state.terminated.message`, where the operator reads it for the
job's final `status.progress` and `status.lastCheckpoint`. The keys are those of the
parameter servers' status reply (`status_client.status_to_dict`), so one parser reads
both.

Outside a pod the file does not exist and nothing is written.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

from collections.abc import Mapping

from pstrain_api import constants as c

from .failure import termination_log_path

# The kubelet's limit for a termination message; a summary is far smaller.
MAX_MESSAGE_BYTES = c.TERMINATION_MESSAGE_MAX_BYTES


def _finite(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None


def final_summary(global_step: int, loss: float | None, samples_per_sec: float | None,
                  eval_accuracy: float | None,
                  checkpoint: tuple[int, str, float] | None) -> dict[str, Any]:
    """What the chief ended with, in the keys of the status reply."""
    step, path, when = checkpoint if checkpoint else (None, None, None)
    return {
        "global_step": int(global_step),
        "loss": _finite(loss),
        "samples_per_sec": _finite(samples_per_sec) or None,
        "eval_accuracy": _finite(eval_accuracy),
        "checkpoint_step": step,
        "checkpoint_path": path,
        "checkpoint_time": when,
        "done": True,
    }


def write_summary(summary: dict[str, Any], environ: Mapping[str, str] | None = None) -> bool:
    """Write `summary` as one JSON line to the termination-message file
    (failure.termination_log_path: PSTRAIN_TERMINATION_LOG, else /dev/termination-log
    inside a pod); True when written. Never raises: a summary is worth having, not worth
    failing a finished job for."""
    path = termination_log_path(os.environ if environ is None else environ)
    text = json.dumps(summary, separators=(",", ":"))
    if path is None or len(text.encode()) > MAX_MESSAGE_BYTES:
        return False
    try:
        path.write_text(text, encoding="utf-8")
    except OSError:
        return False
    return True
