"""Item 6, the worker step with the model on CUDA, and how much of it is transfer.

One parameter server process and one worker process; the worker runs the runtime's
step by hand, timing each part with the device synchronised between parts:

  pull (PS -> pinned host mirror, network) | host -> device copy of the parameters |
  forward + backward on the device | device -> pinned host copy of the gradients |
  push (host -> PS, network)

"transfer" is the sum of the two device copies (PCIe) and, separately, of pull and
push (network). Without a GPU the item reports "not measured"; the same code runs with
`device="cpu"` (copies then stay in host memory) to keep the path tested.
"""

from __future__ import annotations

import time
from typing import Any

from . import rt
from .core import Config, Figure
from .procs import free_port, run_group
from .training import FULL_MODELS, QUICK_MODELS, SEED, ModelSpec

PARTS = ("pull", "h2d", "compute", "d2h", "push")


def _peer(rank: int, port: int, spec: ModelSpec, device_name: str, warmup: int,
          repeats: int, timeout_s: float) -> dict[str, list[float]] | None:
    if rank == 0:
        rt.serve_ps(0, port, timeout_s)
        return None
    import torch
    from pstrain_runtime.task import load_task

    device = torch.device(device_name)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    pin = device.type == "cuda"
    task = load_task(spec.entrypoint, spec.args)
    model = task.model.to(device)
    params = dict(model.named_parameters())
    mirror = {n: torch.empty(p.shape, dtype=p.dtype, pin_memory=pin) for n, p in params.items()}
    grads = {n: torch.empty(p.shape, dtype=p.dtype, pin_memory=pin) for n, p in params.items()}
    for n, p in params.items():
        mirror[n].copy_(p.detach())
    client = rt.connect([port], {n: tuple(t.shape) for n, t in mirror.items()}, "gpu-step")
    rt.init(client, mirror, num_workers=1)
    batches = task.batches(0, 1, spec.batch, SEED)
    out: dict[str, list[float]] = {k: [] for k in (*PARTS, "step")}
    for i in range(warmup + repeats):
        x, y = next(batches)
        t = [time.perf_counter()]
        client.pull(mirror, worker=0)
        t.append(time.perf_counter())
        for n, p in params.items():
            p.data.copy_(mirror[n], non_blocking=True)
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        sync()
        t.append(time.perf_counter())
        model.zero_grad(set_to_none=False)
        task.loss(model(x), y).backward()
        sync()
        t.append(time.perf_counter())
        for n, p in params.items():
            grads[n].copy_(p.grad, non_blocking=True)
        sync()
        t.append(time.perf_counter())
        client.push(grads, worker=0)
        t.append(time.perf_counter())
        if i >= warmup:
            for k, name in enumerate(PARTS):
                out[name].append(t[k + 1] - t[k])
            out["step"].append(t[-1] - t[0])
    rt.shutdown(client)
    return out


def worker_step(cfg: Config, spec: ModelSpec, device: str) -> list[Figure]:
    res: dict[str, Any] = run_group(
        _peer, 2, args=(free_port(), spec, device, cfg.warmup, cfg.repeats,
                        cfg.item_time_limit_s), timeout_s=cfg.item_time_limit_s)[1]
    pcie = [a + b for a, b in zip(res["h2d"], res["d2h"], strict=True)]
    net = [a + b for a, b in zip(res["pull"], res["push"], strict=True)]
    share = [p / s for p, s in zip(pcie, res["step"], strict=True)]
    key = f"gpu.{spec.name}"
    tag = f"{spec.label}, batch {spec.batch}, on {device}"
    figs = [Figure.of(f"{key}.step", f"worker step (pull+copy+fwd/bwd+copy+push), {tag}",
                      "s", res["step"]),
            Figure.of(f"{key}.compute", f"forward + backward, {tag}", "s", res["compute"]),
            Figure.of(f"{key}.pcie", f"host<->device copies (params in, grads out), {tag}",
                      "s", pcie),
            Figure.of(f"{key}.pcie_share", f"host<->device copies / step, {tag}", "x", share),
            Figure.of(f"{key}.network", f"pull + push to the PS (loopback), {tag}", "s", net)]
    return figs


def run(cfg: Config) -> list[Figure]:
    import torch

    if not torch.cuda.is_available():
        return [Figure.missing("gpu.step", "worker step with the model on CUDA", "s",
                               "not measured: no GPU in this run")]
    models = QUICK_MODELS if cfg.quick else FULL_MODELS
    figs: list[Figure] = []
    for spec in models[1:]:
        figs += worker_step(cfg, spec, "cuda")
    return figs
