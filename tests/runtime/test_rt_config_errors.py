"""Configuration errors: an entry point that cannot be imported or called, or returns no
Task, is refused in one line, and the replica exits with the configuration-error code
(which the restart policy treats as permanent) and leaves that line in its
termination-message file."""

from __future__ import annotations

import pytest
from pstrain_api import constants as c
from pstrain_api.cluster import Task, local_cluster_spec
from pstrain_api.model import TrainingJob

from pstrain_runtime.failure import (
    ConfigurationError,
    report_failure,
    termination_log_path,
    write_termination_message,
)
from pstrain_runtime.replica import replica_main
from pstrain_runtime.task import load_task
from tests.api.job_builder import job

BROKEN = "tests.runtime.entrypoints.broken"

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize(
    ("entrypoint", "args", "expected"),
    [
        pytest.param("tests.runtime.entrypoints.raises_at_import:make_task", {},
                     "cannot be imported: RuntimeError: the data bucket is not mounted",
                     id="raises-at-import"),
        pytest.param("tests.runtime.nosuchmodule:make_task", {},
                     "No module named 'tests.runtime.nosuchmodule'", id="no-such-module"),
        pytest.param(f"{BROKEN}:no_such_function", {}, "has no function 'no_such_function'",
                     id="no-such-function"),
        pytest.param(f"{BROKEN}:not_a_function", {}, "has no function 'not_a_function'",
                     id="not-callable"),
        pytest.param(f"{BROKEN}:raises_when_called", {},
                     "calling raises_when_called(**spec.training.args) raised KeyError: "
                     "'feature_columns'", id="raises-when-called"),
        pytest.param(f"{BROKEN}:needs_arguments", {"width": 3},
                     "do not fit the signature of", id="missing-argument"),
        pytest.param(f"{BROKEN}:needs_arguments", {"width": 3, "depth": 2, "colour": 1},
                     "unexpected keyword argument 'colour'", id="unknown-argument"),
        pytest.param(f"{BROKEN}:returns_a_dict", {}, "returned dict, which lacks",
                     id="returns-a-dict"),
        pytest.param(f"{BROKEN}:returns_a_task_with_a_bad_loss", {}, "['loss'] are not callable",
                     id="non-callable-loss"),
        pytest.param("no-colon", {}, "it must be module:function", id="not-module-function"),
    ],
)
def test_a_bad_entry_point_is_a_one_line_configuration_error(entrypoint, args, expected) -> None:
    with pytest.raises(ConfigurationError) as caught:
        load_task(entrypoint, args)
    message = str(caught.value)
    assert expected in message
    assert "\n" not in message
    assert isinstance(caught.value, ValueError)  # callers that caught ValueError still do


def test_a_good_entry_point_still_loads() -> None:
    task = load_task("pstrain_runtime.examples.synthetic:make_task", {})
    assert callable(task.batches)


@pytest.mark.parametrize(
    ("environ", "expected"),
    [
        pytest.param({c.ENV_TERMINATION_LOG: "/x/last"}, "/x/last", id="explicit"),
        pytest.param({c.ENV_TERMINATION_LOG: ""}, None, id="empty-disables"),
    ],
)
def test_termination_log_path(environ, expected) -> None:
    path = termination_log_path(environ)
    assert (str(path) if path else None) == expected


def test_termination_log_defaults_to_the_kubernetes_file_only_where_it_exists(monkeypatch,
                                                                             tmp_path) -> None:
    monkeypatch.setattr(c, "TERMINATION_LOG_PATH", str(tmp_path / "absent"))
    assert termination_log_path({}) is None
    (tmp_path / "present").touch()
    monkeypatch.setattr(c, "TERMINATION_LOG_PATH", str(tmp_path / "present"))
    assert termination_log_path({}) == tmp_path / "present"


def test_termination_message_is_cut_to_what_the_kubelet_keeps(tmp_path) -> None:
    log = tmp_path / "last"
    write_termination_message("x" * 10_000, {c.ENV_TERMINATION_LOG: str(log)})
    assert len(log.read_bytes()) == c.TERMINATION_MESSAGE_MAX_BYTES
    # An unwritable path changes nothing: the replica still fails as it would.
    assert report_failure("boom", 3, {c.ENV_TERMINATION_LOG: str(tmp_path / "no" / "x")}) == 3


def test_replica_with_a_broken_entry_point_exits_with_the_configuration_error_code(
        monkeypatch, capsys, tmp_path) -> None:
    manifest = job("j").ps(1).workers(1).training(
        entrypoint=f"{BROKEN}:raises_when_called").build()
    spec = local_cluster_spec(TrainingJob.model_validate(manifest), range(20000, 20010))
    for key, value in spec.env(Task("worker", 0)).items():
        monkeypatch.setenv(key, value)
    log = tmp_path / "termination-log"
    monkeypatch.setenv(c.ENV_TERMINATION_LOG, str(log))
    assert replica_main([]) == c.EXIT_CONFIGURATION_ERROR
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert "configuration error" in err and "KeyError: 'feature_columns'" in err
    assert log.read_text() == err.strip()
