"""A local run's keys, on disk only while the run lives.

Each `pstrain run` makes a fresh job token and keeps it in memory. Each replica gets its
own private directory (0700, files 0600) with only the keys it may hold: a parameter
server the chief and worker keys, the chief the chief key, worker i its own key (it can
act only as worker i), all under one directory of the run:

    <temp>/pstrain-<job>-auth-<random>/     0700
        runner                              "<pid> <start time>" of the runner
        <replica name>/<key files>          0700 / 0600

Every replica runs as the user who runs `pstrain run`, and the operating system lets a
process read any file of its own user: a replica given only its own keys can still read
its siblings' directories (and the chief key in them). The directories keep keys from
other users of the machine, not from the job's own programs; run code you do not trust
on Kubernetes, where each pod mounts only its own keys.

SIGKILL cannot be caught, so a killed run leaves its directory behind. `remove_stale`
(called when a run starts) removes those of runs that are gone, and nothing else: a
directory directly in the temp directory, named as above, a real directory (not a
link), owned by this user, whose `runner` file names a process that no longer runs (or
a process started at another time: its pid was reused).
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import stat
import tempfile
from pathlib import Path

from pstrain_api import security

from ..transport.auth import Credentials, write_credentials

_log = logging.getLogger(__name__)

RUNNER_FILE = "runner"
_NAME = re.compile(r"pstrain-.+-auth-[A-Za-z0-9_]+", re.ASCII)


def _proc_stat(pid: int) -> list[str]:
    """The fields of /proc/<pid>/stat after the command (state first), [] where there is
    no /proc or no such process."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()
    except OSError:
        return []


def _start_time(pid: int) -> str:
    """Process `pid`'s start time (Linux: clock ticks after boot), "" where unknown."""
    fields = _proc_stat(pid)
    return fields[19] if len(fields) > 19 else ""  # field 22 of the whole line


def _runs(pid: int, started: str) -> bool:
    """Whether process `pid`, started at `started`, still runs (a zombie does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process: not ours to judge
    fields = _proc_stat(pid)
    if fields and fields[0] in ("Z", "X"):
        return False
    now = fields[19] if len(fields) > 19 else ""
    return not (started and now and now != started)


class LocalKeys:
    """The keys of one local run: `directory(...)` writes a replica's on first use;
    `chief` and `worker` are the runner's own (SetWorkers, RequestCheckpoint)."""

    def __init__(self, job_name: str, token: bytes | None = None,
                 temp_dir: str | None = None) -> None:
        self.root = Path(tempfile.mkdtemp(prefix=f"pstrain-{job_name}-auth-", dir=temp_dir))
        pid = os.getpid()
        fd = os.open(self.root / RUNNER_FILE, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(f"{pid} {_start_time(pid)}\n")
        self._every = Credentials.from_token(token or security.new_token())
        self.chief = self._every.only(security.KEY_CHIEF)
        self.worker = self._every.only(security.KEY_WORKER)

    def credentials_for(self, holder: str, trainer_index: int) -> Credentials:
        """The keys of a replica: `holder` as `security.key_holder` says, `trainer_index`
        its index among trainers (chief 0; ignored for a parameter server)."""
        if holder == "ps":
            return self._every
        if holder == security.KEY_CHIEF:
            return self.chief
        return self.worker.for_worker(trainer_index)

    def directory(self, name: str, holder: str, trainer_index: int) -> Path:
        """Replica `name`'s private key directory (its PSTRAIN_AUTH_DIR)."""
        return write_credentials(self.root / name, self.credentials_for(holder, trainer_index))

    def remove(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


def _stale(path: Path, uid: int) -> bool:
    try:
        info = path.lstat()
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != uid:
            return False
        fd = os.open(path / RUNNER_FILE, os.O_RDONLY | os.O_NOFOLLOW)
        with os.fdopen(fd) as f:
            text = f.read(64)
    except OSError:
        return False  # no runner file (not ours, or still being made): leave it
    parts = text.split()
    if not parts or not parts[0].isdigit() or len(parts[0]) > 10:
        return False
    return not _runs(int(parts[0]), parts[1] if len(parts) > 1 else "")


def remove_stale(temp_dir: str | None = None) -> list[Path]:
    """Remove the key directories of local runs whose runner is gone (killed with
    SIGKILL); returns them. Leaves everything else alone (see the module's rules)."""
    root = Path(temp_dir or tempfile.gettempdir())
    uid = os.getuid()
    removed = []
    try:
        names = os.listdir(root)
    except OSError:
        return []
    for name in names:
        path = root / name
        if _NAME.fullmatch(name) and _stale(path, uid):
            shutil.rmtree(path, ignore_errors=True)
            if not path.exists():
                removed.append(path)
                _log.info("removed the key directory %s of a run that is gone", path)
    return removed
