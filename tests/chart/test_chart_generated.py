"""The chart's generated files match their sources (run `python charts/generate.py` after
changing the models, the example, the operator's PERMISSIONS or the schema spec)."""

from __future__ import annotations

import subprocess
import sys

from .helm import CHART, ROOT, generate


def test_chart_crd_is_byte_identical_to_crds_dir() -> None:
    chart_crd = CHART / "crds" / "trainingjob.yaml"
    assert chart_crd.read_bytes() == (ROOT / "crds" / "trainingjob.yaml").read_bytes(), (
        "charts/pstrain/crds/trainingjob.yaml differs from crds/trainingjob.yaml; run "
        "`python charts/generate.py`."
    )


def test_no_generated_file_drifted() -> None:
    stale = [str(p.relative_to(ROOT)) for p in generate.drifted()]
    assert stale == [], f"out of date: {stale}; run `python charts/generate.py`"


def test_generate_check_reports_drift_by_exit_code(tmp_path, monkeypatch) -> None:
    """`--check` (what a pre-commit hook runs) fails and names the file on drift."""
    copy = tmp_path / "trainingjob.yaml"
    copy.write_bytes(b"# stale\n")
    monkeypatch.setattr(generate, "CRD_TARGET", copy)
    assert generate.main(["--check"]) == 1
    assert generate.drifted() == [copy]


def test_generate_check_passes_from_the_command_line() -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "charts" / "generate.py"), "--check"],
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
