"""Item `sparse_disk`: the CTR model with a table many times a server's memory budget
(`spec.training.sparseStorage`: the rows beyond the budget on local disk, RocksDB).

The CTR model of item `ctr` (`pstrain_runtime.examples.ctr`, 26 tables fused into one,
`TOTAL_ROWS` rows x `DIM` float32, Adagrad), pstrain async with 2 PS + 2 workers, batch
`BATCH` per worker, each side in a process group of its own, one after the other in
the same run: `ram` (every row in memory, as before) and `disk` (each server's budget
`BUDGET_MIB`: the table, `TOTAL_ROWS / 2` rows x (row + Adagrad state) per server, is
about 8 times that). For Zipf 1.2 ids (the example's default) and uniform ids (no hot
rows: nearly every update goes to disk and back). With Zipf ids the two sides run in
turn `ROUNDS` times, each round in the other order (this machine's speed drifts by a
third within minutes). Reported:

- samples/s of each side (the chief's progress events, warm-up window dropped; the
  windows of every round) and disk / ram: per round (the medians of that round's
  windows), the median over the rounds;
- Zipf: the held-out AUC of each side after the same `AUC_SAMPLES` samples (a job of
  its own right after the measured one, same processes, a fresh model; the chief's
  end-of-job evaluation), and their difference;
- each server's RSS at the end of the measured windows, and its growth over the RSS of
  a bare parameter server (`ps_baseline_rss`: torch, the runtime and rocksdict
  imported, serving, no tables), against the budget: all of it, and the anonymous
  part (`RssAnon`: without mapped files, i.e. without the code pages of torch's
  kernels that run for the first time, shared and reclaimable), which the target
  judges at its most over the progress events of the measured job (about one a
  second);
- the rows in memory and on disk at the end (over both servers), from the chief's
  progress events;
- Zipf ids: what checkpoints cost with the disk tier, a third side in each round
  (`disk_ckpt`: the disk side with a checkpoint every `CHECKPOINT_INTERVAL` steps, the
  default, into a folder beside the rows): its samples/s over the disk side's, per
  round, the median over the rounds.
"""

from __future__ import annotations

import functools
import math
import os
import shutil
import tempfile
from typing import Any

from .core import Config, Figure, run_parts
from .ctr import ADAGRAD, PS, WORKERS, auc_figure, process_note
from .usage import rss_bytes, status_field

DIM = 32
ROW_BYTES = DIM * 4 * 2 + 16  # row + Adagrad sum, float32, + bookkeeping
TOTAL_ROWS, QUICK_TOTAL_ROWS = 4_000_000, 260_000
BUDGET_MIB, QUICK_BUDGET_MIB = 64, 4
BATCH, QUICK_BATCH = 512, 64
AUC_SAMPLES, QUICK_AUC_SAMPLES = 1 << 18, 1 << 14
IDS = {"zipf": 1.2, "uniform": 0.0}
SIDES = ("ram", "disk")
CHECKPOINT_SIDE = "disk_ckpt"  # Zipf ids: the disk side with checkpoints
CHECKPOINT_INTERVAL = 100  # steps (the default interval)
ROUNDS, QUICK_ROUNDS = 3, 1  # Zipf ids: ram and disk in turn (uniform ids: one round)
ENTRYPOINT = "pstrain_runtime.examples.ctr:make_task"
EVAL_SIZE = 16_384


def sizes(cfg: Config) -> tuple[int, int, int, int]:
    """(total rows, budget MiB per server, batch, AUC samples) of this run."""
    if cfg.quick:
        return QUICK_TOTAL_ROWS, QUICK_BUDGET_MIB, QUICK_BATCH, QUICK_AUC_SAMPLES
    return TOTAL_ROWS, BUDGET_MIB, BATCH, AUC_SAMPLES


def sides(ids: str) -> tuple[str, ...]:
    return SIDES + ((CHECKPOINT_SIDE,) if ids == "zipf" else ())


def _spec(cfg: Config, ids: str) -> Any:
    from .training import ModelSpec

    total, _, batch, _ = sizes(cfg)
    args = {"rows": math.ceil(total / 26), "embedding_dim": DIM, "tables": "ps",
            "zipf": IDS[ids], "eval_size": EVAL_SIZE}
    return ModelSpec(f"ctr-disk-{ids}", f"CTR {total:,} rows x {DIM}, {ids} ids",
                     ENTRYPOINT, args, batch, dict(ADAGRAD))


def side_jobs(cfg: Config, ids: str, side: str, directory: str | None, auc: bool = True
              ) -> list[dict[str, Any]]:
    """The measured job of one side and, for Zipf ids (`auc`), its AUC job."""
    from .training import _throughput_job

    total, budget, batch, auc_samples = sizes(cfg)
    spec = _spec(cfg, ids)
    what = f"CTR {total / 1e6:g} M rows x {DIM}, {ids} ids"
    where = ("every row in memory" if side == "ram" else
             f"{budget} MiB of rows in memory per server, the rest on disk")
    if side == CHECKPOINT_SIDE:
        where += f", a checkpoint every {CHECKPOINT_INTERVAL} steps"
    job = _throughput_job(cfg, spec, "async", f"sparse_disk.{ids}.{side}",
                          f"{what}: pstrain async, {PS} PS + {WORKERS} workers, {where}",
                          f"{what}: pstrain async, {where}", f"bench/disk-{ids}-{side}")
    job["sample_memory"] = True
    jobs = [job]
    if ids == "zipf" and auc and side != CHECKPOINT_SIDE:
        jobs.append({"kind": "fixed", "namespace": f"bench/disk-{ids}-{side}-auc",
                     "training": spec.training("async", math.ceil(auc_samples / batch)),
                     "progress_s": 1.0})
    if side != "ram":
        for each in jobs:
            each["training"]["sparseStorage"] = {"serverMemory": budget,
                                                 "directory": directory}
    if side == CHECKPOINT_SIDE:
        job["training"]["checkpoint"] = {
            "directory": os.path.join(str(directory), "checkpoints"),
            "intervalSteps": CHECKPOINT_INTERVAL}
    return jobs


def _bare_ps_rss(rank: int) -> tuple[int, int]:
    """(RSS, anonymous RSS) of a serving parameter server with no tables: the floor
    under its RSS."""
    import rocksdict  # noqa: F401 - what a server with a disk tier has loaded

    from . import rt
    from .procs import find_free_ports

    server = rt.start_ps(0, find_free_ports(1)[0])
    try:
        return rss_bytes(os.getpid()), status_field(os.getpid(), "RssAnon") * 1024
    finally:
        server.stop(grace=0)


def memory_figures(cfg: Config, ids: str, side: str, got: dict[str, Any],
                   baseline: tuple[int, int]) -> list[Figure]:
    """Each server's RSS and its growth over `baseline`, all of it and without mapped
    files (code pages of torch's kernels first run, shared and reclaimable), against the
    budget; the rows in memory and on disk at the end of the measured windows."""
    _, budget, _, _ = sizes(cfg)
    progress = [f for _, k, f in got["events"] if k == "progress" and "rss_anon" in f]
    if not progress:
        return []
    last = progress[-1]
    key, figs = f"sparse_disk.{ids}.{side}", []
    of_budget = ((lambda b: f"{b / (budget << 20):.2f}x the budget of {budget} MiB")
                 if side == "disk" else (lambda b: "no budget"))
    for ps in range(PS):
        rss, anon = last["rss"][ps], last["rss_anon"][ps]
        peak = max(f["rss_anon"][ps] for f in progress)
        figs += [Figure(f"{key}.ps{ps}_rss", f"{ids} ids, {side}: PS {ps} RSS", "MB",
                        rss / 1e6, note=f"at the end of the measured windows; growth over "
                        f"a bare server {(rss - baseline[0]) / 1e6:.1f} MB, "
                        f"{of_budget(rss - baseline[0])}"),
                 Figure(f"{key}.ps{ps}_rss_growth", f"{ids} ids, {side}: PS {ps} anonymous "
                        "RSS over a bare server's, the most of any progress event",
                        "MB", (peak - baseline[1]) / 1e6,
                        note=f"{of_budget(peak - baseline[1])}; at the end "
                        f"{(anon - baseline[1]) / 1e6:.1f} MB, {of_budget(anon - baseline[1])}; "
                        f"{len(progress)} events")]
    table = last.get("sparse_tables", {})
    rows = sum(t.get("rows", 0) for t in table.values())
    disk = sum(t.get("disk_rows", 0) for t in table.values())
    figs.append(Figure(f"{key}.rows", f"{ids} ids, {side}: live rows (both servers)", "rows",
                       float(rows), note=f"{disk:,} on disk ({100 * disk / max(rows, 1):.0f}%)"
                       f", {(rows - disk) * ROW_BYTES / 1e6:,.0f} MB of rows in memory"))
    return figs


Round = tuple[list[dict[str, Any]], list[dict[str, Any]]]  # (jobs, their results)


def measure_side(cfg: Config, ids: str, side: str, auc: bool) -> Round:
    """One round of one side: its jobs, run in a process group of their own."""
    from .training import _run_ps_jobs

    directory = tempfile.mkdtemp(prefix="pstrain-bench-rows-") if side != "ram" else None
    try:
        jobs = side_jobs(cfg, ids, side, directory, auc)
        return jobs, _run_ps_jobs(cfg, jobs, PS)
    finally:
        if directory:
            shutil.rmtree(directory, ignore_errors=True)


def side_figures(cfg: Config, ids: str, side: str, baseline: tuple[int, int],
                 rounds: list[Round]) -> list[Figure]:
    """samples/s over every round's windows, CPU and memory (the peak over every
    round), the AUC (the round that ran its job)."""
    from .training import _throughput_figures

    per_round = [_throughput_figures(cfg, r_jobs[:1], got[:1], PS) for r_jobs, got in rounds]
    figs = []
    rates = [v for round_figs in per_round for f in round_figs[:1] for v in f.samples]
    first = per_round[0]
    if first and rates:
        head = first[0]
        figs.append(Figure.of(head.key, head.label, head.unit, rates,
                              note=f"{head.note}; {len(rounds)} round(s)"))
        figs += first[1:]  # CPU: the first round's
    else:
        figs += first
    progress = [f for _, k, f in rounds[-1][1][0]["events"] if k == "progress" and "threads" in f]
    if progress and figs:
        threads = progress[-1]["threads"]
        figs[0].note += "; " + process_note([("PS", t) for t in threads[:PS]]
                                            + [("workers", t) for t in threads[PS:]])
    events = [e for _, got in rounds for e in got[0]["events"]]
    figs += memory_figures(cfg, ids, side, {"events": events}, baseline)
    for r_jobs, got in rounds:
        if len(got) > 1:
            evals = [(f["step"], f) for _, k, f in got[1]["events"] if k == "eval"]
            step, metrics = evals[-1] if evals else (0, None)
            figs.append(auc_figure(f"sparse_disk.{ids}.{side}.auc", f"{ids} ids, {side}: "
                                   "held-out AUC", metrics, step * r_jobs[0]["batch"],
                                   "a job of its own after the measured one"))
    return figs


def round_ratio(cfg: Config, ids: str, disk: list[Round | None], ram: list[Round | None],
                key: str | None = None, label: str | None = None) -> Figure:
    """disk / ram samples/s (or of any two sides, as `key`): per round, the medians of
    that round's windows; the median over the rounds where both sides ran."""
    from .training import median_rate

    def rate(r: Round | None) -> float | None:
        if r is None:
            return None
        jobs, got = r
        points = [(t, f["step"]) for t, k, f in got[0]["events"] if k == "progress"]
        return median_rate(points, jobs[0]["per_step"], cfg.train_seconds_per_rep,
                           cfg.warmup, cfg.repeats)

    key = key or f"sparse_disk.{ids}.vs_ram"
    label = label or f"{ids} ids: samples/s with the disk tier / every row in memory"
    pairs = [(rate(d), rate(r)) for d, r in zip(disk, ram)]
    ratios = [d / r for d, r in pairs if d and r]
    if not ratios:
        return Figure.missing(key, label, "x", "no round with both sides measured")
    return Figure.of(key, label, "x", ratios, note=f"per round ({len(ratios)}), the "
                     "medians of that round's windows: "
                     + ", ".join(f"{x:.2f}" for x in ratios))


def auc_gap(figs: list[Figure]) -> list[Figure]:
    """|AUC disk - AUC ram| after the same samples, Zipf ids."""
    by = {f.key: f for f in figs}
    disk, ram = by.get("sparse_disk.zipf.disk.auc"), by.get("sparse_disk.zipf.ram.auc")
    if disk and ram and disk.median is not None and ram.median is not None:
        return [Figure("sparse_disk.zipf.auc_gap", "Zipf ids: |AUC disk - AUC ram| after "
                       "the same samples", "AUC", abs(disk.median - ram.median),
                       note=f"disk {disk.median:.4f}, ram {ram.median:.4f}")]
    return []


def run(cfg: Config) -> list[Figure]:
    from .procs import run_group

    baseline = tuple(run_group(_bare_ps_rss, 1, timeout_s=cfg.item_time_limit_s)[0])
    figs = [Figure("sparse_disk.ps_baseline_rss", "RSS of a bare parameter server (torch, "
                   "the runtime, rocksdict; no tables)", "MB", baseline[0] / 1e6,
                   note=f"anonymous (no mapped files) {baseline[1] / 1e6:.1f} MB")]
    total, budget, _, _ = sizes(cfg)
    figs.append(Figure("sparse_disk.budget", "each server's memory budget for rows "
                       "(serverMemory)", "MB", (budget << 20) / 1e6))
    figs.append(Figure("sparse_disk.table_vs_budget", "the table's rows and Adagrad state "
                       "per server / its budget", "x",
                       total / PS * ROW_BYTES / (budget << 20),
                       note=f"{total:,} rows x {ROW_BYTES} B over {PS} servers; "
                       f"{budget} MiB each"))
    rounds = {ids: QUICK_ROUNDS if cfg.quick or ids != "zipf" else ROUNDS for ids in IDS}
    got: dict[tuple[str, str], list[Round | None]] = {
        (ids, side): [None] * rounds[ids] for ids in IDS for side in sides(ids)}

    def part(ids: str, side: str, k: int) -> list[Figure]:
        got[ids, side][k] = measure_side(cfg, ids, side, auc=k == 0)
        return []

    parts = [(f"{side} {ids}", functools.partial(part, ids, side, k))
             for ids in IDS for k in range(rounds[ids])
             for side in _turn(sides(ids), k)]
    figs += run_parts("sparse_disk", parts)
    for (ids, side), results in got.items():
        done = [r for r in results if r is not None]
        if done:
            figs += side_figures(cfg, ids, side, baseline, done)
    figs += [round_ratio(cfg, ids, got[ids, "disk"], got[ids, "ram"]) for ids in IDS]
    figs.append(round_ratio(
        cfg, "zipf", got["zipf", CHECKPOINT_SIDE], got["zipf", "disk"],
        "sparse_disk.zipf.checkpoints_vs_none", "Zipf ids, disk tier: samples/s with a "
        f"checkpoint every {CHECKPOINT_INTERVAL} steps / without"))
    return figs + auc_gap(figs)


def _turn(order: tuple[str, ...], k: int) -> tuple[str, ...]:
    """Round k's order of the sides: each round another side first (two sides: the
    order reversed every other round)."""
    k %= len(order)
    return order[k:] + order[:k]
