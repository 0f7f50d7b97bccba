"""Item `ctr`: the CTR model (`pstrain_runtime.examples.ctr`, DLRM style, 26 embedding
tables of `DIM` float32 values per row) with large tables, 2 PS + 2 workers.

- samples/s of pstrain (async, the tables on the parameter servers as
  `SparseEmbeddingBag`s) at `SIZES` total rows (over the 26 tables), against
  DistributedDataParallel over gloo (2 processes) with the tables held densely
  (`nn.EmbeddingBag`, every row a parameter, all-reduced every step) and with
  `nn.EmbeddingBag(sparse=True)` (sparse gradients, gathered every step). Same model,
  batch per worker and optimizer (Adagrad) everywhere. A DDP variant runs only where
  its two processes' memory (table, gradient and optimizer state, per rank) fits in
  what the machine has free; elsewhere the figure says so.
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
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .core import GB, Config, Figure, ratio, run_parts
from .usage import mem_available, parse_ss, rss_bytes, wire_bytes

ENTRYPOINT = "pstrain_runtime.examples.ctr:make_task"
NUM_TABLES = 26
DIM = 32
ROW_BYTES = DIM * 4
ADAGRAD = {"name": "adagrad", "learningRate": 0.05}
PS = 2
WORKERS = 2
SIZES = (1_000_000, 10_000_000, 50_000_000)  # total rows over the 26 tables
QUICK_SIZES = (26_000, 260_000)
BATCH, QUICK_BATCH = 512, 64
ROW_FILL, QUICK_ROW_FILL = 2_000_000, 100_000
LOOKUP_IDS = 4096
DDP_STATE_COPIES = 4  # per rank: parameters, gradients, Adagrad sum, DDP bucket copy
MEM_HEADROOM = 0.7  # a DDP variant runs only if it needs under this share of MemAvailable


# --------------------------------------------------------------------------- pure


def size_name(total_rows: int) -> str:
    return f"{total_rows / 1e6:g}M" if total_rows >= 1_000_000 else f"{total_rows / 1e3:g}k"


def size_rows(name: str) -> int:
    """The inverse of `size_name`: "10M" -> 10_000_000."""
    scale = {"M": 1_000_000, "k": 1_000}[name[-1]]
    return round(float(name[:-1]) * scale)


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


def derive(figs: Mapping[str, Figure]) -> list[Figure]:
    """Ratios: pstrain against each DDP variant at every size both ran; the spread of
    pstrain's samples/s over the sizes."""
    out: list[Figure] = []
    for key, fig in figs.items():
        m = re.fullmatch(r"ctr\.ps\.([^.]+)", key)
        if m is None:
            continue
        size = m.group(1)
        for variant in ("ddp_dense", "ddp_sparse"):
            base = figs.get(f"ctr.{variant}.{size}")
            if base is not None:
                out.append(ratio(f"ctr.ps.{size}.vs_{variant}",
                                 f"{size} rows: pstrain / {variant.replace('_', ' ')} "
                                 "samples/s", fig, base))
    rates = {k.split(".")[2]: f.median for k, f in figs.items()
             if re.fullmatch(r"ctr\.ps\.[^.]+", k) and f.median}
    s = spread(rates)  # type: ignore[arg-type]
    if s is not None:
        out.append(Figure("ctr.ps.spread", "pstrain samples/s: fastest / slowest size - 1",
                          "x", s.value, note=f"slowest {s.slowest}, fastest {s.fastest}"))
    return out


# --------------------------------------------------------------------------- measuring


def task_args(total_rows: int, tables: str) -> dict[str, Any]:
    return {"rows": rows_per_table(total_rows), "embedding_dim": DIM, "tables": tables,
            "eval_size": 1024}


def unique_ids(total_rows: int, batch: int, batches: int = 20) -> list[float]:
    """Unique ids per table summed over the tables, for `batches` batches of worker 0."""
    import torch
    from pstrain_runtime.examples import ctr

    task = ctr.make_task(**task_args(total_rows, "none"))
    it = task.batches(0, WORKERS, batch, 0)
    out = []
    for _ in range(batches):
        x, _ = next(it)
        ids = x[:, ctr.NUM_DENSE:].to(torch.int64)
        out.append(float(sum(int(torch.unique(ids[:, t]).numel())
                             for t in range(ids.shape[1]))))
    return out


def _model_spec(total_rows: int, batch: int, tables: str):  # noqa: ANN202
    from .training import ModelSpec

    return ModelSpec(f"ctr{size_name(total_rows)}", f"CTR {size_name(total_rows)} rows x {DIM}",
                     ENTRYPOINT, task_args(total_rows, tables), batch, dict(ADAGRAD))


def ps_throughput(cfg: Config, sizes: Sequence[int], batch: int) -> list[Figure]:
    """pstrain async, 2 PS + 2 workers, each size in a process group of its own (a
    worker's RSS is then that job's alone)."""
    from .training import _run_ps_jobs, _throughput_figures, _throughput_job

    jobs = []
    for total in sizes:
        name = size_name(total)
        job = _throughput_job(cfg, _model_spec(total, batch, "ps"), "async", f"ctr.ps.{name}",
                              f"CTR, {name} rows x {DIM}: pstrain async, {PS} PS + "
                              f"{WORKERS} workers", f"CTR {name}: pstrain", f"bench/ctr-{name}")
        job["sample_memory"] = True
        jobs.append(job)
    res = [_run_ps_jobs(cfg, [job], PS)[0] for job in jobs]
    figs = _throughput_figures(cfg, jobs, res, PS)
    for total, job, got in zip(sizes, jobs, res, strict=True):
        figs += _memory_and_wire(cfg, total, job, got)
    return figs


def _memory_and_wire(cfg: Config, total: int, job: dict[str, Any],
                     got: dict[str, Any]) -> list[Figure]:
    from .training import measured_span

    name = size_name(total)
    progress = [f for _, k, f in got["events"] if k == "progress"]
    points = [(t, f["step"]) for t, k, f in got["events"] if k == "progress"]
    span = measured_span(points, cfg.train_seconds_per_rep, cfg.warmup, cfg.repeats)
    if span is None or "wire" not in progress[span[0]]:
        return [Figure.missing(f"ctr.ps.{name}.wire", f"CTR {name}: bytes on the wire per "
                               "worker step", "KB", "no complete measurement window")]
    i, j = span
    steps = points[j][1] - points[i][1]
    per_step = (progress[j]["wire"] - progress[i]["wire"]) / max(steps, 1)
    rss = progress[j]["rss"]
    worker_rss = max(rss[PS:])
    ps_rss = max(rss[:PS])
    table = table_bytes(total)
    return [
        Figure(f"ctr.ps.{name}.wire", f"CTR {name}: bytes on the wire per worker step "
               "(sent + received, both workers' sockets)", "KB", per_step / 1e3,
               note=f"over {steps} steps; see ctr.unique_ids.{name}"),
        Figure(f"ctr.ps.{name}.worker_rss", f"CTR {name}: worker RSS (the larger)", "MB",
               worker_rss / 1e6, note=f"{100 * worker_rss / table:.1f}% of the table "
               f"({table / 1e6:,.0f} MB)"),
        Figure(f"ctr.ps.{name}.ps_rss", f"CTR {name}: PS RSS (the larger)", "MB",
               ps_rss / 1e6, note="rows are created on first touch: the PS holds the rows "
               "trained so far, not the whole id space"),
    ]


def _ddp_rank(rank: int, world: int, port: int, spec: Any, window_s: float, skip: int,
              count: int) -> tuple[list[Any], int]:
    import warnings
    from pathlib import Path

    from .training import _baseline_rank

    # torch's Adagrad on sparse gradients warns once per process about invariant checks
    warnings.filterwarnings("ignore", message="Sparse invariant checks")
    points = _baseline_rank(rank, world, port, spec, window_s, skip, count)

    hwm = 0
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            hwm = int(line.split()[1]) * 1024
    return points, hwm


def ddp_throughput(cfg: Config, total: int, batch: int, sparse: bool) -> list[Figure]:
    from .procs import free_port, run_group
    from .training import _cpu_figure, window_rates

    name = size_name(total)
    variant = "ddp_sparse" if sparse else "ddp_dense"
    key = f"ctr.{variant}.{name}"
    label = (f"CTR, {name} rows x {DIM}: DDP over gloo, 2 processes, "
             f"{'nn.EmbeddingBag(sparse=True)' if sparse else 'dense nn.EmbeddingBag'}")
    need, free = ddp_bytes_needed(total, sparse), mem_available()
    if need > MEM_HEADROOM * free:
        return [Figure.missing(key, label, "samples/s",
                               f"does not fit: needs about {need / 2**30:.1f} GiB for the "
                               f"tables of both ranks, {free / 2**30:.1f} GiB available")]
    spec = _model_spec(total, batch, "torch_sparse" if sparse else "dense")
    res = run_group(_ddp_rank, WORKERS,
                    args=(WORKERS, free_port(), spec, cfg.train_seconds_per_rep, cfg.warmup,
                          cfg.repeats), timeout_s=cfg.item_time_limit_s)
    per_step = batch * WORKERS
    windows = [window_rates([(t, n) for t, n, _ in r[0]], per_step, 0.0, cfg.warmup,
                            cfg.repeats) for r in res]
    rates = [min(w[i] for w in windows) for i in range(len(windows[0]))]
    hwm = max(r[1] for r in res)
    first, last = cfg.warmup, len(res[0][0]) - 1
    cpu = sum(r[0][last][2] - r[0][first][2] for r in res)
    samples = (res[0][0][last][1] - res[0][0][first][1]) * per_step
    busy = cpu / (res[0][0][last][0] - res[0][0][first][0])
    return [Figure.of(key, label, "samples/s", rates, note=f"batch {batch}/worker"),
            _cpu_figure(f"{key}.cpu", label, cpu, samples, f"{busy:.2f} cores busy"),
            Figure(f"{key}.worker_rss", f"CTR {name}: {variant.replace('_', ' ')} peak RSS "
                   "per rank", "MB", hwm / 1e6,
                   note=f"{100 * hwm / table_bytes(total):.0f}% of the table")]


def _fill_rows(rank: int, count: int) -> dict[str, float]:
    """A parameter server's row table with Adagrad, `count` rows created by updates:
    RSS growth per row."""
    import gc

    from pathlib import Path

    import torch
    from pstrain_runtime.optim import OptimizerConfig
    from pstrain_runtime.sparse.spec import TableSpec
    from pstrain_runtime.sparse.table import RowTable

    def rss() -> int:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        return 0

    spec = TableSpec(name="t", num_embeddings=None, embedding_dim=DIM, init_std=0.01,
                     optimizer=OptimizerConfig(name="adagrad", learning_rate=0.05))
    table = RowTable(spec)
    step = 65_536
    gc.collect()
    before = rss()
    ids = torch.randperm(count * 4, generator=torch.Generator().manual_seed(0))[:count]
    grads = torch.full((step, DIM), 0.01)
    gc.collect()
    base = rss()
    for t, start in enumerate(range(0, count, step), start=1):
        chunk = ids[start:start + step]
        table.apply(chunk, grads[:len(chunk)], t=t, now=t)
    gc.collect()
    after = rss()
    return {"rows": float(table.stats().rows), "bytes": float(after - base),
            "ids_bytes": float(base - before)}


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
    got = run_group(_fill_rows, 1, args=(count,), timeout_s=cfg.item_time_limit_s)[0]
    raw = ROW_BYTES * 2  # the row and its Adagrad sum, float32
    per_row = got["bytes"] / max(got["rows"], 1)
    return [Figure("ctr.ps_row_bytes", f"PS memory per row ({DIM} float32 + Adagrad state), "
                   f"{got['rows']:,.0f} rows in one table", "B", per_row,
                   note=f"raw row + optimizer state: {raw} B, so {per_row / raw:.2f}x raw; "
                   "RSS growth of the process while the rows are created")]


def run(cfg: Config) -> list[Figure]:
    sizes = QUICK_SIZES if cfg.quick else SIZES
    batch = QUICK_BATCH if cfg.quick else BATCH
    figs: list[Figure] = []
    for total in sizes:
        name = size_name(total)
        figs.append(Figure(f"ctr.table_mb.{name}", f"CTR {name}: table size ({NUM_TABLES} "
                           f"tables, {rows_per_table(total):,} rows x {DIM} float32 each)",
                           "MB", table_bytes(total) / 1e6))
        figs.append(Figure.of(f"ctr.unique_ids.{name}", f"CTR {name}: unique ids in one "
                              f"worker batch of {batch} (summed over the tables)", "ids",
                              unique_ids(total, batch)))
    ref = 10_000_000 if not cfg.quick else sizes[-1]
    parts: list[tuple[str, Callable[[], list[Figure]]]] = [
        ("pstrain", lambda: ps_throughput(cfg, sizes, batch)),
        ("ps memory", lambda: ps_memory_per_row(cfg)),
        ("worker baseline", lambda: [worker_baseline(cfg, sizes[0])]),
        ("lookup", lambda: lookup_path(cfg)),
    ]
    for total in sorted({sizes[0], ref}):
        for sparse in (False, True):
            parts.append((f"ddp {size_name(total)} {'sparse' if sparse else 'dense'}",
                          lambda total=total, sparse=sparse:
                          ddp_throughput(cfg, total, batch, sparse)))
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
