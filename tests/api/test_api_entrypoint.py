"""`pstrain validate --check-entrypoint` imports each entry point and calls nothing; an
entry point that cannot be imported fails the job at once (exit code 78), it is not
restarted."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import yaml

from pstrain_api import constants as c
from pstrain_api.cli import main
from pstrain_api.entrypoint import EntrypointError, resolve_entrypoint
from pstrain_api.model import RunPolicy
from pstrain_api.policy import decide_restart

from .job_builder import job

MODULE = """\
CALLED = []
def make_task(**kw):
    CALLED.append(kw)
    raise RuntimeError("must not be called")
"""


@pytest.fixture
def user_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    (tmp_path / "ep_user_model.py").write_text(MODULE)
    (tmp_path / "ep_broken_model.py").write_text("raise RuntimeError('boom at import')\n")
    (tmp_path / "ep_lines_model.py").write_text("raise ImportError('no GPU\\nsee above')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "ep_user_model"
    for name in ("ep_user_model", "ep_broken_model", "ep_lines_model"):
        sys.modules.pop(name, None)


def write(tmp_path: Path, entrypoint: str) -> str:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job("j").training(entrypoint=entrypoint).build()))
    return str(path)


@pytest.mark.parametrize(("entrypoint", "error"), [
    pytest.param("ep_user_model:make_task", None, id="importable"),
    pytest.param("ep_missing_model:make_task",
                 "module 'ep_missing_model' cannot be imported: ModuleNotFoundError",
                 id="no-module"),
    pytest.param("ep_user_model:nothing", "ep_user_model has no function 'nothing'",
                 id="no-function"),
    pytest.param("ep_broken_model:make_task",
                 "module 'ep_broken_model' cannot be imported: RuntimeError: boom at import",
                 id="module-raises"),
    pytest.param("ep_lines_model:make_task",
                 "module 'ep_lines_model' cannot be imported: ImportError: no GPU see above",
                 id="module-raises-lines"),
])
def test_check_entrypoint(user_module, tmp_path, capsys, entrypoint, error) -> None:
    path = write(tmp_path, entrypoint)
    assert main(["validate", path]) == 0  # without the flag nothing is imported
    capsys.readouterr()
    code = main(["validate", "--check-entrypoint", path])
    out = capsys.readouterr()
    if error is None:
        assert code == 0 and "valid" in out.out
        assert sys.modules[user_module].CALLED == []  # imported, not called
    else:
        assert code == 1
        assert out.err.startswith(f"{path}: spec.training.entrypoint is {entrypoint!r}; ")
        assert error in out.err and "Traceback" not in out.err
        assert out.err.count("\n") == 1  # one line, whatever the module raised


def test_resolve_returns_the_function_uncalled(user_module) -> None:
    func = resolve_entrypoint(f"{user_module}:make_task")
    assert callable(func) and sys.modules[user_module].CALLED == []
    with pytest.raises(EntrypointError, match="must be module:function"):
        resolve_entrypoint("no_colon")


@pytest.mark.parametrize("policy", ["OnFailure", "ExitCode", "Never"])
def test_a_configuration_error_fails_the_job_at_once(policy: str) -> None:
    decision = decide_restart(RunPolicy(restart_policy=policy, backoff_limit=3), "j-worker-1",
                              c.EXIT_CONFIGURATION_ERROR, 0)
    assert (decision.action, decision.reason) == ("fail", "ConfigurationError")
    assert "j-worker-1 reported a configuration error" in decision.message
