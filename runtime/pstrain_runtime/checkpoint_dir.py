"""Where checkpoints can go: the configured directory, checked when a job starts, and
the fallback that receives the trained parameters when that directory fails at the end.

Torch-free, so `pstrain run` checks the directory before it starts a single process.

- `check_directory` creates the directory when it is missing and writes, fsyncs and
  removes a probe file in it: a regular file, a path under a regular file, a read-only
  or immutable directory, or a pseudo-filesystem (`/proc/...`) is refused with one line
  that names the path and the cause, before any training is done.
- `fallback_directories`: where the chief saves the final parameters when the configured
  directory fails at the end of training (the temporary directory, which TMPDIR moves,
  then the home and the working directory); the first that passes the check is used,
  and its path is reported.
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


def fallback_directories(job: str) -> list[Path]:
    """Candidates for the final parameters when the configured directory failed."""
    name = "pstrain-fallback-" + "".join(ch if ch.isalnum() or ch in "-_." else "-"
                                         for ch in job)
    bases = [Path(tempfile.gettempdir()), Path.home(), Path.cwd()]
    return [base / name for base in bases]


def _file_above(path: Path) -> Path | None:
    for parent in path.absolute().parents:
        if parent.exists():
            return None if parent.is_dir() else parent
    return None


def _why(exc: OSError) -> str:
    return exc.strerror or str(exc) or type(exc).__name__
