"""Keys of local runs do not outlive them: a run killed with SIGKILL (which nothing can
catch) leaves its key directory, and the next run removes it, and only such directories:
named as pstrain names them, real directories owned by this user, whose runner is gone
(issue 26.4)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from pstrain_runtime.local.keys import RUNNER_FILE, LocalKeys, remove_stale

from .local_builders import make_job
from .test_local_processes import fake  # noqa: F401 - the fixture

pytestmark = pytest.mark.timeout(60)


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def run_dir(root: Path, name: str, runner: str | None) -> Path:
    path = root / name
    path.mkdir(mode=0o700)
    (path / "ps-0").mkdir(mode=0o700)
    (path / "ps-0" / "chief").write_text("00" * 32)
    if runner is not None:
        (path / RUNNER_FILE).write_text(runner)
    return path


def killed_run(root: Path) -> Path:
    """The key directory a runner left when it was killed with SIGKILL."""
    code = ("import os, signal, sys\n"
            "from pstrain_runtime.local.keys import LocalKeys\n"
            f"keys = LocalKeys('j', temp_dir={str(root)!r})\n"
            "keys.directory('j-ps-0', 'ps', 0)\n"
            "print(keys.root, flush=True)\n"
            "os.kill(os.getpid(), signal.SIGKILL)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=30)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    left = Path(proc.stdout.strip())
    assert (left / "j-ps-0" / "chief").exists()
    return left


def test_the_next_run_removes_the_keys_a_killed_run_left(fake, tmp_path: Path,  # noqa: F811
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    temp = tmp_path / "tmp"
    temp.mkdir()
    left = killed_run(temp)
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    result, _, starts = fake(make_job("j"), {})
    assert result.exit_code == 0
    assert all(s["auth"]["dir"].startswith(str(temp)) for s in starts)
    assert not left.exists(), "the killed run's keys are still on disk"
    assert not [p for p in temp.iterdir() if "-auth-" in p.name], "this run's keys stayed"


def test_only_directories_of_runs_that_are_gone_are_removed(tmp_path: Path) -> None:
    started = Path(f"/proc/{os.getpid()}/stat").read_text().rsplit(")", 1)[-1].split()[19]
    me = f"{os.getpid()} {started}\n"
    dead = run_dir(tmp_path, "pstrain-a-auth-dead1", f"{dead_pid()} 1\n")
    reused = run_dir(tmp_path, "pstrain-a-auth-reused", f"{os.getpid()} 1\n")  # pid reused
    kept = {
        "live": run_dir(tmp_path, "pstrain-a-auth-live1", me),
        "no runner file": run_dir(tmp_path, "pstrain-a-auth-nofile", None),
        "garbage runner file": run_dir(tmp_path, "pstrain-a-auth-junk", "x" * 100),
        "another name": run_dir(tmp_path, "pstrain-a-ckpt-dead2", f"{dead_pid()} 1\n"),
        "another user's": run_dir(tmp_path, "pstrain-a-auth-other", f"{dead_pid()} 1\n"),
    }
    os.chown(kept["another user's"], 65534, 65534)
    (tmp_path / "pstrain-a-auth-link").symlink_to(dead)
    (tmp_path / "pstrain-a-auth-file").write_text(f"{dead_pid()}\n")
    removed = remove_stale(str(tmp_path))
    assert sorted(removed) == sorted([dead, reused])
    assert not dead.exists() and not reused.exists()
    for why, path in kept.items():
        assert (path / "ps-0" / "chief").exists(), why
    assert (tmp_path / "pstrain-a-auth-link").is_symlink()
    assert (tmp_path / "pstrain-a-auth-file").is_file()


def test_a_live_runs_keys_are_kept(tmp_path: Path) -> None:
    keys = LocalKeys("j", temp_dir=str(tmp_path))
    keys.directory("j-worker-1", "worker", 1)
    assert remove_stale(str(tmp_path)) == []
    assert (keys.root / "j-worker-1" / "worker-1").exists()
    keys.remove()
    assert not keys.root.exists()
