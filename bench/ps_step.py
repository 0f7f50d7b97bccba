"""Item 3, a parameter-server step against all-reduce.

2 worker processes and 1 (or 2) parameter server processes; one float32 parameter of
`ps_step_mib` MiB (placement splits it by rows over 2 servers). A step: every worker
pushes its gradient of that size and then pulls the parameter back. Workers start each
step together (a barrier); the step time is the slower worker's. The baseline is gloo
`all_reduce` of the same tensor between 2 processes, measured in the same run: once on
its own, and once by the two worker processes themselves, interleaved with the PS steps
repetition by repetition (the ratio uses the interleaved one, so that load shifting on
a shared machine does not skew it).

A step is the runtime's own exchange: the fused push_pull (one round trip per server)
when the runtime has it, else a push then a pull (rt.step). A PS moves twice the bytes
of a 2-process all-reduce (each worker sends and receives
the whole tensor), so 2.0x is byte parity. The bf16 variant sends gradients as
bfloat16 (`spec.training.wireDtype`), parameters still come back in float32.
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

from . import rt
from .allreduce import gloo_allreduce
from .core import MIB, Config, Figure
from .procs import LOOPBACK, find_free_ports, run_group

WORKERS = 2


def _peer(rank: int, num_ps: int, ports: list[int], gloo_port: int, mib: int,
          wire_dtype: str, warmup: int, repeats: int, barrier: Any,
          timeout_s: float) -> dict[str, Any] | None:
    if rank < num_ps:
        rt.serve_ps(rank, ports[rank], timeout_s)
        return None
    import torch
    import torch.distributed as dist

    worker = rank - num_ps
    numel = mib * MIB // 4
    shapes = {"w": (numel,)}
    client = rt.connect(ports, shapes, namespace="ps-step", wire_dtype=wire_dtype)
    params = {"w": torch.zeros(numel)}
    grads = {"w": torch.full((numel,), 1e-6)}
    if worker == 0:
        rt.init(client, params, num_workers=WORKERS)
    dist.init_process_group("gloo", init_method=f"tcp://{LOOPBACK}:{gloo_port}", rank=worker,
                            world_size=WORKERS, timeout=timedelta(seconds=120))
    reduced = torch.ones(numel)
    out: dict[str, Any] = {"step": [], "allreduce": [], "fused": rt.has_push_pull(client)}
    try:
        barrier.wait(timeout=120)
        for i in range(warmup + repeats):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(reduced)
            t_ar = time.perf_counter() - t0
            barrier.wait(timeout=120)
            t0 = time.perf_counter()
            rt.step(client, grads, params, worker)
            t_ps = time.perf_counter() - t0
            if i >= warmup:
                out["allreduce"].append(t_ar)
                out["step"].append(t_ps)
        barrier.wait(timeout=120)
    finally:
        dist.destroy_process_group()
    if worker == 0:
        rt.shutdown(client)
    else:
        client.close()
    return out


def ps_step(cfg: Config, num_ps: int, wire_dtype: str = "float32") -> list[Figure]:
    """The PS step and the all-reduce interleaved with it, as two figures."""
    import multiprocessing as mp

    mib = cfg.ps_step_mib
    barrier = mp.get_context("spawn").Barrier(WORKERS)
    *ports, gloo_port = find_free_ports(num_ps + 1)
    res = run_group(_peer, num_ps + WORKERS,
                    args=(num_ps, ports, gloo_port, mib, wire_dtype, cfg.warmup, cfg.repeats,
                          barrier, cfg.item_time_limit_s),
                    timeout_s=cfg.item_time_limit_s)
    workers = res[num_ps:]
    n = len(workers[0]["step"])
    per_step = [max(w["step"][i] for w in workers) for i in range(n)]
    per_ar = [max(w["allreduce"][i] for w in workers) for i in range(n)]
    tag = "" if wire_dtype == "float32" else f", {wire_dtype} gradients"
    how = ("fused push_pull (one round trip per server)" if workers[0]["fused"]
           else "push, then pull")
    variant = f"ps{num_ps}" + ("" if wire_dtype == "float32" else wire_dtype.replace("float", "f"))
    return [Figure.of(f"ps_step.{variant}.{mib}MiB",
                      f"PS step: 2 workers x (push {mib} MiB + pull {mib} MiB), {num_ps} PS{tag}",
                      "s", per_step, note=how),
            Figure.of(f"ps_step.allreduce_{variant}.{mib}MiB",
                      f"gloo all_reduce {mib} MiB by the same 2 workers, interleaved with the "
                      f"{variant} steps", "s", per_ar)]


def run(cfg: Config) -> list[Figure]:
    figs = [gloo_allreduce(cfg, cfg.ps_step_mib), *ps_step(cfg, 1), *ps_step(cfg, 2)]
    try:
        figs += ps_step(cfg, 1, "bfloat16")
    except RuntimeError as exc:  # GroupError: the runtime may not support it (yet)
        figs.append(Figure.missing(f"ps_step.ps1bf16.{cfg.ps_step_mib}MiB",
                                   "PS step, 1 PS, bfloat16 gradients", "s",
                                   f"failed: {str(exc).strip().splitlines()[-1][:200]}"))
    return figs
