"""The worker's side of sparse tables: `SparseClient` splits a batch's unique ids by
owner (`ids.owner_of`) and makes one call per parameter server, all servers at once;
`RemoteSource` is what a bound layer pulls its rows from."""

from __future__ import annotations

import concurrent.futures as cf
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch

from ..ps.store import PSError
from .cache import RowCache
from .ids import split_by_owner
from .protocol import encode, header_of, tensor_of
from .spec import TableSpec
from .table import RowBlock
from .tiered import StorageSettings

MAX_CALL_BYTES = 32 * 1024 * 1024  # rows per call stay well under the frame limit
EXPORT_ROWS = 65536  # rows per page when a shard is streamed out


class SparseClient:
    def __init__(self, transports: Sequence[Any], namespace: str,
                 max_call_bytes: int = MAX_CALL_BYTES) -> None:
        self.transports = list(transports)
        self.namespace = namespace
        self.num_ps = len(self.transports)
        self.max_call_bytes = max_call_bytes
        # Per server, the generation its last pull reply named (0: none yet): pushes
        # send it back, and a server initialised since refuses them (ABORTED).
        self.generations: list[int] = [0] * self.num_ps
        self.pool = cf.ThreadPoolExecutor(max_workers=max(1, self.num_ps),
                                          thread_name_prefix="sparse-client")

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)

    def _each(self, fn: Callable[[int], Any], servers: Sequence[int]) -> list[Any]:
        """fn(ps) for each server concurrently (every call ends before this returns);
        the first failure is raised."""
        if len(servers) == 1:
            return [fn(servers[0])]
        futures = [self.pool.submit(fn, ps) for ps in servers]
        cf.wait(futures)
        for future in futures:
            if future.exception() is not None:
                raise future.exception()  # type: ignore[misc]
        return [future.result() for future in futures]

    def _call(self, ps: int, header: dict[str, Any], tensors: Sequence[torch.Tensor] = ()
              ) -> tuple[dict[str, Any], list[bytes]]:
        reply = self.transports[ps].sparse(encode({**header, "namespace": self.namespace},
                                                  tensors))
        if not reply:
            raise PSError("INTERNAL", f"parameter server {ps} answered a sparse call with "
                          "no frame")
        return header_of(reply), reply[1:]

    def _rows_per_call(self, dim: int) -> int:
        return max(1, self.max_call_bytes // (4 * dim + 8))

    # ------------------------------------------------------------------ training
    def pull(self, spec: TableSpec, ids: torch.Tensor) -> torch.Tensor:
        """Rows of `ids` (unique int64, CPU), float32 [n, dim], from their owners."""
        return self.pull_many([spec], [ids])[0]

    def pull_many(self, specs: Sequence[TableSpec], ids: Sequence[torch.Tensor]
                  ) -> list[torch.Tensor]:
        """`pull` for several tables at once: one call per server carrying every
        table's ids (more only above the call size limit), all servers at once."""
        outs = [torch.empty((i.numel(), s.embedding_dim), dtype=torch.float32)
                for s, i in zip(specs, ids, strict=True)]
        positions = [split_by_owner(i, self.num_ps) for i in ids]

        def one(ps: int) -> None:
            calls: list[list[tuple[int, torch.Tensor]]] = [[]]
            size = 0
            for k, spec in enumerate(specs):
                for chunk in torch.split(positions[k][ps],
                                         self._rows_per_call(spec.embedding_dim)):
                    if not chunk.numel():
                        continue
                    nbytes = chunk.numel() * (4 * spec.embedding_dim + 8)
                    if calls[-1] and size + nbytes > self.max_call_bytes:
                        calls.append([])
                        size = 0
                    calls[-1].append((k, chunk))
                    size += nbytes
            for call in calls:
                reply, frames = self._call(ps, {"op": "pull", "tables": [
                    {"name": specs[k].name, "count": int(c.numel())} for k, c in call]},
                    [ids[k][c] for k, c in call])
                self.generations[ps] = int(reply.get("generation", 0))
                if len(frames) != len(call):
                    raise PSError("INTERNAL", f"parameter server {ps} answered a pull of "
                                  f"{len(call)} tables with {len(frames)} frames")
                for (k, chunk), frame in zip(call, frames, strict=True):
                    rows = tensor_of(frame, torch.float32, specs[k].embedding_dim,
                                     "pulled rows")
                    if rows.shape[0] != chunk.numel():
                        raise PSError("INTERNAL", f"parameter server {ps} sent "
                                      f"{rows.shape[0]} rows of {specs[k].name!r} for "
                                      f"{chunk.numel()} ids")
                    outs[k][chunk] = rows

        self._each(one, [ps for ps in range(self.num_ps)
                         if any(p[ps].numel() for p in positions)])
        return outs

    def push(self, grads: Mapping[str, tuple[torch.Tensor, torch.Tensor]], worker: int,
             steps: Sequence[int]) -> list[dict[str, Any]]:
        """Push each table's (unique ids, gradient rows) to their owners: per server, the
        rows of every table in as few calls as the size limit allows (numbered parts
        of one step), all servers at once, each with the generation of the rows last
        pulled from it. Returns the replies of the servers called."""
        per_ps: list[list[tuple[str, torch.Tensor, torch.Tensor]]] = [
            [] for _ in range(self.num_ps)]
        for name, (ids, rows) in sorted(grads.items()):
            for ps, pos in enumerate(split_by_owner(ids, self.num_ps)):
                if pos.numel():
                    limit = self._rows_per_call(rows.shape[1])
                    for chunk in torch.split(pos, limit):
                        per_ps[ps].append((name, ids[chunk], rows[chunk]))

        def one(ps: int) -> dict[str, Any]:
            calls: list[list[tuple[str, torch.Tensor, torch.Tensor]]] = [[]]
            size = 0
            for entry in per_ps[ps]:
                nbytes = entry[2].numel() * 4 + entry[1].numel() * 8
                if calls[-1] and size + nbytes > self.max_call_bytes:
                    calls.append([])
                    size = 0
                calls[-1].append(entry)
                size += nbytes
            reply: dict[str, Any] = {}
            for part, entries in enumerate(calls):
                reply, _ = self._call(ps, {
                    "op": "push", "worker": worker, "step": int(steps[ps]), "part": part,
                    "generation": self.generations[ps],
                    "tables": [{"name": n, "count": int(i.numel())} for n, i, _ in entries]},
                    [t for _, ids, rows in entries for t in (ids, rows)])
            return reply

        return self._each(one, [ps for ps in range(self.num_ps) if per_ps[ps]])

    # ------------------------------------------------------------------ chief
    def configure(self, specs: Sequence[TableSpec], reset: bool,
                  only: Sequence[int] | None = None,
                  storage: StorageSettings | None = None) -> None:
        """Define the tables on the servers (`only` some); `storage`: each server's
        memory budget for their rows and the directory for the rest (`tiered`)."""
        header: dict[str, Any] = {"op": "configure", "reset": reset, "num_ps": self.num_ps,
                                  "tables": [spec.to_json() for spec in specs]}
        if storage is not None:
            header["storage"] = storage.to_json()
        self._each(lambda ps: self._call(ps, header),
                   list(range(self.num_ps)) if only is None else list(only))

    def stats(self) -> dict[str, dict[str, int]]:
        """Live rows and bytes (RAM) per table, summed over the servers; with a disk
        tier also `hot_rows`, `disk_rows`, `disk_bytes` and `hot_row_budget`."""
        total: dict[str, dict[str, int]] = {}
        for reply, _ in self._each(lambda ps: self._call(ps, {"op": "stats"}),
                                   list(range(self.num_ps))):
            for name, item in reply.get("tables", {}).items():
                acc = total.setdefault(name, {"rows": 0, "bytes": 0})
                for key, value in item.items():  # rows, bytes (and a disk tier's counts)
                    acc[key] = acc.get(key, 0) + int(value)
        return total

    def export(self, ps: int, spec: TableSpec, slots: Sequence[str],
               page_rows: int | None = None, since: int | None = None
               ) -> Iterator[RowBlock]:
        """Server `ps`'s rows of a table, page by page (EXPORT_ROWS rows at most, and
        no frame above the call size limit); with `since`, only the rows updated at
        clock >= since (a checkpoint's delta)."""
        dim = spec.embedding_dim
        page_rows = min(page_rows or EXPORT_ROWS, self._rows_per_call(dim))
        start = 0
        while True:
            header = {"op": "export", "table": spec.name, "start": start, "limit": page_rows}
            if since is not None:
                header["since"] = since
            reply, frames = self._call(ps, header)
            if len(frames) != 3 + len(slots):
                raise PSError("INTERNAL", f"parameter server {ps} exported {len(frames)} "
                              f"frames of {spec.name!r}; expected {3 + len(slots)}")
            yield RowBlock(ids=tensor_of(frames[0], torch.int64, 0, "ids"),
                           rows=tensor_of(frames[1], torch.float32, dim, "rows"),
                           slots={n: tensor_of(f, torch.float32, dim, n)
                                  for n, f in zip(slots, frames[2:-1], strict=True)},
                           last=tensor_of(frames[-1], torch.int64, 0, "last"))
            start = int(reply["next"])
            if start == 0:
                return

    def mark(self, ps: int, spec: TableSpec, since: int | None) -> dict[str, Any]:
        """Start a checkpoint export of a table on server `ps`: a full one (`since`
        None) or a delta of the rows updated at clock >= since. The reply: the
        `watermark` (the clock of the next update there, the next delta's `since`),
        the server's `generation`, whether the ids dropped since `since` are all
        recorded (`complete`; else the export must be a full one) and its live `rows`."""
        reply, _ = self._call(ps, {"op": "export", "what": "mark", "table": spec.name,
                                   "since": since})
        return reply

    def export_removed(self, ps: int, spec: TableSpec, since: int,
                       page_ids: int | None = None) -> Iterator[torch.Tensor]:
        """The ids server `ps` dropped from a table (eviction) at clock >= since, in
        pages, once `mark` said they are recorded."""
        page_ids = page_ids or self.max_call_bytes // 8
        start = 0
        while True:
            reply, frames = self._call(ps, {"op": "export", "what": "removed",
                                            "table": spec.name, "since": since,
                                            "start": start, "limit": page_ids})
            if len(frames) != 1:
                raise PSError("INTERNAL", f"parameter server {ps} sent {len(frames)} "
                              f"frames of removed ids of {spec.name!r}; expected 1")
            yield tensor_of(frames[0], torch.int64, 0, "removed ids")
            start = int(reply["next"])
            if start == 0:
                return

    def load(self, spec: TableSpec, slots: Sequence[str], block: RowBlock,
             upsert: bool = False) -> None:
        """Send restored rows to their owners (`upsert`: a delta's rows, which replace
        those the servers hold)."""
        positions = split_by_owner(block.ids, self.num_ps)
        mode = "upsert" if upsert else "insert"

        def one(ps: int) -> None:
            pos = positions[ps]
            self._call(ps, {"op": "import", "table": spec.name, "count": int(pos.numel()),
                            "mode": mode},
                       [block.ids[pos], block.rows[pos],
                        *(block.slots[n][pos] for n in slots), block.last[pos]])

        self._each(one, [ps for ps in range(self.num_ps) if positions[ps].numel()])

    def remove(self, spec: TableSpec, ids: torch.Tensor) -> None:
        """Drop the rows of `ids` on their owners (a delta's removed ids, restored)."""
        positions = split_by_owner(ids, self.num_ps)

        def one(ps: int) -> None:
            pos = positions[ps]
            self._call(ps, {"op": "import", "table": spec.name, "count": int(pos.numel()),
                            "mode": "remove"}, [ids[pos]])

        self._each(one, [ps for ps in range(self.num_ps) if positions[ps].numel()])


class RemoteSource:
    """A bound layer's rows: pulled from the parameter servers, through a worker-side
    cache (`cache.RowCache`) for the tables that have one. `step` is the worker's step
    count (the session advances it), the cache's clock."""

    def __init__(self, client: SparseClient,
                 caches: Mapping[str, RowCache] | None = None) -> None:
        self.client = client
        self.caches = dict(caches or {})
        self.step = 0
        self.looked_up = 0  # rows asked for, over every pull
        self.pulled = 0  # rows of them pulled from the servers (the rest: the caches)

    def pull(self, spec: TableSpec, ids: torch.Tensor) -> torch.Tensor:
        return self.pull_many([spec], [ids])[0]

    def pull_many(self, specs: Sequence[TableSpec], ids: Sequence[torch.Tensor]
                  ) -> list[torch.Tensor]:
        asked = sum(int(i.numel()) for i in ids)
        self.looked_up += asked
        if not self.caches:
            self.pulled += asked
            return self.client.pull_many(specs, ids)
        plans = [self.caches[spec.name].plan(i, self.step) if spec.name in self.caches
                 else None for spec, i in zip(specs, ids, strict=True)]
        wanted = [i if plan is None else plan.missing for i, plan in zip(ids, plans, strict=True)]
        self.pulled += sum(int(i.numel()) for i in wanted)
        pulled = self.client.pull_many(specs, wanted)
        return [rows if plan is None else self.caches[spec.name].finish(plan, rows)
                for spec, plan, rows in zip(specs, plans, pulled, strict=True)]
