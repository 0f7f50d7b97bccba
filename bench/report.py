"""From raw figures to what the issue asks to see: the ratios (transport against TCP, PS
step against all-reduce, PS training against DDP), each target's status, and the
markdown table. Pure: no clocks, no processes, no files."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from . import ctr
from .core import MIN_REPEATS, Figure, ratio

Status = Literal["met", "missed", "not measured"]

TRAINING_MODELS = ("digits", "wide", "large")
ITEM_TITLES = {
    "limits": "1. Limits",
    "transport": "2. Transport",
    "ps_step": "3. PS step against all-reduce",
    "training": "4. Training",
    "overlap": "4b. Overlapping communication with backward (2 PS)",
    "operator": "5. Operator (against the Kubernetes emulator)",
    "gpu": "6. GPU",
    "ctr": "7. CTR model with sparse embedding tables (2 PS + 2 workers)",
    "ctr_link": "7a. CTR model over a link of a set rate (a network namespace)",
    "sparse_ckpt": "7b. Sparse checkpoints (CTR 1M rows, 2 PS + 2 workers, async)",
}


@dataclass(frozen=True)
class Target:
    name: str
    status: Status
    detail: str


def by_key(figures: Iterable[Figure]) -> dict[str, Figure]:
    return {f.key: f for f in figures}


def _sizes(figs: Mapping[str, Figure], prefix: str) -> list[int]:
    out = set()
    for key in figs:
        if key.startswith(prefix) and key.endswith("MiB"):
            rest = key[len(prefix):-3]
            if rest.isdigit():
                out.add(int(rest))
    return sorted(out)


def derive(figures: Iterable[Figure]) -> list[Figure]:
    """The ratio figures, from the measured ones (ratio of medians, same run)."""
    figs = by_key(figures)
    out: list[Figure] = []
    for direction in ("push", "push_stream", "pull", "push_grpc", "pull_grpc"):
        for m in _sizes(figs, f"transport.{direction}."):
            # Prefer the TCP figure measured interleaved with the transport itself.
            tcp = figs.get(f"transport.tcp.{m}MiB") or figs.get(f"limits.tcp.{m}MiB")
            out.append(ratio(f"transport.{direction}.{m}MiB.vs_tcp",
                             f"{direction} {m} MiB / loopback TCP {m} MiB",
                             figs.get(f"transport.{direction}.{m}MiB"), tcp))
    for m in _sizes(figs, "ps_step.allreduce."):
        for variant in sorted({k.split(".")[1] for k in figs
                               if k.startswith("ps_step.") and k.endswith(f".{m}MiB")}):
            if variant.startswith("allreduce"):
                continue
            # Prefer the all-reduce measured interleaved with this variant's steps.
            base = (figs.get(f"ps_step.allreduce_{variant}.{m}MiB")
                    or figs.get(f"ps_step.allreduce.{m}MiB"))
            out.append(ratio(f"ps_step.{variant}.{m}MiB.vs_allreduce",
                             f"PS step ({variant}) / gloo all_reduce, {m} MiB",
                             figs.get(f"ps_step.{variant}.{m}MiB"), base))
    for model in TRAINING_MODELS:
        for mode in ("async", "sync", "async_pipeline"):
            ps = figs.get(f"training.{model}.{mode}")
            if ps is None:
                continue
            out.append(ratio(f"training.{model}.{mode}.vs_ddp",
                             f"{model}: PS {mode} / DDP samples/s", ps,
                             figs.get(f"training.{model}.ddp")))
            out.append(ratio(f"training.{model}.{mode}.vs_single",
                             f"{model}: PS {mode} / single process samples/s", ps,
                             figs.get(f"training.{model}.single")))
    on = figs.get("overlap.wide.on")
    if on is not None:
        out.append(ratio("overlap.wide.on_vs_off", "wide: overlap on / off samples/s", on,
                         figs.get("overlap.wide.off")))
    out += ctr.derive(figs)
    for mode in ("async", "async_pipeline"):
        tta_ps = figs.get(f"training.digits.tta.{mode}")
        if tta_ps is not None:
            out.append(ratio(f"training.digits.tta.{mode}.vs_single",
                             f"digits time-to-accuracy: PS {mode} / single process", tta_ps,
                             figs.get("training.digits.tta.single")))
    return out


def _fmt(x: float | None, unit: str = "") -> str:
    if x is None:
        return "n/a"
    if unit == "s" and abs(x) < 1:
        return f"{x * 1000:.1f} ms"
    if abs(x) >= 100:
        text = f"{x:,.0f}"
    elif abs(x) >= 10:
        text = f"{x:.1f}"
    else:
        text = f"{x:.3g}" if unit != "x" else f"{x:.2f}"
    return f"{text} {unit}" if unit and unit != "s" else (f"{text} s" if unit == "s" else text)


def _status(value: float | None, ok: bool) -> Status:
    if value is None:
        return "not measured"
    return "met" if ok else "missed"


def evaluate_targets(figures: Iterable[Figure]) -> list[Target]:
    """Each target of the issue, met or not, with the numbers it was judged on."""
    figs = by_key(figures)
    targets: list[Target] = []

    # Transport: every stream of >= 16 MiB, the push's and the pull's, at >= 0.8x
    # loopback TCP. A push's stream is the push less the server's update of the
    # parameters (which the reply reports); the push to its reply is shown beside it.
    def sized(direction: str) -> list[Figure]:
        return [f for k, f in figs.items() if k.startswith(f"transport.{direction}.") and
                k.endswith("MiB.vs_tcp") and int(k.split(".")[2][:-3]) >= 16]

    streams = sized("push_stream") + sized("pull")
    if streams and all(f.median is not None for f in streams):
        worst = min(streams, key=lambda f: f.median or 0.0)
        detail = ", ".join(f"{f.label.split(' /')[0]}: {_fmt(f.median, 'x')}"
                           for f in streams + sized("push"))
        targets.append(Target("transport: tensor stream >= 16 MB at >= 0.8x loopback TCP",
                              _status(worst.median, (worst.median or 0) >= 0.8), detail))
    else:
        targets.append(Target("transport: tensor stream >= 16 MB at >= 0.8x loopback TCP",
                              "not measured", "no transport figures of >= 16 MiB"))

    step = [f for k, f in figs.items() if k.startswith("ps_step.ps1.") and
            k.endswith("vs_allreduce")]
    if step:
        f = step[-1]
        ps2 = figs.get(f.key.replace("ps_step.ps1.", "ps_step.ps2."))
        extra = f"; with 2 PS: {_fmt(ps2.median, 'x')}" if ps2 else ""
        targets.append(Target("PS step (2 workers, 1 PS) <= 2.0x gloo all_reduce",
                              _status(f.median, (f.median or 99) <= 2.0),
                              f"{_fmt(f.median, 'x')}{extra}"))
    else:
        targets.append(Target("PS step (2 workers, 1 PS) <= 2.0x gloo all_reduce",
                              "not measured", "no PS step figure"))

    for model, need in (("wide", 1.0), ("digits", 1.2)):
        f = figs.get(f"training.{model}.async.vs_ddp")
        name = (f"training: {model} MLP async samples/s >= {need:.1f}x DDP over gloo "
                "(2 workers)")
        if f is None or f.median is None:
            targets.append(Target(name, "not measured", f.note if f else "no figure"))
        else:
            ps = figs.get(f"training.{model}.async")
            ddp = figs.get(f"training.{model}.ddp")
            targets.append(Target(name, _status(f.median, f.median >= need),
                                  f"{_fmt(f.median, 'x')} ({_fmt(ps.median if ps else None)}"
                                  f" vs {_fmt(ddp.median if ddp else None)} samples/s)"))

    targets += _ctr_targets(figs)
    targets += _sparse_ckpt_targets(figs) + _sparse_disk_targets(figs)

    for key, name, limit, unit in (
        ("operator.one_job.pods_after_ps_ready",
         "operator: all pods of a 1 PS + 8 worker job within 1 s of PS Ready", 1.0, "s"),
        ("operator.many_jobs.all_pods",
         "operator: all pods of 50 jobs created at once within 10 s", 10.0, "s"),
        ("operator.peak_rss", "operator: peak RSS under 150 MB", 150.0, "MB"),
    ):
        f = figs.get(key)
        if f is None or f.median is None:
            targets.append(Target(name, "not measured", f.note if f else "no figure"))
        else:
            # Judged on the median, like every figure; a worst run past the bound is said.
            worst = f.max if f.max is not None else f.median
            detail = f"median {_fmt(f.median, unit)}, max {_fmt(worst, unit)}"
            if worst >= limit:
                detail += f" (the worst of {f.n} runs was over the bound)"
            targets.append(Target(name, _status(f.median, f.median < limit), detail))
    return targets


def _sparse_disk_targets(figs: Mapping[str, Figure]) -> list[Target]:
    """Issue 25: a disk tier for tables beyond the servers' memory, with Zipf ids."""
    if not any(k.startswith("sparse_disk.") for k in figs):
        return []
    out = []
    for key, name, ok in (
            ("sparse_disk.zipf.vs_ram", "sparse disk tier: samples/s >= 0.5x all in memory "
             "(Zipf ids)", lambda v: v >= 0.5),
            ("sparse_disk.zipf.auc_gap", "sparse disk tier: held-out AUC within 0.005 of all "
             "in memory", lambda v: v <= 0.005)):
        f = figs.get(key)
        if f is None or f.median is None:
            out.append(Target(name, "not measured", f.note if f else "no figure"))
        else:
            out.append(Target(name, _status(f.median, ok(f.median)),
                              f"{f.median:.4g} {f.unit} ({f.note})"))
    name = ("sparse disk tier: each server's RSS growth (anonymous: without mapped code "
            "pages) under its memory budget")
    growth = [f for k, f in figs.items() if k.startswith("sparse_disk.zipf.disk.ps")
              and k.endswith("_rss_growth") and f.median is not None]
    if not growth:
        out.append(Target(name, "not measured", "no RSS figure"))
    else:
        worst = max(growth, key=lambda f: f.median or 0.0)
        budget = figs.get("sparse_disk.budget")
        if budget is None or budget.median is None:
            out.append(Target(name, "not measured", "no budget figure"))
        else:
            out.append(Target(name, _status(worst.median, worst.median < budget.median),
                              f"largest {_fmt(worst.median, 'MB')} against "
                              f"{_fmt(budget.median, 'MB')} ({worst.note})"))
    return out


def _sparse_ckpt_targets(figs: Mapping[str, Figure]) -> list[Target]:
    """Issue 22: sparse checkpoints at the default interval cost at most 5% of samples/s."""
    f = figs.get("sparse_ckpt.every100.vs_none")
    if f is None:
        return []
    name = "sparse checkpoints every 100 steps cost <= 5% of CTR samples/s"
    if f.median is None:
        return [Target(name, "not measured", f.note)]
    spread = f" (rounds: {_fmt(f.min, 'x')} to {_fmt(f.max, 'x')})" if f.n > 1 else ""
    detail = f"{_fmt(f.median, 'x')} of the samples/s without checkpoints{spread}"
    cpu = figs.get("sparse_ckpt.every100.cpu_vs_none")
    if cpu is not None and cpu.median is not None:
        detail += f"; {_fmt(cpu.median, 'x')} of the samples per CPU-second"
    return [Target(name, _status(f.median, f.median >= 0.95), detail)]


def _ctr_targets(figs: Mapping[str, Figure]) -> list[Target]:
    """The CTR item's targets: pstrain against DDP with the table dense (at the largest
    size DDP ran), samples/s across sizes, worker RSS against the table."""
    if not any(k.startswith("ctr.") for k in figs):
        return []
    out: list[Target] = []
    name = "CTR: pstrain samples/s >= 3x DDP over gloo with the table dense (2 PS + 2 workers)"
    vs = sorted(((ctr.size_rows(k.split(".")[2]), f) for k, f in figs.items()
                 if k.startswith("ctr.ps.") and k.endswith(".vs_ddp_dense")
                 and f.median is not None), key=lambda x: x[0])
    if vs:
        rows, f = vs[-1]
        sparse = figs.get(f.key.replace("vs_ddp_dense", "vs_ddp_sparse"))
        extra = f"; against DDP sparse=True: {_fmt(sparse.median, 'x')}" if sparse else ""
        out.append(Target(name, _status(f.median, f.median >= 3.0),  # type: ignore[operator]
                          f"{_fmt(f.median, 'x')} at {ctr.size_name(rows)} rows{extra}"))
    else:
        out.append(Target(name, "not measured", "no DDP dense figure"))
    spread = figs.get("ctr.ps.spread")
    name = "CTR: pstrain samples/s at 1 M, 10 M, 50 M rows within 20% of each other"
    if spread is None or spread.median is None:
        out.append(Target(name, "not measured", "fewer than two sizes measured"))
    else:
        out.append(Target(name, _status(spread.median, spread.median <= 0.2),
                          f"fastest / slowest - 1 = {spread.median:.2f} ({spread.note})"))
    rss = [(k.split(".")[2], f) for k, f in figs.items()
           if k.startswith("ctr.ps.") and k.endswith(".worker_rss") and f.median is not None
           and ctr.size_rows(k.split(".")[2]) >= 10_000_000]
    name = "CTR: worker RSS below 25% of the table at >= 10 M rows"
    if rss:
        # one entry per figure: "10M" (Zipf ids), "10M uniform"
        shares = {" ".join(f.key.split(".")[2:-1]):
                  f.median / (ctr.table_bytes(ctr.size_rows(size)) / 1e6)  # type: ignore[operator]
                  for size, f in rss}
        worst = max(shares.values())
        out.append(Target(name, _status(worst, worst < 0.25),
                          ", ".join(f"{size}: {100 * v:.1f}%" for size, v in shares.items())))
    else:
        out.append(Target(name, "not measured", "no worker RSS at >= 10 M rows"))
    return out


def render_markdown(result: Mapping[str, Any]) -> str:
    """The results as markdown: machine, one table per item, the targets."""
    lines = ["# pstrain benchmark results", ""]
    m = result.get("machine", {})
    lines.append(f"- date: {result.get('date', '?')}; mode: "
                 f"{'quick (tiny sizes, sanity check only)' if result.get('quick') else 'full'}")
    for k, v in m.items():
        lines.append(f"- {k}: {v}")
    lines.append(f"- each figure: {result.get('warmup', 1)} warm-up run(s), then the median "
                 f"of {result.get('repeats', 5)} timed runs (min and max shown); ratios are "
                 "ratios of medians from this same run. GB/s = 10^9 bytes/s; sizes in MiB.")
    lines.append("")
    figs = [Figure(**f) for f in result.get("figures", [])]
    for item, title in ITEM_TITLES.items():
        rows = [f for f in figs if f.key.split(".")[0] == item]
        err = result.get("errors", {}).get(item)
        if not rows and not err:
            continue
        lines += [f"## {title}", "", "| figure | median | min | max | n | note |",
                  "| --- | ---: | ---: | ---: | ---: | --- |"]
        for f in rows:
            note = f.note
            if f.median is not None and 0 < f.n < MIN_REPEATS and f.unit != "x":
                note = f"fewer than {MIN_REPEATS} runs. {note}".strip()
            # n 0: one aggregate over a whole measurement (a size, a CPU total), no spread
            shown_n = f.n if f.n or f.median is None else "-"
            lo, hi = ("", "") if shown_n == "-" else (_fmt(f.min, f.unit), _fmt(f.max, f.unit))
            lines.append(f"| {f.label} | {_fmt(f.median, f.unit)} | {lo} | {hi} | {shown_n} | "
                         f"{note} |")
        if err:
            lines += ["", f"Error in this item: `{err.strip().splitlines()[-1]}`"]
        lines.append("")
    lines += ["## Targets", ""]
    if result.get("quick"):
        lines += ["Quick mode: sizes differ from those the targets name; these statuses only "
                  "show that the checks run.", ""]
    lines += ["| target | status | numbers |", "| --- | --- | --- |"]
    for t in result.get("targets", []):
        lines.append(f"| {t['name']} | **{t['status']}** | {t['detail']} |")
    lines.append("")
    return "\n".join(lines)
