"""The chief leaves its final summary (step, loss, last checkpoint) in the termination-
message file, which the operator reads for the job's final status."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("sklearn")

ROOT = Path(__file__).resolve().parents[2]
JOB = """\
apiVersion: pstrain.io/v1alpha1
kind: TrainingJob
metadata: {name: tiny}
spec:
  replicas: {ps: {replicas: 1}, worker: {replicas: 1}}
  training: {steps: 30, checkpoint: {intervalSteps: 20}}
"""


@pytest.mark.timeout(150)
def test_the_chief_writes_its_final_summary(tmp_path: Path) -> None:
    manifest = tmp_path / "tiny.yaml"
    manifest.write_text(JOB)
    log = tmp_path / "termination-log"
    log.touch()  # the kubelet creates it in a pod; outside one nothing is written
    env = {**os.environ, "PSTRAIN_TERMINATION_LOG": str(log)}
    proc = subprocess.run(
        [sys.executable, "-m", "pstrain_api.cli", "run", str(manifest), "--quiet",
         "--checkpoint-dir", str(tmp_path / "ckpt"), "--timeout", "120"],
        capture_output=True, text=True, cwd=ROOT, env=env, timeout=140, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads(log.read_text())
    assert (summary["global_step"], summary["checkpoint_step"], summary["done"]) == (
        30, 30, True)
    assert Path(summary["checkpoint_path"]).is_file()
    assert summary["loss"] is not None
