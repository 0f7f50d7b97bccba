"""Item 4, training throughput and time to accuracy.

For each model (the digits MLP, a wider MLP of about 17 MB, the >= 50 MB synthetic
MLP), with the same model, batch size, optimizer and 2 workers:

- pstrain, async and sync: 1 parameter server and 2 trainers (processes), each job run
  through the runtime's own `Trainer`. samples/s comes from the chief's progress events
  (global step and time): the first window is the warm-up, then `repeats` windows of
  about `train_seconds_per_rep` each. Then the chief ends the job (see rt.Recorder).
- DistributedDataParallel over gloo, 2 processes: calibrate a step time, then windows
  of a fixed number of steps (DDP ranks must run the same count).
- a single process, same loop without DDP.

Every process is held to one compute thread (the machine has 2 cores).

Time to 95% accuracy on digits: pstrain async (1 PS, 2 workers) against a single
process, both evaluating every `EVAL_EVERY` global steps, 5 runs each; the clock starts
when training starts (the chief's `run()`, the single process's first step).

Reduced-precision wire (`wireDtype`): final test accuracy on digits after
`WIRE_STEPS` async global steps with float32, bfloat16 and float16 gradients on the
wire, 5 runs each (async runs differ run to run by arrival order).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from . import rt
from .core import Config, Figure, run_parts
from .procs import LOOPBACK, cpu_seconds, find_free_ports, free_port, run_group
from .usage import rss_bytes, status_field, thread_count, wire_bytes

WORKERS = 2
EVAL_EVERY = 10
WIRE_STEPS = 600  # async global steps per run (examples/digits.yaml now runs 900)
WIRE_DTYPES = ("float32", "bfloat16", "float16")
SEED = 0


@dataclass(frozen=True)
class ModelSpec:
    name: str
    label: str
    entrypoint: str
    args: dict[str, Any]
    batch: int
    optimizer: dict[str, Any] = field(
        default_factory=lambda: {"name": "momentum", "learningRate": 0.05, "momentum": 0.9})

    def training(self, mode: str, steps: int, eval_every: int | None = None,
                 wire_dtype: str = "float32") -> dict[str, Any]:
        """`mode` async, sync, or async_pipeline (async with `pipeline: true`)."""
        spec: dict[str, Any] = {"entrypoint": self.entrypoint, "args": self.args,
                                "steps": steps, "batchSize": self.batch,
                                "mode": mode.removesuffix("_pipeline"),
                                "pipeline": mode.endswith("_pipeline"),
                                "optimizer": self.optimizer, "seed": SEED,
                                "wireDtype": wire_dtype}
        if eval_every:
            spec["evalIntervalSteps"] = eval_every
        return spec


DIGITS = "pstrain_runtime.examples.digits:make_task"
SYNTH = "pstrain_runtime.examples.synthetic:make_task"
SGD = {"name": "sgd", "learningRate": 0.01}

FULL_MODELS = (
    ModelSpec("digits", "digits MLP (hidden 1024, 0.31 MB)", DIGITS, {"hidden": 1024}, 64),
    ModelSpec("wide", "wide MLP (hidden 1024 x 4, 16.8 MB)", SYNTH,
              {"hidden": 1024, "layers": 3}, 64, SGD),
    ModelSpec("large", "synthetic MLP (hidden 2048 x 4, 67 MB)", SYNTH,
              {"hidden": 2048, "layers": 3}, 32, SGD),
)
QUICK_MODELS = (
    ModelSpec("digits", "digits MLP (hidden 64, quick)", DIGITS, {"hidden": 64}, 64),
    ModelSpec("wide", "wide MLP (hidden 256 x 2, quick)", SYNTH, {"hidden": 256, "layers": 1},
              64, SGD),
    ModelSpec("large", "synthetic MLP (hidden 512 x 2, quick)", SYNTH,
              {"hidden": 512, "layers": 1}, 32, SGD),
)
ACCURACY_MODEL = FULL_MODELS[0]
PS_MODES = ("async", "sync", "async_pipeline")
MAX_STEPS = 10**7  # the trainers' nominal budget; jobs end by the chief (rt.Recorder)


def model_bytes(spec: ModelSpec) -> int:
    from pstrain_runtime.task import load_task

    return sum(p.numel() * p.element_size() for p in load_task(spec.entrypoint, spec.args)
               .model.parameters())


# --------------------------------------------------------------------------- pure


def window_bounds(points: Sequence[tuple[float, int]], window_s: float) -> list[int]:
    """Indices of `points` ((time, cumulative units), time-ordered) that close
    consecutive windows of at least `window_s` seconds with progress; index 0 opens the
    first window."""
    bounds = [0] if points else []
    for i in range(1, len(points)):
        t0, n0 = points[bounds[-1]]
        t, n = points[i]
        if t - t0 >= window_s and n > n0:
            bounds.append(i)
    return bounds


def window_rates(points: Sequence[tuple[float, int]], per_unit: float, window_s: float,
                 skip: int, count: int) -> list[float]:
    """Rates (per_unit * units/second) over consecutive windows of at least `window_s`
    seconds, from (time, cumulative units) points; the first `skip` windows are
    dropped, at most `count` are returned."""
    b = window_bounds(points, window_s)
    rates = [(points[j][1] - points[i][1]) * per_unit / (points[j][0] - points[i][0])
             for i, j in zip(b, b[1:], strict=False)]
    return rates[skip:skip + count]


def median_rate(points: Sequence[tuple[float, int]], per_unit: float, window_s: float,
                skip: int, count: int) -> float | None:
    """The median of `window_rates` (None without a complete window)."""
    rates = window_rates(points, per_unit, window_s, skip, count)
    return statistics.median(rates) if rates else None


def measured_span(points: Sequence[tuple[float, int]], window_s: float, skip: int,
                  count: int) -> tuple[int, int] | None:
    """(first, last) point indices of the measured windows (warm-up excluded)."""
    b = window_bounds(points, window_s)
    if len(b) <= skip + 1:
        return None
    return b[skip], b[min(skip + count, len(b) - 1)]


def enough_windows(window_s: float, skip: int, count: int) -> Callable[[list], bool]:
    def check(events: list[tuple[float, str, dict]]) -> bool:
        points = [(t, f["step"]) for t, k, f in events if k == "progress"]
        return len(window_rates(points, 1.0, window_s, skip, count)) >= count
    return check


def reached_accuracy(target: float) -> Callable[[list], bool]:
    def check(events: list[tuple[float, str, dict]]) -> bool:
        return any(k == "eval" and f.get("accuracy", 0.0) >= target for _, k, f in events)
    return check


# --------------------------------------------------------------------------- pstrain


def _ps_job_peer(rank: int, ports: list[int], jobs: list[dict[str, Any]], timeout_s: float,
                 pids: Any, barrier: Any) -> Any:
    """ranks 0 .. len(ports) - 1 serve (one PS each); the next rank is the chief, the
    last the other worker. Runs `jobs` in order, each in its own namespace (a job's
    `overlap`, default off, is the trainers' `--overlap`). Every rank writes its pid
    into `pids` (a shared array) and the chief samples every process's CPU time at each
    progress event.

    The trainers meet at `barrier` before and after every job: both start a job
    together (the time-to-accuracy clock is fair), and the chief never runs ahead into
    the next job or shuts the server down while the other worker is still in a job
    (it would then wait for a server that is gone)."""
    import os

    if pids is not None:
        pids[rank] = os.getpid()
    num_ps = len(ports)
    if rank < num_ps:
        rt.serve_ps(rank, ports[rank], timeout_s)
        return None
    worker = rank - num_ps
    out = []
    for job in jobs:
        training = rt.make_training(job["training"])
        barrier.wait(timeout=timeout_s)
        if worker == 0:
            if job["kind"] == "throughput":
                enough = enough_windows(job["window_s"], job["skip"], job["count"])
                memory = job.get("sample_memory", False)

                def stop(events: list, enough: Callable[[list], bool] = enough,
                         memory: bool = memory) -> bool:
                    if events[-1][1] == "progress":
                        events[-1][2]["cpu"] = [cpu_seconds(p) for p in pids[:]]
                        if memory:  # the CTR item: RSS and threads of all, TCP bytes
                            events[-1][2]["rss"] = [rss_bytes(p) for p in pids[:]]
                            events[-1][2]["rss_anon"] = [  # without mapped files (code)
                                status_field(p, "RssAnon") * 1024 for p in pids[:]]
                            events[-1][2]["threads"] = [thread_count(p) for p in pids[:]]
                            events[-1][2]["wire"] = wire_bytes(pids[num_ps:])
                    return enough(events)
            elif job["kind"] == "accuracy":
                stop = reached_accuracy(job["target"])
            else:  # "fixed": run the job's own number of steps
                stop = lambda events: False  # noqa: E731
            rec = rt.Recorder(stop)
            _, t0, t1 = rt.run_trainer(training, job["namespace"], 0, WORKERS, ports, rec,
                                       progress_interval=job["progress_s"],
                                       overlap=job.get("overlap", False))
            out.append({"t0": t0, "t1": t1, "stopped_at": rec.stopped_at,
                        "events": [(t, k, f) for t, k, f in rec.events
                                   if k in ("progress", "eval", "done")]})
        else:
            training.steps = MAX_STEPS
            rt.run_trainer(training, job["namespace"], worker, WORKERS, ports,
                           overlap=job.get("overlap", False))
        barrier.wait(timeout=timeout_s)
    if worker == 0:
        rt.shutdown_servers(ports)
    return out


def _run_ps_jobs(cfg: Config, jobs: list[dict[str, Any]],
                 num_ps: int = 1) -> list[dict[str, Any]]:
    """Run `jobs` in one group of `num_ps` PS + 2 trainer processes; the chief's record
    of each."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    ports = find_free_ports(num_ps)
    return run_group(_ps_job_peer, num_ps + WORKERS,
                     args=(ports, jobs, cfg.item_time_limit_s,
                           ctx.Array("i", num_ps + WORKERS), ctx.Barrier(WORKERS)),
                     timeout_s=cfg.item_time_limit_s)[num_ps]


def _throughput_job(cfg: Config, spec: ModelSpec, mode: str, key: str, label: str,
                    cpu_label: str, namespace: str, overlap: bool = False) -> dict[str, Any]:
    window = cfg.train_seconds_per_rep
    return {"kind": "throughput", "namespace": namespace,
            "training": spec.training(mode, MAX_STEPS), "window_s": window,
            "skip": cfg.warmup, "count": cfg.repeats, "progress_s": min(1.0, window / 4),
            "overlap": overlap, "key": key, "label": label, "cpu_label": cpu_label,
            "batch": spec.batch,
            "per_step": spec.batch * (WORKERS if mode == "sync" else 1)}


def _throughput_figures(cfg: Config, jobs: Sequence[dict[str, Any]],
                        res: Sequence[dict[str, Any]], num_ps: int = 1) -> list[Figure]:
    """samples/s of each throughput job (its `key`, `label`) and its CPU time per 1000
    samples, from the chief's progress events; CPU samples list the PS first."""
    window = cfg.train_seconds_per_rep
    figs = []
    for job, got in zip(jobs, res, strict=True):
        progress = [f for _, k, f in got["events"] if k == "progress"]
        points = [(t, f["step"]) for t, k, f in got["events"] if k == "progress"]
        rates = window_rates(points, job["per_step"], window, cfg.warmup, cfg.repeats)
        key, label = job["key"], job["label"]
        if not rates:
            figs.append(Figure.missing(key, label, "samples/s",
                                       "no complete measurement window"))
            continue
        figs.append(Figure.of(key, label, "samples/s", rates,
                              note=f"batch {job['batch']}/worker"))
        span = measured_span(points, window, cfg.warmup, cfg.repeats)
        if span is not None and "cpu" in progress[span[0]] and "cpu" in progress[span[1]]:
            i, j = span
            samples = (points[j][1] - points[i][1]) * job["per_step"]
            cpu = [b - a for a, b in zip(progress[i]["cpu"], progress[j]["cpu"], strict=True)]
            ps_cpu, worker_cpu = sum(cpu[:num_ps]), sum(cpu[num_ps:])
            figs.append(_cpu_figure(f"{key}.cpu", job["cpu_label"], sum(cpu), samples,
                                    f"PS {1e3 * ps_cpu / samples * 1000:.0f}, workers "
                                    f"{1e3 * worker_cpu / samples * 1000:.0f}; "
                                    f"{sum(cpu) / (points[j][0] - points[i][0]):.2f} "
                                    "cores busy"))
    return figs


def ps_throughput(cfg: Config, models: Sequence[ModelSpec]) -> list[Figure]:
    jobs = [_throughput_job(cfg, spec, mode, f"training.{spec.name}.{mode}",
                            f"{spec.label}: pstrain {mode}, 1 PS + 2 workers",
                            f"{spec.label}: pstrain {mode}", f"bench/{spec.name}-{mode}")
            for spec in models for mode in PS_MODES]
    return _throughput_figures(cfg, jobs, _run_ps_jobs(cfg, jobs))


OVERLAP_PS = 2


def overlap_throughput(cfg: Config) -> list[Figure]:
    """Item `overlap`: pstrain async samples/s on the wide MLP with 2 PS + 2 workers,
    the trainers' `overlap` on (a shard's push starts during backward) and off (one
    fused push_pull per server after backward), in the same process group, one job
    after the other."""
    spec = next(m for m in (QUICK_MODELS if cfg.quick else FULL_MODELS) if m.name == "wide")
    jobs = [_throughput_job(cfg, spec, "async", f"overlap.wide.{name}",
                            f"{spec.label}: pstrain async, {OVERLAP_PS} PS + 2 workers, "
                            f"overlap {name}",
                            f"{spec.label}: pstrain async, {OVERLAP_PS} PS, overlap {name}",
                            f"bench/overlap-{name}", overlap=on)
            for name, on in (("off", False), ("on", True))]
    figs = [Figure("overlap.wide.model_mb", f"{spec.label}: parameters", "MB",
                   model_bytes(spec) / 1e6, note=f"{spec.entrypoint} {spec.args}")]
    return figs + _throughput_figures(cfg, jobs, _run_ps_jobs(cfg, jobs, OVERLAP_PS),
                                      OVERLAP_PS)


def _cpu_figure(key: str, label: str, cpu_s: float, samples: float, note: str) -> Figure:
    """CPU milliseconds per 1000 samples over the measured windows, all processes."""
    value = 1e3 * cpu_s / samples * 1000
    return Figure(key, f"{label}: CPU time per 1000 samples, all processes", "CPU-ms",
                  value, note=f"over all measured windows; {note}")


TTA_MAX_STEPS = 3000  # a run that has not reached the target by then counts as a miss


def ps_time_to_accuracy(cfg: Config, mode: str = "async") -> Figure:
    spec = ACCURACY_MODEL
    jobs = [{"kind": "accuracy", "namespace": f"bench/tta-{mode}-{i}",
             "training": spec.training(mode, TTA_MAX_STEPS, EVAL_EVERY),
             "target": cfg.accuracy_target, "progress_s": 1.0}
            for i in range(cfg.warmup + cfg.repeats)]
    res = _run_ps_jobs(cfg, jobs)
    secs = []
    for got in res[cfg.warmup:]:
        hits = [t for t, k, f in got["events"]
                if k == "eval" and f.get("accuracy", 0.0) >= cfg.accuracy_target]
        if hits:
            secs.append(hits[0] - got["t0"])
    return _tta_figure(f"training.digits.tta.{mode}",
                       f"{spec.label}: time to {cfg.accuracy_target:.0%} test accuracy, "
                       f"pstrain {mode.replace('_', ' + ')} 1 PS + 2 workers", secs, cfg)


def wire_dtype_accuracy(cfg: Config) -> list[Figure]:
    """Final digits test accuracy after WIRE_STEPS async steps, per wire dtype."""
    spec = ACCURACY_MODEL
    steps = WIRE_STEPS if not cfg.quick else 100
    jobs = [{"kind": "fixed", "namespace": f"bench/wire-{dtype}-{i}", "dtype": dtype,
             "training": spec.training("async", steps, wire_dtype=dtype), "progress_s": 1.0}
            for dtype in WIRE_DTYPES for i in range(cfg.repeats)]
    res = _run_ps_jobs(cfg, jobs)
    figs = []
    for dtype in WIRE_DTYPES:
        accs = [100 * f["accuracy"]
                for job, got in zip(jobs, res, strict=True) if job["dtype"] == dtype
                for _, k, f in got["events"] if k == "done" and f.get("accuracy") is not None]
        key = f"training.digits.wire.{dtype}"
        label = (f"{spec.label}: final test accuracy after {steps} async steps, "
                 f"{dtype} gradients on the wire")
        figs.append(Figure.of(key, label, "%", accs) if accs else
                    Figure.missing(key, label, "%", "no run finished"))
    return figs


def _tta_figure(key: str, label: str, secs: list[float], cfg: Config) -> Figure:
    if not secs:
        return Figure.missing(key, label, "s", f"never reached {cfg.accuracy_target:.0%}")
    note = "" if len(secs) == cfg.repeats else (
        f"{cfg.repeats - len(secs)} of {cfg.repeats} runs never reached the target")
    return Figure.of(key, label, "s", secs, note=note)


# --------------------------------------------------------------------------- baselines


Point = tuple[float, int, float]  # (time, steps done, process CPU seconds)


def _calibrated_windows(step: Callable[[], None], window_s: float, skip: int, count: int,
                        agree: Callable[[int], int] = lambda n: n) -> list[Point]:
    """Run `step` in windows of a fixed step count (sized from a short calibration so
    that one window lasts about `window_s`); return (time, steps, process CPU seconds)
    points.

    `agree(n)` returns the maximum of `n` over all ranks (DDP): every collective
    decision (go on calibrating, the window size) is the same on every rank, so the
    ranks run exactly the same number of steps."""
    t0 = time.perf_counter()
    calib = 0
    while True:
        step()
        calib += 1
        want_more = calib < 3 or (time.perf_counter() - t0 < min(1.0, window_s / 2)
                                  and calib < 10_000)
        if not agree(int(want_more)):
            break
    per_step = (time.perf_counter() - t0) / calib
    n = agree(max(1, math.ceil(window_s / max(per_step, 1e-6))))
    points = [(time.perf_counter(), 0, time.process_time())]
    done = 0
    for _ in range(skip + count):
        for _ in range(n):
            step()
        done += n
        points.append((time.perf_counter(), done, time.process_time()))
    return points


def agreed_max(n: int) -> int:
    """The largest `n` over the ranks of the process group (a gloo all_reduce)."""
    import torch
    import torch.distributed as dist

    t = torch.tensor([n], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def baseline_step(rank: int, world: int, port: int, spec: ModelSpec
                  ) -> tuple[Any, Any, Callable[[], None]]:
    """The task, its model (under DDP over gloo when `world` > 1: the process group is
    made here, the caller destroys it) and one step of the plain PyTorch loop every
    baseline runs."""
    import torch
    import torch.distributed as dist
    from pstrain_api.model import Optimizer
    from pstrain_runtime.optim import OptimizerConfig, torch_optimizer
    from pstrain_runtime.task import load_task
    from pstrain_runtime.worker.context import pick_device

    device = pick_device()
    task = load_task(spec.entrypoint, spec.args)
    model = task.model.to(device)
    if world > 1:
        dist.init_process_group("gloo", init_method=f"tcp://{LOOPBACK}:{port}", rank=rank,
                                world_size=world, timeout=timedelta(seconds=120))
        model = torch.nn.parallel.DistributedDataParallel(model)
    config = OptimizerConfig.from_model(Optimizer.model_validate(spec.optimizer))
    opt = torch_optimizer(config, list(model.parameters()))
    batches = task.batches(rank, world, spec.batch, SEED)

    def step() -> None:
        x, y = next(batches)
        opt.zero_grad(set_to_none=False)
        task.loss(model(x.to(device)), y.to(device)).backward()
        opt.step()

    return task, model, step


def _baseline_rank(rank: int, world: int, port: int, spec: ModelSpec, window_s: float,
                   skip: int, count: int) -> list[tuple[float, int, float]]:
    import torch.distributed as dist

    _, _, step = baseline_step(rank, world, port, spec)

    def agree(n: int) -> int:
        return n if world == 1 else agreed_max(n)

    try:
        return _calibrated_windows(step, window_s, skip, count, agree)
    finally:
        if world > 1:
            dist.destroy_process_group()


def baseline_throughput(cfg: Config, spec: ModelSpec, world: int) -> list[Figure]:
    res = run_group(_baseline_rank, world,
                    args=(world, free_port(), spec, cfg.train_seconds_per_rep, cfg.warmup,
                          cfg.repeats), timeout_s=cfg.item_time_limit_s)
    per_step = spec.batch * world
    # DDP ranks run in lockstep; the slower rank's windows set the pace.
    windows = [window_rates([(t, n) for t, n, _ in r], per_step, 0.0, cfg.warmup,
                            cfg.repeats) for r in res]
    rates = [min(w[i] for w in windows) for i in range(len(windows[0]))]
    first, last = cfg.warmup, len(res[0]) - 1
    cpu = sum(r[last][2] - r[first][2] for r in res)
    samples = (res[0][last][1] - res[0][first][1]) * per_step
    busy = f"{cpu / (res[0][last][0] - res[0][first][0]):.2f} cores busy"
    if world > 1:
        key, label = f"training.{spec.name}.ddp", f"{spec.label}: DDP over gloo, 2 processes"
        note = f"batch {spec.batch}/worker"
    else:
        key, label = f"training.{spec.name}.single", f"{spec.label}: single process"
        note = f"batch {spec.batch}"
    return [Figure.of(key, label, "samples/s", rates, note=note),
            _cpu_figure(f"{key}.cpu", label, cpu, samples, busy)]


def _single_tta(rank: int, spec: ModelSpec, target: float, runs: int,
                limit_s: float) -> list[float | None]:
    from pstrain_api.model import Optimizer
    from pstrain_runtime.optim import OptimizerConfig, torch_optimizer
    from pstrain_runtime.task import load_task
    from pstrain_runtime.worker.context import pick_device

    device = pick_device()
    out: list[float | None] = []
    for _ in range(runs):
        task = load_task(spec.entrypoint, spec.args)
        model = task.model.to(device)
        config = OptimizerConfig.from_model(Optimizer.model_validate(spec.optimizer))
        opt = torch_optimizer(config, list(model.parameters()))
        batches = task.batches(0, 1, spec.batch, SEED)
        t0 = time.perf_counter()
        found = None
        step = 0
        while time.perf_counter() - t0 < limit_s:
            x, y = next(batches)
            opt.zero_grad(set_to_none=False)
            task.loss(model(x.to(device)), y.to(device)).backward()
            opt.step()
            step += 1
            if step % EVAL_EVERY == 0:
                model.eval()
                acc = task.evaluate(model).get("accuracy", 0.0)
                model.train()
                if acc >= target:
                    found = time.perf_counter() - t0
                    break
        out.append(found)
    return out


def single_time_to_accuracy(cfg: Config) -> Figure:
    spec = ACCURACY_MODEL
    got = run_group(_single_tta, 1, args=(spec, cfg.accuracy_target, cfg.warmup + cfg.repeats,
                                          cfg.accuracy_time_limit_s),
                    timeout_s=cfg.item_time_limit_s)[0]
    secs = [s for s in got[cfg.warmup:] if s is not None]
    return _tta_figure("training.digits.tta.single",
                       f"{spec.label}: time to {cfg.accuracy_target:.0%} test accuracy, "
                       "single process", secs, cfg)


def run(cfg: Config) -> list[Figure]:
    models = QUICK_MODELS if cfg.quick else FULL_MODELS
    figs: list[Figure] = []
    for spec in models:
        mb = model_bytes(spec) / 1e6
        figs.append(Figure(f"training.{spec.name}.model_mb", f"{spec.label}: parameters",
                           "MB", mb, note=f"{spec.entrypoint} {spec.args}"))
    parts: list[tuple[str, Callable[[], Any]]] = [
        ("pstrain throughput", lambda: ps_throughput(cfg, models))]
    for spec in models:
        parts.append((f"{spec.name} DDP",
                      lambda spec=spec: baseline_throughput(cfg, spec, WORKERS)))
        parts.append((f"{spec.name} single",
                      lambda spec=spec: baseline_throughput(cfg, spec, 1)))
    parts += [("pstrain time to accuracy", lambda: [ps_time_to_accuracy(cfg),
                                                    ps_time_to_accuracy(cfg, "async_pipeline")]),
              ("single time to accuracy", lambda: [single_time_to_accuracy(cfg)]),
              ("wire dtype accuracy", lambda: wire_dtype_accuracy(cfg))]
    return figs + run_parts("training", parts)
