"""`pstrain validate` and `pstrain crd` as a user runs them: exit codes and output."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pstrain_api.cli import main
from pstrain_api.crd import render_crd_yaml

from .job_builder import job

ROOT = Path(__file__).resolve().parents[2]


def test_every_example_validates(capsys):
    examples = sorted(str(p) for p in (ROOT / "examples").glob("*.yaml"))
    assert main(["validate", *examples]) == 0
    out = capsys.readouterr().out
    assert out.count(": valid (") == len(examples)


def test_invalid_manifest_exits_1_with_messages_and_no_traceback(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(job("ok").ps(0).training(mode="fast").build()))
    good = tmp_path / "good.yaml"
    good.write_text(yaml.safe_dump(job("ok").build()))
    assert main(["validate", str(good), str(bad)]) == 1
    captured = capsys.readouterr()
    assert f"{bad}: spec.replicas.ps.replicas is 0; it must be at least 1." in captured.err
    assert f"{bad}: spec.training.mode is 'fast'" in captured.err
    assert "Traceback" not in captured.err
    assert f"{good}: valid (default/ok)" in captured.out


def test_validate_for_kubernetes_applies_the_operators_own_rules(tmp_path, capsys):
    path = tmp_path / "disk.yaml"
    path.write_text(yaml.safe_dump(job("d").training(sparseStorage={"serverMemory": "1Gi"})
                                   .build()))
    assert main(["validate", str(path)]) == 0  # `pstrain run` makes a temporary folder
    assert main(["validate", "--kubernetes", str(path)]) == 1
    err = capsys.readouterr().err
    assert f"{path}: spec.training.sparseStorage.directory is missing;" in err
    assert "Traceback" not in err


def test_multi_document_file_names_the_document(tmp_path, capsys):
    path = tmp_path / "two.yaml"
    path.write_text(yaml.safe_dump_all([job("a").build(), job("b").workers(0).build()]))
    assert main(["validate", str(path)]) == 1
    assert f"{path}#2: spec.replicas.worker.replicas is 0" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        pytest.param("a: [\n", "is not valid YAML at line 2", id="bad-yaml"),
        pytest.param(None, "cannot read the file", id="missing-file"),
    ],
)
def test_unreadable_input_is_a_message(tmp_path, capsys, content, expected):
    path = tmp_path / "x.yaml"
    if content is not None:
        path.write_text(content)
    assert main(["validate", str(path)]) == 1
    assert expected in capsys.readouterr().err


def test_crd_command_prints_the_generated_crd(capsys):
    assert main(["crd"]) == 0
    assert capsys.readouterr().out == render_crd_yaml()


def test_console_script_runs_as_a_process():
    result = subprocess.run(
        [sys.executable, "-m", "pstrain_api.cli", "validate", str(ROOT / "examples" / "digits.yaml")],
        capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert "valid (default/digits)" in result.stdout


def test_no_command_prints_help_and_exits_2(capsys):
    assert main([]) == 2
    assert "validate" in capsys.readouterr().out


def test_unknown_command_is_an_argparse_error(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["trian"])
    assert exc.value.code == 2
    assert "invalid choice: 'trian'" in capsys.readouterr().err


HEAD = b"apiVersion: pstrain.io/v1alpha1\nkind: TrainingJob\nmetadata: {name: j}\n"
BOMB = b"a: &a [x, x, x, x, x, x, x, x, x, x]\n" + b"".join(
    f"{b}: &{b} [{', '.join([f'*{a}'] * 10)}]\n".encode() for a, b in zip("abcdefgh", "bcdefghi"))


@pytest.mark.timeout(30)
@pytest.mark.parametrize("command", ["validate", "run"])
@pytest.mark.parametrize(
    ("content", "expected"),
    [
        pytest.param(b"\x89PNG\r\n\x1a\n\x00", "the file is not UTF-8 text (byte 0x89 at "
                     "offset 0); a manifest must be YAML in UTF-8.", id="binary"),
        pytest.param(b"a: " + b"[" * 20_000 + b"]" * 20_000, "line 1, column 103: the values "
                     "nest more than 100 levels deep; a manifest may nest at most 100.",
                     id="deep"),
        pytest.param(BOMB, "line 5, column 4: its aliases expand the document to more than "
                     "1000000 values; a manifest may hold at most 1000000.", id="alias-bomb"),
        pytest.param(HEAD + b"spec: {training: {steps: 200, steps: 999999}}\n",
                     "line 4, column 31: the key 'steps' appears twice in one mapping (first "
                     "at line 4, column 19); each key may appear once.", id="duplicate-key"),
    ],
)
def test_validate_and_run_refuse_bad_files_in_one_line(tmp_path, capsys, command, content,
                                                       expected):
    path = tmp_path / "job.yaml"
    path.write_bytes(content)
    assert main([command, str(path)]) == 1
    captured = capsys.readouterr()
    assert captured.err.splitlines() == [f"{path}: {expected}"]
    assert captured.out == ""
