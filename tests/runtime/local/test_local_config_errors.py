"""End to end with `pstrain run`: a mistake in the job's configuration fails the run at
once, with the replica's one line as the reason, and spends no restart."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[3]
RUN_LIMIT = 90  # seconds; the run itself takes a few

pytestmark = pytest.mark.timeout(RUN_LIMIT + 30)


def manifest(tmp_path: Path, **training: object) -> Path:
    body = {
        "apiVersion": "pstrain.io/v1alpha1", "kind": "TrainingJob",
        "metadata": {"name": "cfg"},
        "spec": {"replicas": {"ps": {"replicas": 1}, "worker": {"replicas": 2}},
                 "training": {"entrypoint": "pstrain_runtime.examples.digits:make_task",
                              "steps": 20, "batchSize": 16, **training}},
    }
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(body))
    return path


def run(path: Path, *args: str) -> tuple[int, dict, str]:
    proc = subprocess.run(
        [sys.executable, "-m", "pstrain_api.cli", "run", str(path), "--json", *args],
        capture_output=True, text=True, cwd=ROOT, timeout=RUN_LIMIT)
    lines = proc.stdout.splitlines()
    return proc.returncode, (json.loads(lines[-1]) if lines else {}), proc.stderr


def test_an_entry_point_that_raises_fails_the_run_at_once(tmp_path) -> None:
    code, summary, err = run(manifest(
        tmp_path, entrypoint="tests.runtime.entrypoints.broken:raises_when_called"))
    assert code == 1, err[-3000:]
    assert (summary["phase"], summary["reason"]) == ("Failed", "ConfigurationError")
    assert summary["restarts"] == 0
    assert "calling raises_when_called(**spec.training.args) raised KeyError: " \
        "'feature_columns'" in summary["message"]
    assert "Traceback" not in err


def test_a_corrupt_checkpoint_fails_the_run_at_once(tmp_path) -> None:
    """Issue 27.5: a restart reads the same damaged file, so none is spent on it."""
    directory = tmp_path / "ckpt"
    directory.mkdir()
    (directory / "ckpt-000000000010.pt").write_bytes(b"junk that torch cannot load")
    code, summary, err = run(manifest(tmp_path, checkpoint={"directory": str(directory)}))
    assert code == 1, err[-3000:]
    assert (summary["phase"], summary["reason"]) == ("Failed", "ConfigurationError")
    assert summary["restarts"] == 0
    assert (f"no usable checkpoint: checkpoint {directory / 'ckpt-000000000010.pt'} is "
            "corrupt or unreadable") in summary["message"]
