"""The trainer's seam for sparse tables: `SparseSession` finds the sparse layers of a
model, binds them to the parameter servers, pushes their gradient rows each step, and
does the chief's part (defining the tables, checkpointing and restoring their rows,
reporting their size). `Trainer` holds one when the model has sparse layers."""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..checkpoint import CheckpointCorrupt, NoUsableCheckpoint, sparse_links
from ..failure import ConfigurationError
from ..optim import OptimizerConfig
from ..ps.store import PSError
from .chain import Chain, LinkPlan
from .cache import RowCache
from .client import Entry, RemoteSource, SparseClient
from .files import read_ids, read_rows
from .layer import sparse_layers
from .protocol import Encoded, Frame
from .rowopt import coalesce
from .shard_writes import ServerWrites
from .saving import CAPTURE_BYTES, CapturedRows, LinkWrite, LiveRows, start_link, write_link
from .spec import ROW_SLOTS, TableSpec, check_row_optimizer
from .tiered import StorageSettings

SPARSE_DIR_SUFFIX = ".sparse"


def _what_to_remove(links: Sequence[Mapping[str, Any]], k: int) -> str:
    """What to remove when link `k` of a chain is damaged: its directory and every
    checkpoint whose chain names it (those of the steps from it to the chain's end)."""
    name = str(links[k]["dir"])
    if k == len(links) - 1:
        return f"remove {name} and its checkpoint file"
    first, last = links[k].get("step"), links[-1].get("step")
    return (f"remove {name} and the checkpoint files whose rows build on it (steps "
            f"{first} to {last})")


class SparseSession:
    def __init__(self, layers: list[Any], specs: dict[str, TableSpec],
                 client: SparseClient, storage: StorageSettings | None = None) -> None:
        self.layers = layers
        self.specs = specs
        self.client = client
        self.storage = storage  # each server's memory budget for rows (`tiered`)
        self.source: RemoteSource | None = None  # set by `attach`
        self.chain = Chain()  # of the last checkpoint written (see `chain`)
        self.writing: LinkWrite | None = None  # a checkpoint's link being written
        self.told_refusals: set[int] = set()  # servers that leave their rows to the chief
        # Gradient rows `riders` took but could not send with the push_pull: `push`'s.
        self._held: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None
        # The push riding on this step's push_pull: per server, its entries; whether
        # it asked for the rows' versions; the ids and rows pushed, per table.
        self._riding: tuple[list[list[Entry]], bool,
                            dict[str, tuple[torch.Tensor, torch.Tensor]]] = ([], False, {})

    @classmethod
    def attach(cls, model: nn.Module, transports: Sequence[Any], namespace: str,
               optimizer: OptimizerConfig, seed: int,
               cache: tuple[int, int] | None = None,
               storage: StorageSettings | None = None) -> SparseSession | None:
        """Bind the sparse layers of `model` to the servers; None when it has none.
        A table without its own optimizer uses the job's; the job's seed is added to
        each table's seed. Layers sharing a table name must define it identically.
        `cache` (rows, staleness steps): each table's rows go through a worker-side
        `RowCache` (None, or staleness 0: none). `storage`: each server's memory
        budget for the rows, and where the rest go (None: all in memory)."""
        found = list(sparse_layers(model))
        if not found:
            return None
        specs: dict[str, TableSpec] = {}
        for path, layer in found:
            spec = layer.spec.with_defaults(layer.spec.optimizer or optimizer,
                                            layer.spec.seed + seed)
            check_row_optimizer(spec.optimizer, f"sparse table {spec.name!r} ({path})")  # type: ignore[arg-type]
            other = specs.setdefault(spec.name, spec)
            if other != spec:
                raise ValueError(f"sparse table {spec.name!r} is declared twice with "
                                 f"different definitions (one at {path}); layers sharing "
                                 "a table must declare it the same way")
        client = SparseClient(transports, namespace)
        rows, staleness = cache or (0, 0)
        source = RemoteSource(client, {
            name: RowCache(spec.embedding_dim, rows, staleness, spec.num_embeddings)
            for name, spec in specs.items()} if staleness > 0 else None)
        for _, layer in found:
            layer.source = source
        session = cls([layer for _, layer in found], specs, client, storage)
        session.source = source
        return session

    def close(self) -> None:
        self.restart_chain()
        self.client.close()

    def fingerprint(self, dense: str) -> str:
        """The model fingerprint covering the table definitions too (hex sha256)."""
        text = dense + "\n" + "\n".join(spec.canonical() for _, spec in sorted(self.specs.items()))
        return hashlib.sha256(text.encode()).hexdigest()

    # ------------------------------------------------------------------ each step
    def begin_step(self) -> None:
        self._held = None
        for layer in self.layers:
            layer.clear_gradients()
        if self.source is not None:
            self.source.step += 1  # the row cache's clock

    def _gradients(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """This step's gradient rows of every table (tables shared by several layers:
        rows summed), taken from the layers."""
        grads: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        for layer in self.layers:
            taken = layer.take_gradients()
            if taken is not None:
                grads.setdefault(layer.spec.name, []).append(taken)
        merged = {}
        for name, parts in grads.items():
            if len(parts) == 1:
                merged[name] = parts[0]
            else:
                merged[name] = coalesce(torch.cat([p[0] for p in parts]),
                                        torch.cat([p[1] for p in parts]))
        return merged

    def push(self, worker: int, steps: Sequence[int]) -> None:
        """Push this step's gradient rows of every table (those `riders` kept back, if
        it kept any); with row caches, the replies' versions go to them."""
        merged, self._held = self._held or self._gradients(), None
        if not merged:
            return
        replies = self.client.push(merged, worker, steps, versions=self._wants_versions())
        if self.source is not None and self.source.caches:
            self.source.note_pushed(replies, merged)

    def riders(self, worker: int, steps: Sequence[int]) -> list[Encoded | None] | None:
        """This step's push as one call's frames per server, to ride on the dense
        push_pull (async mode, `riding`); None when the rows need more than one call
        on some server (they are kept for `push`, made after the push_pull as before).
        With row caches the push asks for the rows' versions (`rode` hands them on)."""
        self._riding = ([], False, {})  # this step's, whatever returns below
        merged = self._gradients()
        if not merged:
            return [None] * self.client.num_ps
        versions = self._wants_versions()
        planned = self.client.riders(merged, worker, steps, versions)
        if planned is None:
            self._held = merged
            return None
        frames, entries = planned
        self._riding = (entries, versions, merged)
        return frames

    def rode(self, replies: Sequence[list[Frame] | None]) -> None:
        """The sparse replies of a push that rode (`ShardedClient.rider_replies`): a
        refusal raised (PSError), as the push's own call would raise it; with row
        caches, the versions go to them."""
        entries, versions, pushed = self._riding
        taken = self.client.riding_replies(replies, entries, versions)
        if versions:
            self.source.note_pushed(taken, pushed)  # type: ignore[union-attr]

    def _wants_versions(self) -> bool:
        return (self.source is not None and bool(self.source.caches)
                and self.source.wants_versions())

    # ------------------------------------------------------------------ chief
    def install(self, manifest: dict[str, Any] | None, directory: Path | None,
                only: Sequence[int] | None = None) -> None:
        """Define the tables afresh on the servers (`only` some), then stream the
        checkpoint's rows (if any) to their owners: its chain's base, then each delta's
        removed ids and rows. Call before the dense init, so no worker touches a table
        before its rows are back. Any link being written is abandoned: the next
        checkpoint is a full one."""
        self.restart_chain()
        specs = [spec for _, spec in sorted(self.specs.items())]
        try:
            self.client.configure(specs, reset=True, only=only, storage=self.storage)
        except PSError as exc:
            if exc.code == "INVALID_ARGUMENT":  # the job's settings: no retry helps
                raise ConfigurationError(exc.message) from exc
            raise
        if not manifest or directory is None:
            return
        links = sparse_links(manifest)
        for k, link in enumerate(links):
            try:
                self._install_link(directory / str(link["dir"]), link)
            except CheckpointCorrupt as exc:
                # Found while streaming (the sizes were checked before): the rows
                # are half loaded, and a restart would read the same bytes.
                raise NoUsableCheckpoint(
                    f"{exc}; a restart would read the same bytes: "
                    f"{_what_to_remove(links, k)} from {directory} to restore the "
                    "previous checkpoint") from exc

    def _install_link(self, base: Path, link: Mapping[str, Any]) -> None:
        """A link's removed ids, then its rows, upserted: a later row of an id replaces
        an earlier one, of a link before or of this one (an async export may read an
        id evicted and created again in another place twice: the later is newer)."""
        for name, entry in link["tables"].items():
            spec = self.specs[name]
            slots = ROW_SLOTS[spec.optimizer.name]  # type: ignore[union-attr]
            checks = entry.get("checks") or {}
            for filename in entry.get("removed") or []:
                for ids in read_ids(base / filename, spec, checks.get(filename)):
                    self.client.remove(spec, ids)
            for filename in entry["files"]:
                for block in read_rows(base / filename, spec, slots, checks.get(filename)):
                    self.client.load(spec, slots, block, upsert=True)

    def begin_save(self, directory: Path, step: int, frozen: bool) -> LinkWrite:
        """Start writing the rows of the checkpoint of `step` beside it (see `saving`):
        `frozen` (sync mode) when the servers hold that step only until the chief
        trains on. At most one at a time: the caller finishes (or abandons) the last."""
        plan = start_link(self.client, self.specs, self.chain, step)
        num_ps = self.client.num_ps

        def live(cancel: threading.Event, plan: LinkPlan = plan) -> dict[str, Any]:
            # The servers write their own rows where they share the directory.
            with ServerWrites(self.client, directory / plan.dir, cancel,
                              self.told_refusals) as servers:
                return write_link(self.specs, num_ps, directory, plan,
                                  LiveRows(self.client, cancel), servers)

        if not frozen:
            write = LinkWrite(plan, live, background=True)
        elif plan.full:
            write = LinkWrite(plan, live, background=False)
        else:
            captured = CapturedRows.read(self.client, self.specs, plan, CAPTURE_BYTES)
            if captured is None:  # too large to hold: a full link, at once
                full = start_link(self.client, self.specs, self.chain, step, full=True)
                write = LinkWrite(full, lambda c: live(c, full), background=False)
            else:
                write = LinkWrite(plan, lambda _c: write_link(
                    self.specs, num_ps, directory, plan, captured), background=True)
        self.writing = write
        return write

    def finish_save(self, write: LinkWrite) -> dict[str, Any]:
        """Wait for `write`; the manifest its checkpoint records (its error, raised)."""
        try:
            return self.chain.manifest(write.plan, write.result())
        finally:
            self.writing = None

    def commit(self, write: LinkWrite, manifest: Mapping[str, Any]) -> None:
        """The checkpoint recording `manifest` is on disk: the next delta extends it."""
        self.chain.extend(write.plan, manifest)

    def restart_chain(self) -> None:
        """Abandon the link being written, if any; the next checkpoint is a full one."""
        if self.writing is not None:
            self.writing.cancel()
            self.writing = None
        self.chain.reset()

    def stats(self) -> dict[str, dict[str, int]]:
        return self.client.stats()

    def progress_fields(self) -> dict[str, Any]:
        """Live rows and memory of the tables (over all servers), for progress events:
        `sparse_rows`, `sparse_bytes` and `sparse_tables` ({name: {rows, bytes}})."""
        tables = self.stats()
        fields = {"sparse_rows": sum(t["rows"] for t in tables.values()),
                  "sparse_bytes": sum(t["bytes"] for t in tables.values()),
                  "sparse_tables": tables}
        if self.storage is not None:  # rows is both tiers, bytes RAM only
            fields.update(sparse_disk_rows=sum(t.get("disk_rows", 0) for t in tables.values()),
                          sparse_disk_bytes=sum(t.get("disk_bytes", 0)
                                                for t in tables.values()))
        if self.source is not None:  # this worker's lookups, and how many were pulled
            fields.update(sparse_rows_looked_up=self.source.looked_up,
                          sparse_rows_pulled=self.source.pulled)
        return fields
