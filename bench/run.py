"""`python -m bench [--quick] [--only ITEM,...]`: run the benchmark items in order, then
write bench/out/results.json and bench/out/results.md.

An item that fails is recorded with its error and the run goes on, so one broken
component never hides the numbers of the others.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import sys
import time
import traceback
from collections.abc import Sequence
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # `python bench/run.py` as well as `python -m bench`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    __package__ = "bench"

from bench.core import Config, Figure  # noqa: E402
from bench.report import derive, evaluate_targets, render_markdown  # noqa: E402

ITEMS: dict[str, str] = {
    "limits": "bench.limits:run",
    "transport": "bench.transport:run",
    "auth": "bench.auth:run",
    "flood": "bench.flood:run",
    "ps_step": "bench.ps_step:run",
    "training": "bench.training:run",
    "overlap": "bench.training:overlap_throughput",
    "operator": "bench.operator_bench:run",
    "gpu": "bench.gpu:run",
    "ctr": "bench.ctr:run",
    "ctr_link": "bench.ctr_link:run",
    "sparse_ckpt": "bench.sparse_ckpt:run",
    "sparse_disk": "bench.sparse_disk:run",
    "elastic": "bench.elastic:run",
}
DEFAULT_OUT = Path(__file__).resolve().parent / "out"


def git_state() -> str:
    """The commit measured, and which tracked files differed from it."""
    import subprocess

    root = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root,
                              capture_output=True, text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=root, capture_output=True, text=True,
                               timeout=10).stdout.split("\n")
    except (OSError, subprocess.SubprocessError):
        return "unknown (git not available)"
    changed = sorted(line[3:] for line in dirty if line.strip())
    if not changed:
        return f"commit {head}"
    return f"commit {head} plus uncommitted changes to {', '.join(changed)}"


def machine_info() -> dict[str, Any]:
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem_gib = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem_gib = round(int(line.split()[1]) / (1 << 20), 1)
    except OSError:
        pass
    versions: dict[str, str] = {}
    for mod in ("torch", "grpc", "google.protobuf", "kopf"):
        try:
            versions[mod] = str(importlib.import_module(mod).__version__)
        except (ImportError, AttributeError):
            versions[mod] = "absent"
    gpu = "none"
    try:
        import torch

        if torch.cuda.is_available():
            gpu = torch.cuda.get_device_name(0)
    except ImportError:
        pass
    return {
        "code": git_state(),
        "host": platform.node(),
        "cpu": f"{cpu}, {os.cpu_count()} logical cores",
        "memory": f"{mem_gib} GiB",
        "gpu": gpu,
        "python": platform.python_version(),
        "versions": ", ".join(f"{k} {v}" for k, v in versions.items()),
        "load average at start": " ".join(f"{x:.2f}" for x in os.getloadavg()),
    }


def run_items(cfg: Config, only: Sequence[str]) -> tuple[list[Figure], dict[str, str]]:
    figures: list[Figure] = []
    errors: dict[str, str] = {}
    for name in only:
        module_name, func_name = ITEMS[name].split(":")
        t0 = time.monotonic()
        print(f"[bench] {name} ...", file=sys.stderr, flush=True)
        try:
            fn = getattr(importlib.import_module(module_name), func_name)
            got = list(fn(cfg))
        except Exception:  # noqa: BLE001 - one failing item must not hide the others
            errors[name] = traceback.format_exc()
            print(f"[bench] {name} failed:\n{errors[name]}", file=sys.stderr, flush=True)
            continue
        figures += got
        for f in got:
            shown = "n/a" if f.median is None else f"{f.median:.4g}"
            print(f"[bench]   {f.key}: {shown} {f.unit} {f.note}", file=sys.stderr, flush=True)
        print(f"[bench] {name} done in {time.monotonic() - t0:.1f} s", file=sys.stderr,
              flush=True)
    return figures, errors


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    parser.add_argument("--quick", action="store_true",
                        help="tiny sizes: checks that every item runs, in about a minute")
    parser.add_argument("--only", default=",".join(ITEMS),
                        help=f"comma-separated items, from: {', '.join(ITEMS)}")
    parser.add_argument("--repeats", type=int, default=None,
                        help="timed repetitions per figure (default 5; fewer is flagged)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT,
                        help="directory for results.json and results.md")
    parser.add_argument("--render", action="store_true",
                        help="only rewrite results.md from the results.json in --out")
    args = parser.parse_args(argv)
    if args.render:
        result = json.loads((args.out / "results.json").read_text())
        (args.out / "results.md").write_text(render_markdown(result))
        return 0
    only = [x.strip() for x in args.only.split(",") if x.strip()]
    unknown = [x for x in only if x not in ITEMS]
    if unknown:
        parser.error(f"--only names {unknown}; items are {', '.join(ITEMS)}")
    try:
        cfg = Config.build(args.quick, args.repeats)
    except ValueError as exc:
        parser.error(str(exc))
    started = datetime.now(timezone.utc)
    machine = machine_info()
    t0 = time.monotonic()
    figures, errors = run_items(cfg, only)
    figures += derive(figures)
    machine["load average at end"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
    result = {
        "date": started.strftime("%Y-%m-%d %H:%M UTC"),
        "quick": cfg.quick,
        "warmup": cfg.warmup,
        "repeats": cfg.repeats,
        "config": asdict(cfg),
        "machine": machine,
        "wall_seconds": round(time.monotonic() - t0, 1),
        "figures": [f.as_json() for f in figures],
        "targets": [asdict(t) for t in evaluate_targets(figures)],
        "errors": errors,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(result, indent=2) + "\n")
    (args.out / "results.md").write_text(render_markdown(result))
    print(f"[bench] wrote {args.out / 'results.json'} and {args.out / 'results.md'} "
          f"({result['wall_seconds']} s)", file=sys.stderr)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
