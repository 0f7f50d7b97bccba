"""Training is never lost to checkpoint storage: an unusable directory is refused in one
line before anything trains, a write that fails mid-run is reported and retried while
training carries on, and when the final write fails the trained parameters go to a
reported fallback directory before the job fails."""

from __future__ import annotations

import errno
import os
import stat
import tempfile
from pathlib import Path

import pytest
import torch

from pstrain_runtime.checkpoint import (
    Checkpoint,
    CheckpointMismatch,
    CheckpointStore,
    load_checkpoint,
)
from pstrain_runtime.checkpoint_dir import check_directory
from pstrain_runtime.failure import ConfigurationError
from pstrain_runtime.local.cli import run_main
from pstrain_runtime.local.metrics import Metrics, fold
from pstrain_runtime.local.render import format_event
from pstrain_runtime.ps.store import ParameterStore
from pstrain_runtime.worker.client import LocalTransport
from pstrain_runtime.worker.context import WorkerRole
from pstrain_runtime.worker.trainer import Trainer

from .builders import digits_training, run_chief

pytestmark = pytest.mark.timeout(60)
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def one_thread() -> None:
    torch.set_num_threads(1)


# --------------------------------------------------------------------------- at start


def test_a_missing_directory_is_created(tmp_path: Path) -> None:
    assert check_directory(tmp_path / "a" / "b").is_dir()


@pytest.mark.parametrize(
    ("make", "expected"),
    [
        pytest.param(lambda d: _file(d / "f"), "is a file, not a directory", id="a-file"),
        pytest.param(lambda d: _file(d / "f") / "sub" / "dir", "'{d}/f' is a file",
                     id="under-a-file"),
        pytest.param(lambda d: Path("/proc/pstrain-ckpt"), "cannot be created: No such file",
                     id="proc-new"),
        pytest.param(lambda d: Path("/proc/1"), "is not writable", id="proc-existing"),
    ],
)
def test_an_unusable_directory_is_refused_in_one_line(tmp_path: Path, make, expected) -> None:
    path = make(tmp_path)
    with pytest.raises(ConfigurationError) as caught:
        check_directory(path)
    message = str(caught.value)
    assert message.startswith(f"checkpoint.directory {str(path)!r} ")
    assert expected.format(d=tmp_path) in message and "\n" not in message


def _file(path: Path) -> Path:
    path.write_text("not a directory")
    return path


def test_pstrain_run_refuses_the_directory_before_starting_anything(tmp_path, capsys) -> None:
    blocker = _file(tmp_path / "ckpt")
    code = run_main([str(ROOT / "examples" / "digits.yaml"), "--checkpoint-dir", str(blocker),
                     "--replica-command", "false"])
    err = capsys.readouterr().err
    assert code == 1
    assert err == (f"pstrain run: --checkpoint-dir {str(blocker)!r} is a file, not a "
                   "directory; point --checkpoint-dir at a directory (it is created when "
                   "missing)\n")


def test_the_chief_refuses_the_directory_before_it_initialises_anything(tmp_path) -> None:
    store = ParameterStore()
    training = digits_training(steps=5, checkpoint={"directory": str(_file(tmp_path / "f"))})
    chief = Trainer(training, WorkerRole("ns", 0, 1), [LocalTransport(store)])
    with pytest.raises(ConfigurationError, match="is a file, not a directory"):
        chief.run()
    chief.close()
    assert not store.info("ns").initialized


# --------------------------------------------------------------------------- mid-run, end


class FailingStore(CheckpointStore):
    """A checkpoint directory whose writes fail at the given steps (None: always)."""

    def __init__(self, directory: Path, fail_at: set[int] | None) -> None:
        super().__init__(directory)
        self.fail_at = fail_at

    def save(self, ckpt: Checkpoint, background: bool = False) -> Path:
        if self.fail_at is None or ckpt.global_step in self.fail_at:
            raise OSError(errno.ENOSPC, "No space left on device")
        return super().save(ckpt, background)


def chief_with(tmp_path: Path, fail_at: set[int] | None, emitted: list) -> Trainer:
    training = digits_training(steps=60, mode="sync",
                               checkpoint={"directory": str(tmp_path / "ckpt"),
                                           "intervalSteps": 20})
    chief = Trainer(training, WorkerRole("ns", 0, 1), [LocalTransport(ParameterStore())],
                    emit=lambda kind, **f: emitted.append((kind, f)))
    chief.ckpt_store = FailingStore(tmp_path / "ckpt", fail_at)
    return chief


def test_a_failed_write_mid_run_is_reported_and_retried(tmp_path, capsys) -> None:
    emitted: list = []
    run_chief(chief_with(tmp_path, {20}, emitted))
    assert [f["step"] for k, f in emitted if k == "checkpoint"] == [40, 60]
    out = capsys.readouterr().out
    assert ("the checkpoint of step 20 could not be written to "
            f"{tmp_path / 'ckpt'} (OSError: [Errno 28] No space left on device); training "
            "goes on and the next checkpoint tries again") in out
    assert [k for k, _ in emitted if k == "done"] == ["done"]


def test_a_failed_final_write_saves_the_parameters_elsewhere_then_fails(
        tmp_path, monkeypatch, capsys) -> None:
    """Issue 27.1: the fallback directory is a fresh private one (0700, an unpredictable
    name), never the predictable name another user may have made first."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    planted = tmp_path / "tmp" / "pstrain-fallback-ns"  # made first by someone else
    planted.mkdir(mode=0o777)
    if os.geteuid() == 0:
        os.chown(planted, 65534, 65534)  # nobody's
    emitted: list = []
    chief = chief_with(tmp_path, None, emitted)
    with pytest.raises(ConfigurationError) as caught:
        run_chief(chief)
    assert list(planted.iterdir()) == []
    made = [p for p in (tmp_path / "tmp").iterdir() if p != planted]
    assert len(made) == 1 and made[0].name.startswith("pstrain-fallback-ns-")
    assert len(made[0].name) > len("pstrain-fallback-ns-") + 6  # mkdtemp's random part
    assert stat.S_IMODE(made[0].stat().st_mode) == 0o700
    assert made[0].stat().st_uid == os.geteuid()
    saved = made[0] / "ckpt-000000000060.pt"
    assert stat.S_IMODE(saved.stat().st_mode) == 0o600
    assert f"were saved to {saved}" in capsys.readouterr().out
    assert str(caught.value) == (
        f"the final checkpoint (step 60) could not be written to {tmp_path / 'ckpt'} "
        f"(OSError: [Errno 28] No space left on device); the trained parameters were saved "
        f"to {saved} instead (point checkpoint.directory at its directory to continue "
        "from them)")
    ckpt = load_checkpoint(saved)
    assert ckpt.global_step == 60
    for name, value in chief.mirror.items():
        torch.testing.assert_close(ckpt.params[name], value)
    assert [k for k, _ in emitted if k == "done"] == []  # the job is not reported done


# --------------------------------------------------------------------------- what is restored


def model_tensors() -> dict[str, torch.Tensor]:
    return {"w": torch.zeros(4, 3), "b": torch.zeros(4)}


ADAM_SLOTS = ("exp_avg", "exp_avg_sq")


def ckpt_of(params: dict, slots: dict | None = None) -> Checkpoint:
    """An adam checkpoint; its slots are well-formed unless `slots` says otherwise."""
    good = {n: {s: torch.zeros_like(t) for s in ADAM_SLOTS}
            for n, t in model_tensors().items() if n in params}
    return Checkpoint(global_step=7, fingerprint="f", optimizer="adam", params=params,
                      slots=good if slots is None else slots)


@pytest.mark.parametrize(
    ("ckpt", "expected"),
    [
        pytest.param(ckpt_of({"w": torch.zeros(4, 4), "b": torch.zeros(4)}),
                     "parameter 'w' is [4, 4] float32 in the file, but the model's is [4, 3] "
                     "float32", id="wrong-shape"),
        pytest.param(ckpt_of({"w": torch.zeros(4, 3, dtype=torch.float64),
                              "b": torch.zeros(4)}),
                     "parameter 'w' is [4, 3] float64 in the file", id="wrong-dtype"),
        pytest.param(ckpt_of({"w": torch.zeros(4, 3)}), "parameters ['b'] are missing",
                     id="missing"),
        pytest.param(ckpt_of({**model_tensors(), "c": torch.zeros(1)}),
                     "parameters ['c'] are not in the model", id="extra"),
        pytest.param(ckpt_of(model_tensors(), {"w": {"exp_avg": torch.zeros(3, 4),
                                                     "exp_avg_sq": torch.zeros(4, 3)},
                                               "b": {s: torch.zeros(4) for s in ADAM_SLOTS}}),
                     "exp_avg slot of 'w' is [3, 4] float32", id="slot-shape"),
        pytest.param(ckpt_of(model_tensors(), {"w": {"exp_avg": torch.zeros(4, 3)}}),
                     "optimizer slots ['exp_avg_sq'] of 'w' are missing", id="slot-missing"),
        pytest.param(ckpt_of(model_tensors(), {"c": {"exp_avg": torch.zeros(1)}}),
                     "optimizer slots of 'c', which is not in the model", id="slot-extra"),
        pytest.param(ckpt_of({"w": [[0.0] * 3] * 4, "b": torch.zeros(4)}),
                     "parameter 'w' is a list, not a tensor", id="not-a-tensor"),
    ],
)
def test_tensors_that_do_not_fit_the_model_are_refused(ckpt, expected) -> None:
    with pytest.raises(CheckpointMismatch) as caught:
        ckpt.check_tensors(model_tensors(), "/ckpt/ckpt-000000000007.pt", ADAM_SLOTS)
    message = str(caught.value)
    assert message.startswith("/ckpt/ckpt-000000000007.pt does not fit this model: ")
    assert expected in message and message.endswith("nothing was restored")
    assert isinstance(caught.value, ConfigurationError)  # no restart can fix it


def test_tensors_that_fit_pass() -> None:
    ckpt_of(model_tensors()).check_tensors(model_tensors(), "x", ADAM_SLOTS)


def test_a_forged_checkpoint_is_refused_before_anything_is_installed(tmp_path) -> None:
    training = digits_training(steps=5, checkpoint={"directory": str(tmp_path)})
    store = ParameterStore()
    chief = Trainer(training, WorkerRole("ns", 0, 1), [LocalTransport(store)])
    params = {n: t.clone() for n, t in chief.mirror.items()}
    first = next(iter(params))
    params[first] = torch.zeros(params[first].shape[0] + 1, *params[first].shape[1:])
    forged = CheckpointStore(tmp_path).save(Checkpoint(
        global_step=3, fingerprint=chief.fingerprint, optimizer=chief.optimizer.name,
        params=params))
    with pytest.raises(CheckpointMismatch, match=f"^{forged} does not fit this model: "
                                                 f"parameter '{first}' is "):
        run_chief(chief)
    assert not store.info("ns").initialized


def test_a_checkpoint_past_the_target_step_is_reported(tmp_path, capsys) -> None:
    emitted: list = []
    training = digits_training(steps=5, checkpoint={"directory": str(tmp_path)})
    first = Trainer(training, WorkerRole("ns", 0, 1), [LocalTransport(ParameterStore())])
    path = CheckpointStore(tmp_path).save(Checkpoint(
        global_step=999_999, fingerprint=first.fingerprint, optimizer=first.optimizer.name,
        params={n: t.clone() for n, t in first.mirror.items()},
        slots={n: {"momentum_buffer": torch.zeros_like(t)} for n, t in first.mirror.items()}))
    first.close()
    chief = Trainer(training, WorkerRole("ns", 0, 1), [LocalTransport(ParameterStore())],
                    emit=lambda kind, **f: emitted.append((kind, f)))
    run_chief(chief)
    warning = (f"checkpoint {path} is at global step 999999, past this job's target of 5 "
               "steps (spec.training.steps): nothing is left to train, so the job ends with "
               "that checkpoint's parameters")
    [restored] = [f for k, f in emitted if k == "restored"]
    assert restored["warning"] == warning
    assert f"pstrain: warning: {warning}" in capsys.readouterr().out
    metrics = fold(Metrics(total_steps=5), "j-worker-0", {"event": "restored", **restored})
    assert format_event("j-worker-0", {"event": "restored", **restored}, metrics) == (
        f"j-worker-0: resumed from the checkpoint at step 999999 ({path}); {warning}")


# --------------------------------------------------------------------------- damaged files


def saved_by(chief: Trainer, directory: Path, step: int) -> Path:
    return CheckpointStore(directory).save(Checkpoint(
        global_step=step, fingerprint=chief.fingerprint, optimizer=chief.optimizer.name,
        params={n: t.clone() for n, t in chief.mirror.items()},
        slots={n: {"momentum_buffer": torch.zeros_like(t)} for n, t in chief.mirror.items()}))


def test_a_damaged_newest_checkpoint_falls_back_to_the_previous_and_says_which(
        tmp_path, capsys) -> None:
    """Issue 27.5: restore the previous intact checkpoint, named in the log and in the
    restored event."""
    training = digits_training(steps=5, checkpoint={"directory": str(tmp_path)})
    emitted: list = []
    chief = Trainer(training, WorkerRole("ns", 0, 1), [LocalTransport(ParameterStore())],
                    emit=lambda kind, **f: emitted.append((kind, f)))
    good = saved_by(chief, tmp_path, 3)
    damaged = saved_by(chief, tmp_path, 4)
    damaged.write_bytes(damaged.read_bytes()[:-100])  # truncated
    run_chief(chief)
    [restored] = [f for k, f in emitted if k == "restored"]
    assert (restored["step"], restored["path"]) == (3, str(good))
    assert restored["warning"] == ("1 newer checkpoint skipped as damaged; restored the "
                                   f"previous intact one, {good} (step 3)")
    out = capsys.readouterr().out
    assert f"pstrain: skipping checkpoint: checkpoint {damaged} is corrupt" in out


def test_only_damaged_checkpoints_fail_at_once_before_anything_is_installed(
        tmp_path) -> None:
    training = digits_training(steps=5, checkpoint={"directory": str(tmp_path)})
    store = ParameterStore()
    chief = Trainer(training, WorkerRole("ns", 0, 1), [LocalTransport(store)])
    CheckpointStore(tmp_path).path_for(4).write_bytes(b"not a checkpoint")
    with pytest.raises(ConfigurationError, match="^no usable checkpoint: checkpoint "):
        run_chief(chief)
    assert not store.info("ns").initialized
