"""Item `ctr`: the CTR model (`pstrain_runtime.examples.ctr`, DLRM style, 26 embedding
tables of `DIM` float32 values per row) with large tables, 2 PS + 2 workers.

- samples/s of pstrain (async, the tables on the parameter servers as
  `SparseEmbeddingBag`s) at `SIZES` total rows (over the 26 tables), against
  DistributedDataParallel over gloo (2 processes) with the tables held densely
  (`nn.EmbeddingBag`, every row a parameter, all-reduced every step) and with
  `nn.EmbeddingBag(sparse=True)` (sparse gradients, gathered every step), and against
  TorchRec (`bench.torchrec_ref`: `DistributedModelParallel`, 2 ranks over gloo, the
  tables sharded table-wise with a fused EXACT_ADAGRAD). Same model, batch per worker,
  data and optimizer (Adagrad, lr 0.05, eps `ADAGRAD_EPS`) everywhere. A DDP or TorchRec
  variant runs only where its processes' memory (tables, gradients, optimizer state)
  fits in what the machine has free; elsewhere the figure says so.
- the ids: Zipf 1.2 (the example's default) at every size; at `COMPARE_SIZES` also
  uniform over each table's rows (`zipf=0`: no hot rows), for pstrain, DDP with
  `sparse=True` and TorchRec.
- samples/s, CPU time per 1000 samples (all processes), worker RSS and the held-out AUC
  (the task's `evaluate`, `EVAL_SIZE` samples) of every side, the AUC after the same
  `AUC_SAMPLES` samples trained on every side (the figure's note says how many): DDP
  and TorchRec evaluate at that step (inside the measured windows or after them; the
  evaluation's time is left out of them), pstrain in a job of its own right after the
  measured one (same processes, a fresh model, the chief's end-of-job evaluation);
- bytes on the wire per worker step (every TCP socket of both workers, read with
  `ss -ti`: bytes sent + received, over the measured windows) beside the unique ids
  of one worker's batch (summed over the tables, from the same generator);
- worker and PS resident memory at the end of the measured windows, against the
  table's size;
- PS memory per row: a parameter server's row table (`sparse.table.RowTable`) filled
  with `ROW_FILL` rows in a process of its own, its RSS growth per row against the raw
  bytes of a row plus its Adagrad state;
- the lookup path: a pull of the rows of `LOOKUP_IDS` unique ids from 2 PS, latency and
  GB/s, beside loopback TCP moving the same bytes between two processes in this run.

The sides run one after the other in the same run, every process with one compute
thread (`torch.set_num_threads(1)`); each figure's note says how many processes and
how many OS threads each had (the compute thread plus gRPC, gloo, ... I/O threads).

Keys: `ctr.<side>.<size>[.<ids>][.<metric>]`, see `fig_key`.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .core import GB, Config, Figure, ratio, run_parts
from .usage import (mem_available, parse_ss, peak_rss_bytes, rss_bytes, thread_count,
                    wire_bytes)

ENTRYPOINT = "pstrain_runtime.examples.ctr:make_task"
NUM_TABLES = 26
DIM = 32
ROW_BYTES = DIM * 4
LR = 0.05
# Adagrad's eps on every side: pstrain's (dense parameters and table rows), DDP's
# torch.optim.Adagrad and TorchRec's fused EXACT_ADAGRAD (whose own default is 1e-8).
# torch.optim.Adagrad's default, which pstrain's Adagrad follows (OptimizerConfig); given
# explicitly so that no side's default can make the sides differ.
ADAGRAD_EPS = 1e-10
ADAGRAD = {"name": "adagrad", "learningRate": LR, "eps": ADAGRAD_EPS}
PS = 2
WORKERS = 2
SIZES = (1_000_000, 10_000_000, 50_000_000)  # total rows over the 26 tables
QUICK_SIZES = (26_000, 260_000)
COMPARE_SIZES = (1_000_000, 10_000_000)  # uniform ids and TorchRec (quick: QUICK_SIZES)
IDS = {"zipf": 1.2, "uniform": 0.0}  # the example's `zipf` exponent of each id law
BATCH, QUICK_BATCH = 512, 64
EVAL_SIZE = 16_384  # held-out samples behind every AUC figure
AUC_SAMPLES, QUICK_AUC_SAMPLES = 1 << 19, 1 << 14  # trained before the AUC is taken
ROW_FILL, QUICK_ROW_FILL = 4_000_000, 100_000
LOOKUP_IDS = 4096
DDP_STATE_COPIES = 4  # per rank: parameters, gradients, Adagrad sum, DDP bucket copy
MEM_HEADROOM = 0.7  # a DDP variant runs only if it needs under this share of MemAvailable
SIDES = {"ps": "pstrain async", "ddp_dense": "DDP dense", "ddp_sparse": "DDP sparse=True",
         "torchrec": "TorchRec"}
_LEGACY_SIDES = ("ps", "ddp_dense", "ddp_sparse")  # their Zipf keys name no ids


# --------------------------------------------------------------------------- pure


def size_name(total_rows: int) -> str:
    return f"{total_rows / 1e6:g}M" if total_rows >= 1_000_000 else f"{total_rows / 1e3:g}k"


def size_rows(name: str) -> int:
    """The inverse of `size_name`: "10M" -> 10_000_000."""
    scale = {"M": 1_000_000, "k": 1_000}[name[-1]]
    return round(float(name[:-1]) * scale)


def fig_key(side: str, size: str, ids: str = "zipf", metric: str = "") -> str:
    """`ctr.<side>.<size>[.<ids>][.<metric>]`. The Zipf figures of pstrain and DDP keep
    the keys they had before uniform ids and TorchRec came (`ctr.ps.1M`,
    `ctr.ps.1M.cpu`: the targets and earlier results refer to them); every other figure
    names its ids: `ctr.ps.1M.uniform.auc`, `ctr.torchrec.1M.zipf.cpu`."""
    if ids not in IDS:
        raise ValueError(f"ids is {ids!r}; it must be one of {', '.join(IDS)}")
    key = f"ctr.{side}.{size}" if ids == "zipf" and side in _LEGACY_SIDES else \
        f"ctr.{side}.{size}.{ids}"
    return f"{key}.{metric}" if metric else key


def ids_label(ids: str) -> str:
    return f"Zipf {IDS[ids]:g} ids" if IDS[ids] else "uniform ids"


def rows_per_table(total_rows: int) -> int:
    return math.ceil(total_rows / NUM_TABLES)


def table_bytes(total_rows: int) -> int:
    return rows_per_table(total_rows) * NUM_TABLES * ROW_BYTES


def ddp_bytes_needed(total_rows: int, sparse: bool) -> int:
    """Both DDP ranks' memory for the tables: parameters, gradients (dense: a full copy,
    plus DDP's bucket; sparse: small), Adagrad's per-element sum."""
    copies = 2 if sparse else DDP_STATE_COPIES
    return WORKERS * copies * table_bytes(total_rows)


@dataclass(frozen=True)
class Spread:
    """How far apart the samples/s of the table sizes are: max / min - 1."""

    value: float
    slowest: str
    fastest: str


def spread(rates: Mapping[str, float]) -> Spread | None:
    if len(rates) < 2 or min(rates.values()) <= 0:
        return None
    lo = min(rates, key=lambda k: rates[k])
    hi = max(rates, key=lambda k: rates[k])
    return Spread(rates[hi] / rates[lo] - 1.0, lo, hi)


_PS_RATE = re.compile(r"ctr\.ps\.([^.]+)(?:\.(uniform))?")


def derive(figs: Mapping[str, Figure]) -> list[Figure]:
    """Ratios: pstrain's samples/s against each other side's at every size and id law
    both ran, pstrain's CPU time per sample against TorchRec's; the spread of pstrain's
    samples/s (Zipf ids) over the sizes."""
    out: list[Figure] = []
    for key, fig in figs.items():
        m = _PS_RATE.fullmatch(key)
        if m is None or m.group(1) == "spread":
            continue
        size, ids = m.group(1), m.group(2) or "zipf"
        for side in ("ddp_dense", "ddp_sparse", "torchrec"):
            base = figs.get(fig_key(side, size, ids))
            if base is None:
                continue
            what = f"{size} rows" + ("" if side in _LEGACY_SIDES and ids == "zipf"
                                     else f", {ids_label(ids)}")
            out.append(ratio(fig_key("ps", size, ids, f"vs_{side}"),
                             f"{what}: pstrain / {side.replace('_', ' ')} samples/s", fig,
                             base))
            if side == "torchrec":
                out.append(ratio(fig_key("ps", size, ids, "cpu.vs_torchrec"),
                                 f"{what}: pstrain / torchrec CPU time per sample",
                                 figs.get(fig_key("ps", size, ids, "cpu")),
                                 figs.get(fig_key(side, size, ids, "cpu"))))
    for side in VARIANTS:  # each variant against the main side, same size and ids
        for key, fig in figs.items():
            m = re.fullmatch(rf"ctr\.{side}\.([^.]+)\.([^.]+)", key)
            if m is not None and m.group(2) in IDS:
                size, ids = m.groups()
                out.append(ratio(f"{key}.vs_ps", f"{size} rows, {ids_label(ids)}: pstrain"
                                 f"{variant_note(side)} / pstrain samples/s", fig,
                                 figs.get(fig_key("ps", size, ids))))
    rates = {k.split(".")[2]: f.median for k, f in figs.items()
             if re.fullmatch(r"ctr\.ps\.[^.]+", k) and f.median}
    s = spread(rates)  # type: ignore[arg-type]
    if s is not None:
        out.append(Figure("ctr.ps.spread", "pstrain samples/s: fastest / slowest size - 1",
                          "x", s.value, note=f"slowest {s.slowest}, fastest {s.fastest}"))
    return out


def process_note(roles: Sequence[tuple[str, int]]) -> str:
    """How many processes, each role's OS threads per process, e.g. "4 processes (PS 23,
    23; workers 31, 30 OS threads), 1 compute thread each (...)"."""
    count = len(roles)
    parts: dict[str, list[str]] = {}
    for role, threads in roles:
        parts.setdefault(role, []).append(str(threads))
    threads = "; ".join(f"{role} {', '.join(t)}" for role, t in parts.items())
    return (f"{count} processes ({threads} OS threads), 1 compute thread each "
            "(torch.set_num_threads(1))")


def auc_figure(key: str, label: str, metrics: Mapping[str, float] | None, samples: int,
               how: str) -> Figure:
    if not metrics or "auc" not in metrics:
        return Figure.missing(key, label, "AUC", "no evaluation")
    return Figure(key, label, "AUC", float(metrics["auc"]),
                  note=f"after {samples:,} samples trained; {EVAL_SIZE:,} held-out samples; "
                  f"logloss {metrics.get('logloss', float('nan')):.4f}; {how}")


# --------------------------------------------------------------------------- measuring


def task_args(total_rows: int, tables: str, ids: str = "zipf") -> dict[str, Any]:
    return {"rows": rows_per_table(total_rows), "embedding_dim": DIM, "tables": tables,
            "zipf": IDS[ids], "eval_size": EVAL_SIZE}


def unique_ids(total_rows: int, batch: int, batches: int = 20,
               ids: str = "zipf") -> list[float]:
    """Unique ids per table summed over the tables, for `batches` batches of worker 0."""
    import torch
    from pstrain_runtime.examples import ctr

    task = ctr.make_task(**task_args(total_rows, "none", ids))
    it = task.batches(0, WORKERS, batch, 0)
    out = []
    for _ in range(batches):
        x, _ = next(it)
        cols = x[:, ctr.NUM_DENSE:].to(torch.int64)
        out.append(float(sum(int(torch.unique(cols[:, t]).numel())
                             for t in range(cols.shape[1]))))
    return out


def _model_spec(total_rows: int, batch: int, tables: str, ids: str = "zipf"):  # noqa: ANN202
    from .training import ModelSpec

    name = size_name(total_rows)
    return ModelSpec(f"ctr{name}", f"CTR {name} rows x {DIM}, {ids_label(ids)}",
                     ENTRYPOINT, task_args(total_rows, tables, ids), batch, dict(ADAGRAD))


VARIANTS = {  # pstrain sides beside the main one: (CTR tables kind, cache staleness)
    "ps_tables": ("ps_tables", 0),  # 26 tables in a SparseEmbeddingCollection (fused)
    "ps_tables_apart": ("ps_tables_apart", 0),  # the same, fusion off
    "ps_cache16": ("ps", 16),  # workers' row cache, staleness 16
    "ps_cache32": ("ps", 32),
}


def ps_throughput(cfg: Config, sizes: Sequence[int], batch: int, ids: str = "zipf",
                  auc_samples: int = 0, side: str = "ps") -> list[Figure]:
    """pstrain async, 2 PS + 2 workers, each size in a process group of its own (a
    worker's RSS is then that job's alone). With `auc_samples`, a second job in the same
    group after the measured one: a fresh model trained for `auc_samples` samples (a
    global step is one worker's batch), then the chief's end-of-job evaluation gives the
    AUC. `side` "ps" is the model as one table with offsets and no row cache; the
    others are `VARIANTS`."""
    from .training import _run_ps_jobs, _throughput_figures, _throughput_job

    tables, staleness = VARIANTS.get(side, ("ps", 0))
    jobs, auc_jobs = [], []
    for total in sizes:
        name = size_name(total)
        what = f"CTR, {name} rows x {DIM}, {ids_label(ids)}"
        spec = _model_spec(total, batch, tables, ids)
        namespace = f"bench/ctr-{side}-{name}" + ("" if ids == "zipf" else f"-{ids}")
        job = _throughput_job(cfg, spec, "async", fig_key(side, name, ids),
                              f"{what}: pstrain async, {PS} PS + {WORKERS} workers"
                              + variant_note(side), f"{what}: pstrain", namespace)
        job["sample_memory"] = True
        jobs.append(job)
        auc_jobs.append({"kind": "fixed", "namespace": f"{namespace}-auc",
                         "training": spec.training("async", math.ceil(auc_samples / batch)),
                         "progress_s": 1.0} if auc_samples else None)
        for each in (job, auc_jobs[-1]):
            if each is not None and staleness:
                each["training"]["sparseCache"] = {"stalenessSteps": staleness}
    res, auc_res = [], []
    for job, auc_job in zip(jobs, auc_jobs, strict=True):
        got = _run_ps_jobs(cfg, [job] if auc_job is None else [job, auc_job], PS)
        res.append(got[0])
        auc_res.append(got[1] if auc_job is not None else None)
    figs = _throughput_figures(cfg, jobs, res, PS)
    for total, job, got, auc_got in zip(sizes, jobs, res, auc_res, strict=True):
        progress = [f for _, k, f in got["events"] if k == "progress"]
        if progress and "threads" in progress[-1]:
            threads = progress[-1]["threads"]
            note = process_note([("PS", t) for t in threads[:PS]] +
                                [("workers", t) for t in threads[PS:]])
            for f in figs:
                if f.key == job["key"]:
                    f.note = f"{f.note}; {note}"
        figs += _memory_and_wire(cfg, total, job, got, ids)
        if auc_got is None:
            continue
        evals = [(f["step"], f) for _, k, f in auc_got["events"] if k == "eval"]
        step, metrics = evals[-1] if evals else (0, None)
        figs.append(auc_figure(f"{job['key']}.auc", f"CTR {size_name(total)}, "
                               f"{ids_label(ids)}: pstrain async{variant_note(side)}: "
                               "held-out AUC", metrics,
                               step * batch, f"global step {step} x batch {batch}; a job "
                               "of its own after the measured one (same processes, a fresh "
                               "model), the chief's evaluation at its end"))
    return figs


def _memory_and_wire(cfg: Config, total: int, job: dict[str, Any],
                     got: dict[str, Any], ids: str = "zipf") -> list[Figure]:
    from .training import measured_span

    name = size_name(total)
    key = job["key"]
    what = f"CTR {name}, {ids_label(ids)}"
    progress = [f for _, k, f in got["events"] if k == "progress"]
    points = [(t, f["step"]) for t, k, f in got["events"] if k == "progress"]
    span = measured_span(points, cfg.train_seconds_per_rep, cfg.warmup, cfg.repeats)
    if span is None or "wire" not in progress[span[0]]:
        return [Figure.missing(f"{key}.wire", f"{what}: bytes on the wire per "
                               "worker step", "KB", "no complete measurement window")]
    i, j = span
    steps = points[j][1] - points[i][1]
    per_step = (progress[j]["wire"] - progress[i]["wire"]) / max(steps, 1)
    rss = progress[j]["rss"]
    pulled = _pulled_share(progress[i], progress[j], f"{key}.pulled", what)
    worker_rss = max(rss[PS:])
    ps_rss = max(rss[:PS])
    table = table_bytes(total)
    unique = f"ctr.unique_ids.{name}" + ("" if ids == "zipf" else f".{ids}")
    return [
        Figure(f"{key}.wire", f"{what}: bytes on the wire per worker step "
               "(sent + received, both workers' sockets)", "KB", per_step / 1e3,
               note=f"over {steps} steps; see {unique}"),
        Figure(f"{key}.worker_rss", f"{what}: worker RSS (the larger)", "MB",
               worker_rss / 1e6, note=f"{100 * worker_rss / table:.1f}% of the table "
               f"({table / 1e6:,.0f} MB); at the end of the measured windows"),
        Figure(f"{key}.ps_rss", f"{what}: PS RSS (the larger)", "MB",
               ps_rss / 1e6, note="rows are created on first touch: the PS holds the rows "
               "trained so far, not the whole id space"),
        *pulled,
    ]


def variant_note(side: str) -> str:
    if side not in VARIANTS:
        return ""
    tables, staleness = VARIANTS[side]
    what = {"ps_tables": "26 tables in a SparseEmbeddingCollection (fused)",
            "ps_tables_apart": "26 tables in a SparseEmbeddingCollection, fuse=False"}
    return f" ({what[tables]})" if tables in what else f" (row cache, staleness {staleness})"


def _pulled_share(first: Mapping[str, Any], last: Mapping[str, Any], key: str,
                  what: str) -> list[Figure]:
    """Rows the chief pulled from the servers per row it looked up, over the window."""
    if "sparse_rows_pulled" not in last or "sparse_rows_pulled" not in first:
        return []
    asked = last["sparse_rows_looked_up"] - first["sparse_rows_looked_up"]
    pulled = last["sparse_rows_pulled"] - first["sparse_rows_pulled"]
    return [Figure(key, f"{what}: rows pulled from the servers per row looked up (the "
                   "chief)", "x", pulled / max(asked, 1),
                   note=f"{asked:,} rows looked up over the measured windows")]


# ----------------------------------------------------- lockstep sides (DDP, TorchRec)


def lockstep_run(step: Callable[[], None], agree: Callable[[int], int],
                 evaluate: Callable[[], Mapping[str, float] | None], window_s: float,
                 skip: int, count: int, eval_at: int | None) -> dict[str, Any]:
    """One rank of a side whose ranks step together (DDP, TorchRec), its process group
    up: the measured windows (`training._calibrated_windows`), and at step `eval_at`
    (None: never) a barrier, `evaluate()` (on every rank; it returns the metrics where it
    evaluated, else None) and a barrier. When that falls inside the windows, its wall and
    CPU time are taken out of the points after it; when the windows end sooner, training
    goes on to `eval_at` steps (every rank runs the same count)."""
    import time

    import torch.distributed as dist

    from .training import _calibrated_windows

    done = 0
    got: dict[str, Any] = {"eval": None, "pause": None}

    def counted() -> None:
        nonlocal done
        step()
        done += 1
        if done == eval_at:
            t0, c0 = time.perf_counter(), time.process_time()
            dist.barrier()
            metrics = evaluate()
            dist.barrier()
            got["eval"] = dict(metrics) if metrics else None
            got["pause"] = (t0, time.perf_counter(), time.process_time() - c0)

    points = _calibrated_windows(counted, window_s, skip, count, agree)
    if got["pause"] is not None:  # the evaluation happened inside the windows
        t0, t1, cpu = got["pause"]
        points = [(t - (t1 - t0), n, c - cpu) if t >= t1 else (t, n, c) for t, n, c in points]
    while eval_at is not None and done < eval_at:
        counted()
    return {"points": points, "eval_steps": eval_at, "eval": got["eval"],
            "peak_rss": peak_rss_bytes(), "threads": thread_count()}


def lockstep_figures(cfg: Config, side: str, total: int, ids: str, batch: int, label: str,
                     res: Sequence[Mapping[str, Any]], eval_how: str,
                     extra_note: str = "") -> list[Figure]:
    """samples/s (each window's slower rank), CPU time per 1000 samples (both ranks), the
    larger peak RSS and the AUC of a lockstep side, from its ranks' `lockstep_run`."""
    from .training import _cpu_figure, window_rates

    name = size_name(total)
    key = fig_key(side, name, ids)
    per_step = batch * WORKERS
    windows = [window_rates([(t, n) for t, n, _ in r["points"]], per_step, 0.0, cfg.warmup,
                            cfg.repeats) for r in res]
    rates = [min(w[i] for w in windows) for i in range(len(windows[0]))]
    points = res[0]["points"]
    first, last = cfg.warmup, len(points) - 1
    cpu = sum(r["points"][last][2] - r["points"][first][2] for r in res)
    samples = (points[last][1] - points[first][1]) * per_step
    busy = cpu / (points[last][0] - points[first][0])
    hwm = max(r["peak_rss"] for r in res)
    procs = process_note([("ranks", r["threads"]) for r in res])
    short = f"CTR {name}, {ids_label(ids)}: {SIDES[side]}"
    figs = [Figure.of(key, label, "samples/s", rates,
                      note=f"batch {batch}/worker; {procs}" +
                      (f"; {extra_note}" if extra_note else "")),
            _cpu_figure(f"{key}.cpu", label, cpu, samples, f"{busy:.2f} cores busy"),
            Figure(f"{key}.worker_rss", f"{short}: peak RSS per rank (the larger)", "MB",
                   hwm / 1e6, note=f"{100 * hwm / table_bytes(total):.0f}% of the table "
                   f"({table_bytes(total) / 1e6:,.0f} MB); VmHWM at the end")]
    if eval_how:
        steps = res[0]["eval_steps"] or 0
        figs.append(auc_figure(f"{key}.auc", f"{short}: held-out AUC", res[0]["eval"],
                               steps * per_step, f"{steps} steps x {WORKERS} ranks x batch "
                               f"{batch}; {eval_how}"))
    return figs


def _ddp_rank(rank: int, world: int, port: int, spec: Any, window_s: float, skip: int,
              count: int, auc_steps: int | None) -> dict[str, Any]:
    """One DDP rank (as `training._baseline_rank`); unless `auc_steps` is None, rank 0
    evaluates its model after `auc_steps` steps."""
    import warnings

    import torch.distributed as dist

    from .training import agreed_max, baseline_step

    # torch's Adagrad on sparse gradients warns once per process about invariant checks
    warnings.filterwarnings("ignore", message="Sparse invariant checks")
    task, model, step = baseline_step(rank, world, port, spec)
    try:
        def evaluate() -> Mapping[str, float] | None:
            if rank != 0:
                return None
            return task.evaluate(model.module)  # the plain model: no collectives

        return lockstep_run(step, agreed_max, evaluate, window_s, skip, count, auc_steps)
    finally:
        dist.destroy_process_group()


def ddp_throughput(cfg: Config, total: int, batch: int, sparse: bool, ids: str = "zipf",
                   auc_samples: int | None = None) -> list[Figure]:
    """DDP over gloo, 2 processes; with `auc_samples`, the AUC after that many samples
    (not for the dense tables: too slow to train that far)."""
    from .procs import free_port, run_group

    name = size_name(total)
    variant = "ddp_sparse" if sparse else "ddp_dense"
    key = fig_key(variant, name, ids)
    label = (f"CTR, {name} rows x {DIM}, {ids_label(ids)}: DDP over gloo, 2 processes, "
             f"{'nn.EmbeddingBag(sparse=True)' if sparse else 'dense nn.EmbeddingBag'}")
    need, free = ddp_bytes_needed(total, sparse), mem_available()
    if need > MEM_HEADROOM * free:
        return [Figure.missing(key, label, "samples/s",
                               f"does not fit: needs about {need / 2**30:.1f} GiB for the "
                               f"tables of both ranks, {free / 2**30:.1f} GiB available")]
    spec = _model_spec(total, batch, "torch_sparse" if sparse else "dense", ids)
    auc_steps = None if auc_samples is None else math.ceil(auc_samples / (batch * WORKERS))
    res = run_group(_ddp_rank, WORKERS,
                    args=(WORKERS, free_port(), spec, cfg.train_seconds_per_rep, cfg.warmup,
                          cfg.repeats, auc_steps), timeout_s=cfg.item_time_limit_s)
    return lockstep_figures(cfg, variant, total, ids, batch, label, res,
                            "" if auc_steps is None else
                            "rank 0 evaluates its model (model.module) after a barrier, "
                            "the time it takes left out of the measured windows")


def _fill_rows(rank: int, count: int, fixed: bool = False) -> dict[str, float]:
    """A parameter server's row table with Adagrad (one of 2 servers' shard; `fixed`: of
    a table of 2 x `count` rows, reserved and mapped up front as a server does when it
    fits, else a dynamic one), `count` rows created by updates: RSS growth per row from
    before the table was made, in a process whose allocator is set as a server's."""
    import gc

    from pathlib import Path

    import torch
    from pstrain_runtime import allocator
    from pstrain_runtime.optim import OptimizerConfig
    from pstrain_runtime.sparse.prefault import should_prefault
    from pstrain_runtime.sparse.service import reserve_bytes, reserve_rows
    from pstrain_runtime.sparse.spec import TableSpec
    from pstrain_runtime.sparse.table import RowTable

    allocator.tune("ps")
    map_wait_s = 120.0  # the reserve's mapping (about a second per GB here)

    def rss() -> int:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        return 0

    spec = TableSpec(name="t", num_embeddings=2 * count if fixed else None,
                     embedding_dim=DIM, init_std=0.01,
                     optimizer=OptimizerConfig(name="adagrad", learning_rate=0.05))
    step = 65_536
    gc.collect()
    before = rss()
    ids = torch.randperm(count * 2, generator=torch.Generator().manual_seed(0))[:count]
    grads = torch.full((step, DIM), 0.01)
    gc.collect()
    base = rss()
    reserve = reserve_rows(spec, 2)
    table = RowTable(spec, reserve=reserve, num_ps=2,
                     prefault=should_prefault(reserve_bytes(spec, 2)))
    for t, start in enumerate(range(0, count, step), start=1):
        chunk = ids[start:start + step]
        table.apply(chunk, grads[:len(chunk)], t=t, now=t)
    if table.prefault is not None:
        table.prefault.done.wait(map_wait_s)
    gc.collect()
    after = rss()
    return {"rows": float(table.stats().rows), "bytes": float(after - base),
            "ids_bytes": float(base - before),
            "prefault": float(table.prefault is not None and table.prefault.ok)}


def _bare_worker_rss(rank: int, total_rows: int) -> int:
    """RSS of a process that has imported the trainer and built the CTR model (its
    tables hold no rows on a worker): what a worker costs before it trains."""
    import pstrain_runtime.worker.trainer  # noqa: F401 - the imports a worker has
    from pstrain_runtime.examples import ctr as example

    example.make_task(**task_args(total_rows, "ps"))
    return rss_bytes(os.getpid())


def worker_baseline(cfg: Config, total_rows: int) -> Figure:
    from .procs import run_group

    got = run_group(_bare_worker_rss, 1, args=(total_rows,),
                    timeout_s=cfg.item_time_limit_s)[0]
    return Figure("ctr.worker_baseline_rss", "RSS of a process with torch, the runtime and "
                  "the CTR model loaded, before training", "MB", got / 1e6,
                  note="the floor under every worker's RSS, whatever the table's size")


def ps_memory_per_row(cfg: Config) -> list[Figure]:
    from .procs import run_group

    count = QUICK_ROW_FILL if cfg.quick else ROW_FILL
    raw = ROW_BYTES * 2  # the row and its Adagrad sum, float32
    figs = []
    for fixed, key, what in ((False, "ctr.ps_row_bytes", "a dynamic table"),
                             (True, "ctr.ps_row_bytes.fixed",
                              f"a fixed-size table of {2 * count:,} ids over 2 servers")):
        got = run_group(_fill_rows, 1, args=(count, fixed),
                        timeout_s=cfg.item_time_limit_s)[0]
        per_row = got["bytes"] / max(got["rows"], 1)
        mapped = ("; its reserve (the expected shard, 5 % more) mapped up front, so the "
                  "same whatever its live rows" if got.get("prefault") else "")
        figs.append(Figure(key, f"PS memory per row ({DIM} float32 + Adagrad state), "
                           f"{got['rows']:,.0f} rows of {what}", "B", per_row,
                           note=f"raw row + optimizer state: {raw} B, so {per_row / raw:.2f}x "
                           "raw; RSS growth of the process from before the table was made "
                           "until the rows are created (its allocator set as a parameter "
                           f"server's){mapped}"))
    return figs


def run(cfg: Config) -> list[Figure]:
    """Every side one after the other in this run: pstrain (Zipf at every size, then
    uniform at the compared sizes), the PS memory and lookup parts, then DDP and TorchRec
    at the compared sizes."""
    from . import torchrec_ref

    sizes = QUICK_SIZES if cfg.quick else SIZES
    compare = QUICK_SIZES if cfg.quick else COMPARE_SIZES
    batch = QUICK_BATCH if cfg.quick else BATCH
    auc = QUICK_AUC_SAMPLES if cfg.quick else AUC_SAMPLES
    figs: list[Figure] = []
    for total in sizes:
        name = size_name(total)
        figs.append(Figure(f"ctr.table_mb.{name}", f"CTR {name}: table size ({NUM_TABLES} "
                           f"tables, {rows_per_table(total):,} rows x {DIM} float32 each)",
                           "MB", table_bytes(total) / 1e6))
        for ids in IDS:
            if ids == "zipf" or total in compare:
                figs.append(Figure.of(
                    f"ctr.unique_ids.{name}" + ("" if ids == "zipf" else f".{ids}"),
                    f"CTR {name}, {ids_label(ids)}: unique ids in one worker batch of "
                    f"{batch} (summed over the tables)", "ids",
                    unique_ids(total, batch, ids=ids)))
    parts: list[tuple[str, Callable[[], list[Figure]]]] = [
        ("pstrain", lambda: ps_throughput(cfg, sizes, batch, "zipf", auc)),
        ("pstrain uniform", lambda: ps_throughput(cfg, compare, batch, "uniform", auc)),
        ("pstrain 26 tables", lambda: ps_throughput(cfg, compare[:1], batch, "zipf", 0,
                                                    "ps_tables")),
        ("pstrain 26 tables apart", lambda: ps_throughput(cfg, compare[:1], batch, "zipf",
                                                          0, "ps_tables_apart")),
        *((f"pstrain {side}", lambda side=side: ps_throughput(cfg, compare, batch, "zipf",
                                                                auc, side))
          for side in ("ps_cache16", "ps_cache32")),
        ("pstrain ps_cache16 uniform", lambda: ps_throughput(cfg, compare[-1:], batch,
                                                             "uniform", auc, "ps_cache16")),
        ("ps memory", lambda: ps_memory_per_row(cfg)),
        ("worker baseline", lambda: [worker_baseline(cfg, sizes[0])]),
        ("lookup", lambda: lookup_path(cfg)),
    ]
    for total in compare:
        name = size_name(total)
        parts += [(f"ddp {name} dense",
                   lambda total=total: ddp_throughput(cfg, total, batch, sparse=False)),
                  *((f"ddp {name} sparse {ids}",
                     lambda total=total, ids=ids:
                     ddp_throughput(cfg, total, batch, True, ids, auc)) for ids in IDS),
                  *((f"torchrec {name} {ids}",
                     lambda total=total, ids=ids:
                     torchrec_ref.throughput(cfg, total, batch, ids, auc)) for ids in IDS)]
    return figs + run_parts("ctr", parts)


def _lookup_peer(rank: int, ports: list[int], samples: int, timeout_s: float) -> Any:
    """Ranks 0 and 1 serve; rank 2 pulls the rows of LOOKUP_IDS unique ids and returns
    the latency samples. The rows exist (a push created them), as the hot rows of a
    batch do in training: a row never pushed is computed from its id at every pull."""
    if rank < PS:
        from . import rt

        rt.serve_ps(rank, ports[rank], timeout_s)
        return None
    import torch

    from . import rt
    from .core import latency_samples

    client, spec, dense = rt.sparse_table(ports, "bench/lookup", DIM)
    ids = torch.randperm(1 << 24, generator=torch.Generator().manual_seed(0))[:LOOKUP_IDS]
    try:
        client.push({spec.name: (ids, torch.zeros(LOOKUP_IDS, DIM))}, 0, [0] * PS)
        return latency_samples(lambda: client.pull(spec, ids), samples, warmup=10,
                               calls=samples * 20)
    finally:
        client.close()
        rt.shutdown(dense)


def lookup_path(cfg: Config) -> list[Figure]:
    """A pull of one batch's unique rows from 2 PS, and loopback TCP moving the same
    bytes (one 512 KiB message and a 1-byte answer) between two processes, in this
    run."""
    import multiprocessing as mp

    from .limits import CHUNK, _tcp_peer
    from .procs import find_free_ports, run_group

    nbytes = LOOKUP_IDS * ROW_BYTES
    what = f"{LOOKUP_IDS} unique ids x {DIM} float32 ({nbytes / 1024:.0f} KiB)"
    secs = run_group(_lookup_peer, PS + 1, args=(find_free_ports(PS), cfg.repeats,
                                                  cfg.item_time_limit_s),
                     timeout_s=cfg.item_time_limit_s)[PS]
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    tcp = run_group(_tcp_peer, 2, args=([nbytes], cfg.warmup + cfg.repeats * 20, CHUNK),
                    rank_args=[(a,), (b,)], timeout_s=cfg.item_time_limit_s)[1][nbytes]
    tcp = tcp[cfg.warmup:]
    k = len(tcp) // cfg.repeats
    tcp_secs = [sorted(tcp[i * k:(i + 1) * k])[k // 2] for i in range(cfg.repeats)]
    pull = Figure.of("ctr.lookup.pull", f"sparse pull of {what} from {PS} PS: latency",
                     "s", secs, note="each sample the median of 20 pulls")
    pull_gbs = Figure.of("ctr.lookup.pull_gbs", f"sparse pull of {what}: rows moved",
                         "GB/s", [nbytes / GB / s for s in secs])
    tcp_fig = Figure.of("ctr.lookup.tcp", f"loopback TCP, the same {nbytes / 1024:.0f} KiB "
                        "and a 1-byte answer: latency", "s", tcp_secs,
                        note="each sample the median of 20 transfers")
    tcp_gbs = Figure.of("ctr.lookup.tcp_gbs", f"loopback TCP, {nbytes / 1024:.0f} KiB",
                        "GB/s", [nbytes / GB / s for s in tcp_secs])
    return [pull, pull_gbs, tcp_fig, tcp_gbs,
            ratio("ctr.lookup.vs_tcp", "sparse pull GB/s / loopback TCP GB/s, same bytes",
                  pull_gbs, tcp_gbs)]


__all__ = ["GB", "derive", "parse_ss", "run", "spread", "wire_bytes"]
