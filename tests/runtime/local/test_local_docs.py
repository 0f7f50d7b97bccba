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


# --------------------------------------------------------------------------- the sample run

TEMP = "/tmp/pstrain-digits-ckpt-5gby98y9"
SAMPLE_START = "$ pstrain run examples/digits.yaml\n"


class _Proc:
    def __init__(self, pid: int) -> None:
        self.pid = pid

    def probe_health(self, *_: object, **__: object) -> None:
        pass


class _Table:
    """Processes on paper: fixed pids, nothing runs."""

    def __init__(self) -> None:
        self.pids = iter([31754, 31923, 31927])

    def start(self, name: str, attempt: int) -> _Proc:
        return _Proc(next(self.pids))

    def signal(self, names: object, signum: int) -> None:
        pass

    def tail(self, name: str, lines: int = 10) -> list[str]:
        return []


def sample_run() -> list[str]:
    """What `pstrain run examples/digits.yaml` prints (plain output) for a fixed
    script of replica output, made by the runner's own parts: the opening notices, the
    supervisor's decisions, the executor's notices, the event lines and the result."""
    import io
    import types

    from pstrain_api.cluster import local_cluster_spec
    from pstrain_api.events import format_event
    from pstrain_runtime.local import runner
    from pstrain_runtime.local.processes import Line
    from pstrain_runtime.local.render import PlainReporter
    from pstrain_runtime.local.startup import startup_notices
    from pstrain_runtime.local.supervisor import (Begin, Exited, Healthy, Settings,
                                                  decide, initial_state)
    from pstrain_api.validate import load_job

    job = runner.with_checkpoint_dir(load_job(ROOT / "examples" / "digits.yaml"), TEMP)
    spec = local_cluster_spec(job, [40567, 41589, 47123])
    names = [spec.replica_name(t) for t in spec.tasks()]
    ps, w1, chief = names
    out = io.StringIO()
    reporter = PlainReporter(out, names)
    for level, text in startup_notices(job, spec, {}, TEMP):
        reporter.notice(level, text)
    clock = iter(float(t) for t in range(1000))
    executor = runner._Executor(_Table(), reporter, lambda: next(clock))  # type: ignore
    state = initial_state(spec, Settings(policy=job.spec.run_policy), job)
    metrics = runner.Metrics(total_steps=job.spec.training.steps)

    def ckpt(step: int) -> str:
        return format_event("checkpoint", step=step, path=f"{TEMP}/ckpt-{step:012d}.pt")

    script: list[object] = [
        Begin(0.0), Line(ps, 1, format_event("ready", address=str(spec.addresses[
            spec.tasks()[0]]))), Healthy(ps, 1, 2.0),
        Line(chief, 1, format_event("progress", step=1, loss=2.2994,
                                    samples_per_sec=2103.0)),
        Line(chief, 1, ckpt(100)),
        Line(w1, 1, "pstrain: worker 1 joins at step 139"),
        Line(chief, 1, ckpt(200)), Line(chief, 1, ckpt(300)),
        Line(chief, 1, format_event("eval", step=301, accuracy=0.9556, loss=0.1435)),
        Line(chief, 1, format_event("progress", step=374, loss=0.4530,
                                    samples_per_sec=23186.0)),
        *[Line(chief, 1, ckpt(s)) for s in (400, 500, 600)],
        Line(chief, 1, format_event("eval", step=600, accuracy=0.9733, loss=0.1162)),
        *[Line(chief, 1, ckpt(s)) for s in (700, 800)],
        Line(chief, 1, format_event("progress", step=856, loss=0.0478,
                                    samples_per_sec=26930.0)),
        Line(chief, 1, format_event("eval", step=900, accuracy=0.9756, loss=0.0945)),
        Line(chief, 1, ckpt(900)),
        Line(chief, 1, format_event("done", step=900, loss=0.0362, accuracy=0.9756,
                                    samples_per_sec=27101.0, wall_seconds=9.4)),
        # The chief stops the parameter server, which exits just before it.
        Exited(ps, 1, 0, 29.5), Exited(chief, 1, 0, 30.0), Exited(w1, 1, 0, 31.0),
    ]
    finish = None
    for item in script:
        if isinstance(item, Line):
            metrics = executor.line(item, metrics)
            continue
        state, actions = decide(state, item)  # type: ignore[arg-type]
        for action in actions:
            finish = executor.apply(action, state) or finish
    assert finish is not None
    ending = runner._Ending(state, metrics, finish, None, 35.7)
    runner._conclude(job, runner.RunOptions(manifest="examples/digits.yaml"),
                     types.SimpleNamespace(executor=executor),  # type: ignore[arg-type]
                     ending, TEMP, out)
    return out.getvalue().splitlines()


def documented_sample() -> str:
    return RUNNER_DOC.split(SAMPLE_START, 1)[1].split("```", 1)[0]


def test_runner_doc_sample_run_is_what_the_runner_prints():
    """The sample in docs/local-runner.md comes from `sample_run`; to refresh it after
    changing what the runner prints: PSTRAIN_UPDATE_DOCS=1 pytest this test."""
    import os

    printed = "\n".join(sample_run()) + "\n"
    if os.environ.get("PSTRAIN_UPDATE_DOCS"):
        path = ROOT / "docs" / "local-runner.md"
        path.write_text(RUNNER_DOC.replace(SAMPLE_START + documented_sample(),
                                           SAMPLE_START + printed))
        return
    assert documented_sample() == printed


def test_runner_doc_stopped_sample_is_what_the_runner_prints():
    from pstrain_runtime.local.render import format_result

    block = RUNNER_DOC.split("prints the exact command:\n\n```\n", 1)[1].split("```", 1)[0]
    summary = {"job": "digits", "phase": "Failed", "reason": "Interrupted",
               "message": "interrupted by SIGINT; stopped every replica.", "steps": 372,
               "total_steps": 900, "loss": 0.4012, "accuracy": 0.9556,
               "wall_seconds": 14.2, "samples_per_sec": 21004.0, "restarts": 0,
               "lost_steps": 0, "checkpoint_dir": TEMP, "last_checkpoint_step": 300,
               "stopped_by": "SIGINT",
               "resume": f"pstrain run examples/digits.yaml --checkpoint-dir {TEMP}"}
    assert block == "\n".join(format_result(summary)) + "\n"
