"""How a replica fails: one line on stderr, the same line in the termination-message
file, and an exit code that says whether a restart can help.

- `ConfigurationError`: a mistake in the job's configuration (an entry point that cannot
  be imported or called, an unusable checkpoint directory). The replica exits with
  `constants.EXIT_CONFIGURATION_ERROR`, which the restart policy
  (`pstrain_api.policy.decide_restart`) treats as permanent: the job fails at once, with
  the line as its reason.
- The termination-message file (`termination_log_path`) outlives the container: the
  kubelet copies it into the pod's status, where the operator reads it before it deletes
  or restarts the pod; the local runner points it at a file of its own.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from pathlib import Path

from pstrain_api import constants as c


class ConfigurationError(ValueError):
    """A mistake in the job's configuration that no restart can fix; the message is one
    line that names what is wrong."""


def termination_log_path(environ: Mapping[str, str]) -> Path | None:
    """Where to write the termination message (see constants.ENV_TERMINATION_LOG)."""
    explicit = environ.get(c.ENV_TERMINATION_LOG)
    if explicit is not None:
        return Path(explicit) if explicit else None
    default = Path(c.TERMINATION_LOG_PATH)
    return default if default.exists() else None


def write_termination_message(text: str, environ: Mapping[str, str] | None = None) -> None:
    """Best effort: a replica that cannot write its last words still fails as it would."""
    path = termination_log_path(os.environ if environ is None else environ)
    if path is None:
        return
    data = text.encode("utf-8", errors="replace")[: c.TERMINATION_MESSAGE_MAX_BYTES]
    try:
        path.write_bytes(data)
    except OSError:
        pass


def report_failure(message: str, exit_code: int,
                   environ: Mapping[str, str] | None = None) -> int:
    """Print `message` (one line) on stderr, leave it as the termination message, and
    return `exit_code` for the replica to exit with."""
    print(message, file=sys.stderr, flush=True)
    write_termination_message(message, environ)
    return exit_code
