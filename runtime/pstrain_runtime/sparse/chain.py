"""Which rows a sparse checkpoint writes: a chain of links (pure; no I/O).

A checkpoint's tables are a chain: a full write of every live row (the base), then
deltas, each holding only the rows updated since the link before it began and the ids
dropped (evicted) since then. A row's update clock (`RowTable.last`) says what changed:
each link starts by asking every server for its watermark (the clock its next update
gets), and the next delta holds the rows updated at clock >= that watermark, so a row
updated while a link was being read is written again by the next one.

The manifest a checkpoint records (`Checkpoint.sparse`):

    {"format": 2,
     "chain": [link, ...],             # the base first, then the deltas in order
     "tables": {name: {"rows": n}}}    # live rows the servers reported as the newest
                                       # link began (exact in sync mode)
    link = {"dir": "ckpt-<step>.sparse", "step": s, "full": bool,
            "tables": {name: {"files": [rows file per server], "rows": n,
                              "removed": [ids file per server],   # deltas only
                              "checks": {file: {bytes, crc32c}}}}}

Restoring applies the links in order: the base's rows, then per delta its removed ids
(dropped) and its rows (replacing those held). A manifest from before chains, {dir,
tables}, is a chain of one full link (`checkpoint.sparse_links`).

A full write comes first, then again once the chain holds `MAX_DELTAS` deltas or its
deltas together are larger than `DELTAS_PER_BASE` times a full write of the tables as
they are now (`Chain.full_bytes`: the base's bytes, grown with the tables' rows since),
so a restore reads at most about three times a full write (a full write rewrites
unchanged rows: the rarer it is, the less a checkpoint costs on average; while the
tables grow, deltas are mostly new rows, which a full write would hold too), and
whenever the chain cannot go on exactly: after a restore or any re-initialisation of a
server (its generation changed), when a server has not recorded every id it dropped
since the last link, or after a checkpoint that failed.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

MAX_DELTAS = 16
DELTAS_PER_BASE = 2  # a chain's deltas add up to at most this many full writes
MANIFEST_FORMAT = 2
Key = tuple[str, int]  # (table, server)


def link_dir(step: int) -> str:
    return f"ckpt-{step:012d}.sparse"


def _entry_bytes(entry: Mapping[str, Any]) -> int:
    """The bytes of one table's files in a link, from their checks."""
    return sum(int(check.get("bytes", 0)) for check in (entry.get("checks") or {}).values())


def link_bytes(link: Mapping[str, Any]) -> int:
    """The bytes of a link's files, from their checks."""
    return sum(_entry_bytes(entry) for entry in link["tables"].values())


@dataclass(frozen=True)
class LinkPlan:
    """One checkpoint's link, as its export begins: full or a delta, and per (table,
    server) the clock the delta starts from (`since`) and the watermark now (the next
    delta's `since`)."""

    step: int
    full: bool
    since: dict[Key, int]
    marks: dict[Key, int]
    generations: dict[int, int]
    rows: dict[str, int]  # live rows per table, summed over the servers, at the mark

    @property
    def dir(self) -> str:
        return link_dir(self.step)


@dataclass
class Chain:
    """The chain the next checkpoint extends: the links of the last checkpoint written
    (committed), and what the next delta starts from."""

    links: list[dict[str, Any]] = field(default_factory=list)
    marks: dict[Key, int] = field(default_factory=dict)
    generations: dict[int, int] = field(default_factory=dict)
    rows: dict[str, int] = field(default_factory=dict)  # live rows at the newest link

    def full_bytes(self) -> float:
        """About the bytes a full write would take now: per table, the base's bytes
        times the rows it has grown to since (never less than the base's)."""
        total = 0.0
        for name, entry in self.links[0]["tables"].items():
            size, rows = _entry_bytes(entry), int(entry.get("rows", 0))
            total += size * max(1.0, self.rows.get(name, 0) / rows) if rows else size
        return total

    def full_due(self) -> bool:
        if not self.links:
            return True
        deltas = self.links[1:]
        return (len(deltas) >= MAX_DELTAS
                or sum(link_bytes(d) for d in deltas) > DELTAS_PER_BASE * self.full_bytes())

    def may_extend(self, plan_marks: Mapping[Key, Mapping[str, Any]]) -> bool:
        """Whether a delta's marks (the servers' replies) let the chain go on: every
        server kept its generation and recorded the ids it dropped."""
        return all(reply.get("complete") and key in self.marks
                   and reply.get("generation") == self.generations.get(key[1])
                   for key, reply in plan_marks.items())

    def manifest(self, plan: LinkPlan, link: dict[str, Any]) -> dict[str, Any]:
        """The manifest of a checkpoint whose newest link is `link`."""
        links = [link] if plan.full else [*self.links, link]
        return {"format": MANIFEST_FORMAT, "chain": links,
                "tables": {name: {"rows": rows} for name, rows in sorted(plan.rows.items())}}

    def extend(self, plan: LinkPlan, manifest: Mapping[str, Any]) -> None:
        """The checkpoint of `manifest` is on disk: the next delta goes on from it."""
        self.links = list(manifest["chain"])
        self.marks = dict(plan.marks)
        self.generations = dict(plan.generations)
        self.rows = dict(plan.rows)

    def reset(self) -> None:
        """The next checkpoint is a full write."""
        self.links, self.marks, self.generations, self.rows = [], {}, {}, {}
