"""Item `sparse_ckpt`: what sparse checkpoints cost the CTR model's training.

The CTR model of item `ctr` (`pstrain_runtime.examples.ctr`, 1M total rows x `DIM`
float32, Adagrad), pstrain async with 2 PS + 2 workers, batch 512 per worker, each job
in a process group of its own: without checkpoints, with a checkpoint every 100 global
steps (the default interval) and every 20, the servers writing their own rows (they
are given the checkpoint directory, as replicas are: `sparse.shard_writes`); and, in
the same run, every 100 steps with every row received and written by the chief, as
before session 26 (`chief100`: the servers are given no directory); the same two
intervals with every checkpoint written as before chains (`full100`, `full20`: every
row, on the chief's training thread: the chief's `sparse.chain.MAX_DELTAS` set to 0
and its writes made at once, as sync mode writes a full link); and every 100 steps
with the rows written through the page cache, as before session 22 (`buffered100`:
the chief's `sparse.files.DIRECT` off, see `pstrain_runtime.direct_write`); and every
100 steps with the servers' pages gathered into new tensors and then copied into the
write buffer, as before session 31 (`copied100`: the servers' `shard_writes.write_pages`
given the table's own tensors, page by page). The variants run in
turn, `ROUNDS` times over, each round in another order (the machine's load drifts).
Reported:

- samples/s of each (the chief's progress events, warm-up window dropped, as item
  `training` measures it; the windows of all rounds), and the ratio of each
  checkpointing variant to the one without, per round (the medians of that round's
  windows), over the rounds;
- CPU time of all processes per 1000 samples, per round, and its ratio to the job
  without checkpoints (samples per CPU-second): on a machine whose CPUs the job
  saturates, what the checkpoints cost in throughput, much less disturbed than
  samples/s by what else runs there;
- bytes written per checkpoint: the checkpoint file plus its own sparse directory
  (`ckpt-<step>.sparse`, the rows that checkpoint wrote), taken by the chief when each
  checkpoint is reported (before retention can remove anything); the median, with the
  count, the largest (a full write) and the total in the note.
"""

from __future__ import annotations

import shutil
import statistics
import tempfile
from pathlib import Path
from typing import Any

from . import rt
from .core import Config, Figure
from .ctr import ADAGRAD, BATCH, DIM, PS, QUICK_BATCH, WORKERS, size_name, task_args
from .procs import cpu_seconds, find_free_ports, run_group
from .training import (MAX_STEPS, ModelSpec, enough_windows, measured_span, median_rate,
                       window_rates)

TOTAL_ROWS, QUICK_TOTAL_ROWS = 1_000_000, 26_000
# How the chief writes, where not as shipped: "full" (every row on the training
# thread, as before chains), "buffered" (through the page cache, as before O_DIRECT).
HOW = {"": "", "full": ", every row on the training thread (as before chains)",
       "buffered": ", rows written through the page cache (as before session 22)",
       "chief": ", every row through the chief (as before session 26)",
       "copied": ", the servers' pages copied into the write buffer (as before session 31)"}
# (name, checkpoint interval or None, how)
VARIANTS: tuple[tuple[str, int | None, str], ...] = (
    ("none", None, ""), ("every100", 100, ""), ("every20", 20, ""),
    ("chief100", 100, "chief"), ("full100", 100, "full"), ("full20", 20, "full"),
    ("buffered100", 100, "buffered"), ("copied100", 100, "copied"))
ROUNDS, QUICK_ROUNDS = 3, 1
ENTRYPOINT = "pstrain_runtime.examples.ctr:make_task"


def _write_everything_at_once() -> None:
    """In the chief's process: every checkpoint a full link written on the training
    thread, as every checkpoint was before chains."""
    from pstrain_runtime.sparse import chain, session

    chain.MAX_DELTAS = 0
    begin = session.SparseSession.begin_save

    def at_once(self: Any, directory: Path, step: int, frozen: bool) -> Any:
        return begin(self, directory, step, True)

    session.SparseSession.begin_save = at_once  # type: ignore[method-assign]


def _copy_pages_into_the_buffer() -> None:
    """In a server's process: each page of its shard writes exported into the table's
    own tensors, then copied into the file's write buffer, as before session 31."""
    from pstrain_runtime.sparse import files, shard_writes

    def copied(path: Path, spec: Any, slots: Any, export: Any) -> Any:
        return files.write_rows(path, spec, slots,
                                shard_writes._paged(lambda start: export(start, None)))

    shard_writes.write_pages = copied


def written_bytes(checkpoint: Path) -> int:
    """A checkpoint file's size plus its own sparse directory's (0 when absent)."""
    total = checkpoint.stat().st_size if checkpoint.exists() else 0
    rows = checkpoint.with_suffix(".sparse")
    if rows.is_dir():
        total += sum(p.stat().st_size for p in rows.iterdir() if p.is_file())
    return total


def _peer(rank: int, ports: list[int], job: dict[str, Any], timeout_s: float,
          barrier: Any, pids: Any) -> Any:
    """Ranks 0..PS-1 serve; rank PS is the chief (it records progress events, the CPU
    time of every process at each, and the bytes of each checkpoint it reports), the
    last rank the other worker. Every rank writes its pid into `pids`."""
    import os

    pids[rank] = os.getpid()
    if rank < PS:
        # As shipped, the servers write their own rows (they see the directory); the
        # variants of before, the chief every row.
        directory = (job["training"].get("checkpoint") or {}).get("directory")
        if job["how"] == "copied":
            _copy_pages_into_the_buffer()
        rt.serve_ps(rank, ports[rank], timeout_s,
                    checkpoint_dir=directory if job["how"] in ("", "copied") else None)
        return None
    worker = rank - PS
    training = rt.make_training(job["training"])
    barrier.wait(timeout=timeout_s)
    out = None
    if worker == 0:
        if job["how"] == "full":
            _write_everything_at_once()
        if job["how"] == "buffered":
            from pstrain_runtime.sparse import files

            files.DIRECT = False
        enough = enough_windows(job["window_s"], job["skip"], job["count"])
        sizes: list[int] = []
        cpu: list[list[float]] = []  # each process's CPU seconds, at each progress event

        def stop(events: list) -> bool:
            _, kind, fields = events[-1]
            if kind == "checkpoint":
                sizes.append(written_bytes(Path(str(fields["path"]))))
            if kind == "progress":
                cpu.append([cpu_seconds(p) for p in pids[:]])
            return enough(events)

        rec = rt.Recorder(stop)
        rt.run_trainer(training, job["namespace"], 0, WORKERS, ports, rec,
                       progress_interval=job["progress_s"])
        out = {"points": [(t, f["step"]) for t, k, f in rec.events if k == "progress"],
               "sizes": sizes, "cpu": cpu}
    else:
        training.steps = MAX_STEPS
        rt.run_trainer(training, job["namespace"], worker, WORKERS, ports)
    barrier.wait(timeout=timeout_s)
    if worker == 0:
        rt.shutdown_servers(ports)
    return out


def _job(cfg: Config, name: str, interval: int | None, how: str,
         directory: Path) -> dict[str, Any]:
    total = QUICK_TOTAL_ROWS if cfg.quick else TOTAL_ROWS
    batch = QUICK_BATCH if cfg.quick else BATCH
    spec = ModelSpec("ctr", f"CTR {total} rows", ENTRYPOINT, task_args(total, "ps"), batch,
                     dict(ADAGRAD))
    training = spec.training("async", MAX_STEPS)
    if interval is not None:
        training["checkpoint"] = {"directory": str(directory), "intervalSteps": interval}
    window = cfg.train_seconds_per_rep
    return {"namespace": f"bench/sparse-ckpt-{name}", "training": training, "how": how,
            "window_s": window, "skip": cfg.warmup, "count": cfg.repeats,
            "progress_s": min(1.0, window / 4), "per_step": batch}


def _figures(cfg: Config, name: str, interval: int | None, how: str, per_step: int,
             got: list[dict[str, Any]]) -> list[Figure]:
    what = ("no checkpoints" if interval is None else
            f"a checkpoint every {interval} steps{HOW[how]}")
    key = f"sparse_ckpt.{name}"
    rows = size_name(QUICK_TOTAL_ROWS if cfg.quick else TOTAL_ROWS)
    label = f"CTR {rows} rows x {DIM}, async, {PS} PS + {WORKERS} workers, {what}"
    rates = [r for one in got for r in window_rates(one["points"], per_step,
                                                    cfg.train_seconds_per_rep,
                                                    cfg.warmup, cfg.repeats)]
    if not rates:
        return [Figure.missing(key, label, "samples/s", "no complete measurement window")]
    figs = [Figure.of(key, label, "samples/s", rates,
                      note=f"batch {per_step}/worker, {len(got)} rounds")]
    cpu = [c * 1e6 for c in (cpu_per_sample(cfg, one, per_step) for one in got) if c]
    if cpu:
        shares = {role: [c * 1e6 for c in (cpu_per_sample(cfg, one, per_step, ranks)
                                           for one in got) if c]
                  for role, ranks in (("servers", slice(0, PS)), ("chief", slice(PS, PS + 1)),
                                      ("the other worker", slice(PS + 1, None)))}
        split = "; ".join(f"{role} {statistics.median(v):.1f}" for role, v in shares.items()
                          if v)
        figs.append(Figure.of(f"{key}.cpu", f"{label}: CPU time per 1000 samples, all "
                              "processes", "CPU-ms", cpu,
                              note=f"one per round; medians: {split}"))
    sizes = [s for one in got for s in one["sizes"]]
    if interval is not None and sizes:
        figs.append(Figure(f"{key}.bytes", f"{label}: bytes written per checkpoint "
                           "(file + its sparse rows)", "MB",
                           statistics.median(sizes) / 1e6, n=len(sizes),
                           note=f"{len(sizes)} checkpoints in {len(got)} rounds, largest "
                           f"{max(sizes) / 1e6:.1f} MB, total {sum(sizes) / 1e6:.0f} MB",
                           samples=[round(s / 1e6, 3) for s in sizes]))
    return figs


def cpu_per_sample(cfg: Config, one: dict[str, Any], per_step: int,
                   ranks: slice = slice(None)) -> float | None:
    """CPU seconds per sample over a job's measured windows, of all processes (or of
    those of `ranks`: servers first, then the chief, then the other worker)."""
    span = measured_span(one["points"], cfg.train_seconds_per_rep, cfg.warmup, cfg.repeats)
    if span is None or len(one["cpu"]) <= span[1]:
        return None
    i, j = span
    samples = (one["points"][j][1] - one["points"][i][1]) * per_step
    used = sum(one["cpu"][j][ranks]) - sum(one["cpu"][i][ranks])
    return used / samples if samples > 0 else None


def _round_ratios(cfg: Config, got: dict[str, list[dict[str, Any]]], per_step: int
                  ) -> list[Figure]:
    """Per variant and round, against the run without checkpoints of the same round
    (the load drifts between rounds more than within one): samples/s (the medians of
    the round's windows), and samples per CPU-second of all processes (what the
    checkpoints cost where the CPUs are saturated, whatever else the machine runs)."""
    def rate(one: dict[str, Any]) -> float | None:
        return median_rate(one["points"], per_step, cfg.train_seconds_per_rep,
                           cfg.warmup, cfg.repeats)

    def cpu(one: dict[str, Any]) -> float | None:
        per = cpu_per_sample(cfg, one, per_step)
        return None if per is None else 1.0 / per

    figs = []
    for name, interval, how in VARIANTS[1:]:
        for suffix, measure, what in (("vs_none", rate, "samples/s"),
                                      ("cpu_vs_none", cpu, "samples per CPU-second")):
            key = f"sparse_ckpt.{name}.{suffix}"
            label = f"{what} with a checkpoint every {interval} steps{HOW[how]} / without"
            pairs = [(measure(a), measure(b))
                     for a, b in zip(got[name], got["none"], strict=True)]
            ratios = [a / b for a, b in pairs if a and b]
            figs.append(Figure.of(key, label, "x", ratios, note="per round, against the "
                                  "round's job without checkpoints") if ratios else
                        Figure.missing(key, label, "x", "no complete measurement window"))
    return figs


def run(cfg: Config) -> list[Figure]:
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    directory = Path(tempfile.mkdtemp(prefix="pstrain-bench-sparse-ckpt-"))
    got: dict[str, list[dict[str, Any]]] = {name: [] for name, _, _ in VARIANTS}
    jobs: dict[str, dict[str, Any]] = {}
    try:
        for k in range(QUICK_ROUNDS if cfg.quick else ROUNDS):
            # each round in another order, so that a drift of the load spreads evenly
            for name, interval, how in VARIANTS[k:] + VARIANTS[:k]:
                job = jobs[name] = _job(cfg, name, interval, how, directory / f"{name}-{k}")
                got[name].append(run_group(_peer, PS + WORKERS,
                                           args=(find_free_ports(PS), job,
                                                 cfg.item_time_limit_s,
                                                 ctx.Barrier(WORKERS),
                                                 ctx.Array("i", PS + WORKERS)),
                                           timeout_s=cfg.item_time_limit_s)[PS])
                shutil.rmtree(directory / f"{name}-{k}", ignore_errors=True)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    figs: list[Figure] = []
    for name, interval, how in VARIANTS:
        figs += _figures(cfg, name, interval, how, jobs[name]["per_step"], got[name])
    return figs + _round_ratios(cfg, got, jobs["none"]["per_step"])
