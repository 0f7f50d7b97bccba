"""Runtime tests leave nothing in the temporary directory: a local run makes
`pstrain-<job>-auth-*` (the run's keys), `pstrain-<job>-ckpt-*` and `pstrain-<job>-exit-*`
there, and a test that ends with one of them still on disk fails (but for a temporary
checkpoint folder that holds only the TensorBoard files `pstrain run` keeps).

Each test gets a temporary directory of its own (`tempfile.gettempdir()` in the test and
`TMPDIR` for the processes it starts), so what a test leaves is told apart from what
anything else on the machine makes at the same time, and the directory is removed after
the test whatever it holds: no key outlives the test that made it.
"""

from __future__ import annotations

import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from pstrain_runtime.ps.server import PSServer

RUN_FOLDER = re.compile(r"pstrain-.+-(auth|ckpt|exit)-[A-Za-z0-9_]+", re.ASCII)


def _only_event_files(path: Path) -> bool:
    """A temporary checkpoint folder that `pstrain run` emptied but for the chief's
    TensorBoard files, which it keeps on purpose (and names in its summary)."""
    return path.name.split("-")[-2] == "ckpt" and [c.name for c in path.iterdir()] == [
        "tensorboard"]


def run_folders(directory: Path) -> list[str]:
    """The folders of local runs in `directory`, by name (not a kept TensorBoard log)."""
    return sorted(p.name for p in directory.iterdir()
                  if RUN_FOLDER.fullmatch(p.name) and not _only_event_files(p))


@pytest.fixture(autouse=True)
def own_temp_dir(tmp_path_factory: pytest.TempPathFactory,
                 monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    directory = tmp_path_factory.mktemp("tmp")
    monkeypatch.setenv("TMPDIR", str(directory))
    monkeypatch.setattr(tempfile, "tempdir", str(directory))
    try:
        yield directory
        left = run_folders(directory)
        assert not left, f"the test left the folders of local runs behind: {left}"
    finally:
        shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
def servers() -> Iterator[list[PSServer]]:
    """Two parameter servers on free ports, stopped after the test."""
    started = [PSServer("127.0.0.1:0", ps_index=i) for i in range(2)]
    for server in started:
        server.start()
    yield started
    for server in started:
        server.stop(0)
