"""The TorchRec side of item `ctr`: the same DLRM model, data, batch and optimizer as
pstrain and DDP (`bench.ctr`), trained the way TorchRec trains it on CPUs.

- 2 ranks over gloo, each a process with one compute thread (`torch.set_num_threads(1)`).
- The 26 tables (`rows_per_table` rows x `DIM` each, one feature per table, sum
  pooling) in one `EmbeddingBagCollection`, sharded by `DistributedModelParallel` with
  the default planner (`EmbeddingShardingPlanner`; on 2 CPU ranks it places whole
  tables: table-wise, 13 tables per rank, the figure's note says what it chose). The
  tables' optimizer is fused into their backward: EXACT_ADAGRAD (per element, like
  torch.optim.Adagrad), lr `ctr.LR`, eps `ctr.ADAGRAD_EPS`. Their rows start uniform
  with the standard deviation of the example's normal(0, 0.05) rows (fbgemm's tables
  initialise uniformly).
- The dense part (bottom MLP 13-64-32, pairwise dot products of the 27 vectors, top MLP
  32 + 351 -> 64 -> 1, the example's own `mlp`) is replicated by DMP under DDP and
  trained with torch.optim.Adagrad built by pstrain's `torch_optimizer` from
  `ctr.ADAGRAD` (as the DDP side's).
- Batches: `pstrain_runtime.examples.ctr`'s task (`make_task(...).batches`, the same
  generator seeds per worker as pstrain's workers and DDP's ranks), batch per rank as
  theirs; each batch's ids become a `KeyedJaggedTensor` in the model's forward.
- Measured as DDP is (`ctr.lockstep_run`): windows of a calibrated step count, samples/s
  of the slower rank, CPU time of both processes, peak RSS; after `auc_samples` samples
  (during the windows or after them) the task's `evaluate` (its held-out AUC). The
  sharded forward is collective, so both ranks run `evaluate` after a barrier and rank
  0's result is the figure.

torchrec and fbgemm_gpu are imported only inside the rank function; where they are not
installed the figures are missing and say how to install them.
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Mapping, Sequence
from typing import Any

from . import ctr
from .core import Config, Figure
from .usage import mem_available

SIDE = "torchrec"
INSTALL = ("pip install --no-deps torchrec==1.8.0 fbgemm-gpu-cpu==1.8.0 && "
           "pip install tensordict torchmetrics tqdm pyre-extensions")
MISSING = f"torchrec is not installed: {INSTALL}"
MODULES = ("torchrec", "fbgemm_gpu")
STATE_COPIES = 2  # the tables and their Adagrad sums, over both ranks together
INIT_STD = 0.05  # the example's `init_std`


# --------------------------------------------------------------------------- pure


def keys(size: str, ids: str) -> dict[str, str]:
    """The figure keys of one (size, ids) run: samples/s, cpu, worker_rss, auc."""
    base = ctr.fig_key(SIDE, size, ids)
    return {"samples/s": base, **{m: f"{base}.{m}" for m in ("cpu", "worker_rss", "auc")}}


def label(total: int, ids: str) -> str:
    return (f"CTR, {ctr.size_name(total)} rows x {ctr.DIM}, {ctr.ids_label(ids)}: TorchRec "
            f"DistributedModelParallel over gloo, {ctr.WORKERS} processes, fused "
            "EXACT_ADAGRAD")


def missing_figures(total: int, ids: str, why: str) -> list[Figure]:
    """Every figure of one run, missing for the same reason."""
    units = {"samples/s": "samples/s", "cpu": "CPU-ms", "worker_rss": "MB", "auc": "AUC"}
    return [Figure.missing(key, label(total, ids) if metric == "samples/s" else
                           f"CTR {ctr.size_name(total)}, {ctr.ids_label(ids)}: TorchRec "
                           f"{metric}", units[metric], why)
            for metric, key in keys(ctr.size_name(total), ids).items()]


def not_installed() -> str | None:
    """Why TorchRec cannot run here (the install command), or None. Looks the modules
    up without importing them; the rank function still guards its imports."""
    for name in MODULES:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            return MISSING
    return None


def bytes_needed(total_rows: int) -> int:
    return STATE_COPIES * ctr.table_bytes(total_rows)


def plan_note(plan: Mapping[str, Sequence[int]]) -> str:
    """{"table_wise": [13, 13]} -> "default planner's plan: table_wise, 13 + 13 tables
    per rank"."""
    return "default planner's plan: " + "; ".join(
        f"{kind}, {' + '.join(str(n) for n in per_rank)} tables per rank"
        for kind, per_rank in sorted(plan.items()))


# --------------------------------------------------------------------------- measuring


def _import_problem() -> str | None:
    try:
        import fbgemm_gpu  # noqa: F401
        import torchrec  # noqa: F401
    except ImportError as exc:  # also a None in sys.modules: the tests' simulated absence
        return f"{MISSING} ({type(exc).__name__}: {exc})"
    return None


def build_model(rows: int) -> Any:
    """The DLRM model with its tables in an `EmbeddingBagCollection` on the meta device
    (DMP materialises each rank's shards). Its forward takes the example's batch input
    (float64: 13 dense features, then 26 ids) like `CTRModel`'s."""
    import torch
    from pstrain_runtime.examples import ctr as example
    from torch import nn
    from torchrec import (EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor,
                          PoolingType)

    bound = INIT_STD * math.sqrt(3.0)  # uniform(-b, b) has the std of normal(0, INIT_STD)
    names = [f"f{t}" for t in range(example.NUM_SPARSE)]
    tables = [EmbeddingBagConfig(name=f"t{t}", embedding_dim=ctr.DIM, num_embeddings=rows,
                                 feature_names=[names[t]], pooling=PoolingType.SUM,
                                 weight_init_min=-bound, weight_init_max=bound)
              for t in range(example.NUM_SPARSE)]

    class DLRM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            n = 1 + example.NUM_SPARSE
            self.bottom = example.mlp([example.NUM_DENSE, 64, ctr.DIM], last_relu=True)
            self.sparse = EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
            self.top = example.mlp([ctr.DIM + n * (n - 1) // 2, 64, 1], last_relu=False)
            i, j = torch.triu_indices(n, n, offset=1)
            self.register_buffer("pairs_i", i, persistent=False)
            self.register_buffer("pairs_j", j, persistent=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            batch = len(x)
            dense = self.bottom(x[:, :example.NUM_DENSE].to(torch.float32))
            ids = x[:, example.NUM_DENSE:].to(torch.int64)  # (batch, 26)
            kjt = KeyedJaggedTensor.from_lengths_sync(
                keys=names, values=ids.t().reshape(-1),  # feature-major, one id per bag
                lengths=torch.ones(example.NUM_SPARSE * batch, dtype=torch.int32))
            emb = self.sparse(kjt).values().view(batch, example.NUM_SPARSE, ctr.DIM)
            feats = torch.cat([dense.unsqueeze(1), emb], 1)  # (batch, 27, dim)
            dots = torch.bmm(feats, feats.transpose(1, 2))[:, self.pairs_i, self.pairs_j]
            return self.top(torch.cat([dense, dots], 1)).squeeze(1)

    return DLRM()


def _torchrec_rank(rank: int, world: int, port: int, total_rows: int, ids: str,
                   batch: int, window_s: float, skip: int, count: int,
                   auc_steps: int | None) -> dict[str, Any]:
    """One TorchRec rank: build, shard, measure (`ctr.lockstep_run`), evaluate. Returns
    {"missing": why} at once when torchrec or fbgemm_gpu cannot be imported."""
    problem = _import_problem()
    if problem is not None:
        return {"missing": problem}
    import logging
    import warnings
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from pstrain_api.model import Optimizer
    from pstrain_runtime.examples import ctr as example
    from pstrain_runtime.optim import OptimizerConfig, torch_optimizer
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    from .procs import LOOPBACK
    from .training import SEED, agreed_max

    # The planner's advice on building topologies and its storage estimates, DMP's on
    # DDP arguments, torch.fx's on tracing checks: nothing this benchmark acts on.
    warnings.filterwarnings("ignore", category=FutureWarning)
    for name in ("torchrec", "torch.fx"):
        logging.getLogger(name).setLevel(logging.ERROR)
    torch.set_num_threads(1)

    task = example.make_task(**ctr.task_args(total_rows, "none", ids))  # data, loss, eval
    config = OptimizerConfig.from_model(Optimizer.model_validate(ctr.ADAGRAD))
    dist.init_process_group("gloo", init_method=f"tcp://{LOOPBACK}:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=120))
    try:
        torch.manual_seed(SEED)
        model = build_model(ctr.rows_per_table(total_rows))
        sharder = EmbeddingBagCollectionSharder(fused_params={
            "optimizer": EmbOptimType.EXACT_ADAGRAD, "learning_rate": config.learning_rate,
            "eps": config.eps})
        planner = EmbeddingShardingPlanner(
            topology=Topology(world_size=world, compute_device="cpu"))
        plan = planner.collective_plan(model, [sharder], dist.GroupMember.WORLD)
        placed: dict[str, list[int]] = {}
        for tables in plan.plan.values():
            for option in tables.values():  # type: ignore[union-attr]
                per_rank = placed.setdefault(str(option.sharding_type), [0] * world)
                for r in option.ranks or []:
                    per_rank[r] += 1
        dmp = DistributedModelParallel(model, device=torch.device("cpu"), plan=plan,
                                       sharders=[sharder])
        dense = [p for _, p in in_backward_optimizer_filter(dmp.named_parameters())]
        opt = torch_optimizer(config, dense)
        batches = task.batches(rank, world, batch, SEED)

        def step() -> None:
            x, y = next(batches)
            opt.zero_grad(set_to_none=False)
            task.loss(dmp(x), y).backward()  # the tables update inside backward
            opt.step()

        def evaluate() -> Mapping[str, float] | None:
            metrics = task.evaluate(dmp)  # collective: both ranks run it
            return metrics if rank == 0 else None

        out = ctr.lockstep_run(step, agreed_max, evaluate, window_s, skip, count, auc_steps)
        out["plan"] = placed
        out["dense_params"] = sum(p.numel() for p in dense)
        return out
    finally:
        dist.destroy_process_group()


def throughput(cfg: Config, total: int, batch: int, ids: str = "zipf",
               auc_samples: int = 0) -> list[Figure]:
    """TorchRec's samples/s, CPU time per 1000 samples, peak RSS per rank and held-out
    AUC (after `auc_samples` samples) at `total` rows with `ids`."""
    from .procs import free_port, run_group

    why = not_installed()
    if why is not None:
        return missing_figures(total, ids, why)
    need, free = bytes_needed(total), mem_available()
    if need > ctr.MEM_HEADROOM * free:
        return missing_figures(total, ids, f"does not fit: needs about {need / 2**30:.1f} "
                               f"GiB for the tables and their Adagrad state, "
                               f"{free / 2**30:.1f} GiB available")
    auc_steps = math.ceil(auc_samples / (batch * ctr.WORKERS)) if auc_samples else None
    res = run_group(_torchrec_rank, ctr.WORKERS,
                    args=(ctr.WORKERS, free_port(), total, ids, batch,
                          cfg.train_seconds_per_rep, cfg.warmup, cfg.repeats, auc_steps),
                    timeout_s=cfg.item_time_limit_s)
    return figures(cfg, total, ids, batch, res)


def figures(cfg: Config, total: int, ids: str, batch: int,
            res: Sequence[Mapping[str, Any]]) -> list[Figure]:
    """The figures from the ranks' results (missing ones where a rank could not import
    torchrec)."""
    problem = next((r["missing"] for r in res if "missing" in r), None)
    if problem is not None:
        return missing_figures(total, ids, MISSING)
    return ctr.lockstep_figures(
        cfg, SIDE, total, ids, batch, label(total, ids), res,
        "both ranks run the task's evaluate on the sharded model (its forward is "
        "collective) after a barrier, rank 0's result; the time it takes left out of the "
        "measured windows",
        extra_note=f"{plan_note(res[0]['plan'])}; dense part under DDP")
