"""A disk tier's checkpoint exports taken while it trains, in-process (not a bench item):
`python -m bench.export_moves [--rows N] [--budget-mib M] [--steps N]`.

One shard of a fixed-size table (32 float32 + Adagrad state a row) with a memory budget,
trained by Zipf 1.2 batches of 3,000 ids (a read, then an update, as a worker's pull and
push reach a server), then exported as the chief's checkpoint chain does: a full export,
100 steps, a delta since its mark, 100 steps, another delta; one training step between
every two pages of an export (async mode: the chief reads pages while the workers
train). Prints, per export, the rows it had to give (live at its start; a delta: those
updated since `since`), the rows it gave, over how many pages, and the wanted rows it
did not give (bench/RESULTS.md, session 19: a row coming back from disk during the
export was given by no page before).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np
import torch

PAGE = 10_000  # rows asked per page (the server gives at most its `page_rows`)


def main(argv: list[str] | None = None) -> list[dict[str, int | str]]:
    """Prints and returns each export's figures."""
    from pstrain_runtime.optim import OptimizerConfig
    from pstrain_runtime.sparse.spec import TableSpec
    from pstrain_runtime.sparse.tiered import TieredTable

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=400_000, help="the table's id space")
    ap.add_argument("--budget-mib", type=int, default=24, help="the shard's memory")
    ap.add_argument("--steps", type=int, default=1_500, help="steps before the exports")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    spec = TableSpec("t", args.rows, 32, 0.01,
                     optimizer=OptimizerConfig("adagrad", learning_rate=0.05))
    with tempfile.TemporaryDirectory(prefix="pstrain-export-moves-") as folder:
        table = TieredTable(spec, args.budget_mib << 20, Path(folder))
        rng = np.random.default_rng(0)
        clock = [0]

        def train(steps: int) -> None:
            for _ in range(steps):
                clock[0] += 1
                ids = np.unique(np.minimum(rng.zipf(1.2, 3000), args.rows) - 1)
                ids_t = torch.from_numpy(ids.astype(np.int64))
                table.read(ids_t)
                table.apply(ids_t, torch.randn(ids_t.numel(), 32) * 0.01, clock[0], clock[0])

        train(args.steps)
        print(f"after {args.steps} steps: {table.tier_stats()}", flush=True)
        since, out = None, []
        for _ in range(3):
            want = _wanted(table, since)
            table.track_removals(since, clock[0])
            mark = clock[0]
            given, pages = _export(table, since, train)
            missing = len(want - given)
            out.append({"kind": "full" if since is None else "delta", "wanted": len(want),
                        "given": len(given), "pages": pages, "missing": missing})
            print(f"{'full' if since is None else 'delta'}: {len(want):,} rows wanted, "
                  f"{len(given):,} given over {pages} pages, {missing:,} missing "
                  f"({100 * missing / max(1, len(want)):.2f} %)", flush=True)
            train(100)
            since = mark
        table.close()
    return out


def _wanted(table, since: int | None) -> set[int]:  # noqa: ANN001 - a TieredTable
    """The ids an export starting now must give: live (with `since`: updated at or
    after it), in either tier, read from the tiers directly."""
    hot = table.hot
    live = hot.owner[:hot.used] >= 0
    if since is not None:
        live &= hot.last[:hot.used] >= since
    out = set(hot.owner[:hot.used][live].tolist())
    at: int | None = 0
    while at is not None:
        ids, _, last, at = table.cold.page(at, 50_000)
        out |= set((ids if since is None else ids[last >= since]).tolist())
    return out


def _export(table, since: int | None, train) -> tuple[set[int], int]:  # noqa: ANN001
    """An export's ids and pages, one training step between pages; raises on an id
    given twice."""
    got, start, pages = [], 0, 0
    while True:
        block, start = table.export(start, PAGE, since)
        got.append(block.ids)
        pages += 1
        if start == 0:
            break
        train(1)
    ids = torch.cat(got)
    if ids.numel() != torch.unique(ids).numel():
        raise AssertionError("an export gave an id twice")
    return set(ids.tolist()), pages


if __name__ == "__main__":
    main()
