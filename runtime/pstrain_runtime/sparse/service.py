"""The parameter server's side of sparse tables: `handle` answers one sparse call on
a `ParameterStore`, and `NamespaceTables` (a namespace's `sparse` attribute) holds the
namespace's table shards and, in sync mode, the gradient rows waiting for their step.

Rules:
- Tables are defined by the chief (`configure`) before it initialises the namespace;
  workers may pull and push once the namespace is initialised. An unknown table is
  NOT_FOUND; bad ids or rows are INVALID_ARGUMENT and change nothing (every table of a
  push is checked before any is applied).
- A push is refused as a dense push is (`ps.membership`): from a worker outside the
  job's set (INVALID_ARGUMENT), or computed on rows of another generation of the
  namespace (ABORTED: pulls tell the generation, pushes send it back); a push whose
  worker is removed while it is in flight is dropped whole.
- async: a push is applied at once, under the namespace's lock, with Adam's step and
  the eviction clock at global step + 1.
- sync: a push of step s is kept per (worker, part) and applied, summed over workers
  and divided by their number (the mean, as for dense gradients), when the store applies
  step s's dense bucket (`apply_step`, called under the namespace's lock). Workers push
  a step's sparse rows before its dense gradients, so they are there in time. Rows
  pushed before the namespace was last initialised (another epoch) are dropped.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..ps import membership
from ..ps.store import Namespace, ParameterStore, PSError
from ..transport import auth
from .checks import check_grads, check_ids
from .protocol import Encoded, Frame, encode, field, header_of, tensor_of
from .spec import TableSpec
from .prefault import should_prefault
from .shard_writes import save_shard
from .table import RowBlock, RowTable
from .tiered import FIELD as STORAGE_FIELD
from .tiered import ROW_BOOKKEEPING, StorageSettings, TieredTable, shard_directory

Entry = tuple[str, torch.Tensor, torch.Tensor]  # table, ids, grad rows


def reserve_rows(spec: TableSpec, num_ps: int) -> int:
    """Rows a server reserves for its shard of a fixed-size table (about
    num_embeddings / num_ps, with room for an uneven split); 0 for a dynamic table."""
    if spec.num_embeddings is None:
        return 0
    return math.ceil(spec.num_embeddings / num_ps * 1.05) + 64


def reserve_bytes(spec: TableSpec, num_ps: int) -> int:
    """The memory a server's reserve of `spec` holds once mapped: its rows, their
    optimizer state and bookkeeping, and a direct id map's 4 bytes an id."""
    if spec.num_embeddings is None:
        return 0
    return (reserve_rows(spec, num_ps) * (spec.row_bytes() + ROW_BOOKKEEPING)
            + 4 * spec.num_embeddings)


class NamespaceTables:
    def __init__(self) -> None:
        self.tables: dict[str, RowTable | TieredTable] = {}
        self.pending: dict[int, dict[tuple[int, int], tuple[int, list[Entry]]]] = {}

    def configure(self, specs: list[TableSpec], reset: bool, num_ps: int, where: str,
                  storage: StorageSettings | None = None, ps_index: int = 0) -> None:
        """Define the tables (`reset`: afresh, dropping the rows held). With `storage`
        (a memory budget for the server's rows), each table gets an even share of it
        and keeps the rows beyond in `storage.directory` (`tiered`)."""
        root = None
        if storage is not None:
            try:
                if storage.directory is None:
                    raise ValueError(f"{STORAGE_FIELD}.directory is unset while "
                                     "serverMemory is set; point it at a volume mounted "
                                     "in the parameter servers' pod template (see "
                                     "docs/sparse.md)")
                root = shard_directory(storage.directory, ps_index)
            except ValueError as exc:
                raise PSError("INVALID_ARGUMENT", f"{where}: {exc}") from exc

        def make(spec: TableSpec) -> RowTable | TieredTable:
            if root is not None and storage is not None:
                try:  # an even share of the server's budget per table
                    return TieredTable(spec, storage.memory_bytes // max(1, len(specs)),
                                       root, num_ps=num_ps)
                except ValueError as exc:
                    raise PSError("INVALID_ARGUMENT", f"{where}: {exc}") from exc
            return RowTable(spec, reserve=reserve_rows(spec, num_ps), num_ps=num_ps,
                            prefault=prefault)

        # The new fixed-size tables' reserves are mapped up front when all of them fit
        # this server's memory (`prefault`); a disk tier's RAM tier never is.
        new = [spec for spec in specs if reset or spec.name not in self.tables]
        prefault = root is None and should_prefault(sum(reserve_bytes(spec, num_ps)
                                                        for spec in new))
        if reset:
            self.close()
            self.tables = {spec.name: make(spec) for spec in specs}
            self.pending.clear()
            return
        for spec in specs:
            have = self.tables.get(spec.name)
            if have is None:
                self.tables[spec.name] = make(spec)
            elif have.spec.canonical() != spec.canonical():
                raise PSError("FAILED_PRECONDITION",
                              f"{where}: sparse table {spec.name!r} already exists with "
                              "another definition; use another namespace for another model")

    def close(self) -> None:
        """Drop the tables' disk rows, if any, and stop mapping pages ahead."""
        for table in self.tables.values():
            table.close()

    def apply_step(self, ns: Namespace, step: int, contributors: int) -> None:
        """Apply step `step`'s rows (the store holds ns.cond)."""
        for stale in [s for s in self.pending if s < step]:
            del self.pending[stale]
        parts = self.pending.pop(step, {})
        by_table: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        for epoch, entries in parts.values():
            if epoch != ns.epoch:
                continue
            for name, ids, grads in entries:
                by_table.setdefault(name, []).append((ids, grads))
        for name, items in sorted(by_table.items()):
            table = self.tables.get(name)
            if table is None:
                continue
            ids = torch.cat([i for i, _ in items])
            grads = torch.cat([g for _, g in items])
            if contributors > 1:
                grads = grads / contributors
            table.apply(ids, grads, t=step + 1, now=step + 1)


def _tables(ns: Namespace, store: ParameterStore) -> NamespaceTables:
    if ns.sparse is None:
        raise PSError("NOT_FOUND", f"namespace {ns.name!r} on parameter server "
                      f"{store.ps_index} has no sparse tables")
    return ns.sparse  # type: ignore[no-any-return]


def _table(tables: NamespaceTables, name: object, ns: Namespace,
           store: ParameterStore, call: str) -> RowTable | TieredTable:
    table = tables.tables.get(name) if isinstance(name, str) else None
    if table is None:
        raise PSError("NOT_FOUND", f"sparse {call}: table {name!r} is not defined in "
                      f"namespace {ns.name!r} on parameter server {store.ps_index}; it has "
                      f"{sorted(tables.tables)}")
    return table


def handle(store: ParameterStore, frames: Sequence[Frame],
           role: str | None = None) -> Encoded:
    """Answer one sparse call (see `protocol`) from a caller holding `role`'s key (None:
    no authentication); PSError for a refused one. Defining tables and installing rows
    (a restore) are the chief's, as Init is."""
    header = header_of(frames)
    op = header.get("op")
    handler = _HANDLERS.get(op)  # type: ignore[arg-type]
    if handler is None:
        raise PSError("INVALID_ARGUMENT", f"sparse call: op is {op!r}; it must be one of "
                      f"{sorted(_HANDLERS)}")
    return handler(store, _namespace(header, op, role), header, list(frames[1:]))


def _namespace(header: dict[str, Any], op: str, role: str | None) -> str:
    """A call of `op` from a caller holding `role`'s key: its namespace, once the
    caller may make it (PSError otherwise)."""
    if role is not None and not auth.may_call(role, f"Sparse.{op}"):
        raise PSError("PERMISSION_DENIED", f"sparse {op} needs the chief's credentials")
    return field(header, "namespace", str, op)


def _pull(store: ParameterStore, namespace: str, header: dict[str, Any],
          body: list[Frame]) -> Encoded:
    ns = store._ready(namespace)
    tables = _tables(ns, store)
    wanted = field(header, "tables", list, "pull")
    if len(body) != len(wanted):
        raise PSError("INVALID_ARGUMENT", f"sparse pull: {len(wanted)} tables but "
                      f"{len(body)} id frames")
    with_versions = header.get("versions") is True
    rows, versions = [], []
    for item, frame in zip(wanted, body, strict=True):
        table = _table(tables, item.get("name") if isinstance(item, dict) else None, ns,
                       store, "pull")
        ids = tensor_of(frame, torch.int64, 0, f"ids of {table.spec.name!r}")
        check_ids(table.spec, ids, "sparse pull")
        # The versions as of the rows read (one lookup, under the table's lock).
        got, counts = table.read_versioned(ids, with_versions)
        rows.append(got)
        if with_versions:
            versions.append(counts)
    return encode({"global_step": ns.global_step, "generation": ns.generation},
                  rows + versions)


@dataclass(frozen=True)
class CheckedPush:
    """A sparse push read and checked (`check_push`), not yet applied (`apply_push`)."""

    ns: Namespace
    tables: NamespaceTables
    worker: int
    step: int
    part: Any
    generation: int
    entries: list[Entry]
    versions: bool


def check_push(store: ParameterStore, frames: Sequence[Frame],
               role: str | None = None) -> CheckedPush:
    """A push call's frames read and checked as `handle` would (PSError when refused),
    for a caller that applies it later (`riding`: after the dense push it rides on)."""
    header = header_of(frames)
    if header.get("op") != "push":
        raise PSError("INVALID_ARGUMENT", f"sparse call: op is {header.get('op')!r}; it "
                      "must be push here")
    return _check_push(store, _namespace(header, "push", role), header, list(frames[1:]))


def _check_push(store: ParameterStore, namespace: str, header: dict[str, Any],
                body: list[Frame]) -> CheckedPush:
    ns = store._ready(namespace)
    tables = _tables(ns, store)
    worker = field(header, "worker", int, "push")
    step = field(header, "step", int, "push")
    part = header.get("part", 0)
    generation = header.get("generation", 0)  # 0: unknown (a client before generations)
    if not isinstance(generation, int) or isinstance(generation, bool) or generation < 0:
        raise PSError("INVALID_ARGUMENT", f"sparse push: field 'generation' is "
                      f"{generation!r}; it must be a non-negative integer")
    items = field(header, "tables", list, "push")
    membership.check_member(ns, worker, "sparse push")
    entries = _push_entries(ns, store, tables, items, body)
    return CheckedPush(ns, tables, worker, step, part, generation, entries,
                       header.get("versions") is True)


def apply_push(store: ParameterStore, push: CheckedPush) -> Encoded:
    """Apply (async) or queue (sync) a checked push; its reply's frames."""
    ns, tables = push.ns, push.tables
    with ns.cond:
        reply = _apply_push(ns, store, tables, push.worker, push.step, push.part,
                            push.generation, push.entries)
        if not push.versions:
            return encode(reply)
        # The pushed ids' versions after the update (applies hold ns.cond: exact).
        return encode({**reply, "generation": ns.generation},
                      [tables.tables[name].versions(ids) for name, ids, _ in push.entries])


def _push(store: ParameterStore, namespace: str, header: dict[str, Any],
          body: list[Frame]) -> Encoded:
    return apply_push(store, _check_push(store, namespace, header, body))


def _push_entries(ns: Namespace, store: ParameterStore, tables: NamespaceTables,
                  items: list[Any], body: list[Frame]) -> list[Entry]:
    """A push's (table, ids, grad rows), every table checked before any is applied."""
    if len(body) != 2 * len(items):
        raise PSError("INVALID_ARGUMENT", f"sparse push: {len(items)} tables need "
                      f"{2 * len(items)} frames (ids, rows), got {len(body)}")
    entries: list[Entry] = []
    for k, item in enumerate(items):
        table = _table(tables, item.get("name") if isinstance(item, dict) else None, ns,
                       store, "push")
        dim = table.spec.embedding_dim
        ids = tensor_of(body[2 * k], torch.int64, 0, f"ids of {table.spec.name!r}")
        grads = tensor_of(body[2 * k + 1], torch.float32, 0, f"rows of {table.spec.name!r}")
        if grads.numel() != ids.numel() * dim:
            raise PSError("INVALID_ARGUMENT", f"sparse push: table {table.spec.name!r} got "
                          f"{grads.numel()} values for {ids.numel()} ids; rows must have "
                          f"{dim} values")
        grads = grads.reshape(-1, dim)
        check_grads(table.spec, ids, grads, "sparse push")
        entries.append((table.spec.name, ids, grads))
    return entries


def _apply_push(ns: Namespace, store: ParameterStore, tables: NamespaceTables, worker: int,
                step: int, part: Any, generation: int, entries: list[Entry]
                ) -> dict[str, Any]:
    """Apply (async) or queue (sync) a checked push, under ns.cond; its reply header."""
    if ns.done:
        return {"applied": False, "note": "the job is done", "global_step": ns.global_step}
    # Fenced out, as a dense push is: rows computed on another generation's
    # parameters, or of a worker removed while the push was in flight.
    membership.check_generation(ns, worker, generation, store.ps_index, "sparse push")
    if worker not in ns.members:
        return {"applied": False, "note": membership.removed_note(worker),
                "global_step": ns.global_step}
    # (async: the worker pushes rows after its dense push was applied, which
    # checked the target; sync: the step itself must be below it)
    if ns.mode == "sync" and ns.target_steps and step >= ns.target_steps:
        return {"applied": False, "note": "the target step is reached",
                "global_step": ns.global_step}
    if ns.mode == "sync":
        if step < ns.global_step:
            return {"applied": False, "global_step": ns.global_step,
                    "note": f"step {step} was already applied"}
        tables.pending.setdefault(step, {})[(worker, int(part))] = (ns.epoch, entries)
        return {"applied": True, "note": "queued for its step", "global_step": ns.global_step}
    for name, ids, grads in entries:
        tables.tables[name].apply(ids, grads, t=ns.global_step + 1, now=ns.global_step + 1)
    return {"applied": True, "note": "", "global_step": ns.global_step}


def _configure(store: ParameterStore, namespace: str, header: dict[str, Any],
               body: list[Frame]) -> Encoded:
    try:
        specs = [TableSpec.from_json(item) for item in field(header, "tables", list,
                                                              "configure")]
        storage = StorageSettings.from_json(header.get("storage"))
    except (TypeError, ValueError) as exc:
        raise PSError("INVALID_ARGUMENT", f"sparse configure: {exc}") from exc
    if any(spec.optimizer is None for spec in specs):
        raise PSError("INVALID_ARGUMENT", "sparse configure: every table needs its optimizer")
    ns = store.namespace(namespace, create=True)
    with ns.cond:
        if ns.sparse is None:
            ns.sparse = NamespaceTables()
        num_ps = header.get("num_ps", 1)
        if not isinstance(num_ps, int) or num_ps < 1:
            raise PSError("INVALID_ARGUMENT", f"sparse configure: num_ps is {num_ps!r}; it "
                          "must be a positive integer")
        ns.sparse.configure(specs, bool(header.get("reset")), num_ps,
                            f"parameter server {store.ps_index}", storage, store.ps_index)
    return encode({"tables": len(specs)})


SLOTS_FIRST = ("ids", "rows")


def _export(store: ParameterStore, namespace: str, header: dict[str, Any],
            body: list[Frame]) -> Encoded:
    """A page of a table's rows (`what` "rows", the default; with `since`, only rows
    updated at clock >= since), a checkpoint export's start (`what` "mark"), or a page
    of the ids sweeps dropped at clock >= `since` (`what` "removed")."""
    ns = store.namespace(namespace)
    table = _table(_tables(ns, store), header.get("table"), ns, store, "export")
    what = header.get("what", "rows")
    since = header.get("since")
    if since is not None and (not isinstance(since, int) or isinstance(since, bool)):
        raise PSError("INVALID_ARGUMENT", f"sparse export: field 'since' is {since!r}; it "
                      "must be an integer or absent")
    if what == "mark":
        # The clock the next update gets (async: global step + 1; sync: the next
        # step's + 1): rows updated from now on have last >= it.
        with ns.cond:
            watermark, generation = ns.global_step + 1, ns.generation
            complete = table.track_removals(since, watermark)
        return encode({"watermark": watermark, "generation": generation,
                       "complete": complete, "rows": table.stats().rows})
    start = field(header, "start", int, "export")
    limit = field(header, "limit", int, "export")
    if what == "removed":
        ids, after = table.removed_ids(field(header, "since", int, "export"), start, limit)
        return encode({"next": after, "count": int(ids.numel())}, [ids])
    if what != "rows":
        raise PSError("INVALID_ARGUMENT", f"sparse export: field 'what' is {what!r}; it "
                      "must be rows, mark or removed")
    block, after = table.export(start, limit, since)
    return encode({"next": after, "count": int(block.ids.numel())},
                  [block.ids, block.rows, *(block.slots[n] for n in table.slot_names),
                   block.last])


def _import(store: ParameterStore, namespace: str, header: dict[str, Any],
            body: list[Frame]) -> Encoded:
    """Restored rows: `mode` "insert" (the default; ids must be absent), "upsert" (a
    delta's rows replace those present) or "remove" (a delta's removed ids, one frame)."""
    ns = store.namespace(namespace)
    table = _table(_tables(ns, store), header.get("table"), ns, store, "import")
    mode = header.get("mode", "insert")
    if mode not in ("insert", "upsert", "remove"):
        raise PSError("INVALID_ARGUMENT", f"sparse import: field 'mode' is {mode!r}; it "
                      "must be insert, upsert or remove")
    names = table.slot_names
    wanted = 1 if mode == "remove" else 3 + len(names)
    if len(body) != wanted:
        what = ("ids" if mode == "remove"
                else f"ids, rows, {', '.join(names) or 'no slots'}, last")
        raise PSError("INVALID_ARGUMENT", f"sparse import: {wanted} frames expected "
                      f"({what}), got {len(body)}")
    dim = table.spec.embedding_dim
    ids = tensor_of(body[0], torch.int64, 0, "ids")
    check_ids(table.spec, ids, "sparse import")
    if mode == "remove":
        return encode({"count": table.remove(ids)})
    block = RowBlock(ids=ids, rows=tensor_of(body[1], torch.float32, dim, "rows"),
                     slots={n: tensor_of(f, torch.float32, dim, n)
                            for n, f in zip(names, body[2:-1], strict=True)},
                     last=tensor_of(body[-1], torch.int64, 0, "last"))
    if any(len(t) != len(ids) for t in (block.rows, block.last, *block.slots.values())):
        raise PSError("INVALID_ARGUMENT", "sparse import: ids, rows, slots and last "
                      "must have one entry per row")
    try:
        if mode == "upsert":
            table.upsert(block)
        else:
            table.load(block)
    except ValueError as exc:
        raise PSError("INVALID_ARGUMENT", f"sparse import: {exc}") from exc
    return encode({"count": int(ids.numel())})


def _stats(store: ParameterStore, namespace: str, header: dict[str, Any],
           body: list[Frame]) -> Encoded:
    ns = store.namespace(namespace)
    tables = ns.sparse.tables if ns.sparse is not None else {}
    out = {}
    for name, table in tables.items():
        stats = table.stats()
        out[name] = {"rows": stats.rows, "bytes": stats.bytes}
        if isinstance(table, TieredTable):  # the tiers apart (rows: both, bytes: RAM)
            out[name].update(table.tier_stats())
    return encode({"tables": out})


def _save(store: ParameterStore, namespace: str, header: dict[str, Any],
          body: list[Frame]) -> Encoded:
    """This server's shard of a table written into its checkpoint directory
    (`shard_writes`)."""
    ns = store.namespace(namespace)
    table = _table(_tables(ns, store), header.get("table"), ns, store, "save")
    return encode(save_shard(table, store.ps_index, store.checkpoint_dir, header))


_HANDLERS = {"pull": _pull, "push": _push, "configure": _configure, "export": _export,
             "import": _import, "stats": _stats, "save": _save}
