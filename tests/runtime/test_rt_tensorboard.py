"""The chief's TensorBoard log (`worker.chief.tensorboard`): which scalars each event
becomes, the event files read back with TensorBoard's own reader, a restore that purges
what came after it, a temporary checkpoint directory that keeps its event files, and
one real `pstrain run` whose chief (and only the chief) leaves loss and accuracy curves
that the summary names."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

pytest.importorskip("torch")
pytest.importorskip("tensorboard")

from tensorboard.backend.event_processing.event_accumulator import (  # noqa: E402
    EventAccumulator)

from pstrain_runtime.worker.chief.tensorboard import (  # noqa: E402
    TensorBoardLog, build_scalars, has_event_files, remove_checkpoints, tee,
    tensorboard_dir)

ROOT = Path(__file__).resolve().parents[2]
STARTED = re.compile(r"^pstrain: started (\S+) \(pid (\d+)")
# events.out.tfevents.<time>.<host>.<pid>.<n>: the writer's process is in the name
EVENT_FILE_PID = re.compile(r"^events\.out\.tfevents\.\d+\..+\.(\d+)\.\d+$")


def read_scalars(directory: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar series under `directory`, as TensorBoard loads it: tag -> [(step,
    value)] (rounded to float32's precision, as it is stored)."""
    acc = EventAccumulator(str(directory))
    acc.Reload()
    return {tag: [(e.step, round(e.value, 4)) for e in acc.Scalars(tag)]
            for tag in acc.Tags()["scalars"]}


@pytest.mark.parametrize("kind,fields,expected", [
    pytest.param("progress", {"step": 10, "loss": 2.25, "samples_per_sec": 1500.0,
                              "staleness": 0.5},
                 {"train/samples_per_sec": 1500.0, "train/staleness": 0.5},
                 id="progress-the-curve-has-its-own-events"),
    pytest.param("loss", {"step": 10, "loss": 2.25}, {"train/loss": 2.25},
                 id="loss-curve-point"),
    pytest.param("progress", {"step": 10, "loss": 1.0, "samples_per_sec": 9.0,
                              "staleness": 0.0, "sparse_rows": 120, "sparse_bytes": 4096,
                              "sparse_tables": {"user": {"rows": 120, "bytes": 4096}}},
                 {"train/samples_per_sec": 9.0, "train/staleness": 0.0,
                  "sparse/rows": 120.0, "sparse/bytes": 4096.0}, id="progress-sparse"),
    pytest.param("eval", {"step": 300, "accuracy": 0.95, "loss": 0.14},
                 {"eval/accuracy": 0.95, "eval/loss": 0.14}, id="eval-classifier"),
    pytest.param("eval", {"step": 300, "auc": 0.8, "logloss": 0.45, "note": "x",
                          "ok": True},
                 {"eval/auc": 0.8, "eval/logloss": 0.45}, id="eval-ctr-skips-non-numbers"),
    pytest.param("checkpoint", {"step": 100, "path": "/c/ckpt-100.pt"}, {},
                 id="checkpoint-none"),
    pytest.param("done", {"step": 900, "loss": 0.03, "accuracy": 0.97}, {},
                 id="done-none-the-final-eval-has-them"),
    pytest.param("restored", {"step": 200, "path": "/c", "lost_steps": 0}, {},
                 id="restored-none"),
])
def test_build_scalars(kind: str, fields: dict[str, Any], expected: dict[str, float]) -> None:
    assert build_scalars(kind, fields) == expected


def feed(log: TensorBoardLog, *events: tuple[str, dict[str, Any]]) -> None:
    for kind, fields in events:
        log(kind, **fields)
    log.close()


def test_events_become_scalars_tensorboard_reads(tmp_path: Path) -> None:
    directory = tensorboard_dir(tmp_path)
    feed(TensorBoardLog(directory),
         ("loss", {"step": 1, "loss": 2.3}),
         ("progress", {"step": 1, "loss": 2.3, "samples_per_sec": 100.0, "staleness": 0.0}),
         ("checkpoint", {"step": 100, "path": "x"}),
         ("loss", {"step": 150, "loss": 0.5}),
         ("progress", {"step": 150, "loss": 0.5, "samples_per_sec": 2000.0,
                       "staleness": 1.5}),
         ("eval", {"step": 150, "accuracy": 0.9, "loss": 0.25}),
         ("eval", {"step": 300, "accuracy": 0.95, "loss": 0.125}),
         ("done", {"step": 300, "loss": 0.1, "accuracy": 0.95}))
    assert directory == tmp_path / "tensorboard"
    assert has_event_files(directory)
    assert read_scalars(directory) == {
        "train/loss": [(1, 2.3), (150, 0.5)],
        "train/samples_per_sec": [(1, 100.0), (150, 2000.0)],
        "train/staleness": [(1, 0.0), (150, 1.5)],
        "eval/accuracy": [(150, 0.9), (300, 0.95)],
        "eval/loss": [(150, 0.25), (300, 0.125)],
    }


def test_a_restore_purges_the_steps_after_it(tmp_path: Path) -> None:
    """A chief that went back to the checkpoint at step 200 (a new process, like a
    restarted chief) continues the curve from there, without the steps it lost."""
    first = TensorBoardLog(tmp_path)
    feed(first, *[("loss", {"step": s, "loss": 1.0 / s}) for s in (1, 100, 200, 300)])
    feed(TensorBoardLog(tmp_path),
         ("restored", {"step": 200, "path": "ckpt-200.pt", "lost_steps": 100}),
         ("loss", {"step": 250, "loss": 0.5}))
    assert read_scalars(tmp_path)["train/loss"] == [(1, 1.0), (100, 0.01), (250, 0.5)]


class FailingWriter:
    def add_scalar(self, tag: str, scalar_value: float, global_step: int) -> None:
        raise OSError("No space left on device")

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


def test_a_log_that_cannot_be_written_is_reported_once_and_training_goes_on(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log = TensorBoardLog(tmp_path, writer_factory=lambda _d, _p: FailingWriter())
    log("loss", step=1, loss=1.0)
    log("loss", step=2, loss=0.9)
    err = capsys.readouterr().err
    assert err.count("TensorBoard log") == 1
    assert f"TensorBoard log in {tmp_path} stopped: No space left on device" in err


def test_tee_calls_each_emitter_in_order() -> None:
    seen: list[tuple[str, str, dict[str, Any]]] = []
    emit = tee(lambda kind, **f: seen.append(("a", kind, f)),
               lambda kind, **f: seen.append(("b", kind, f)))
    emit("eval", step=3, accuracy=0.5)
    assert seen == [("a", "eval", {"step": 3, "accuracy": 0.5}),
                    ("b", "eval", {"step": 3, "accuracy": 0.5})]


def test_removing_temporary_checkpoints_keeps_the_event_files(tmp_path: Path) -> None:
    root = tmp_path / "pstrain-j-ckpt-1"
    (root / "sparse-000000000100").mkdir(parents=True)
    (root / "ckpt-000000000100.pt").write_bytes(b"x")
    feed(TensorBoardLog(tensorboard_dir(root)), ("loss", {"step": 1, "loss": 1.0}))
    remove_checkpoints(root)
    assert [p.name for p in root.iterdir()] == ["tensorboard"]
    assert has_event_files(root / "tensorboard")


def test_removing_temporary_checkpoints_without_event_files_removes_all(
        tmp_path: Path) -> None:
    root = tmp_path / "pstrain-j-ckpt-2"
    (root / "tensorboard").mkdir(parents=True)  # a chief that never wrote a scalar
    (root / "ckpt-000000000100.pt").write_bytes(b"x")
    remove_checkpoints(root)
    assert not root.exists()


@pytest.mark.timeout(300)
def test_pstrain_run_leaves_the_chiefs_curves_and_names_them(tmp_path: Path) -> None:
    """A short real digits run with a temporary checkpoint directory: the checkpoints go,
    the chief's event files stay (loss and accuracy), no other replica wrote any, and
    the summary says how to open them."""
    job = yaml.safe_load((ROOT / "examples" / "digits.yaml").read_text())
    # Sync mode: every step is the chief's too. In async mode the other worker, which
    # starts before the chief, could take the whole job (120 digits steps take under a
    # second) and leave the chief's curve with a point or two.
    job["spec"]["training"].update(steps=120, evalIntervalSteps=60, mode="sync")
    job["metadata"]["name"] = "digits-tb"
    manifest = tmp_path / "digits-tb.yaml"
    manifest.write_text(yaml.safe_dump(job))
    proc = subprocess.run([sys.executable, "-m", "pstrain_api.cli", "run", str(manifest),
                           "--json"], capture_output=True, text=True, cwd=ROOT,
                          timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = json.loads(proc.stdout)
    events_dir = Path(summary["tensorboard_dir"])
    try:
        assert events_dir.parent == Path(summary["checkpoint_dir_removed"])
        assert f"tensorboard --logdir {events_dir}" in proc.stderr
        assert [p.name for p in events_dir.parent.iterdir()] == ["tensorboard"]
        pids = {m.group(1): int(m.group(2)) for m in map(STARTED.match,
                                                         proc.stderr.splitlines()) if m}
        writers = {int(EVENT_FILE_PID.match(p.name).group(1))  # type: ignore[union-attr]
                   for p in events_dir.iterdir()}
        assert writers == {pids["digits-tb-worker-0"]}, "only the chief writes"
        scalars = read_scalars(events_dir)
        assert {"train/loss", "train/samples_per_sec", "train/staleness", "eval/accuracy",
                "eval/loss"} <= set(scalars)
        # every 60 steps: at 60 and at the end
        assert [step for step, _ in scalars["eval/accuracy"]] == [60, 120]
        assert len(scalars["train/loss"]) >= 10  # the curve: a point every step here
        assert scalars["eval/accuracy"][-1][1] == pytest.approx(summary["accuracy"],
                                                                abs=1e-4)
    finally:
        shutil.rmtree(events_dir.parent, ignore_errors=True)
