"""What a local run checks and says before its first process: the entry point (refused
in one line, nothing started), core warnings, and whether the scale hint is shown."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from pstrain_runtime.failure import ConfigurationError
from pstrain_runtime.local.capacity import cores_warning
from pstrain_runtime.local.runner import RunOptions, run_job
from pstrain_runtime.local.startup import (entrypoint_problem, locate_problem, may_scale,
                                           scale_hint)

from .local_builders import make_job

ROOT = Path(__file__).resolve().parents[3]
TF = ["python", "-m", "pstrain_runtime.examples.tf_config_program"]
WHERE = "spec.training.entrypoint is"

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize(("entrypoint", "expected"), [
    pytest.param("pstrain_runtime.examples.digits:make_task", None, id="the-example"),
    pytest.param("tests.runtime.entrypoints.broken:raises_when_called", None,
                 id="found-in-this-directory"),
    pytest.param("no_such_module_xyz:make_task",
                 f"{WHERE} 'no_such_module_xyz:make_task'; module 'no_such_module_xyz' "
                 "cannot be imported: ModuleNotFoundError: No module named "
                 "'no_such_module_xyz'", id="no-module"),
    pytest.param("no_such_pkg_xyz.models:make_task",
                 f"{WHERE} 'no_such_pkg_xyz.models:make_task'; module "
                 "'no_such_pkg_xyz.models' cannot be imported: ModuleNotFoundError: No "
                 "module named 'no_such_pkg_xyz'", id="no-package"),
    pytest.param("pstrain_runtime.examples.digits:make_tsak",
                 f"{WHERE} 'pstrain_runtime.examples.digits:make_tsak'; "
                 "pstrain_runtime.examples.digits has no function 'make_tsak'",
                 id="no-function"),
    pytest.param("pstrain_runtime.examples.digits", f"{WHERE} "
                 "'pstrain_runtime.examples.digits'; it must be module:function",
                 id="no-function-named"),
])
def test_locate_problem(entrypoint, expected):
    assert locate_problem(entrypoint, str(ROOT)) == expected


def test_the_users_module_is_read_not_run():
    sys.modules.pop("tests.runtime.entrypoints.raises_at_import", None)
    assert locate_problem("tests.runtime.entrypoints.raises_at_import:make_task",
                          str(ROOT)) is not None  # no such function in its source
    assert "tests.runtime.entrypoints.raises_at_import" not in sys.modules


def test_the_check_needs_the_default_replica_command_and_a_trainer_that_loads_it():
    bad = make_job().training(entrypoint="no_such_module_xyz:make_task")
    assert entrypoint_problem(bad.model(), RunOptions().replica_command) is not None
    assert entrypoint_problem(bad.model(), ["my-python", "-m", "x"]) is None
    own = bad.template("worker", command=TF)
    assert entrypoint_problem(own.model(), RunOptions().replica_command) is None


def test_run_job_refuses_an_unimportable_entry_point_before_starting_anything(tmp_path):
    """Issue "rough edges" 2: no replica starts, one sentence says why."""
    job = make_job("j").training(entrypoint="no_such_module_xyz:make_task").model()
    with pytest.raises(ConfigurationError) as refused:
        run_job(job, RunOptions(handle_signals=False, checkpoint_dir=str(tmp_path)))
    assert str(refused.value) == (
        f"{WHERE} 'no_such_module_xyz:make_task'; module 'no_such_module_xyz' cannot be "
        "imported: ModuleNotFoundError: No module named 'no_such_module_xyz'.")


def test_pstrain_run_prints_the_entry_point_error_once_and_starts_nothing(tmp_path):
    manifest = make_job("j").training(entrypoint="no_such_module_xyz:make_task").write(
        tmp_path / "job.yaml")
    proc = subprocess.run([sys.executable, "-m", "pstrain_api.cli", "run", str(manifest)],
                          capture_output=True, text=True, cwd=tmp_path, timeout=50)
    assert proc.returncode == 1
    assert proc.stdout == ""
    assert proc.stderr.splitlines() == [
        f"pstrain run: {WHERE} 'no_such_module_xyz:make_task'; module 'no_such_module_xyz' "
        "cannot be imported: ModuleNotFoundError: No module named 'no_such_module_xyz'."]


@pytest.mark.parametrize(("workers", "cores", "expected"), [
    pytest.param(2, 2, None, id="as-many-as-cores"),
    pytest.param(2, None, None, id="cores-unknown"),
    pytest.param(9, 2, "9 workers on 2 CPU cores: the workers take turns on the cores, so "
                       "more workers than cores train no faster here "
                       "(spec.replicas.worker.maxReplicas bounds a scale)", id="9-on-2"),
    pytest.param(2, 1, "2 workers on 1 CPU core: the workers take turns on the cores, so "
                       "more workers than cores train no faster here "
                       "(spec.replicas.worker.maxReplicas bounds a scale)", id="2-on-1"),
])
def test_cores_warning(workers, cores, expected):
    assert cores_warning(workers, cores) == expected


@pytest.mark.parametrize(("builder", "expected"), [
    pytest.param(make_job().workers(2), True, id="no-bounds"),
    pytest.param(make_job().workers(2, minReplicas=1, maxReplicas=4), True, id="elastic"),
    pytest.param(make_job().workers(2, maxReplicas=2), True, id="may-scale-down-to-1"),
    pytest.param(make_job().workers(2, minReplicas=2, maxReplicas=2), False, id="fixed"),
    pytest.param(make_job().workers(1, maxReplicas=1), False, id="one-at-most"),
    pytest.param(make_job().template("ps", command=TF).template("worker", command=TF),
                 False, id="tf-config-program"),
])
def test_may_scale(builder, expected):
    assert may_scale(builder.model()) is expected


def test_scale_hint_names_the_bounds():
    assert scale_hint(make_job("j").workers(2, maxReplicas=4).model()) == (
        "change the worker count while it runs (1 to 4 workers): "
        "pstrain scale j --replicas N")
    assert scale_hint(make_job("j").model()).startswith(
        "change the worker count while it runs (1 or more workers)")


def test_a_program_in_an_image_or_volume_is_named_before_it_fails_locally() -> None:
    """examples/tf-ps.yaml runs `python /app/train.py` from TensorFlow's image with the
    program mounted at /app: `pstrain run` has neither, so it says so in one warning
    before the replicas fail to find the program; a role that runs the pstrain
    runtime (whose template only mounts, say, a disk tier's volume) is not named."""
    from pstrain_api.validate import load_job
    from pstrain_runtime.local.startup import pod_only_notice

    notice = pod_only_notice(load_job(ROOT / "examples" / "tf-ps.yaml"))
    assert notice is not None and "\n" not in notice
    assert notice.startswith("the ps, worker, chief templates set image "
                             "tensorflow/tensorflow:2.16.1 and volumes at /app, which a "
                             "local run does not use"), notice
    builder = make_job("j")
    builder.set("spec.replicas.ps.template", {"spec": {"containers": [
        {"name": "pstrain", "image": "my/runtime:1",
         "volumeMounts": [{"name": "rows", "mountPath": "/var/lib/rows"}]}],
        "volumes": [{"name": "rows", "emptyDir": {}}]}})
    assert pod_only_notice(builder.model()) is None
    builder.set("spec.replicas.worker.template", {"spec": {"containers": [
        {"name": "pstrain", "command": TF, "image": "my/program:2"}]}})
    assert pod_only_notice(builder.model()) == (
        "the worker template sets image my/program:2, which a local run does not use (its "
        "replicas run this machine's Python and files): a program that lives there is not "
        "found locally; run the job on a cluster")
