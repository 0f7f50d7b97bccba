"""The all-reduce baseline of item 3: gloo `all_reduce` of one float32 tensor between 2
processes on 127.0.0.1 (`torch.distributed`), timed from a barrier to the moment the
slower rank has the sum."""

from __future__ import annotations

import time
from datetime import timedelta

from .core import MIB, Config, Figure
from .procs import LOOPBACK, free_port, run_group


def _allreduce_rank(rank: int, world: int, port: int, numel: int, warmup: int,
                    repeats: int) -> list[float]:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://{LOOPBACK}:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=120))
    try:
        t = torch.ones(numel, dtype=torch.float32)
        secs = []
        for i in range(warmup + repeats):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(t)
            dt = time.perf_counter() - t0
            if i >= warmup:
                secs.append(dt)
        return secs
    finally:
        dist.destroy_process_group()


def gloo_allreduce(cfg: Config, mib: int, world: int = 2) -> Figure:
    numel = mib * MIB // 4
    res = run_group(_allreduce_rank, world,
                    args=(world, free_port(), numel, cfg.warmup, cfg.repeats),
                    timeout_s=cfg.item_time_limit_s)
    per_rep = [max(r[i] for r in res) for i in range(len(res[0]))]
    return Figure.of(f"ps_step.allreduce.{mib}MiB",
                     f"gloo all_reduce {mib} MiB fp32, {world} processes", "s", per_rep)
