"""What every benchmark item shares: the settings of a run, how a figure is measured
(warm-up, then timed repetitions, median with min and max) and the record of a figure.

Pure apart from the clock: the items do the I/O (processes, sockets, gRPC) and hand
their raw timings here.
"""

from __future__ import annotations

import os

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

MIB = 1 << 20
GB = 1e9  # throughput is reported in GB/s = 10^9 bytes per second

MIN_REPEATS = 5  # the issue: each figure is the median of at least 5 runs after a warm-up


@dataclass(frozen=True)
class Config:
    """Sizes and counts of one run. `quick` shrinks sizes (not the method) so that the
    whole suite can be sanity-checked in a few minutes."""

    quick: bool = False
    warmup: int = 1
    repeats: int = MIN_REPEATS
    memcpy_mib: int = 256
    transport_mib: tuple[int, ...] = (4, 64, 256)
    ps_step_mib: int = 64
    train_seconds_per_rep: float = 4.0  # each samples/s repetition trains about this long
    accuracy_target: float = 0.95
    accuracy_time_limit_s: float = 240.0
    operator_workers: int = 8
    operator_jobs: int = 50
    item_time_limit_s: float = 900.0  # a hard wall per multi-process group

    @classmethod
    def build(cls, quick: bool, repeats: int | None = None) -> Config:
        if repeats is not None and repeats < 1:
            raise ValueError(f"--repeats is {repeats}; it must be at least 1.")
        if quick:
            cfg = cls(
                quick=True,
                memcpy_mib=16,
                transport_mib=(1, 4),
                ps_step_mib=4,
                train_seconds_per_rep=0.5,
                accuracy_time_limit_s=60.0,
                operator_workers=2,
                operator_jobs=3,
                item_time_limit_s=180.0,
            )
        else:
            cfg = cls()
        return cfg if repeats is None else replace(cfg, repeats=repeats)


@dataclass(frozen=True)
class Stats:
    median: float
    min: float
    max: float
    n: int


def summarise(values: Sequence[float]) -> Stats:
    """Median, min and max of the timed repetitions (warm-up runs already dropped)."""
    if not values:
        raise ValueError("no timed repetitions to summarise; at least one is needed.")
    vals = [float(v) for v in values]
    return Stats(statistics.median(vals), min(vals), max(vals), len(vals))


@dataclass
class Figure:
    """One reported number. `key` is stable (targets and ratios refer to it); `label` is
    for people. Rates are computed per repetition, then summarised."""

    key: str
    label: str
    unit: str
    median: float | None
    min: float | None = None
    max: float | None = None
    n: int = 0
    note: str = ""
    samples: list[float] = field(default_factory=list)

    @classmethod
    def of(cls, key: str, label: str, unit: str, values: Sequence[float],
           note: str = "") -> Figure:
        s = summarise(values)
        return cls(key, label, unit, s.median, s.min, s.max, s.n, note,
                   [round(float(v), 6) for v in values])

    @classmethod
    def missing(cls, key: str, label: str, unit: str, note: str) -> Figure:
        """A figure that could not be measured in this run, and why."""
        return cls(key, label, unit, None, note=note)

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


def ratio(key: str, label: str, num: Figure | None, den: Figure | None,
          note: str = "") -> Figure:
    """num.median / den.median as a figure in 'x' (ratio of medians)."""
    if num is None or den is None or num.median is None or not den.median:
        return Figure.missing(key, label, "x", note or "an input figure is missing")
    return Figure(key, label, "x", num.median / den.median, n=min(num.n, den.n),
                  note=note or f"{num.key} / {den.key}")


def rates(amount: float, seconds: Sequence[float]) -> list[float]:
    """amount/second for each repetition (GB/s when amount is in GB)."""
    return [amount / s for s in seconds if s > 0]


def time_repeated(fn: Callable[[], object], warmup: int, repeats: int,
                  time_limit_s: float = 600.0) -> list[float]:
    """Seconds of each timed call of `fn`, after `warmup` untimed calls.

    Bounded in count (warmup + repeats) and in time: once `time_limit_s` has passed,
    no new repetition starts (the figure then has fewer samples and says so in n).
    """
    deadline = time.monotonic() + time_limit_s
    for _ in range(warmup):
        fn()
    out: list[float] = []
    for _ in range(repeats):
        if out and time.monotonic() > deadline:
            break
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


SMALL_WARMUP, SMALL_CALLS = 20, 200  # calls behind one round-trip latency figure


def latency_samples(fn: Callable[[], object], samples: int, warmup: int = SMALL_WARMUP,
                    calls: int = SMALL_CALLS) -> list[float]:
    """Round-trip seconds of `fn` as `samples` figures, each the median of a batch of
    consecutive calls (one call of a millisecond is too short to stand alone)."""
    secs = time_repeated(fn, warmup, calls)
    k = calls // samples
    return [statistics.median(secs[i * k:(i + 1) * k]) for i in range(samples)]


def run_parts(item: str, parts: Sequence[tuple[str, Callable[[], Sequence[Figure]]]]
              ) -> list[Figure]:
    """Run an item's parts in order; a part whose process group fails (GroupError, a
    RuntimeError) leaves a missing figure `<item>.failed.<part>` with the error's last
    line, and the other parts still run. `PSTRAIN_BENCH_PARTS` (part names, comma
    separated) runs only those parts: e.g. pstrain's parts again with an older tree of
    the runtime first on PYTHONPATH, for a before/after comparison in one session."""
    only = [p.strip() for p in os.environ.get("PSTRAIN_BENCH_PARTS", "").split(",") if p.strip()]
    figs: list[Figure] = []
    for name, part in parts:
        if only and name not in only:
            continue
        try:
            figs += part()
        except RuntimeError as exc:
            last = str(exc).strip().splitlines()[-1][:300]
            figs.append(Figure.missing(f"{item}.failed.{name.replace(' ', '_')}",
                                       f"{name}: failed", "", last))
    return figs
