"""The trainer's seam for sparse tables: `SparseSession` finds the sparse layers of a
model, binds them to the parameter servers, pushes their gradient rows each step, and
does the chief's part (defining the tables, checkpointing and restoring their rows,
reporting their size). `Trainer` holds one when the model has sparse layers."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..checkpoint import CheckpointCorrupt, NoUsableCheckpoint
from ..optim import OptimizerConfig
from .client import RemoteSource, SparseClient
from .files import read_rows, write_rows
from .layer import sparse_layers
from .rowopt import coalesce
from .spec import ROW_SLOTS, TableSpec, check_row_optimizer

SPARSE_DIR_SUFFIX = ".sparse"


class SparseSession:
    def __init__(self, layers: list[Any], specs: dict[str, TableSpec],
                 client: SparseClient) -> None:
        self.layers = layers
        self.specs = specs
        self.client = client

    @classmethod
    def attach(cls, model: nn.Module, transports: Sequence[Any], namespace: str,
               optimizer: OptimizerConfig, seed: int) -> SparseSession | None:
        """Bind the sparse layers of `model` to the servers; None when it has none.
        A table without its own optimizer uses the job's; the job's seed is added to
        each table's seed. Layers sharing a table name must define it identically."""
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
        source = RemoteSource(client)
        for _, layer in found:
            layer.source = source
        return cls([layer for _, layer in found], specs, client)

    def close(self) -> None:
        self.client.close()

    def fingerprint(self, dense: str) -> str:
        """The model fingerprint covering the table definitions too (hex sha256)."""
        text = dense + "\n" + "\n".join(spec.canonical() for _, spec in sorted(self.specs.items()))
        return hashlib.sha256(text.encode()).hexdigest()

    # ------------------------------------------------------------------ each step
    def begin_step(self) -> None:
        for layer in self.layers:
            layer.clear_gradients()

    def push(self, worker: int, steps: Sequence[int]) -> None:
        """Push this step's gradient rows of every table (tables shared by several
        layers: rows summed)."""
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
        if merged:
            self.client.push(merged, worker, steps)

    # ------------------------------------------------------------------ chief
    def install(self, manifest: dict[str, Any] | None, directory: Path | None,
                only: Sequence[int] | None = None) -> None:
        """Define the tables afresh on the servers (`only` some), then stream the
        checkpoint's rows (if any) to their owners. Call before the dense init, so no
        worker touches a table before its rows are back."""
        specs = [spec for _, spec in sorted(self.specs.items())]
        self.client.configure(specs, reset=True, only=only)
        if not manifest or directory is None:
            return
        base = directory / manifest["dir"]
        for name, entry in manifest["tables"].items():
            spec = self.specs[name]
            slots = ROW_SLOTS[spec.optimizer.name]  # type: ignore[union-attr]
            checks = entry.get("checks") or {}
            for filename in entry["files"]:
                try:
                    for block in read_rows(base / filename, spec, slots,
                                           checks.get(filename)):
                        self.client.load(spec, slots, block)
                except CheckpointCorrupt as exc:
                    # Found while streaming (the sizes were checked before): the rows
                    # are half loaded, and a restart would read the same bytes.
                    raise NoUsableCheckpoint(
                        f"{exc}; a restart would read the same bytes: remove "
                        f"{base.name} and its checkpoint file from {directory} to "
                        "restore the previous checkpoint") from exc

    def save(self, directory: Path, step: int) -> dict[str, Any]:
        """Stream every server's rows of every table into files beside the checkpoint
        of `step`; the manifest the checkpoint records."""
        sub = f"ckpt-{step:012d}{SPARSE_DIR_SUFFIX}"
        tables: dict[str, Any] = {}
        for k, (name, spec) in enumerate(sorted(self.specs.items())):
            slots = ROW_SLOTS[spec.optimizer.name]  # type: ignore[union-attr]
            files, rows, checks = [], 0, {}
            for ps in range(self.client.num_ps):
                filename = f"table{k}-ps{ps}.rows"
                written = write_rows(directory / sub / filename, spec, slots,
                                     self.client.export(ps, spec, slots))
                rows += written.rows
                files.append(filename)
                checks[filename] = written.check()
            tables[name] = {"files": files, "rows": rows, "checks": checks}
        return {"dir": sub, "tables": tables}

    def stats(self) -> dict[str, dict[str, int]]:
        return self.client.stats()

    def progress_fields(self) -> dict[str, Any]:
        """Live rows and memory of the tables (over all servers), for progress events:
        `sparse_rows`, `sparse_bytes` and `sparse_tables` ({name: {rows, bytes}})."""
        tables = self.stats()
        return {"sparse_rows": sum(t["rows"] for t in tables.values()),
                "sparse_bytes": sum(t["bytes"] for t in tables.values()),
                "sparse_tables": tables}
