"""Static checks of the Dockerfile and .dockerignore (no Docker engine is needed), and
proof that `pstrain operator` runs with only what the operator image installs."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from .helm import ROOT

DOCKERFILE = (ROOT / "Dockerfile").read_text(encoding="utf-8")
DOCKERIGNORE = (ROOT / ".dockerignore").read_text(encoding="utf-8")
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
DEPENDENCIES = PYPROJECT["project"]["dependencies"]

COMPILERS = ("gcc", "g++", "clang", "build-essential", "make", "cc1", "cmake")


@dataclass
class Stage:
    name: str
    base: str
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def all(self, keyword: str) -> list[str]:
        return [args for kw, args in self.instructions if kw == keyword]


def parse_dockerfile(text: str) -> tuple[dict[str, str], list[Stage]]:
    """(global ARG defaults, stages): joins continuation lines, drops comments."""
    logical: list[str] = []
    buf = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not buf and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):
            continue
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        logical.append(buf + line)
        buf = ""
    args: dict[str, str] = {}
    stages: list[Stage] = []
    for line in logical:
        keyword, _, rest = line.partition(" ")
        keyword = keyword.upper()
        if keyword == "FROM":
            match = re.fullmatch(r"(\S+)\s+AS\s+(\S+)", rest.strip(), re.IGNORECASE)
            assert match, f"every stage is named: FROM {rest}"
            stages.append(Stage(match.group(2), match.group(1)))
        elif not stages:
            assert keyword == "ARG", f"only ARG may precede the first FROM, found {keyword}"
            name, _, default = rest.partition("=")
            args[name.strip()] = default.strip()
        else:
            stages[-1].instructions.append((keyword, rest.strip()))
    return args, stages


GLOBAL_ARGS, STAGES = parse_dockerfile(DOCKERFILE)
BY_NAME = {s.name: s for s in STAGES}


def chain(stage: Stage) -> list[Stage]:
    """The stage and every stage it builds on or copies from, recursively."""
    seen: list[Stage] = []
    todo = [stage]
    while todo:
        current = todo.pop()
        if current in seen:
            continue
        seen.append(current)
        if current.base in BY_NAME:
            todo.append(BY_NAME[current.base])
        for copy in current.all("COPY"):
            match = re.search(r"--from=(\S+)", copy)
            if match and match.group(1) in BY_NAME:
                todo.append(BY_NAME[match.group(1)])
    return seen


def test_both_targets_exist_and_runtime_is_the_default() -> None:
    assert {"runtime", "operator"} <= set(BY_NAME)
    assert STAGES[-1].name == "runtime"


@pytest.mark.parametrize(("target", "entrypoint"), [
    ("runtime", ["pstrain", "replica"]),
    ("operator", ["pstrain", "operator"]),
])
def test_final_stages_run_as_non_root_with_the_pstrain_entrypoint(
    target: str, entrypoint: list[str],
) -> None:
    stage = BY_NAME[target]
    assert [json.loads(e) for e in stage.all("ENTRYPOINT")] == [entrypoint]
    users = stage.all("USER")
    assert users, f"{target} sets no USER"
    uid, _, gid = users[-1].partition(":")
    # Numeric, so that Kubernetes' runAsNonRoot can verify it without /etc/passwd.
    assert uid.isdigit() and int(uid) != 0, users[-1]
    assert not gid or (gid.isdigit() and int(gid) != 0), users[-1]
    # The user is last: nothing after it could run as root.
    keywords = [kw for kw, _ in stage.instructions]
    assert "RUN" not in keywords[keywords.index("USER"):]


@pytest.mark.parametrize("target", ["runtime", "operator"])
def test_final_stages_hold_no_compilers_and_run_nothing(target: str) -> None:
    stage = BY_NAME[target]
    # The final stage only copies a finished virtualenv onto the base.
    assert stage.all("RUN") == []
    for build in chain(stage):
        for run in build.all("RUN"):
            assert not re.search(r"\b(apt-get|apt|apk|yum|dnf)\s+install\b", run), run
            words = set(re.findall(r"[\w+.-]+", run))
            assert not words & set(COMPILERS), run


def test_base_image_is_pinned() -> None:
    image = GLOBAL_ARGS["PYTHON_IMAGE"]
    # A full patch version and a Debian release, never a floating tag like 3.11-slim.
    assert re.fullmatch(r"python:3\.\d+\.\d+-slim-[a-z]+(@sha256:[0-9a-f]{64})?", image), image
    for stage in STAGES:
        assert stage.base == "${PYTHON_IMAGE}" or stage.base in BY_NAME, stage.base


def test_operator_image_never_installs_torch() -> None:
    for stage in chain(BY_NAME["operator"]):
        for run in stage.all("RUN"):
            for install in re.split(r"&&|;", run):
                if "pip install" in install:
                    assert "torch" not in install, install
                    if "/src" in install:
                        assert "--no-deps" in install, install


def _operator_requirements() -> list[str]:
    specs: list[str] = []
    for run in BY_NAME["build-operator"].all("RUN"):
        for install in re.split(r"&&|;", run):
            if "pip install" in install and "/src" not in install:
                specs += re.findall(r'"([^"]+)"', install)
    return specs


def test_operator_requirements_are_spelled_as_in_pyproject() -> None:
    specs = _operator_requirements()
    assert specs, "the operator stage installs no dependencies"
    assert set(specs) <= set(DEPENDENCIES), set(specs) - set(DEPENDENCIES)
    assert not any(s.startswith("torch") for s in specs)


def test_runtime_torch_version_and_variant_come_from_build_args() -> None:
    build = BY_NAME["build-runtime"]
    args = dict(a.partition("=")[::2] for a in build.all("ARG"))
    assert args["TORCH_VARIANT"] == "cpu"
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert f"torch=={args['TORCH_VERSION']}" in ci, "the image and CI pin the same torch"
    install = " ".join(build.all("RUN"))
    assert '"torch==${TORCH_VERSION}"' in install
    assert "https://download.pytorch.org/whl/${TORCH_VARIANT}" in install


def test_dockerignore_lets_in_exactly_what_the_build_copies() -> None:
    lines = [ln.strip() for ln in DOCKERIGNORE.splitlines()
             if ln.strip() and not ln.startswith("#")]
    assert lines[0] == "*", "the context is an allowlist"
    allowed = {ln[1:].rstrip("/") for ln in lines if ln.startswith("!")}
    copied = set()
    for stage in STAGES:
        for copy in stage.all("COPY"):
            if "--from=" in copy:
                continue
            *sources, _dest = copy.split()
            copied |= {s.rstrip("/") for s in sources}
    assert copied == allowed
    package_dirs = set(PYPROJECT["tool"]["setuptools"]["packages"]["find"]["where"])
    assert package_dirs <= copied, "every package directory is copied into the image"
    assert (ROOT / PYPROJECT["project"]["readme"]).name in copied


# ---------------------------------------------------------------------------------------
# `pstrain operator` imports nothing the operator image lacks.

# pyproject distribution -> the top-level module(s) it provides.
IMPORT_NAMES = {
    "pydantic": ["pydantic"], "PyYAML": ["yaml"], "kopf": ["kopf"],
    "kubernetes": ["kubernetes"], "grpcio": ["grpc"],
    "grpcio-health-checking": ["grpc_health"], "protobuf": ["google.protobuf"],
    "torch": ["torch"], "numpy": ["numpy"], "scikit-learn": ["sklearn"],
    "rich": ["rich"], "prometheus-client": ["prometheus_client"],
    "jsonschema": ["jsonschema"], "tensorboard": ["tensorboard"], "safetensors": ["safetensors"],
    "google-crc32c": ["google_crc32c"],
}


def _dist(spec: str) -> str:
    return re.split(r"[<>=!~\[; ]", spec, maxsplit=1)[0]


def blocked_modules() -> list[str]:
    installed = {_dist(s) for s in _operator_requirements()}
    unknown = [_dist(s) for s in DEPENDENCIES if _dist(s) not in IMPORT_NAMES]
    assert not unknown, f"add the import names of {unknown} to IMPORT_NAMES"
    return sorted(m for s in DEPENDENCIES if _dist(s) not in installed
                  for m in IMPORT_NAMES[_dist(s)])


PROBE = """
import importlib.abc, sys
BLOCKED = {blocked!r}

def _blocked(name):
    return any(name == b or name.startswith(b + ".") for b in BLOCKED)

class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if _blocked(name):
            raise ModuleNotFoundError(f"No module named {{name!r}} (not in the operator image)",
                                      name=name)
        return None

sys.meta_path.insert(0, Block())
from pstrain_api.cli import main
try:
    code = main(["operator", "--help"])
except SystemExit as exc:
    code = exc.code
# `--help` may stop before the heavy imports: import every operator module as well.
import importlib, pkgutil, pstrain_operator
for info in pkgutil.walk_packages(pstrain_operator.__path__, "pstrain_operator."):
    importlib.import_module(info.name)
    print("IMPORTED", info.name)
# The operator reads progress through the runtime's torch-free status client.
try:
    importlib.import_module("pstrain_runtime.status_client")
    print("IMPORTED pstrain_runtime.status_client")
except ModuleNotFoundError as exc:
    if exc.name != "pstrain_runtime.status_client":
        raise
leaked = sorted(m for m in sys.modules if _blocked(m))
print("LEAKED", leaked)
sys.exit(code if not leaked else 3)
"""


def test_blocked_modules_include_torch() -> None:
    assert "torch" in blocked_modules()
    assert "kopf" not in blocked_modules()


def test_pstrain_operator_help_runs_without_torch() -> None:
    probe = PROBE.format(blocked=blocked_modules())
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          timeout=120, check=False, cwd=Path(ROOT))
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output
    assert "usage: pstrain operator" in proc.stdout
    assert "IMPORTED pstrain_operator.main" in proc.stdout
    if (ROOT / "runtime" / "pstrain_runtime" / "status_client.py").exists():
        assert "IMPORTED pstrain_runtime.status_client" in proc.stdout
    assert "LEAKED []" in proc.stdout
