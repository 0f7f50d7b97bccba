"""docs/guide.md's commands, run as written: the block of "The whole path on one machine"
(validate, run, export, load in plain PyTorch, the TensorBoard files) from the
repository's root, so the guide cannot drift from the code."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GUIDE = ROOT / "docs" / "guide.md"
SECTION = "## The whole path on one machine"


def guide_block() -> str:
    text = GUIDE.read_text()
    section = text[text.index(SECTION):]
    found = re.search(r"```bash\n(.*?)```", section, re.S)
    assert found, f"no bash block under {SECTION!r}"
    return found[1]


def test_the_guide_names_every_step_of_the_path() -> None:
    block = guide_block()
    for command in ("pstrain validate", "pstrain run", "pstrain export", "load_exported",
                    "tensorboard"):
        assert command in block, command


@pytest.mark.timeout(300)
def test_the_guides_commands_run_as_written(tmp_path: Path) -> None:
    script = "set -euo pipefail\n" + guide_block()
    proc = subprocess.run(["bash", "-c", script], cwd=ROOT, capture_output=True, text=True,
                          timeout=280, env={**__import__("os").environ,
                                            "TMPDIR": str(tmp_path)})
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-3000:])
    assert re.search(r"job digits-files Succeeded", proc.stdout + proc.stderr), proc.stdout[-2000:]
    assert re.search(r"^loaded \d+ parameters$", proc.stdout, re.M), proc.stdout
    assert re.search(r"events\.out\.tfevents\.", proc.stdout), proc.stdout
