"""The worker's side of sparse tables: `SparseClient` splits a batch's unique ids by
owner (`ids.owner_of`) and makes one call per parameter server, all servers at once;
`RemoteSource` is what a bound layer pulls its rows from."""

from __future__ import annotations

import concurrent.futures as cf
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from ..ps.store import PSError
from ..transport.dataplane import on_data_plane
from .cache import Lookup, RowCache
from .ids import split_by_owner
from . import riding
from .protocol import Encoded, Frame, encode, header_of, tensor_of
from .scatter import put_rows
from .spec import TableSpec
from .table import EXPORT_ROWS, RowBlock
from .tiered import StorageSettings

Entry = tuple[str, torch.Tensor, torch.Tensor]  # a push's (table, ids, gradient rows)
MAX_CALL_BYTES = 32 * 1024 * 1024  # rows per call stay well under the frame limit
GENERATION_TRIES = 3  # lookups through the caches while generations change under them


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
        # The last pull's ids and their split by owner: a step pushes gradients for
        # the very id tensors it pulled, whose split is then not computed again.
        self._pulled_splits: list[tuple[torch.Tensor, list[torch.Tensor]]] = []
        # The last push's, likewise: with a cache a step pulls only some of the ids
        # it pushes, and the push's replies' versions go back to these positions
        # (`RemoteSource.note_pushed`).
        self._pushed_splits: list[tuple[torch.Tensor, list[torch.Tensor]]] = []

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)

    def _each(self, fn: Callable[[int], Any], servers: Sequence[int]) -> list[Any]:
        """fn(ps) for each server concurrently (every call ends before this returns);
        the first failure is raised."""
        if len(servers) == 1:
            return [fn(servers[0])]
        # The first server's call runs on this thread (one thread hop fewer per call).
        futures = [self.pool.submit(fn, ps) for ps in servers[1:]]
        try:
            first = fn(servers[0])
        finally:
            cf.wait(futures)
        for future in futures:
            if future.exception() is not None:
                raise future.exception()  # type: ignore[misc]
        return [first, *(future.result() for future in futures)]

    def call(self, ps: int, header: dict[str, Any], tensors: Sequence[torch.Tensor] = ()
             ) -> tuple[dict[str, Any], list[Frame]]:
        """One sparse call to server `ps` (in this client's namespace): its reply's
        header and frames. The ops of their own modules (`shard_writes`) call it."""
        return self._reply(ps, self.transports[ps].sparse(self._request(header, tensors)))

    def _request(self, header: dict[str, Any], tensors: Sequence[torch.Tensor]) -> Encoded:
        return encode({**header, "namespace": self.namespace}, tensors)

    @staticmethod
    def _reply(ps: int, frames: list[Frame]) -> tuple[dict[str, Any], list[Frame]]:
        if not frames:
            raise PSError("INTERNAL", f"parameter server {ps} answered a sparse call with "
                          "no frame")
        return header_of(frames), frames[1:]

    def _at_once_fits(self, servers: Sequence[int], per_ps: Any) -> bool:
        """Whether `_at_once` serves these servers' calls (`per_ps[ps]`: a list each):
        the usual case, several servers, one call each, all on the data plane."""
        return len(servers) > 1 and all(
            len(per_ps[ps]) == 1 and on_data_plane(self.transports[ps]) for ps in servers)

    def _at_once(self, calls: Mapping[int, tuple[dict[str, Any], Sequence[torch.Tensor]]]
                 ) -> Iterator[tuple[int, dict[str, Any], list[Frame]]]:
        """One call to each server in `calls` (transports `on_data_plane`), all in
        flight at once from this thread: every request sent, then every reply read (no
        thread hop; a transport that lost its data plane meanwhile makes its call when
        its turn comes). Yields (server, header, frames) in the order of `calls`."""
        sent = []
        for ps, (header, tensors) in calls.items():
            send = getattr(self.transports[ps], "sparse_sent", None)
            sent.append((ps, send(self._request(header, tensors)) if send else None))
        for ps, finish in sent:
            if finish is None:
                yield (ps, *self.call(ps, *calls[ps]))
            else:
                yield (ps, *self._reply(ps, finish()))

    def _split(self, ids: torch.Tensor) -> list[torch.Tensor]:
        """`split_by_owner` of `ids`, taken from the last pull's or push's when `ids` is
        one of their tensors (the same object: ids are never changed in place)."""
        for known, positions in (*self._pulled_splits, *self._pushed_splits):
            if known is ids:
                return positions
        return split_by_owner(ids, self.num_ps)

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
        return self.pull_versioned(specs, ids, versions=False)[0]

    def pull_versioned(self, specs: Sequence[TableSpec], ids: Sequence[torch.Tensor],
                       versions: bool = True, also: Collection[int] = ()
                       ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """`pull_many`, and with `versions` each row's version (int32 [n] per table,
        see `protocol`; else empty). The servers in `also` are called even when they
        own none of the ids (a call of no ids: it tells their `generations`)."""
        outs = [torch.empty((i.numel(), s.embedding_dim), dtype=torch.float32)
                for s, i in zip(specs, ids, strict=True)]
        counts = [torch.zeros(i.numel() if versions else 0, dtype=torch.int32) for i in ids]
        positions = [self._split(i) for i in ids]
        self._pulled_splits = list(zip(ids, positions, strict=True))

        def request(call: list[tuple[int, torch.Tensor]]
                    ) -> tuple[dict[str, Any], list[torch.Tensor]]:
            return ({"op": "pull", "tables": [{"name": specs[k].name, "count": int(c.numel())}
                                              for k, c in call],
                     **({"versions": True} if versions else {})},
                    [ids[k].index_select(0, c) for k, c in call])

        def take(ps: int, call: list[tuple[int, torch.Tensor]], reply: dict[str, Any],
                 frames: list[Frame]) -> None:
            self.generations[ps] = int(reply.get("generation", 0))
            if len(frames) != len(call) * (2 if versions else 1):
                raise PSError("INTERNAL", f"parameter server {ps} answered a pull of "
                              f"{len(call)} tables with {len(frames)} frames")
            for n, (k, chunk) in enumerate(call):
                put_rows(outs[k], chunk, self._checked(ps, frames[n], torch.float32,
                                                       specs[k], chunk, "rows"))
                if versions:
                    put_rows(counts[k], chunk, self._checked(
                        ps, frames[len(call) + n], torch.int32, specs[k], chunk,
                        "versions"))

        servers = [ps for ps in range(self.num_ps)
                   if ps in also or any(p[ps].numel() for p in positions)]
        per_ps = {ps: self._pull_calls(specs, [p[ps] for p in positions]) for ps in servers}
        if self._at_once_fits(servers, per_ps):
            for ps, reply, frames in self._at_once({ps: request(per_ps[ps][0])
                                                    for ps in servers}):
                take(ps, per_ps[ps][0], reply, frames)
        else:
            self._each(lambda ps: [take(ps, call, *self.call(ps, *request(call)))
                                   for call in per_ps[ps]], servers)
        return outs, counts

    def _pull_calls(self, specs: Sequence[TableSpec], positions: Sequence[torch.Tensor]
                    ) -> list[list[tuple[int, torch.Tensor]]]:
        """One server's pull calls: (table, positions of its ids) each, the rows of a
        call within the size limit (one call of no ids when there are none)."""
        calls: list[list[tuple[int, torch.Tensor]]] = [[]]
        size = 0
        for k, spec in enumerate(specs):
            for chunk in torch.split(positions[k], self._rows_per_call(spec.embedding_dim)):
                if not chunk.numel():
                    continue
                nbytes = chunk.numel() * (4 * spec.embedding_dim + 8)
                if calls[-1] and size + nbytes > self.max_call_bytes:
                    calls.append([])
                    size = 0
                calls[-1].append((k, chunk))
                size += nbytes
        return calls

    @staticmethod
    def _checked(ps: int, frame: bytes, dtype: torch.dtype, spec: TableSpec,
                 chunk: torch.Tensor, what: str) -> torch.Tensor:
        width = spec.embedding_dim if dtype == torch.float32 else 0
        values = tensor_of(frame, dtype, width, f"pulled {what}")
        if values.shape[0] != chunk.numel():
            raise PSError("INTERNAL", f"parameter server {ps} sent {values.shape[0]} {what} "
                          f"of {spec.name!r} for {chunk.numel()} ids")
        return values

    def _push_calls(self, grads: Mapping[str, tuple[torch.Tensor, torch.Tensor]],
                    worker: int, steps: Sequence[int], versions: bool
                    ) -> list[list[tuple[list[Entry], dict[str, Any]]]]:
        """Per server, the calls of a push: (its entries, its header) each, the rows of
        every table in as few calls as the size limit allows (numbered parts of one
        step), each with the generation of the rows last pulled from that server."""
        per_ps: list[list[Entry]] = [[] for _ in range(self.num_ps)]
        splits = {name: self._split(ids) for name, (ids, _) in grads.items()}
        self._pushed_splits = [(grads[name][0], split) for name, split in splits.items()]
        for name, (ids, rows) in sorted(grads.items()):
            for ps, pos in enumerate(splits[name]):
                if pos.numel():
                    limit = self._rows_per_call(rows.shape[1])
                    for chunk in torch.split(pos, limit):
                        per_ps[ps].append((name, ids.index_select(0, chunk),
                                           rows.index_select(0, chunk)))
        out: list[list[tuple[list[Entry], dict[str, Any]]]] = []
        for ps, entries in enumerate(per_ps):
            calls: list[list[Entry]] = [[]] if entries else []
            size = 0
            for entry in entries:
                nbytes = entry[2].numel() * 4 + entry[1].numel() * 8
                if calls[-1] and size + nbytes > self.max_call_bytes:
                    calls.append([])
                    size = 0
                calls[-1].append(entry)
                size += nbytes
            out.append([(call, {
                "op": "push", "worker": worker, "step": int(steps[ps]), "part": part,
                "generation": self.generations[ps],
                "tables": [{"name": n, "count": int(i.numel())} for n, i, _ in call],
                **({"versions": True} if versions else {})})
                for part, call in enumerate(calls)])
        return out

    def push(self, grads: Mapping[str, tuple[torch.Tensor, torch.Tensor]], worker: int,
             steps: Sequence[int], versions: bool = False) -> list[dict[str, Any]]:
        """Push each table's (unique ids, gradient rows) to their owners (`_push_calls`),
        all servers at once. Returns the replies of the servers called (the last
        part's), each with its server as `ps`; with `versions`, also the pushed rows'
        versions after the update as `versions`: [(table, ids, int32 versions)] over
        the parts."""
        per_ps = self._push_calls(grads, worker, steps, versions)

        def request(entries: list[Entry], header: dict[str, Any]
                    ) -> tuple[dict[str, Any], list[torch.Tensor]]:
            return header, [t for _, ids, rows in entries for t in (ids, rows)]

        def answer(ps: int, reply: dict[str, Any], pushed: list[Entry]) -> dict[str, Any]:
            return {**reply, "ps": ps, **({"versions": pushed} if versions else {})}

        servers = [ps for ps in range(self.num_ps) if per_ps[ps]]
        if self._at_once_fits(servers, per_ps):
            return [answer(ps, reply, _pushed_versions(ps, per_ps[ps][0][0], frames)
                           if versions else [])
                    for ps, reply, frames in self._at_once({ps: request(*per_ps[ps][0])
                                                            for ps in servers})]

        def one(ps: int) -> dict[str, Any]:
            reply: dict[str, Any] = {}
            pushed: list[Entry] = []
            for entries, header in per_ps[ps]:
                reply, frames = self.call(ps, *request(entries, header))
                if versions:
                    pushed.extend(_pushed_versions(ps, entries, frames))
            return answer(ps, reply, pushed)

        return self._each(one, servers)

    def riders(self, grads: Mapping[str, tuple[torch.Tensor, torch.Tensor]], worker: int,
               steps: Sequence[int], versions: bool = False
               ) -> tuple[list[Encoded | None], list[list[Entry]]] | None:
        """The push of `grads` as one call's frames per server, to ride on the step's
        dense push_pull (`riding`; None for a server with no rows), and each call's
        entries (for `riding_replies`); None when some server's rows need more than one
        call (then `push` them)."""
        per_ps = self._push_calls(grads, worker, steps, versions)
        if any(len(calls) > 1 for calls in per_ps):
            return None
        frames = [encode({**calls[0][1], "namespace": self.namespace},
                         [t for _, ids, rows in calls[0][0] for t in (ids, rows)])
                  if calls else None for calls in per_ps]
        return frames, [calls[0][0] if calls else [] for calls in per_ps]

    @staticmethod
    def riding_replies(replies: Sequence[Sequence[Frame] | None],
                       entries: Sequence[Sequence[Entry]], versions: bool
                       ) -> list[dict[str, Any]]:
        """The replies of a push that rode (`riders`), as `push` gives them: each with
        its server as `ps` (servers not called left out) and, with `versions`, the
        pushed rows' versions where the server sent them (not where it did not apply
        the dense push). A refusal of the rows is raised (PSError)."""
        out = []
        for ps, frames in enumerate(replies):
            if frames is None:
                continue
            reply = {**riding.reply_of(frames), "ps": ps}
            if versions and len(frames) > 1:
                reply["versions"] = _pushed_versions(ps, entries[ps], frames[1:])
            out.append(reply)
        return out

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
        self._each(lambda ps: self.call(ps, header),
                   list(range(self.num_ps)) if only is None else list(only))

    def stats(self) -> dict[str, dict[str, int]]:
        """Live rows and bytes (RAM) per table, summed over the servers; with a disk
        tier also `hot_rows`, `disk_rows`, `disk_bytes` and `hot_row_budget`."""
        total: dict[str, dict[str, int]] = {}
        for reply, _ in self._each(lambda ps: self.call(ps, {"op": "stats"}),
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
            reply, frames = self.call(ps, header)
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
        reply, _ = self.call(ps, {"op": "export", "what": "mark", "table": spec.name,
                                   "since": since})
        return reply

    def export_removed(self, ps: int, spec: TableSpec, since: int,
                       page_ids: int | None = None) -> Iterator[torch.Tensor]:
        """The ids server `ps` dropped from a table (eviction) at clock >= since, in
        pages, once `mark` said they are recorded."""
        page_ids = page_ids or self.max_call_bytes // 8
        start = 0
        while True:
            reply, frames = self.call(ps, {"op": "export", "what": "removed",
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
            self.call(ps, {"op": "import", "table": spec.name, "count": int(pos.numel()),
                            "mode": mode},
                       [block.ids[pos], block.rows[pos],
                        *(block.slots[n][pos] for n in slots), block.last[pos]])

        self._each(one, [ps for ps in range(self.num_ps) if positions[ps].numel()])

    def remove(self, spec: TableSpec, ids: torch.Tensor) -> None:
        """Drop the rows of `ids` on their owners (a delta's removed ids, restored)."""
        positions = split_by_owner(ids, self.num_ps)

        def one(ps: int) -> None:
            pos = positions[ps]
            self.call(ps, {"op": "import", "table": spec.name, "count": int(pos.numel()),
                            "mode": "remove"}, [ids[pos]])

        self._each(one, [ps for ps in range(self.num_ps) if positions[ps].numel()])


def _pushed_versions(ps: int, entries: Sequence[tuple[str, torch.Tensor, torch.Tensor]],
                     frames: Sequence[bytes]) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """A push reply's versions of the ids pushed (one int32 frame per table)."""
    if len(frames) != len(entries):
        raise PSError("INTERNAL", f"parameter server {ps} answered a push of {len(entries)} "
                      f"tables asking for versions with {len(frames)} frames")
    out = []
    for (name, ids, _), frame in zip(entries, frames, strict=True):
        versions = tensor_of(frame, torch.int32, 0, "pushed rows' versions")
        if versions.numel() != ids.numel():
            raise PSError("INTERNAL", f"parameter server {ps} sent {versions.numel()} "
                          f"versions of {name!r} for {ids.numel()} ids pushed")
        out.append((name, ids, versions))
    return out


class RemoteSource:
    """A bound layer's rows: pulled from the parameter servers, through a worker-side
    cache (`cache.RowCache`) for the tables that have one. `step` is the worker's step
    count (the session advances it), the cache's clock.

    With caches, pulls ask for the rows' versions (kept with the rows), and when a
    lookup serves rows from a cache every server is called (with no ids when none of
    its ids are pulled), so that its generation is known first: a server whose
    generation is not the one the kept rows came from (it was reset or restored) has
    its rows dropped from every cache, and the lookup is made again. `note_pushed`
    takes the versions a push's replies carry (`SparseSession.push`)."""

    def __init__(self, client: SparseClient,
                 caches: Mapping[str, RowCache] | None = None) -> None:
        self.client = client
        self.caches = dict(caches or {})
        self.step = 0
        self.looked_up = 0  # rows asked for, over every pull
        self.pulled = 0  # rows of them pulled from the servers (the rest: the caches)
        self.generations = [0] * client.num_ps  # of the rows kept, per server (0: none)

    def pull(self, spec: TableSpec, ids: torch.Tensor) -> torch.Tensor:
        return self.pull_many([spec], [ids])[0]

    def pull_many(self, specs: Sequence[TableSpec], ids: Sequence[torch.Tensor]
                  ) -> list[torch.Tensor]:
        asked = sum(int(i.numel()) for i in ids)
        self.looked_up += asked
        if self.caches:
            for _ in range(GENERATION_TRIES):
                rows = self._through_caches(specs, ids)
                if rows is not None:
                    return rows
        # No cache, or generations changing under every try: the servers' rows as they
        # are now, none kept.
        self.pulled += asked
        rows = self.client.pull_many(specs, ids)
        if self.caches:
            self._check_generations()
        return rows

    def _through_caches(self, specs: Sequence[TableSpec], ids: Sequence[torch.Tensor]
                        ) -> list[torch.Tensor] | None:
        """A lookup through the caches; None when a server's generation changed (its
        rows are dropped then, and nothing is kept or served)."""
        plans = [self.caches[spec.name].plan(i, self.step) if spec.name in self.caches
                 else None for spec, i in zip(specs, ids, strict=True)]
        wanted = [i if plan is None else plan.missing
                  for i, plan in zip(ids, plans, strict=True)]
        self.pulled += sum(int(i.numel()) for i in wanted)
        keeping = any(plan is not None and plan.keep for plan in plans)
        pulled, versions = self.client.pull_versioned(specs, wanted, versions=keeping,
                                                      also=self._serving(plans))
        if self._check_generations():
            return None
        return [rows if plan is None else self.caches[spec.name].finish(plan, rows, version)
                for spec, plan, rows, version in zip(specs, plans, pulled, versions,
                                                     strict=True)]

    def wants_versions(self) -> bool:
        """Whether a push should ask for its rows' versions: some cache is in use (not
        standing aside)."""
        return any(cache.active for cache in self.caches.values())

    def _serving(self, plans: Sequence[Lookup | None]) -> range:
        """The servers to call even without ids to pull from them: every one when the
        caches serve any row in this lookup (cheaper than finding the servers owning
        the rows served; a server with no row to pull is rare with the ids a cache
        helps with), else none."""
        if any(plan is not None and plan.miss.numel() < plan.ids.numel() for plan in plans):
            return range(self.client.num_ps)
        return range(0)

    def _check_generations(self) -> bool:
        """Take the generations the client's pulls saw; True when any changed."""
        changed = [self._see(ps, g) for ps, g in enumerate(self.client.generations)]
        return any(changed)

    def _see(self, ps: int, generation: int) -> bool:
        """Server `ps` answered with `generation`: when it is not the one of the rows
        kept (a reset or restore since), drop its rows from every cache (True)."""
        known = self.generations[ps]
        if not generation or generation == known:
            return False
        self.generations[ps] = generation
        if not known:
            return False
        for cache in self.caches.values():
            cache.drop_owned_by(ps, self.client.num_ps)
        return True

    def note_pushed(self, replies: Sequence[Mapping[str, Any]],
                    pushed: Mapping[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """The replies of a push with versions (`SparseClient.push`) of `pushed` (per
        table, its ids and gradient rows, as pushed): each cache counts this worker's
        push of its rows and drops those that miss too many updates
        (`RowCache.note_pushed`); a server of another generation drops its rows."""
        parts: dict[str, dict[int, list[tuple[torch.Tensor, torch.Tensor]]]] = {}
        for reply in replies:
            if "ps" in reply and reply.get("generation"):
                self._see(int(reply["ps"]), int(reply["generation"]))
            for name, ids, versions in reply.get("versions", ()):
                if name in self.caches:
                    parts.setdefault(name, {}).setdefault(int(reply["ps"]), []).append(
                        (ids, versions))
        for name, by_ps in parts.items():
            ids, versions = self._in_order(pushed[name][0], by_ps)
            self.caches[name].note_pushed(ids, versions)

    def _in_order(self, ids: torch.Tensor,
                  by_ps: Mapping[int, Sequence[tuple[torch.Tensor, torch.Tensor]]]
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """The pushed `ids` of a table and their versions in their order, from each
        server's parts of the replies. A server's parts follow its positions in `ids`
        (`SparseClient._push_calls`), so every server's versions go straight to their
        positions (the usual case: the very ids the lookup had, whose places the
        cache knows); where some server sent none (a riding push it did not apply),
        the ids that have them, in id order."""
        positions = self.client._split(ids)
        got = {ps: (torch.cat([v for _, v in p]) if len(p) > 1 else p[0][1])
               for ps, p in by_ps.items()}
        if all(got.get(ps, torch.empty(0)).numel() == pos.numel()
               for ps, pos in enumerate(positions)):
            versions = torch.empty(ids.numel(), dtype=torch.int32)
            for ps, pos in enumerate(positions):
                if pos.numel():
                    put_rows(versions, pos, got[ps])
            return ids, versions
        some = torch.cat([i for p in by_ps.values() for i, _ in p])
        # Each server's ids come sorted: a stable sort (timsort) merges the runs.
        order = torch.from_numpy(np.argsort(some.numpy(), kind="stable"))
        return some[order], torch.cat([v for p in by_ps.values() for _, v in p])[order]
