"""One server's table calls in-process, for profiling the disk tier (not a bench item):
`python -m bench.tier_calls {ram,disk} [--steps N] [--warmup N] [--zipf A]`.

A shard of the `sparse_disk` item's table (the CTR model's 26 tables fused into one,
`sparse_disk.TOTAL_ROWS` rows x `DIM`, Adagrad) on server 0 of 2: every step reads,
then updates, the unique ids of one CTR batch of `BATCH` that server 0 owns (Zipf
`--zipf`, or uniform with 0), as a worker's pull and push reach it. `ram` is a
`RowTable` with every row in memory, `disk` a `TieredTable` with the item's budget
(`BUDGET_MIB`, its rows beyond it in RocksDB in a temporary folder), one torch thread
as in a server. Prints one JSON line: milliseconds per read + update over the measured
steps (the id draws excluded); the process's CPU milliseconds per step, every thread's
(the draws excluded: RocksDB's flushes and compactions run on threads of their own,
beside the calls, and with every core busy, as in a job, they cost what they take); ids
per call; the process's minor page faults and system CPU seconds over them; its peak
anonymous RSS (sampled every 50 ms); and the tiers' rows at the end. Without the server's threads, sockets and frames: a table's
own costs, which `pstrain run`'s servers add to (bench/RESULTS.md, session 12).

`--evict K` gives the table `evict_after_steps` K (sweeps every K/4 steps, in the calls'
figures). `--deltas N` then exports the shard as checkpoints do (`export_ms`): a full export,
then N times `--interval` more steps and a delta of the rows updated since the export
before, each with the export's thread CPU milliseconds and rows, and the CPU
milliseconds of the steps between (bench/RESULTS.md, session 18).
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import tempfile
import threading
import time
from typing import Any

from .ctr import ADAGRAD, PS
from .sparse_disk import BATCH, BUDGET_MIB, DIM, TOTAL_ROWS
from .usage import status_field

SERVER = 0  # the shard measured


class PeakAnon:
    """The process's peak `RssAnon` (KiB), sampled every `every_s` on a thread until
    `stop`."""

    def __init__(self, every_s: float = 0.05) -> None:
        self.peak_kib = 0
        self.every_s = every_s
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._watch, name="rss-anon-peak", daemon=True)
        self.thread.start()

    def _watch(self) -> None:
        while True:
            self.peak_kib = max(self.peak_kib, status_field("self", "RssAnon"))
            if self.stopped.wait(self.every_s):
                return

    def stop(self) -> int:
        """Stop sampling; the peak in KiB."""
        self.stopped.set()
        self.thread.join(timeout=5 * self.every_s + 1.0)
        return self.peak_kib


def make_table(side: str, rows: int, directory: str, evict: int | None = None) -> Any:
    """Server `SERVER`'s shard of a table of `rows` rows: all in RAM, or with a disk tier
    (`evict`: the table's `evict_after_steps`)."""
    from pstrain_runtime.optim import OptimizerConfig
    from pstrain_runtime.sparse.spec import TableSpec
    from pstrain_runtime.sparse.table import RowTable
    from pstrain_runtime.sparse.tiered import TieredTable, shard_directory

    spec = TableSpec("ctr", rows, DIM, 0.01, evict_after_steps=evict,
                     optimizer=OptimizerConfig("adagrad", ADAGRAD["learningRate"],
                                               eps=ADAGRAD["eps"]))
    if side == "ram":
        return RowTable(spec, reserve=rows // PS, num_ps=PS)
    return TieredTable(spec, BUDGET_MIB << 20, shard_directory(directory, SERVER), num_ps=PS)


def measure(side: str, directory: str, steps: int, warmup: int, zipf: float,
            deltas: int = 0, interval: int = 100, evict: int | None = None
            ) -> dict[str, Any]:
    """`warmup` then `steps` read + update calls on a fresh shard (`make_table`); the
    measured steps' figures and the tiers' rows at the end."""
    import torch
    from pstrain_runtime.examples.ctr import NUM_SPARSE, scramble, zipf_ids
    from pstrain_runtime.sparse.ids import owner_of

    rows_per_table = math.ceil(TOTAL_ROWS / NUM_SPARSE)
    offsets = torch.arange(NUM_SPARSE) * rows_per_table
    gen = torch.Generator().manual_seed(1)
    table = make_table(side, rows_per_table * NUM_SPARSE, directory, evict)
    spent, drawing, ids_seen = 0.0, 0.0, 0
    before = resource.getrusage(resource.RUSAGE_SELF)

    def one_step(step: int) -> None:
        nonlocal spent, drawing, ids_seen
        drawn = time.thread_time()
        ids = (scramble(zipf_ids(gen, (BATCH, NUM_SPARSE), rows_per_table, zipf),
                        rows_per_table) + offsets).reshape(-1)
        ids = torch.unique(ids[owner_of(ids, PS) == SERVER])
        grads = torch.randn(ids.numel(), DIM, generator=gen) * 0.01
        drawing += time.thread_time() - drawn
        start = time.perf_counter()
        table.read(ids)
        table.apply(ids, grads, step, step)
        spent += time.perf_counter() - start
        ids_seen += ids.numel()

    for step in range(1, warmup + steps + 1):
        if step == warmup + 1:
            spent, drawing, ids_seen = 0.0, 0.0, 0
            before = resource.getrusage(resource.RUSAGE_SELF)
        one_step(step)
    after = resource.getrusage(resource.RUSAGE_SELF)
    tiers = table.tier_stats() if hasattr(table, "tier_stats") else {}
    cpu_s = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime) - drawing
    out = {"ms_per_call": round(spent / steps * 1e3, 3),
           "cpu_ms_per_call": round(cpu_s / steps * 1e3, 3),
           "ids_per_call": round(ids_seen / steps),
           "minor_faults": after.ru_minflt - before.ru_minflt,
           "system_s": round(after.ru_stime - before.ru_stime, 2), **tiers}
    if deltas:  # (after the figures above: its steps count in none of them)
        out["export_ms"] = checkpoint_exports(table, one_step, warmup + steps + 1,
                                              deltas, interval)
    if hasattr(table, "close"):
        table.close()
    return out


def checkpoint_exports(table: Any, one_step: Any, step: int, deltas: int, interval: int
                       ) -> list[dict[str, Any]]:
    """A full export of `table` from step `step` on, then `deltas` times `interval`
    steps (`one_step(step)`) and a delta since the export before: per export, its
    thread CPU ms and rows, and the steps' CPU ms before it."""
    def export(since: int | None) -> tuple[float, int]:
        start, rows, cpu = 0, 0, time.thread_time()
        while True:
            block, start = table.export(start, 65536, since)
            rows += int(block.ids.numel())
            if start == 0:
                return round((time.thread_time() - cpu) * 1e3, 1), rows
    out: list[dict[str, Any]] = []
    since: int | None = None  # the export's base: the mark of the one before
    steps_ms = 0.0
    for k in range(deltas + 1):
        table.track_removals(since, step)  # the mark: the export begins
        ms, rows = export(since)
        out.append({"kind": "delta" if k else "full", "cpu_ms": ms, "rows": rows,
                    "steps_cpu_ms": steps_ms})
        since, cpu = step, time.thread_time()
        for _ in range(interval if k < deltas else 0):
            one_step(step)
            step += 1
        steps_ms = round((time.thread_time() - cpu) * 1e3, 1)
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m bench.tier_calls",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("side", choices=("ram", "disk"))
    parser.add_argument("--steps", type=int, default=800, help="measured steps")
    parser.add_argument("--warmup", type=int, default=300, help="steps before them")
    parser.add_argument("--zipf", type=float, default=1.2, help="exponent; 0: uniform")
    parser.add_argument("--deltas", type=int, default=0,
                        help="then a full export and this many deltas (checkpoints)")
    parser.add_argument("--interval", type=int, default=100, help="steps between them")
    parser.add_argument("--evict", type=int, default=None,
                        help="the table's evict_after_steps (sweeps every K/4 steps)")
    args = parser.parse_args(argv)
    for flag, value, least in (("--steps", args.steps, 1), ("--warmup", args.warmup, 0),
                               ("--zipf", args.zipf, 0), ("--deltas", args.deltas, 0),
                               ("--interval", args.interval, 1),
                               ("--evict", 1 if args.evict is None else args.evict, 1)):
        if not value >= least:
            parser.error(f"{flag} is {value}; it must be at least {least}")

    import torch

    torch.set_num_threads(1)
    peak = PeakAnon()
    try:
        with tempfile.TemporaryDirectory(prefix="pstrain-tier-calls-") as directory:
            measured = measure(args.side, directory, args.steps, args.warmup, args.zipf,
                               args.deltas, args.interval, args.evict)
    finally:
        peak_kib = peak.stop()
    out = {"side": args.side, "zipf": args.zipf, "steps": args.steps,
           **({"evict": args.evict} if args.evict else {}), **measured,
           "peak_anon_mib": round(peak_kib / 1024, 1)}
    print(json.dumps(out), flush=True)
    return out


if __name__ == "__main__":
    main()
