"""Item `ctr_link`: the CTR model of item `ctr` over a link of a set rate instead of
this machine's unlimited loopback, where the network, not only the CPU, costs what it
costs on a cluster.

Every side of item `ctr` talks over 127.0.0.1. Here the whole item runs in a network
namespace of its own whose loopback is held to `RATE` (Linux's `tbf` queueing
discipline, `LINK_RATE` to change it): pstrain async without a row cache, pstrain
with the workers' row cache at S = 16 (`ctr.VARIANTS`), and TorchRec, at `SIZES` rows
with Zipf and uniform ids, each side once per round for `ROUNDS` rounds. Every byte
any side moves between its processes crosses that link: pstrain's pulls, pushes and
dense push_pulls, TorchRec's all-to-alls and its dense all-reduce. Figures: as item
`ctr`'s, keyed `ctr_link.<side>.<size>[.<ids>]...`, the median over the rounds' windows,
with the cache over none and pstrain over TorchRec (samples/s, CPU per sample).

It needs root, `ip` and `tc` (iproute2) and a kernel with network namespaces and
`sch_tbf`; elsewhere every figure says which is missing. The namespace is made for the
run and deleted after it, also when the run fails (about 6 minutes;
`--only ctr_link`).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence

from . import ctr
from .core import Config, Figure, ratio

RATE = os.environ.get("LINK_RATE", "1gbit")
SIZES = (10_000_000,)
QUICK_SIZES = (26_000,)
ROUNDS, QUICK_ROUNDS = 2, 1
SIDES = ("ps", "ps_cache16", "torchrec")
PREFIX = "ctr_link."


# --------------------------------------------------------------------------- pure


def renamed(fig: Figure) -> Figure:
    """Item `ctr`'s figure under this item's key, its label saying the link."""
    key = PREFIX + fig.key.removeprefix("ctr.")
    return Figure(key, f"{fig.label} (over a {RATE} link)", fig.unit, fig.median, fig.min,
                  fig.max, fig.n, fig.note, list(fig.samples))


def merged(rounds: Sequence[Sequence[Figure]]) -> list[Figure]:
    """One figure per key over the rounds: the samples of every round together (a
    figure without samples keeps its first round's value), in first-seen order."""
    order: list[str] = []
    by_key: dict[str, list[Figure]] = {}
    for figs in rounds:
        for fig in figs:
            if fig.key not in by_key:
                order.append(fig.key)
            by_key.setdefault(fig.key, []).append(fig)
    out = []
    for key in order:
        figs = by_key[key]
        samples = [s for f in figs for s in f.samples]
        measured = [f for f in figs if f.median is not None]
        if not measured:
            out.append(figs[0])
            continue
        first = measured[0]
        if not samples:
            out.append(first)
            continue
        out.append(Figure.of(key, first.label, first.unit, samples,
                             note=f"{len(measured)} rounds; {first.note}".rstrip("; ")))
    return out


def derive(figs: Sequence[Figure], sizes: Sequence[int]) -> list[Figure]:
    """The cache over none, and each pstrain side over TorchRec (samples/s and CPU time
    per sample), at every size and id law."""
    by_key = {f.key: f for f in figs}
    out = []
    for total in sizes:
        size = ctr.size_name(total)
        for ids in ctr.IDS:
            def key(side: str, metric: str = "") -> str:
                return PREFIX + ctr.fig_key(side, size, ids, metric).removeprefix("ctr.")
            what = f"{size} rows, {ctr.ids_label(ids)}, over a {RATE} link"
            out.append(ratio(key("ps_cache16", "vs_ps"), f"{what}: pstrain with the row "
                             "cache (S = 16) / without, samples/s",
                             by_key.get(key("ps_cache16")), by_key.get(key("ps"))))
            for side in ("ps", "ps_cache16"):
                out.append(ratio(key(side, "vs_torchrec"), f"{what}: pstrain"
                                 f"{ctr.variant_note(side)} / TorchRec samples/s",
                                 by_key.get(key(side)), by_key.get(key("torchrec"))))
                out.append(ratio(key(side, "cpu.vs_torchrec"), f"{what}: pstrain"
                                 f"{ctr.variant_note(side)} / TorchRec CPU time per sample",
                                 by_key.get(key(side, "cpu")),
                                 by_key.get(key("torchrec", "cpu"))))
    return out


def missing(sizes: Sequence[int], why: str) -> list[Figure]:
    return [Figure.missing(PREFIX + ctr.fig_key(side, ctr.size_name(total), ids)
                           .removeprefix("ctr."),
                           f"CTR {ctr.size_name(total)}, {ctr.ids_label(ids)}, {side}, "
                           f"over a {RATE} link", "samples/s", why)
            for total in sizes for ids in ctr.IDS for side in SIDES]


def unavailable() -> str | None:
    """Why a namespace with a held link cannot be made here, or None."""
    if os.geteuid() != 0:
        return "needs root (a network namespace and a tbf qdisc on its loopback)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"needs `{tool}` (Debian's iproute2)"
    return None


# --------------------------------------------------------------------------- measuring


def side_figures(cfg: Config, side: str, total: int, ids: str, batch: int) -> list[Figure]:
    from . import torchrec_ref

    if side == "torchrec":
        return torchrec_ref.throughput(cfg, total, batch, ids)
    return ctr.ps_throughput(cfg, [total], batch, ids, side=side)


def inner(cfg: Config, sizes: Sequence[int], rounds: int,
          measure: Callable[[Config, str, int, str, int], list[Figure]] = side_figures
          ) -> list[Figure]:
    """Inside the namespace: every side at every size and id law, `rounds` times (each
    round in the order before reversed), merged."""
    batch = ctr.QUICK_BATCH if cfg.quick else ctr.BATCH
    runs: list[list[Figure]] = []
    for r in range(rounds):
        order = [(total, ids, side) for total in sizes for ids in ctr.IDS for side in SIDES]
        for total, ids, side in (order if r % 2 == 0 else order[::-1]):
            runs.append(measure(cfg, side, total, ids, batch))
    return merged(runs)


def run(cfg: Config) -> list[Figure]:
    sizes = QUICK_SIZES if cfg.quick else SIZES
    why = unavailable()
    if why is not None:
        return missing(sizes, why)
    name = f"pstrain-bench-{os.getpid()}"
    limit_s = cfg.item_time_limit_s * len(sizes) * len(ctr.IDS) * len(SIDES) * ROUNDS

    def sh(*args: str) -> None:
        subprocess.run(args, check=True, capture_output=True, timeout=30)

    with tempfile.TemporaryDirectory(prefix="pstrain-ctr-link-") as tmp:
        out = os.path.join(tmp, "figures.json")
        try:
            sh("ip", "netns", "add", name)
            sh("ip", "netns", "exec", name, "ip", "link", "set", "lo", "up")
            sh("ip", "netns", "exec", name, "tc", "qdisc", "add", "dev", "lo", "root",
               "tbf", "rate", RATE, "burst", "256kb", "latency", "50ms")
            subprocess.run(["ip", "netns", "exec", name, sys.executable, "-m",
                            "bench.ctr_link", "--out", out, "--rounds",
                            str(QUICK_ROUNDS if cfg.quick else ROUNDS), "--repeats",
                            str(cfg.repeats), *(["--quick"] if cfg.quick else [])],
                           check=True, timeout=limit_s,
                           cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        except (OSError, subprocess.SubprocessError) as exc:
            detail = getattr(exc, "stderr", b"") or b""
            return missing(sizes, f"the run in a namespace failed: {exc} "
                                  f"{detail.decode(errors='replace').strip()}".strip())
        finally:
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)
        with open(out) as fh:
            figs = [Figure(**f) for f in json.load(fh)]
    figs = [renamed(f) for f in figs]
    return figs + derive(figs, sizes)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.ctr_link",
                                     description="the inner run of item ctr_link (inside "
                                     "its network namespace)")
    parser.add_argument("--out", required=True)
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    cfg = Config.build(args.quick, args.repeats)
    figs = inner(cfg, QUICK_SIZES if args.quick else SIZES, args.rounds)
    with open(args.out, "w") as fh:
        json.dump([f.as_json() for f in figs], fh)


if __name__ == "__main__":
    main()
