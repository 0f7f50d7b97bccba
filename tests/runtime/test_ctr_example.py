"""The CTR example (pstrain_runtime.examples.ctr): its generated data, its metrics, and
that training it through pstrain's trainer, with the embedding tables on the parameter
servers, learns what a single-process PyTorch model learns and clearly more than a
model of the dense features alone."""

from __future__ import annotations

import pytest
import torch

from pstrain_runtime.examples import ctr
from pstrain_runtime.ps.store import ParameterStore
from pstrain_runtime.worker.client import LocalTransport

from .builders import Events, digits_training
from .test_rt_trainer import run_job

pytestmark = pytest.mark.timeout(120)

ROWS = 20_000
BATCH = 256
STEPS = 120
ADAGRAD = {"name": "adagrad", "learningRate": 0.05}


@pytest.fixture(autouse=True)
def one_thread() -> None:
    torch.set_num_threads(1)


def ctr_training(steps: int = STEPS, **args):
    return digits_training(entrypoint="pstrain_runtime.examples.ctr:make_task",
                           args={"rows": ROWS, **args}, steps=steps, batchSize=BATCH,
                           mode="sync", optimizer=ADAGRAD, evalIntervalSteps=steps // 2)


def test_batches_are_deterministic_per_worker_and_seed():
    task = ctr.make_task(rows=ROWS, tables="none")
    first = [next(task.batches(w, 2, 8, s)) for w, s in ((0, 0), (0, 0), (1, 0), (0, 1))]
    assert torch.equal(first[0][0], first[1][0]) and torch.equal(first[0][1], first[1][1])
    assert not torch.equal(first[0][0], first[2][0]), "workers draw different samples"
    assert not torch.equal(first[0][0], first[3][0]), "seeds draw different samples"


def test_ids_are_in_range_and_zipf_skewed_and_labels_are_mixed():
    x, y = ctr.sample(torch.Generator().manual_seed(0), 20_000, ROWS, 1.2, ctr.Teacher(7))
    ids = x[:, ctr.NUM_DENSE:].to(torch.int64)
    assert x.shape == (20_000, ctr.NUM_DENSE + ctr.NUM_SPARSE)
    assert int(ids.min()) >= 0 and int(ids.max()) < ROWS
    assert torch.equal(ids.to(torch.float64), x[:, ctr.NUM_DENSE:]), "ids are exact"
    counts = torch.bincount(ids[:, 0], minlength=ROWS).sort(descending=True).values
    top = int(counts[: ROWS // 100].sum()) / 20_000
    assert top > 0.6, f"the top 1% of ids carry {top:.0%} of the lookups; Zipf 1.2 gives ~70%"
    hot = int(torch.bincount(ids[:, 0]).argmax())
    assert hot != 0, "ranks are scrambled: the hottest id is not id 0"
    assert 0.2 < float(y.mean()) < 0.5


def test_zipf_ranks_follow_the_power_law():
    ranks = ctr.zipf_ids(torch.Generator().manual_seed(1), (200_000,), 1_000_000, 1.2)
    c = torch.bincount(ranks, minlength=8).to(torch.float64)
    # P(rank 0) / P(rank 1) = (1^-0.2 - 2^-0.2) / (2^-0.2 - 3^-0.2) for the continuous law
    expected = (1 - 2**-0.2) / (2**-0.2 - 3**-0.2)
    assert abs(float(c[0] / c[1]) - expected) < 0.15 * expected


def _zipf_ids_before_uniform(gen: torch.Generator, shape: tuple[int, ...], rows: int,
                             exponent: float) -> torch.Tensor:
    """`zipf_ids` as it was before `zipf=0` (uniform ids) existed, kept verbatim."""
    import math

    u = torch.rand(shape, generator=gen, dtype=torch.float64)
    if abs(exponent - 1.0) < 1e-9:
        x = torch.exp(u * math.log(rows + 1.0))
    else:
        a = 1.0 - exponent
        x = (1.0 + u * ((rows + 1.0) ** a - 1.0)) ** (1.0 / a)
    return (x.floor().to(torch.int64) - 1).clamp_(0, rows - 1)


@pytest.mark.parametrize("exponent", [0.5, 1.0, 1.2, 2.0])
def test_zipf_ids_are_unchanged_by_the_uniform_option(exponent):
    got = ctr.zipf_ids(torch.Generator().manual_seed(3), (4000, 26), ROWS, exponent)
    want = _zipf_ids_before_uniform(torch.Generator().manual_seed(3), (4000, 26), ROWS,
                                    exponent)
    assert torch.equal(got, want)


def test_batches_with_the_default_zipf_are_unchanged():
    """The default task's batches are the composition they always were: dense, then the
    scrambled Zipf 1.2 ranks, then the teacher's clicks, from one generator."""
    x, y = next(ctr.make_task(rows=ROWS, tables="none").batches(1, 2, 64, 3))
    gen = torch.Generator().manual_seed(3 * 100_003 + 1 + 1)
    dense = torch.randn(64, ctr.NUM_DENSE, generator=gen, dtype=torch.float64)
    ids = ctr.scramble(_zipf_ids_before_uniform(gen, (64, ctr.NUM_SPARSE), ROWS, 1.2), ROWS)
    p = torch.sigmoid(ctr.Teacher(7).logits(dense, ids))
    clicks = (torch.rand(64, generator=gen, dtype=torch.float64) < p).to(torch.float32)
    assert torch.equal(x, torch.cat([dense, ids.to(torch.float64)], 1))
    assert torch.equal(y, clicks)


def test_uniform_ids_cover_the_id_space_evenly():
    rows = 1000
    task = ctr.make_task(rows=rows, zipf=0, tables="none")
    x, y = next(task.batches(0, 1, 20_000, 0))
    ids = x[:, ctr.NUM_DENSE:].to(torch.int64)
    assert int(ids.min()) >= 0 and int(ids.max()) < rows
    counts = torch.bincount(ids.reshape(-1), minlength=rows).to(torch.float64)
    mean = ids.numel() / rows  # 520 lookups per id; sd about 23
    assert bool((counts > 0.8 * mean).all()) and bool((counts < 1.2 * mean).all()), (
        float(counts.min()), float(counts.max()), mean)
    top = float(counts.sort(descending=True).values[: rows // 100].sum()) / ids.numel()
    assert top < 0.015, f"the top 1% of ids carry {top:.1%}; uniform ids give ~1%"
    per_table = [int(torch.unique(ids[:, t]).numel()) for t in range(ctr.NUM_SPARSE)]
    assert min(per_table) == rows, "20,000 draws per table reach every one of 1,000 ids"
    assert 0.2 < float(y.mean()) < 0.5


def test_auc_and_logloss_of_known_scores():
    labels = torch.tensor([0.0, 0.0, 1.0, 1.0])
    perfect = ctr.auc_logloss(torch.tensor([-3.0, -1.0, 1.0, 3.0]), labels)
    assert perfect["auc"] == 1.0
    half = ctr.auc_logloss(torch.zeros(4), labels)
    assert half == pytest.approx({"auc": 0.5, "logloss": 0.6931471805599453})


def test_bad_arguments_are_refused_with_the_value():
    with pytest.raises(ValueError, match="rows is 0"):
        ctr.make_task(rows=0)
    with pytest.raises(ValueError, match=r"zipf -1.0; .* at least 0 \(0: uniform ids\)"):
        ctr.make_task(zipf=-1.0)
    with pytest.raises(ValueError, match="zipf nan"):
        ctr.make_task(zipf=float("nan"))
    with pytest.raises(ValueError, match="tables is 'hashed'"):
        ctr.make_task(tables="hashed")  # type: ignore[arg-type]


def test_chief_reports_auc_and_logloss_to_parameter_server_0():
    """The status path the operator reads: a task without accuracy still has its eval."""
    store = ParameterStore()
    events = Events()
    run_job(ctr_training(steps=20, tables="none"), [LocalTransport(store)], emit=events)
    status = store.job_status("ns")
    assert status.has_eval
    assert set(status.eval_metrics) == {"auc", "logloss", "loss"}
    assert status.eval_metrics["auc"] == events.of("eval")[-1]["auc"]


def reference_auc(tables: ctr.TableKind, steps: int = STEPS) -> float:
    """A single PyTorch process on the same data with the same optimizer (Adagrad
    handles the sparse gradients of `nn.EmbeddingBag(sparse=True)`)."""
    task = ctr.make_task(rows=ROWS, tables=tables)
    opt = torch.optim.Adagrad(task.model.parameters(), lr=ADAGRAD["learningRate"])
    batches = task.batches(0, 1, BATCH, 0)
    for _ in range(steps):
        x, y = next(batches)
        opt.zero_grad()
        task.loss(task.model(x), y).backward()
        # Adagrad builds sparse tensors from the sparse gradients: say that their
        # invariants are checked (left unsaid, torch warns once per process).
        with torch.sparse.check_sparse_tensor_invariants():
            opt.step()
    task.model.eval()
    return task.evaluate(task.model)["auc"]


def test_tables_on_the_parameter_servers_learn_like_pytorch_and_beat_dense_only():
    """1 worker, sync, 2 PS: the same samples and updates as the single process, but the
    tables' initial rows come from the layer's own per-id rule, so the AUCs differ by
    initialisation noise only (measured ~0.005); the dense-only model is ~0.25 below."""
    events = Events()
    run_job(ctr_training(), [LocalTransport(ParameterStore(i)) for i in range(2)],
            emit=events)
    pstrain_auc = events.of("eval")[-1]["auc"]
    torch_auc = reference_auc("torch_sparse")
    dense_only = reference_auc("none")
    assert torch_auc > dense_only + 0.15, (torch_auc, dense_only)
    assert pstrain_auc > dense_only + 0.15, (pstrain_auc, dense_only)
    assert abs(pstrain_auc - torch_auc) < 0.03, (pstrain_auc, torch_auc)
