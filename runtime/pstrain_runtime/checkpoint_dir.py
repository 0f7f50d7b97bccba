"""Where checkpoints can go: the configured directory, checked when a job starts, and
the fallback that receives the trained parameters when that directory fails at the end.

Torch-free, so `pstrain run` checks the directory before it starts a single process.

- `check_directory` creates the directory when it is missing and writes, fsyncs and
  removes a probe file in it: a regular file, a path under a regular file, a read-only
  or immutable directory, or a pseudo-filesystem (`/proc/...`) is refused with one line
  that names the path and the cause, before any training is done.
- `fallback_bases` and `private_directory`: where the chief saves the final parameters
  when the configured directory fails at the end of training. In the temporary
  directory (which TMPDIR moves), else the home, else the working directory, the chief
  creates a fresh directory of its own (`tempfile.mkdtemp`: an unpredictable name, mode
  0700, never one that exists already, so never one another user made first); the
  first that can be created and written is used, and its path is reported.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from .failure import ConfigurationError


def check_directory(directory: str | os.PathLike[str], what: str = "checkpoint.directory"
                    ) -> Path:
    """`directory` made if missing and proven writable; else ConfigurationError."""
    path = Path(directory)
    where = f"{what} {str(path)!r}"
    if path.exists() and not path.is_dir():
        raise ConfigurationError(f"{where} is a file, not a directory; point {what} at a "
                                 "directory (it is created when missing)")
    blocker = _file_above(path)
    if blocker is not None:
        raise ConfigurationError(f"{where} cannot be created: {str(blocker)!r} is a file, "
                                 "not a directory")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigurationError(f"{where} cannot be created: {_why(exc)}") from exc
    try:
        fd, probe = tempfile.mkstemp(prefix=".pstrain-probe-", dir=path)
        try:
            os.write(fd, b"pstrain")
            os.fsync(fd)
        finally:
            os.close(fd)
            os.unlink(probe)
    except OSError as exc:
        raise ConfigurationError(f"{where} is not writable: {_why(exc)}") from exc
    return path


def fallback_bases() -> list[Path]:
    """Where a fallback directory may be made, in order of preference."""
    return [Path(tempfile.gettempdir()), Path.home(), Path.cwd()]


def private_directory(base: Path, job: str) -> Path:
    """A new directory in `base` that only this user can enter (0700), with a fresh,
    unpredictable name that starts `pstrain-fallback-<job>-`; ConfigurationError naming
    `base` and the cause when it cannot be made."""
    name = "".join(ch if ch.isalnum() or ch in "-_." else "-" for ch in job)
    try:
        return Path(tempfile.mkdtemp(prefix=f"pstrain-fallback-{name}-", dir=base))
    except OSError as exc:
        raise ConfigurationError(f"no private directory can be made in {str(base)!r}: "
                                 f"{_why(exc)}") from exc


def _file_above(path: Path) -> Path | None:
    for parent in path.absolute().parents:
        if parent.exists():
            return None if parent.is_dir() else parent
    return None


def _why(exc: OSError) -> str:
    return exc.strerror or str(exc) or type(exc).__name__
