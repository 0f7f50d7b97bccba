"""Table tests of event folding, the --json summary and the text the user sees."""

from __future__ import annotations

import io
import json

import pytest

from .local_builders import make_job, play, state_of
from pstrain_api.events import format_event, parse_event
from pstrain_runtime.local.metrics import Metrics, Restore, build_summary, fold
from pstrain_runtime.local.render import (PlainReporter, RichReporter,
                                          format_event as format_event_line,
                                          format_notice, format_progress,
                                          format_replica_line, format_result)
from pstrain_runtime.local.supervisor import Begin, Exited, Healthy


def ev(kind: str, **fields):
    """An event exactly as a replica prints it and the runner parses it."""
    return parse_event(format_event(kind, **fields))


M0 = Metrics(total_steps=600)


@pytest.mark.parametrize(
    ("events", "expected"),
    [
        pytest.param([ev("progress", step=10, loss=2.0, samples_per_sec=900.0)],
                     Metrics(600, step=10, loss=2.0, samples_per_sec=900.0), id="progress"),
        pytest.param([ev("progress", step=10, loss=2.0, samples_per_sec=900.0),
                      ev("eval", step=10, accuracy=0.5, loss=1.5)],
                     Metrics(600, step=10, loss=2.0, samples_per_sec=900.0, accuracy=0.5,
                             eval_loss=1.5), id="eval-keeps-training-loss"),
        pytest.param([ev("eval", step=10, auc=0.8, logloss=0.45, loss=0.45)],
                     Metrics(600, step=10, eval_loss=0.45, auc=0.8, logloss=0.45),
                     id="eval-auc"),
        pytest.param([ev("checkpoint", step=100, path="/c/100")],
                     Metrics(600, step=100, checkpoint_step=100, checkpoint_path="/c/100"),
                     id="checkpoint"),
        pytest.param([ev("progress", step=1, loss=2.3, samples_per_sec=5.0),
                      ev("eval", step=301, accuracy=0.95, loss=0.2),
                      ev("checkpoint", step=400, path="/c/400")],
                     Metrics(600, step=400, loss=2.3, samples_per_sec=5.0, accuracy=0.95,
                             eval_loss=0.2, checkpoint_step=400, checkpoint_path="/c/400"),
                     id="evals-and-checkpoints-advance-a-stale-progress-step"),
        pytest.param([ev("progress", step=1, loss=2.3, samples_per_sec=5.0),
                      ev("loss", step=40, loss=0.7)],
                     Metrics(600, step=40, loss=0.7, samples_per_sec=5.0),
                     id="a-loss-curve-point-is-the-latest-loss"),
        pytest.param([ev("progress", step=130, loss=1.0, samples_per_sec=5.0),
                      ev("restored", step=100, path="/c/100", lost_steps=30, servers=[1])],
                     Metrics(600, step=100, loss=1.0, samples_per_sec=5.0,
                             restores=(Restore("r", 100, 30, "/c/100", (1,)),)),
                     id="restore-rewinds-step-and-counts-lost"),
        pytest.param([ev("done", step=600, loss=0.1, accuracy=0.97, samples_per_sec=1e4,
                         wall_seconds=12.5)],
                     Metrics(600, step=600, loss=0.1, accuracy=0.97, samples_per_sec=1e4,
                             done=True, train_seconds=12.5), id="done"),
        pytest.param([ev("progress", step="x", loss=None, samples_per_sec=True)],
                     Metrics(600), id="malformed-fields-ignored"),
        pytest.param([ev("ready", role="ps", index=0, address="127.0.0.1:1")], M0,
                     id="ready-changes-nothing"),
    ],
)
def test_fold(events, expected):
    metrics = M0
    for event in events:
        metrics = fold(metrics, "r", event)
    assert metrics == expected


def test_lost_steps_add_up_over_restores():
    metrics = M0
    for step, lost in ((100, 30), (200, 7)):
        metrics = fold(metrics, "j-worker-0", ev("restored", step=step, lost_steps=lost))
    assert metrics.lost_steps == 37


def test_summary_has_the_contract_fields():
    job = make_job("j").model()
    state, _ = play(state_of(job), [Begin(0.0), Healthy("j-ps-0", 1, 0.1),
                                    Exited("j-worker-1", 1, 137, 1.0),
                                    Exited("j-worker-0", 1, 0, 2.0),
                                    Exited("j-ps-0", 1, 0, 2.1)])
    metrics = fold(M0, "j-worker-0", ev("restored", step=100, lost_steps=4))
    metrics = fold(metrics, "j-worker-0", ev("done", step=600, loss=0.2, accuracy=0.96,
                                             samples_per_sec=2000.0, wall_seconds=9.0))
    summary = build_summary(state, metrics, 10.0, "j", "/ckpt")
    json.dumps(summary)  # must be serialisable as one line
    assert {k: summary[k] for k in ("phase", "steps", "loss", "accuracy", "wall_seconds",
                                    "samples_per_sec", "restarts", "lost_steps")} == {
        "phase": "Succeeded", "steps": 600, "loss": 0.2, "accuracy": 0.96,
        "wall_seconds": 10.0, "samples_per_sec": 2000.0, "restarts": 1, "lost_steps": 4}
    assert summary["replicas"] == {
        "j-ps-0": {"role": "ps", "index": 0, "exit_code": 0, "restarts": 0},
        "j-worker-1": {"role": "worker", "index": 1, "exit_code": 137, "restarts": 0},
        "j-worker-0": {"role": "worker", "index": 0, "exit_code": 0, "restarts": 0},
    }


def test_summary_carries_auc_and_logloss():
    state, _ = play(state_of(make_job("j").model()), [Begin(0.0)])
    metrics = fold(M0, "j-worker-0", ev("eval", step=600, auc=0.85, logloss=0.47, loss=0.47))
    summary = build_summary(state, metrics, 1.0, "j", None)
    assert (summary["auc"], summary["logloss"], summary["accuracy"]) == (0.85, 0.47, None)
    assert "auc 0.8500" in format_result(summary)[0]


@pytest.mark.parametrize(
    ("replica", "event", "expected"),
    [
        pytest.param("j-worker-0", ev("eval", step=300, auc=0.8512, logloss=0.5, loss=0.5),
                     "j-worker-0: eval at step 300: auc 0.8512, loss 0.5000", id="eval-auc"),
        pytest.param("j-worker-0", ev("eval", step=300, accuracy=0.97, loss=0.1),
                     "j-worker-0: eval at step 300: accuracy 0.9700, loss 0.1000",
                     id="eval-accuracy"),
        pytest.param("j-worker-0", ev("restored", step=200, lost_steps=13, servers=[0]),
                     "j-worker-0: restored ps shard 0 from step 200; 13 steps lost",
                     id="ps-restore"),
        pytest.param("j-worker-0", ev("restored", step=200, lost_steps=0, servers=[0, 2]),
                     "j-worker-0: restored ps shards 0, 2 from step 200; 0 steps lost",
                     id="two-ps-restore"),
        pytest.param("j-worker-0", ev("restored", step=100, lost_steps=1),
                     "j-worker-0: restored checkpoint from step 100; 1 step lost",
                     id="chief-restore"),
        pytest.param("j-worker-0", ev("checkpoint", step=100, path="/c"),
                     "j-worker-0: checkpoint at step 100 -> /c", id="checkpoint"),
        pytest.param("j-worker-0", ev("progress", step=1, loss=1.0), None, id="progress"),
    ],
)
def test_event_lines(replica, event, expected):
    assert format_event_line(replica, event, fold(M0, replica, event)) == expected


def test_progress_and_prefix_formats():
    assert format_progress(Metrics(600, step=12, loss=0.5, samples_per_sec=1234.4)) == (
        "step 12/600  loss 0.5000  1234 samples/s")
    assert format_progress(M0) == "step 0/600  loss -  - samples/s"
    assert format_progress(Metrics(600, step=12, auc=0.81234)) == (
        "step 12/600  loss -  - samples/s  auc 0.8123")
    assert format_replica_line("j-ps-0", "hello", width=10) == "[j-ps-0]     hello"
    assert format_notice("warning", "x") == "pstrain: warning: x"


@pytest.mark.parametrize("quiet", [False, True], ids=["plain", "quiet"])
def test_plain_reporter(quiet):
    out = io.StringIO()
    rep = PlainReporter(out, ["j-ps-0", "j-worker-0"], quiet=quiet)
    rep.replica_line("j-ps-0", "serving")
    rep.event("j-worker-0", ev("progress", step=5, loss=1.0), fold(
        M0, "j-worker-0", ev("progress", step=5, loss=1.0)))
    restored = ev("restored", step=3, lost_steps=2, servers=[0])
    rep.event("j-worker-0", restored, fold(M0, "j-worker-0", restored))
    rep.notice("error", "boom", ["tb line"])
    lines = out.getvalue().splitlines()
    noisy = ["[j-ps-0]     serving", "pstrain: step 5/600  loss 1.0000  - samples/s"]
    assert lines == [*([] if quiet else noisy),
                     "pstrain: warning: j-worker-0: restored ps shard 0 from step 3; 2 steps lost",
                     "pstrain: error: boom", "    tb line"]


def test_result_lines_explain_failure():
    summary = {"job": "j", "phase": "Failed", "reason": "BackoffLimitExceeded",
               "wall_seconds": 3.25, "steps": 7, "total_steps": 100, "loss": None,
               "accuracy": None, "samples_per_sec": None, "restarts": 3, "lost_steps": 0,
               "message": "j-ps-0 failed (exit code 2) after 3 restarts; backoffLimit is 3."}
    assert format_result(summary) == [
        "job j Failed (BackoffLimitExceeded) after 3.2s: 7/100 steps, loss -, accuracy -, "
        "- samples/s",
        "restarts: 3, steps lost to restores: 0",
        "j-ps-0 failed (exit code 2) after 3 restarts; backoffLimit is 3.",
    ]


def test_rich_reporter_prints_prefixed_lines_and_notices():
    out = io.StringIO()
    rep = RichReporter(out, ["j-ps-0", "j-worker-0"], total_steps=600, job_name="j")
    rep.replica_line("j-ps-0", "[not markup] serving")
    progress = ev("progress", step=5, loss=1.0, samples_per_sec=10.0)
    rep.event("j-worker-0", progress, fold(M0, "j-worker-0", progress))
    restored = ev("restored", step=3, lost_steps=2, servers=[0])
    rep.event("j-worker-0", restored, fold(M0, "j-worker-0", restored))
    rep.notice("error", "boom", ["tb line"])
    evaluated = ev("eval", step=5, auc=0.8123, logloss=0.5)
    rep.event("j-worker-0", evaluated, fold(M0, "j-worker-0", evaluated))
    rep.close()
    text = out.getvalue()
    for expected in ("[j-ps-0]     [not markup] serving", "auc 0.8123",
                     "pstrain: warning: j-worker-0: restored ps shard 0 from step 3; 2 steps "
                     "lost", "pstrain: error: boom", "    tb line"):
        assert expected in text


def test_sparse_table_sizes_from_progress_reach_the_line_and_the_summary():
    metrics = fold(M0, "j-worker-0", ev("progress", step=5, loss=1.0, sparse_rows=1500,
                                        sparse_bytes=3 * 2**20,
                                        sparse_tables={"t": {"rows": 1500,
                                                             "bytes": 3 * 2**20}}))
    assert format_progress(metrics).endswith("  1500 table rows (3.0 MiB on the ps)")
    metrics = fold(metrics, "j-worker-0", ev("eval", step=5, accuracy=0.5))
    assert (metrics.sparse_rows, metrics.sparse_bytes) == (1500, 3 * 2**20)
    job = make_job("j").model()
    state, _ = play(state_of(job), [Begin(0.0)])
    summary = build_summary(state, metrics, 1.0, "j", None)
    assert (summary["sparse_rows"], summary["sparse_bytes"]) == (1500, 3 * 2**20)


def test_rich_progress_bar_follows_start_up_until_the_first_step():
    rep = RichReporter(io.StringIO(), ["j-ps-0", "j-worker-0"], total_steps=600,
                       job_name="j")
    stages = [rep.stage]
    rep.notice("info", "starting 1 parameter server(s): j-ps-0")
    stages.append(rep.stage)
    ready = ev("ready", address="127.0.0.1:4000")
    rep.event("j-ps-0", ready, fold(M0, "j-ps-0", ready))
    stages.append(rep.stage)
    rep.notice("info", "1 parameter server(s) serving; starting 0 worker(s), then the chief "
                       "j-worker-0")
    stages.append(rep.stage)
    first = ev("progress", step=1, loss=2.3, samples_per_sec=50.0)
    rep.event("j-worker-0", first, fold(M0, "j-worker-0", first))
    stages.append(rep.stage)
    rep.notice("info", "a notice during training")
    stages.append(rep.stage)
    rep.close()
    assert stages == ["starting", "starting 1 parameter server(s): j-ps-0",
                      "j-ps-0: serving on 127.0.0.1:4000",
                      "1 parameter server(s) serving; starting 0 wor...",
                      "training", "training"]


# --------------------------------------------------------------------------- honest endings

ENDED = {"job": "j", "wall_seconds": 5.06, "total_steps": 400, "loss": 0.5,
         "accuracy": None, "samples_per_sec": 900.0, "restarts": 0, "lost_steps": 0,
         "checkpoint_dir": "/ckpt", "last_checkpoint_step": None}


@pytest.mark.parametrize(("summary", "expected"), [
    pytest.param(
        {**ENDED, "phase": "Failed", "reason": "Interrupted", "steps": 37,
         "message": "interrupted by SIGINT; stopped every replica.", "stopped_by": "SIGINT",
         "last_checkpoint_step": 30, "resume": "pstrain run job.yaml --checkpoint-dir /ckpt"},
        ["job j stopped by you (Ctrl-C) at step 37 of 400 after 5.1s: loss 0.5000, "
         "accuracy -, 900 samples/s",
         "restarts: 0, steps lost to restores: 0",
         "last checkpoint: step 30, in /ckpt",
         "resume with: pstrain run job.yaml --checkpoint-dir /ckpt"],
        id="ctrl-c-after-a-checkpoint"),
    pytest.param(
        {**ENDED, "phase": "Failed", "reason": "Interrupted", "steps": 3, "message": "x",
         "stopped_by": "SIGTERM", "checkpoint_dir": None,
         "checkpoint_dir_removed": "/tmp/pstrain-j-ckpt-1"},
        ["job j stopped by SIGTERM at step 3 of 400 after 5.1s: loss 0.5000, accuracy -, "
         "900 samples/s",
         "restarts: 0, steps lost to restores: 0",
         "no checkpoint was written before it stopped: a new run starts from step 0",
         "checkpoints: the temporary directory /tmp/pstrain-j-ckpt-1 was removed; pass "
         "--checkpoint-dir DIR to keep them"],
        id="sigterm-before-a-checkpoint"),
    pytest.param(
        {**ENDED, "phase": "Succeeded", "reason": "ChiefSucceeded", "steps": None,
         "total_steps": None, "loss": None, "message": "done"},
        ["job j Succeeded (ChiefSucceeded) after 5.1s; pstrain does not count the steps of "
         "this job's own program (it prints no PSTRAIN_EVENT lines)",
         "restarts: 0, steps lost to restores: 0"],
        id="tf-config-program"),
    pytest.param(
        {**ENDED, "phase": "Succeeded", "reason": "ChiefSucceeded", "steps": 400,
         "message": "done", "checkpoint_dir": None, "last_checkpoint_step": 400,
         "checkpoint_dir_removed": "/tmp/pstrain-j-ckpt-2"},
        ["job j Succeeded (ChiefSucceeded) after 5.1s: 400/400 steps, loss 0.5000, "
         "accuracy -, 900 samples/s",
         "restarts: 0, steps lost to restores: 0",
         "checkpoints: the temporary directory /tmp/pstrain-j-ckpt-2 was removed; pass "
         "--checkpoint-dir DIR to keep them"],
        id="temporary-directory-removed"),
])
def test_result_lines_say_what_happened(summary, expected):
    assert format_result(summary) == expected


def test_summary_never_names_a_removed_directory_nor_uncounted_steps():
    job = make_job("j").model()
    state, _ = play(state_of(job), [Begin(0.0)])
    summary = build_summary(state, Metrics(total_steps=100), 1.0, "j", "/tmp/x",
                            checkpoint_removed=True, counts_steps=False)
    assert (summary["checkpoint_dir"], summary["checkpoint_dir_removed"]) == (None, "/tmp/x")
    assert (summary["steps"], summary["total_steps"]) == (None, None)
    assert "resume" not in summary and "stopped_by" not in summary
    kept = build_summary(state, Metrics(total_steps=100), 1.0, "j", "/ckpt",
                         resume="pstrain run j.yaml", stopped_by="SIGINT")
    assert (kept["checkpoint_dir"], kept["resume"], kept["stopped_by"]) == (
        "/ckpt", "pstrain run j.yaml", "SIGINT")
    assert "checkpoint_dir_removed" not in kept


@pytest.mark.parametrize(("event", "expected"), [
    pytest.param(ev("restored", step=300, lost_steps=0, path="/c/ckpt-300.pt"),
                 "pstrain: j-worker-0: resumed from the checkpoint at step 300 "
                 "(/c/ckpt-300.pt)", id="a-resume-is-news"),
    pytest.param(ev("restored", step=300, lost_steps=0, path="/c/ckpt-300.pt",
                    warning="1 newer checkpoint skipped as damaged"),
                 "pstrain: warning: j-worker-0: resumed from the checkpoint at step 300 "
                 "(/c/ckpt-300.pt); 1 newer checkpoint skipped as damaged",
                 id="a-resume-past-damage-is-a-warning"),
    pytest.param(ev("restored", step=150, lost_steps=50, path="/c/ckpt-150.pt",
                    servers=[0]),
                 "pstrain: warning: j-worker-0: restored ps shard 0 from step 150; 50 steps "
                 "lost", id="a-recovery-is-a-warning"),
])
def test_restore_lines(event, expected):
    out = io.StringIO()
    PlainReporter(out, ["j-worker-0"]).event("j-worker-0", event,
                                             fold(M0, "j-worker-0", event))
    assert out.getvalue().splitlines() == [expected]
