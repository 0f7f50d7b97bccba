"""What others rely on: the operator's modules import no torch, the generated proto
modules match ps.proto, and the protobuf lower bound covers the generated code."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from pstrain_runtime.proto import regen

ROOT = Path(__file__).resolve().parents[2]


def test_status_client_and_proto_modules_do_not_import_torch() -> None:
    code = (
        "import sys\n"
        "import pstrain_runtime, pstrain_runtime.status_client\n"
        "import pstrain_runtime.proto.ps_pb2, pstrain_runtime.proto.ps_pb2_grpc\n"
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=60)
    assert out.stdout.strip() == "[]"


def test_generated_modules_match_the_proto(tmp_path: Path) -> None:
    recorded = regen.VERSION_FILE.read_text().strip()
    installed = regen.tools_version()
    if installed != recorded:
        pytest.skip(f"grpcio-tools {installed} installed; the modules were generated with "
                    f"{recorded}")
    for path in regen.generate(tmp_path):
        committed = regen.PACKAGE_DIR / path.name
        assert path.read_text() == committed.read_text(), (
            f"{committed} is stale; run python -m pstrain_runtime.proto.regen")


def test_protobuf_lower_bound_covers_the_generated_code() -> None:
    text = (regen.PACKAGE_DIR / "ps_pb2.py").read_text()
    gen = re.search(r"Protobuf Python Version: (\d+)\.(\d+)\.(\d+)", text)
    assert gen is not None
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    spec = next(d for d in deps if d.startswith("protobuf"))
    low = re.search(r">=(\d+)\.(\d+)(?:\.(\d+))?", spec)
    assert low is not None
    lower = tuple(int(x or 0) for x in low.groups())
    assert lower >= tuple(int(x) for x in gen.groups()), (
        f"pyproject has {spec}, the generated code needs protobuf>={'.'.join(gen.groups())}")
