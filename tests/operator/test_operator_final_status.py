"""A succeeded job's status.progress and status.lastCheckpoint are final: read from the
chief's summary (its termination message), else from PS 0 before the clean-up; and a
short job shows its step while it runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pstrain_api.model import Progress, TrainingJobStatus
from pstrain_operator.progress import (
    EARLY_PROGRESS_S, checkpoint_from_status, chief_summary, progress_from_status,
    progress_interval_for)
from pstrain_runtime.summary import final_summary, write_summary

from .fake_kube import FakeKube
from .op_builders import T0, make_job
from .test_operator_controller import FakeStatus, Recorder, make_reconciler

SUMMARY = final_summary(3000, 0.031, 8123.4, 0.97, (3000, "/ckpt/ckpt-3000.pt", 1.7e9))


def running_job(kube: FakeKube, status: FakeStatus):
    kube.add_job(make_job().body())
    op = make_reconciler(kube, Recorder(), status)
    op.reconcile("ns", "j")
    kube.set_pod("ns", "j-ps-0", "Running", ready=True)
    op.reconcile("ns", "j")
    for name in ("j-worker-0", "j-worker-1"):
        kube.set_pod("ns", name, "Running", ready=True)
    status.reply = {"global_step": 2783, "loss": 0.05, "checkpoint_step": 2500,
                    "checkpoint_path": "/ckpt/ckpt-2500.pt", "checkpoint_time": 1.6e9}
    op.reconcile("ns", "j")
    st = kube.jobs[("ns", "j")]["status"]
    assert (st["progress"]["globalStep"], st["lastCheckpoint"]["step"]) == (2783, 2500)
    return op


def test_the_chiefs_summary_is_the_final_status() -> None:
    kube, status = FakeKube(), FakeStatus()
    op = running_job(kube, status)
    status.reply = None  # PS 0 is already gone
    kube.set_pod("ns", "j-worker-0", "Succeeded", exit_code=0, message=json.dumps(SUMMARY))
    op.reconcile("ns", "j")
    st = kube.jobs[("ns", "j")]["status"]
    assert st["phase"] == "Succeeded"
    assert st["progress"]["globalStep"] == 3000 and st["progress"]["loss"] == 0.031
    assert st["lastCheckpoint"] == {"step": 3000, "path": "/ckpt/ckpt-3000.pt",
                                    "time": "2023-11-14T22:13:20Z"}
    succeeded = next(c for c in st["conditions"] if c["type"] == "Succeeded")
    assert succeeded["message"] == "the chief j-worker-0 completed at global step 3000"


def test_without_a_summary_ps0_is_read_once_more_before_clean_up() -> None:
    kube, status = FakeKube(), FakeStatus()
    op = running_job(kube, status)
    asked = len(status.asked)
    status.reply = {"global_step": 3000, "loss": 0.03, "checkpoint_step": 3000,
                    "checkpoint_path": "/ckpt/ckpt-3000.pt", "checkpoint_time": 1.7e9}
    kube.set_pod("ns", "j-worker-0", "Succeeded", exit_code=0)  # no termination message
    op.reconcile("ns", "j")
    st = kube.jobs[("ns", "j")]["status"]
    assert len(status.asked) == asked + 1  # the final read, not rate-limited
    assert (st["phase"], st["progress"]["globalStep"], st["lastCheckpoint"]["step"]) == (
        "Succeeded", 3000, 3000)
    assert "j-ps-0" not in kube.pod_names()  # cleaned up after the read


@pytest.mark.parametrize(("progress", "expected"), [
    pytest.param(None, EARLY_PROGRESS_S, id="no-progress-yet"),
    pytest.param(Progress(global_step=0), EARLY_PROGRESS_S, id="step-0"),
    pytest.param(Progress(global_step=5), 10.0, id="steps-known"),
])
def test_a_job_without_a_step_is_read_sooner(progress, expected) -> None:
    assert progress_interval_for(TrainingJobStatus(progress=progress), 10.0) == expected


def test_summary_round_trip_through_the_termination_message(tmp_path: Path) -> None:
    path = tmp_path / "termination-log"
    assert not write_summary(SUMMARY, {"PSTRAIN_TERMINATION_LOG": ""})  # nowhere
    assert write_summary(SUMMARY, {"PSTRAIN_TERMINATION_LOG": str(path)})
    reply = chief_summary(path.read_text())
    progress = progress_from_status(reply, T0)
    assert progress is not None and progress.global_step == 3000
    assert progress.samples_per_second == 8123.4 and progress.eval_accuracy == 0.97
    checkpoint = checkpoint_from_status(reply)
    assert checkpoint is not None and (checkpoint.step, checkpoint.path) == (
        3000, "/ckpt/ckpt-3000.pt")


@pytest.mark.parametrize("message", ["", "Error", "[1, 2]", '{"loss": 1}'])
def test_other_termination_messages_are_no_summary(message: str) -> None:
    assert chief_summary(message) is None
