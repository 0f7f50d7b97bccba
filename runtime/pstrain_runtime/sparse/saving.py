"""The chief's writing of one checkpoint's sparse link (see `chain`): the servers are
marked (`start_link`), then each server's rows of each table (and, for a delta, the
ids it dropped) stream into `ckpt-<step>.sparse/` (`write_link`), and the checkpoint
file naming the link is written only once they are all on disk (by the caller).

Where the rows are read decides when the chief may train again (`LinkWrite`):
- async: on a thread of its own while training goes on (the rows were never one
  step's in async mode: other workers push during any export);
- sync: the rows are those of the checkpoint's step only while the chief holds that
  step (no step is applied without the chief's rows), so they are read before it trains
  on: a delta is read into memory (at most `CAPTURE_BYTES`) and written on the thread;
  a full link, or a delta above that, is read and written at once.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from .chain import Chain, Key, LinkPlan
from .files import Written, write_ids, write_rows
from .spec import ROW_SLOTS, TableSpec
from .table import RowBlock

if TYPE_CHECKING:
    from .client import SparseClient
    from .shard_writes import ServerWrites

CAPTURE_BYTES = 512 << 20  # a sync delta read into the chief's memory, at most


class SaveCancelled(Exception):
    """A link write stopped because its checkpoint was abandoned (a restore began)."""


def shard_name(table_index: int, ps: int, what: str) -> str:
    """The file of server `ps`'s shard of a link's `table_index`-th table (tables in
    name order): its rows ("rows"), or the ids a delta dropped ("removed")."""
    return f"table{table_index}-ps{ps}.{what}"


def _slots(spec: TableSpec) -> tuple[str, ...]:
    return ROW_SLOTS[spec.optimizer.name]  # type: ignore[union-attr]


def start_link(client: SparseClient, specs: Mapping[str, TableSpec], chain: Chain,
               step: int, full: bool = False) -> LinkPlan:
    """Mark every (table, server): the link's export begins. A delta where the chain
    allows one and every server can give it exactly; else a full link."""
    full = full or chain.full_due()
    while True:
        replies: dict[Key, dict[str, Any]] = {}
        for name, spec in sorted(specs.items()):
            for ps in range(client.num_ps):
                since = None if full else chain.marks.get((name, ps))
                replies[(name, ps)] = client.mark(ps, spec, since)
        if full or chain.may_extend(replies):
            break
        full = True
    rows: dict[str, int] = {}
    for (name, _), reply in replies.items():
        rows[name] = rows.get(name, 0) + int(reply.get("rows", 0))
    return LinkPlan(step=step, full=full,
                    since={} if full else {key: chain.marks[key] for key in replies},
                    marks={key: int(r["watermark"]) for key, r in replies.items()},
                    generations={ps: int(r["generation"]) for (_, ps), r in replies.items()},
                    rows=rows)


class LiveRows:
    """The servers' rows, read page by page as they are written; `cancel` stops it."""

    def __init__(self, client: SparseClient, cancel: threading.Event) -> None:
        self.client, self.cancel = client, cancel

    def _checked(self, pages: Iterator[Any]) -> Iterator[Any]:
        for page in pages:
            if self.cancel.is_set():
                raise SaveCancelled("the checkpoint was abandoned")
            yield page

    def rows(self, ps: int, spec: TableSpec, since: int | None) -> Iterator[RowBlock]:
        return self._checked(self.client.export(ps, spec, _slots(spec), since=since))

    def removed(self, ps: int, spec: TableSpec, since: int) -> Iterator[torch.Tensor]:
        return self._checked(self.client.export_removed(ps, spec, since))


class CapturedRows:
    """The servers' rows of a delta, read into memory (sync: at the checkpoint's step)."""

    def __init__(self) -> None:
        self.blocks: dict[Key, list[RowBlock]] = {}
        self.ids: dict[Key, list[torch.Tensor]] = {}

    @classmethod
    def read(cls, client: SparseClient, specs: Mapping[str, TableSpec], plan: LinkPlan,
             budget: int) -> CapturedRows | None:
        """A delta's rows and removed ids, or None once they pass `budget` bytes."""
        got, size = cls(), 0
        for name, spec in sorted(specs.items()):
            for ps in range(client.num_ps):
                since = plan.since[(name, ps)]
                got.ids[(name, ps)] = list(client.export_removed(ps, spec, since))
                blocks = got.blocks[(name, ps)] = []
                for block in client.export(ps, spec, _slots(spec), since=since):
                    blocks.append(block)
                    size += sum(t.numel() * t.element_size() for t in (
                        block.ids, block.rows, block.last, *block.slots.values()))
                    if size > budget:
                        return None
        return got

    def rows(self, ps: int, spec: TableSpec, since: int | None) -> list[RowBlock]:
        return self.blocks[(spec.name, ps)]

    def removed(self, ps: int, spec: TableSpec, since: int) -> list[torch.Tensor]:
        return self.ids[(spec.name, ps)]


def write_link(specs: Mapping[str, TableSpec], num_ps: int, directory: Path,
               plan: LinkPlan, source: LiveRows | CapturedRows,
               servers: ServerWrites | None = None) -> dict[str, Any]:
    """Write a link's files into `directory / plan.dir`; the link's manifest entry.
    With `servers`, each server writes its own shards where it can (`shard_writes`);
    the chief writes those of the others, from `source`."""
    sub = directory / plan.dir

    def shard(ps: int, k: int, spec: TableSpec, what: str, since: int | None) -> Written:
        written = servers.write(ps, k, spec, what, since) if servers is not None else None
        if written is not None:
            return written
        path = sub / shard_name(k, ps, what)
        if what == "removed":
            return write_ids(path, spec, source.removed(ps, spec, since))  # type: ignore[arg-type]
        return write_rows(path, spec, _slots(spec), source.rows(ps, spec, since))

    tables: dict[str, Any] = {}
    for k, (name, spec) in enumerate(sorted(specs.items())):
        entry: dict[str, Any] = {"files": [], "rows": 0, "checks": {}}
        if not plan.full:
            entry["removed"] = []
        for ps in range(num_ps):
            since = plan.since.get((name, ps))
            for what in ("rows",) if plan.full else ("removed", "rows"):
                written = shard(ps, k, spec, what, since)
                filename = shard_name(k, ps, what)
                entry["files" if what == "rows" else "removed"].append(filename)
                entry["checks"][filename] = written.check()
                if what == "rows":
                    entry["rows"] += written.rows
        tables[name] = entry
    return {"dir": plan.dir, "step": plan.step, "full": plan.full, "tables": tables}


class LinkWrite:
    """One checkpoint's link being written: by `run(cancel)`, on a thread of its own
    (`background`) or at once. `result` waits for it and raises what it raised."""

    def __init__(self, plan: LinkPlan, run: Callable[[threading.Event], dict[str, Any]],
                 background: bool) -> None:
        self.plan = plan
        self.cancelled = threading.Event()
        self._done = threading.Event()
        self._link: dict[str, Any] | None = None
        self._error: Exception | None = None
        if background:
            threading.Thread(target=self._run, args=(run,), daemon=True,
                             name=f"sparse-checkpoint-{plan.step}").start()
        else:
            self._run(run)

    def _run(self, run: Callable[[threading.Event], dict[str, Any]]) -> None:
        try:
            self._link = run(self.cancelled)
        except Exception as exc:  # noqa: BLE001 - handed to the chief's thread by result()
            self._error = exc
        finally:
            self._done.set()

    def done(self) -> bool:
        return self._done.is_set()

    def result(self) -> dict[str, Any]:
        self._done.wait()
        if self._error is not None:
            raise self._error
        assert self._link is not None  # set when no error was
        return self._link

    def cancel(self) -> None:
        """Stop at the next page and wait until the thread has."""
        self.cancelled.set()
        self._done.wait()
