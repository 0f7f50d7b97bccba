"""The README and docs/local-runner.md agree with the program: the --json examples have
the real summary's fields, the documented exit codes are the ones `pstrain run --help`
names, and the example run shows the example's step count."""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path

import yaml

from .local_builders import make_job, state_of
from pstrain_runtime.local.cli import build_parser
from pstrain_runtime.local.metrics import Metrics, build_summary

ROOT = Path(__file__).resolve().parents[3]
README = (ROOT / "README.md").read_text()
RUNNER_DOC = (ROOT / "docs" / "local-runner.md").read_text()


def real_summary() -> dict:
    job = make_job("j").model()
    return build_summary(state_of(job), Metrics(total_steps=100), 1.0, "j", "/ckpt")


def keys(summary: dict) -> tuple[set[str], set[str]]:
    """Top-level keys, and the keys of one replica's entry."""
    return set(summary), set(next(iter(summary["replicas"].values())))


def test_readme_json_example_has_exactly_the_summary_fields():
    line = README.split("--json\n", 1)[1].splitlines()[0]
    assert keys(json.loads(line)) == keys(real_summary())


def test_runner_doc_json_example_has_exactly_the_summary_fields():
    block = RUNNER_DOC.split("## `--json` summary", 1)[1].split("```json\n", 1)[1]
    assert keys(json.loads(block.split("```", 1)[0])) == keys(real_summary())


def test_documented_exit_codes_are_the_ones_help_names():
    table = RUNNER_DOC.split("### Exit codes", 1)[1].split("##", 1)[0]
    documented = {int(code) for code in re.findall(r"^\| (\d+) \|", table, re.M)}
    helped = {int(code) for code in re.findall(r"\b(\d+)\b", build_parser().description)}
    assert documented == helped == {0, 1, 2, 130, 143}


def test_runner_doc_example_run_has_the_example_step_count():
    steps = yaml.safe_load((ROOT / "examples" / "digits.yaml").read_text())["spec"][
        "training"]["steps"]
    run = RUNNER_DOC.split("$ pstrain run examples/digits.yaml\n", 1)[1].split("```", 1)[0]
    shown = set(re.findall(r"(\d+)/(\d+) steps", run))
    assert shown == {(str(steps), str(steps))}


def test_pytest_asyncio_fixture_loop_scope_is_set():
    """Unset, pytest-asyncio (0.24 to 0.26) opens every run with a deprecation warning."""
    options = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"][
        "ini_options"]
    assert options["asyncio_default_fixture_loop_scope"] == "function"
