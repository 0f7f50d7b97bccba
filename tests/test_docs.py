"""The README and docs/ say what the program does: the install commands are the ones CI
runs, every `kubectl get tj` column list is the CRD's printer columns, the values table
names every key of the chart's values.yaml, every manifest in a doc is one the API
accepts (the TensorFlow one is examples/tf-ps.yaml, whose program the repo ships), and
the runtime's file list (docs/runtime.md, the README's layout) is its tree.

docs/local-runner.md has its own tests (tests/runtime/local/test_local_docs.py).
"""

from __future__ import annotations

import copy
import json
import os
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml
from packaging.requirements import Requirement

from pstrain_api.crd import PRINTER_COLUMNS
from pstrain_api.validate import check_manifest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
INSTALL = ROOT / "docs" / "install.md"
OPERATOR = ROOT / "docs" / "operator.md"
TENSORFLOW = ROOT / "docs" / "tensorflow.md"
CHART = ROOT / "charts" / "pstrain"
# Every doc these tests read: the README and docs/, less the local runner's own.
DOCS = [README] + sorted(p for p in (ROOT / "docs").glob("*.md") if p.name != "local-runner.md")

VENV = "python3.11 -m venv .venv && . .venv/bin/activate && "
COLUMNS = ["NAME"] + [column["name"].upper() for column in PRINTER_COLUMNS]


def code_blocks(path: Path) -> list[tuple[str, str]]:
    """(language, text) of every fenced block, in order."""
    return re.findall(r"^```(\w*)\n(.*?)^```$", path.read_text(encoding="utf-8"), re.M | re.S)


def section(path: Path, heading: str) -> str:
    """The text under `heading` up to the next heading of the same or a higher level."""
    text = path.read_text(encoding="utf-8")
    level = heading.split(" ", 1)[0]
    body = text.split(f"\n{heading}\n", 1)[1]
    return re.split(rf"^#{{1,{len(level)}}} ", body, maxsplit=1, flags=re.M)[0]


def table(text: str) -> list[list[str]]:
    """The rows of the first markdown table in `text`, header and rule left out."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    return rows


# ------------------------------------------------------------------------- installing


def readme_commands() -> tuple[str, str]:
    """The README's first two blocks: the newcomer's two commands."""
    (lang1, run), (lang2, test) = code_blocks(README)[:2]
    assert (lang1, lang2) == ("bash", "bash")
    return run.strip(), test.strip()


def test_readme_starts_with_the_two_commands_in_a_virtual_environment():
    run, test = readme_commands()
    assert "\n" not in run and "\n" not in test
    assert run.startswith(VENV)
    assert run.endswith("pip install -e . && pstrain run examples/digits.yaml")
    assert test.startswith(VENV) and test.endswith("&& python -m pytest")
    assert "pip install -e '.[test]'" in test


def test_ci_runs_exactly_the_readme_test_command():
    lines = (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()
    setup = {"#!/usr/bin/env bash", "set -euo pipefail", 'cd "$(dirname "$0")/.."'}
    commands = [line for line in lines
                if line.strip() and not line.startswith("#") and line not in setup]
    assert commands == [readme_commands()[1]]


def test_install_doc_installs_into_a_virtual_environment():
    blocks = [text for lang, text in code_blocks(INSTALL) if lang == "bash"]
    assert any(line.startswith(VENV + "pip install torch==2.13.0 && pip install -e .")
               for text in blocks for line in text.splitlines())


def test_docs_say_where_npm_puts_helm():
    for path in (README, INSTALL):
        assert ".tools/node_modules/.bin/helm" in path.read_text(encoding="utf-8"), path.name


def test_pyproject_license_is_an_spdx_expression_that_setuptools_reads():
    """The table form (`{text = ...}`) made every install print a deprecation warning;
    the string form needs setuptools 77 (PEP 639)."""
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    assert pyproject["project"]["license"] == "Apache-2.0"
    (setuptools,) = [Requirement(r) for r in pyproject["build-system"]["requires"]
                     if Requirement(r).name == "setuptools"]
    assert not setuptools.specifier.contains("76.99") and setuptools.specifier.contains("77.0")


# ------------------------------------------------------------------------ kubectl get


def documented_column_lists() -> list[tuple[str, list[str]]]:
    """(where, columns) of every `kubectl get tj` column list in the docs: a header in
    the comment after the command, or the first line of its output in a console block."""
    found = []
    for path in DOCS:
        lines = path.read_text(encoding="utf-8").splitlines()
        for number, line in enumerate(lines):
            if not re.search(r"kubectl get (tj|trainingjobs?)\b", line):
                continue
            comment = line.split("#", 1)[1].split() if "#" in line else []
            if comment[:1] == ["NAME"]:
                found.append((f"{path.name}:{number + 1}", comment))
            following = lines[number + 1] if number + 1 < len(lines) else ""
            if line.startswith("$ ") and following.split()[:1] == ["NAME"]:
                found.append((f"{path.name}:{number + 2}", following.split()))
    return found


def test_every_kubectl_get_column_list_is_the_crds_printer_columns():
    found = documented_column_lists()
    assert {where.split(":")[0] for where, _ in found} >= {
        "README.md", "install.md", "operator.md"}
    assert [(where, columns) for where, columns in found if columns != COLUMNS] == []


def test_operator_doc_example_output_has_a_value_per_column():
    output = OPERATOR.read_text(encoding="utf-8").split(
        "$ kubectl get tj\n", 1)[1].split("```", 1)[0].splitlines()
    assert output[0].split() == COLUMNS
    assert all(len(row.split()) == len(COLUMNS) for row in output[1:]) and output[1:]


def test_operator_doc_column_table_is_the_crds_printer_columns():
    rows = table(section(OPERATOR, "## Status"))
    expected = [[f"`{c['name'].upper()}`", f"`{c['jsonPath']}`", c.get("description", "")]
                for c in PRINTER_COLUMNS]
    assert rows == expected


# -------------------------------------------------------------------- the chart values


def values_keys() -> list[str]:
    """Every key of values.yaml a user sets: records (objects with properties in the
    schema) are walked into; maps, lists and Kubernetes-typed blocks are one key."""
    values = yaml.safe_load((CHART / "values.yaml").read_text(encoding="utf-8"))
    schema = json.loads((CHART / "values.schema.json").read_text(encoding="utf-8"))
    kubernetes_typed = {"resources", "podSecurityContext", "securityContext", "affinity"}

    def walk(value: Any, node: dict[str, Any], path: str) -> list[str]:
        if (isinstance(value, dict) and "properties" in node
                and path.rsplit(".", 1)[-1] not in kubernetes_typed):
            return [key for name, sub in value.items()
                    for key in walk(sub, node["properties"][name],
                                    f"{path}.{name}" if path else name)]
        return [path]

    return walk(values, schema, "")


def documented_values() -> list[str]:
    """The keys the install doc's values table names: `a.b` / `c` is a.b and a.c, and
    `x`, `y` two keys."""
    keys = []
    for row in table(section(INSTALL, "## Values")):
        for group in row[0].split(","):
            first, *siblings = [name.strip().strip("`") for name in group.split("/")]
            keys.append(first)
            parent = first.rsplit(".", 1)[0] + "." if "." in first else ""
            keys.extend(parent + sibling for sibling in siblings)
    return keys


def test_values_table_names_every_key_of_values_yaml_once():
    documented = documented_values()
    assert sorted(documented) == sorted(set(documented))
    assert sorted(documented) == sorted(values_keys())


# ---------------------------------------------------------------- manifests in docs


def doc_manifests() -> list[Any]:
    """Every YAML block of a doc that is a TrainingJob or a part of one (a block that
    starts at `spec:` is checked inside a minimal job)."""
    found = []
    for path in DOCS:
        for number, (lang, text) in enumerate(code_blocks(path)):
            if lang != "yaml":
                continue
            data = yaml.safe_load(text)
            if not isinstance(data, dict):
                continue
            if data.get("kind") == "TrainingJob":
                found.append(pytest.param(data, id=f"{path.name}-{number}"))
            elif set(data) == {"spec"}:
                job = {"apiVersion": "pstrain.io/v1alpha1", "kind": "TrainingJob",
                       "metadata": {"name": "doc"}, **data}
                found.append(pytest.param(job, id=f"{path.name}-{number}-spec"))
    return found


def test_docs_have_manifests_to_check():
    assert {p.id.split("-")[0] for p in doc_manifests()} >= {
        "README.md", "operator.md", "tensorflow.md"}


@pytest.mark.parametrize("manifest", doc_manifests())
def test_every_manifest_in_the_docs_validates(manifest: dict[str, Any]):
    job, problems = check_manifest(manifest, "doc")
    assert problems == [] and job is not None


# ------------------------------------------------------------------------- TensorFlow

TF_EXAMPLE = ROOT / "examples" / "tf-ps.yaml"
TF_PROGRAM = ROOT / "examples" / "tensorflow" / "train.py"


def test_tensorflow_doc_manifest_is_the_shipped_example():
    text = TF_EXAMPLE.read_text(encoding="utf-8")
    manifest = text[text.index("apiVersion:"):]
    assert ("yaml", manifest) in code_blocks(TENSORFLOW)


def test_tensorflow_example_runs_the_program_its_configmap_is_made_from():
    """The doc's `kubectl create configmap NAME --from-file=KEY=PATH` makes the ConfigMap
    the example mounts, and the command runs the file KEY of it: the shipped program."""
    commands = [shlex.split(line) for lang, text in code_blocks(TENSORFLOW) if lang == "bash"
                for line in text.splitlines() if line.startswith("kubectl create configmap")]
    (command,) = commands
    name = command[3]
    (source,) = [arg.split("=", 1)[1] for arg in command if arg.startswith("--from-file=")]
    key, path = source.split("=", 1)
    assert (ROOT / path) == TF_PROGRAM
    compile(TF_PROGRAM.read_text(encoding="utf-8"), str(TF_PROGRAM), "exec")
    job = yaml.safe_load(TF_EXAMPLE.read_text(encoding="utf-8"))
    for role, spec in job["spec"]["replicas"].items():
        pod = spec["template"]["spec"]
        (mount,) = pod["containers"][0]["volumeMounts"]
        (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
        assert volume["configMap"]["name"] == name, role
        assert pod["containers"][0]["command"] == ["python", f"{mount['mountPath']}/{key}"]


def python_with_tensorflow() -> str | None:
    """$PSTRAIN_TEST_TF_PYTHON, or this Python where it has TensorFlow."""
    explicit = os.environ.get("PSTRAIN_TEST_TF_PYTHON")
    if explicit:
        return explicit
    try:
        import tensorflow  # noqa: F401
    except ImportError:
        return None
    return sys.executable


@pytest.mark.timeout(600)
def test_tensorflow_example_trains_under_pstrain_run(tmp_path: Path):
    """The program, unchanged, under `pstrain run`: the servers come up (TCP readiness),
    the chief trains and exits 0, pstrain stops the servers. Needs TensorFlow, which the
    test extras leave out: set PSTRAIN_TEST_TF_PYTHON to a Python that has it."""
    python = python_with_tensorflow()
    if python is None:
        pytest.skip("TensorFlow is not installed; set PSTRAIN_TEST_TF_PYTHON to a Python "
                    "with tensorflow-cpu==2.16.1")
    job = yaml.safe_load(TF_EXAMPLE.read_text(encoding="utf-8"))
    for role, spec in job["spec"]["replicas"].items():
        spec["template"] = copy.deepcopy(spec["template"])  # the YAML anchor shares it
        container = spec["template"]["spec"]["containers"][0]
        container["command"] = [python, str(TF_PROGRAM)]
        container["env"].append({"name": "TF_CPP_MIN_LOG_LEVEL", "value": "2"})
        if role == "chief":
            container["args"] = ["--steps", "100"]
    manifest = tmp_path / "tf-ps.yaml"
    manifest.write_text(yaml.safe_dump(job), encoding="utf-8")
    proc = subprocess.run(
        [sys.executable, "-m", "pstrain_api.cli", "run", str(manifest), "--json"],
        capture_output=True, text=True, timeout=540,
        env={**os.environ, "TMPDIR": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert json.loads(proc.stdout)["phase"] == "Succeeded"
    assert "done: 100 steps" in proc.stderr


# ---------------------------------------------------------------------------- bench


def test_bench_doc_lists_every_item():
    from bench.run import ITEMS

    block = next(text for lang, text in code_blocks(ROOT / "docs" / "bench.md")
                 if "--only" in text)
    listed = block.split("# some items:", 1)[1].split("\npython", 1)[0]
    assert re.findall(r"[a-z_]+", listed.replace("#", " ")) == list(ITEMS)


# --------------------------------------------------------------------- runtime layout

RUNTIME = ROOT / "runtime" / "pstrain_runtime"
ROOMS = ("ps/", "worker/", "transport/")


def tree_entries(folder: Path) -> list[str]:
    """The modules and packages in `folder`: `name.py` and `name/`."""
    return sorted(p.name + "/" if p.is_dir() else p.name for p in folder.iterdir()
                  if p.suffix == ".py" or (p / "__init__.py").exists())


def runtime_doc_listing() -> dict[str, list[str]]:
    """docs/runtime.md's "Where the code lives": the entries at the top ("") and in each
    folder listed there, continuation lines left out."""
    block = next(text for lang, text in code_blocks(ROOT / "docs" / "runtime.md")
                 if lang == "text" and "transport/" in text)
    listing: dict[str, list[str]] = {"": []}
    folder = ""
    for line in filter(str.strip, block.splitlines()):
        indent, name = re.match(r"( *)(\S+)", line).groups()
        if indent == "":
            listing[""].append(name)
            folder = name if name.endswith("/") else ""
            listing.setdefault(folder, [])
        elif indent == "  " and folder:
            listing[folder].append(name)
    return listing


def test_runtime_doc_lists_every_module_of_the_top_and_of_each_room():
    listing = runtime_doc_listing()
    assert sorted(listing[""]) == tree_entries(RUNTIME)
    for room in ROOMS:
        modules = [name for name in tree_entries(RUNTIME / room) if name != "__init__.py"]
        assert sorted(listing[room]) == modules, room
    block = section(ROOT / "docs" / "runtime.md", "## Where the code lives")
    for name in tree_entries(RUNTIME / "worker" / "chief"):
        assert name == "__init__.py" or name in block, name


def test_readme_layout_names_every_room_and_every_shared_module():
    layout = section(README, "## Layout")
    names = [name for name in tree_entries(RUNTIME) if name != "__init__.py"]
    assert [name for name in names if f"`{name}`" not in layout] == []
