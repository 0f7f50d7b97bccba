"""`pstrain export`: a checkpoint as files a plain PyTorch program (or a serving system)
loads, without the parameter servers and without optimizer state.

    out/
      model.safetensors    dense parameters: the model's state-dict keys -> tensors
      model.pt             the same dict, for `torch.load(..., weights_only=True)`
      tables/<name>.safetensors   one per sparse table: `ids` int64 [n] (ascending),
                                  `rows` float32 [n, dim]; row k is the row of ids[k]
      manifest.json        step, source checkpoint, fingerprint, pstrain version, and
                           per table its file, dim and row count

`model.safetensors` is the primary form (no pickle, memory-mapped, readable from Rust or
C++); `model.pt` holds the same tensors. The dense names are the worker's parameter
names, `model.named_parameters()`, which are the model's `state_dict()` keys for a model
without buffers (pstrain trains parameters only: a checkpoint holds no buffers).

A sparse table exports the rows it holds. An id without a row (never updated, not yet
admitted, or evicted) reads during training as its deterministic initial value
(`sparse.ids.initial_rows`), which depends on the job's seed; the checkpoint does not
record that seed, so `load_exported(..., seed=job_seed)` reproduces those values and,
without it, such ids read as zero rows (what a serving system usually wants for an
unknown id).

`manifest.json` is written last: an export without it is incomplete. The rows files of
the checkpoint (its whole chain: a full write and the deltas on it, see
`sparse.chain`) are read with the size and CRC-32 checks their manifest records, so a
damaged checkpoint is refused (`CheckpointCorrupt`), never exported.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .checkpoint import (Checkpoint, CheckpointCorrupt, CheckpointError, CheckpointStore,
                         check_sparse_files, load_checkpoint, sparse_links,
                         write_atomically)
from .sparse.files import MAGIC, read_ids, read_rows
from .sparse.layer import sparse_layers
from .sparse.spec import TableSpec

EXPORT_FORMAT = "pstrain-export"
EXPORT_VERSION = 1
MANIFEST = "manifest.json"
DENSE_SAFETENSORS = "model.safetensors"
DENSE_PT = "model.pt"
TABLES_DIR = "tables"
_SAFE_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")


class ExportError(ValueError):
    """An export that cannot be made or loaded; the message names the path and why."""


@dataclass(frozen=True)
class ExportResult:
    """What `export_checkpoint` wrote."""

    out_dir: Path
    source: Path
    global_step: int
    files: list[Path]
    dense: int  # parameters
    tables: dict[str, int] = field(default_factory=dict)  # name -> rows


# ---------------------------------------------------------------------- exporting
def resolve_checkpoint(path: str | Path) -> tuple[Checkpoint, Path]:
    """The checkpoint in `path` (a checkpoint file) or the newest intact one of `path`
    (a checkpoint directory), with its file; its rows files checked by size."""
    path = Path(path)
    if path.is_dir():
        found = CheckpointStore(path).latest()
        if found is None:
            raise CheckpointError(f"{path} holds no checkpoint (no ckpt-<step>.pt files)")
        ckpt, file, _ = found
        return ckpt, file
    ckpt = load_checkpoint(path)
    check_sparse_files(path.parent, ckpt.sparse)
    return ckpt, path


def _table_file(name: str, index: int) -> str:
    stem = name if _SAFE_NAME.match(name) and name not in (".", "..") else f"table{index}"
    return f"{TABLES_DIR}/{stem}.safetensors"


def _rows_header(path: Path) -> dict[str, Any]:
    """The header of a rows file (table, dim, slots), to read it without its spec."""
    try:
        with open(path, "rb") as fh:
            if fh.read(len(MAGIC)) != MAGIC:
                raise CheckpointCorrupt(f"{path} is not a pstrain sparse rows file")
            header = json.loads(fh.readline())
    except FileNotFoundError:
        raise CheckpointCorrupt(f"sparse rows {path} are missing") from None
    except ValueError as exc:
        raise CheckpointCorrupt(f"{path} has a corrupt header: {exc}") from exc
    except OSError as exc:
        raise CheckpointError(f"sparse rows {path} cannot be read: {exc}") from exc
    if (not isinstance(header, dict) or not isinstance(header.get("dim"), int)
            or not isinstance(header.get("slots"), list)):
        raise CheckpointCorrupt(f"{path} has a malformed header: {header!r}")
    return header


def _latest(ids: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows of a shard file by id (ascending), the later of an id held twice: an
    async export may read an id evicted and created again elsewhere in its shard twice,
    and the later read is the newer row (as a restore's upserts take it)."""
    order = torch.argsort(ids, stable=True)  # an id's rows stay in file order
    ids = ids[order]
    last = torch.ones(ids.numel(), dtype=torch.bool)
    last[:-1] = ids[1:] != ids[:-1]
    return ids[last], rows[order[last]]


def read_table(directory: Path, name: str, entry: Mapping[str, Any]
               ) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(ids ascending, rows, dim) of one table of a checkpoint's sparse manifest, over
    all its shard files; the optimizer slots are read (to check the file) and dropped."""
    ids, rows, dim = [], [], None
    checks = entry.get("checks") or {}
    for filename in entry.get("files") or []:
        path = directory / filename
        header = _rows_header(path)
        if header.get("table") != name or (dim is not None and header["dim"] != dim):
            raise CheckpointCorrupt(f"{path} holds {header}; expected table {name!r}"
                                    + (f" with dim {dim}" if dim is not None else ""))
        dim = int(header["dim"])
        spec = TableSpec(name, None, dim, 0.0)
        blocks = list(read_rows(path, spec, tuple(header["slots"]), checks.get(filename)))
        if blocks:
            file_ids, file_rows = _latest(torch.cat([b.ids for b in blocks]),
                                          torch.cat([b.rows for b in blocks]))
            ids.append(file_ids)
            rows.append(file_rows)
    if dim is None:
        raise CheckpointCorrupt(f"sparse table {name!r} of the checkpoint has no rows files")
    all_ids = torch.cat(ids) if ids else torch.zeros(0, dtype=torch.int64)
    all_rows = torch.cat(rows) if rows else torch.zeros((0, dim), dtype=torch.float32)
    order = torch.argsort(all_ids)
    all_ids, all_rows = all_ids[order].contiguous(), all_rows[order].contiguous()
    if all_ids.numel() > 1 and not bool((all_ids[1:] != all_ids[:-1]).all()):
        raise CheckpointCorrupt(f"sparse table {name!r} holds an id in two shard files")
    return all_ids, all_rows, dim


def read_chain_table(directory: Path, links: Sequence[Mapping[str, Any]], name: str
                     ) -> tuple[torch.Tensor, torch.Tensor, int]:
    """`read_table` over a checkpoint's sparse chain (`checkpoint.sparse_links`): the
    base's rows, then per delta its removed ids dropped and its rows in place of
    those read before."""
    first = links[0]
    ids, rows, dim = read_table(directory / str(first["dir"]), name, first["tables"][name])
    for link in links[1:]:
        entry = link["tables"].get(name)
        if not isinstance(entry, Mapping):
            raise CheckpointCorrupt(f"sparse table {name!r} is missing from link "
                                    f"{link['dir']} of the checkpoint's chain")
        base = directory / str(link["dir"])
        checks = entry.get("checks") or {}
        spec = TableSpec(name, None, dim, 0.0)
        gone = [block for filename in entry.get("removed") or []
                for block in read_ids(base / filename, spec, checks.get(filename))]
        new_ids, new_rows, new_dim = read_table(base, name, entry)
        if new_dim != dim:
            raise CheckpointCorrupt(f"sparse table {name!r} has dim {new_dim} in "
                                    f"{link['dir']} and {dim} in {links[0]['dir']}")
        keep = ~torch.isin(ids, torch.cat([new_ids, *gone]))
        ids, rows = torch.cat([ids[keep], new_ids]), torch.cat([rows[keep], new_rows])
        order = torch.argsort(ids)
        ids, rows = ids[order].contiguous(), rows[order].contiguous()
    return ids, rows, dim


def _prepare_out(out_dir: Path, force: bool) -> None:
    if out_dir.exists() and not out_dir.is_dir():
        raise ExportError(f"--out {out_dir} is a file; it must be a directory (created "
                          "when missing)")
    if out_dir.is_dir() and any(out_dir.iterdir()):
        if not force:
            raise ExportError(f"--out {out_dir} is not empty; choose an empty or new "
                              "directory, or pass --force to overwrite the export there")
        # Overwriting: no table of an older export may stay beside the new ones.
        (out_dir / MANIFEST).unlink(missing_ok=True)
        shutil.rmtree(out_dir / TABLES_DIR, ignore_errors=True)
    out_dir.mkdir(parents=True, exist_ok=True)


def export_checkpoint(checkpoint: str | Path, out_dir: str | Path, *,
                      force: bool = False) -> ExportResult:
    """Export the checkpoint `checkpoint` (a file, or a directory: its newest intact
    checkpoint) into `out_dir` (see the module doc for the layout). CheckpointError
    (or CheckpointCorrupt) for a missing or damaged checkpoint; ExportError for an
    `out_dir` that is a file or not empty (unless `force`)."""
    from safetensors.torch import save as save_safetensors

    from pstrain_api import __version__

    ckpt, source = resolve_checkpoint(checkpoint)
    # Read every table before writing anything: a damaged checkpoint leaves no export.
    tables: dict[str, tuple[torch.Tensor, torch.Tensor, int]] = {}
    links = sparse_links(ckpt.sparse)
    if links:
        for name in sorted(links[0]["tables"]):
            tables[name] = read_chain_table(source.parent, links, name)
    out = Path(out_dir)
    _prepare_out(out, force)

    dense = {name: t.detach().contiguous() for name, t in sorted(ckpt.params.items())}
    files: list[Path] = []

    def put(relative: str, data: bytes) -> None:
        path = out / relative
        write_atomically(path, lambda fh: fh.write(data))
        files.append(path)

    put(DENSE_SAFETENSORS, save_safetensors(dense, metadata={"format": "pt"}))
    write_atomically(out / DENSE_PT, lambda fh: torch.save(dense, fh))
    files.append(out / DENSE_PT)
    table_entries: dict[str, Any] = {}
    for k, (name, (ids, rows, dim)) in enumerate(sorted(tables.items())):
        relative = _table_file(name, k)
        put(relative, save_safetensors({"ids": ids, "rows": rows},
                                       metadata={"table": name, "dim": str(dim)}))
        table_entries[name] = {"file": relative, "dim": dim, "rows": int(ids.numel())}
    document = {
        "format": EXPORT_FORMAT, "version": EXPORT_VERSION,
        "pstrain_version": __version__,
        "global_step": ckpt.global_step,
        "source": str(source.resolve()),
        "fingerprint": ckpt.fingerprint,
        "dense": {"file": DENSE_SAFETENSORS, "torch_file": DENSE_PT,
                  "parameters": {n: {"shape": list(t.shape),
                                     "dtype": str(t.dtype).removeprefix("torch.")}
                                 for n, t in dense.items()}},
        "tables": table_entries,
    }
    put(MANIFEST, (json.dumps(document, indent=2, sort_keys=True) + "\n").encode())
    return ExportResult(out, source, ckpt.global_step, files, len(dense),
                        {n: e["rows"] for n, e in table_entries.items()})


# ---------------------------------------------------------------------- loading
class ExportedTable:
    """One exported sparse table in memory: `ids` (int64, ascending) and their `rows`.

    `lookup(ids)` gives the row of every id (any shape, repeats allowed), and for an id
    without a row its `default` (zeros, or the training's initial values: `load_exported`
    with `seed=`). For a serving program without pstrain's layers, `to_embedding_bag(mode)`
    / `to_embedding()` build a frozen `nn.EmbeddingBag` / `nn.Embedding` of the rows plus
    one last zero row for unknown ids; map raw ids to their positions with `index(ids)`.
    """

    def __init__(self, name: str, ids: torch.Tensor, rows: torch.Tensor,
                 default: Any = None) -> None:
        if ids.dim() != 1 or rows.dim() != 2 or rows.shape[0] != ids.shape[0]:
            raise ExportError(f"sparse table {name!r}: ids {list(ids.shape)} and rows "
                              f"{list(rows.shape)} do not match; ids must be [n] and rows "
                              "[n, dim]")
        self.name = name
        self.ids = ids.to(torch.int64)
        self.rows = rows.to(torch.float32)
        self.dim = int(rows.shape[1])
        # default(absent_ids) -> rows of ids without a row; None: zero rows.
        self.default = default

    @classmethod
    def load(cls, path: str | Path, name: str | None = None) -> ExportedTable:
        """A table file written by `export_checkpoint`."""
        from safetensors.torch import load_file

        tensors = load_file(str(path))
        if set(tensors) != {"ids", "rows"}:
            raise ExportError(f"{path} holds {sorted(tensors)}; an exported table holds "
                              "exactly 'ids' and 'rows'")
        return cls(name or Path(path).stem, tensors["ids"], tensors["rows"])

    def __len__(self) -> int:
        return int(self.ids.numel())

    def index(self, ids: torch.Tensor) -> torch.Tensor:
        """The position of each id in `rows` (same shape); `len(self)` for an id
        without a row (the zero row of `to_embedding*`)."""
        flat = ids.reshape(-1).to("cpu", torch.int64)
        pos = torch.searchsorted(self.ids, flat).clamp_(max=max(len(self) - 1, 0))
        found = (self.ids[pos] == flat) if len(self) else torch.zeros_like(flat, dtype=torch.bool)
        return torch.where(found, pos, len(self)).reshape(ids.shape)

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """float32 rows [*ids.shape, dim] of `ids`."""
        flat = ids.reshape(-1).to("cpu", torch.int64)
        where = self.index(flat)
        out = torch.zeros((flat.numel(), self.dim), dtype=torch.float32)
        present = where < len(self)
        out[present] = self.rows[where[present]]
        absent = ~present
        if self.default is not None and bool(absent.any()):
            out[absent] = self.default(flat[absent])
        return out.reshape(*ids.shape, self.dim)

    def pull(self, spec: TableSpec, ids: torch.Tensor) -> torch.Tensor:
        """The sparse layers' row source protocol (`sparse.layer.RowSource`)."""
        return self.lookup(ids)

    def _weight(self) -> torch.Tensor:
        return torch.cat([self.rows, self.rows.new_zeros((1, self.dim))])

    def to_embedding(self) -> nn.Embedding:
        """A frozen `nn.Embedding(len + 1, dim)`: the rows, then the zero row that
        `index` gives unknown ids."""
        return nn.Embedding.from_pretrained(self._weight(), freeze=True)

    def to_embedding_bag(self, mode: str = "mean") -> nn.EmbeddingBag:
        """A frozen `nn.EmbeddingBag(len + 1, dim, mode=mode)` like `to_embedding`: an
        unknown id counts as a zero row in its bag, as in `lookup`."""
        return nn.EmbeddingBag.from_pretrained(self._weight(), freeze=True, mode=mode)


def read_manifest(out_dir: str | Path) -> dict[str, Any]:
    path = Path(out_dir) / MANIFEST
    try:
        document = json.loads(path.read_text())
    except FileNotFoundError:
        raise ExportError(f"{path} does not exist; {out_dir} is not a complete pstrain "
                          "export (run `pstrain export CHECKPOINT --out DIR`)") from None
    except ValueError as exc:
        raise ExportError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(document, dict) or document.get("format") != EXPORT_FORMAT:
        raise ExportError(f"{path} is not a pstrain export manifest")
    if document.get("version") != EXPORT_VERSION:
        raise ExportError(f"{path} has export version {document.get('version')!r}; this "
                          f"runtime reads version {EXPORT_VERSION}")
    return document


def load_tables(out_dir: str | Path) -> dict[str, ExportedTable]:
    """Every sparse table of an export, by name."""
    document = read_manifest(out_dir)
    return {name: ExportedTable.load(Path(out_dir) / entry["file"], name)
            for name, entry in document["tables"].items()}


def load_exported(out_dir: str | Path, model: nn.Module, *, seed: int | None = None
                  ) -> dict[str, ExportedTable]:
    """Fill `model` (built as for training) from an export: the dense parameters with
    `load_state_dict`, each sparse layer with its table's rows (the layer then reads
    them in-process; no parameter server). Returns the tables by name.

    Strict: every parameter of the model must be in the export and every exported
    parameter and table in the model, with its shape. Buffers (which no checkpoint
    holds) keep the model's values. `seed`: the job's `spec.training.seed`, to make
    ids without a row read as their initial values in training; without it they read
    as zeros."""
    from safetensors.torch import load_file

    document = read_manifest(out_dir)
    state = load_file(str(Path(out_dir) / document["dense"]["file"]))
    params = dict(model.named_parameters())
    buffers = {name for name, _ in model.named_buffers()}
    missing = sorted(set(params) - set(state))
    unexpected = sorted(set(state) - set(params) - buffers)
    problems = ([f"parameters {missing} are missing"] if missing else []) + (
        [f"parameters {unexpected} are not in the model"] if unexpected else []) + [
        f"parameter {name!r} is {_describe(state[name])} in the export, but "
        f"{_describe(p)} in the model"
        for name, p in params.items()
        if name in state and (state[name].shape != p.shape or state[name].dtype != p.dtype)]
    if problems:
        raise ExportError(f"the export in {out_dir} does not fit this model: "
                          + "; ".join(problems) + "; build the model as the training job did")
    if buffers:
        model.load_state_dict(state, strict=False)
    else:
        model.load_state_dict(state, strict=True)

    tables = load_tables(out_dir)
    layers = list(sparse_layers(model))
    names = {layer.spec.name for _, layer in layers}
    extra = sorted(set(tables) - names)
    if extra:
        raise ExportError(f"the export in {out_dir} holds sparse tables {extra}, which "
                          "this model does not declare")
    for path, layer in layers:
        spec = layer.spec
        table = tables.get(spec.name)
        if table is None:
            raise ExportError(f"sparse layer {path} reads table {spec.name!r}, which the "
                              f"export in {out_dir} does not hold")
        if table.dim != spec.embedding_dim:
            raise ExportError(f"sparse table {spec.name!r} has dim {table.dim} in the "
                              f"export, but layer {path} declares {spec.embedding_dim}")
        if seed is not None:
            table.default = _initial_values(spec, seed)
        layer.source = table
    return tables


def _describe(t: torch.Tensor) -> str:
    return f"{list(t.shape)} {str(t.dtype).removeprefix('torch.')}"


def _initial_values(spec: TableSpec, seed: int) -> Any:
    """The training's initial rows of ids without a row (what the servers compute: the
    layer's seed plus the job's; a fused table's ids each from their own table)."""
    return replace(spec, seed=spec.seed + seed).initializer()


# ---------------------------------------------------------------------- the command
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pstrain export",
        description="Export a pstrain checkpoint for plain PyTorch or serving: dense "
        "parameters as model.safetensors (and model.pt), each sparse table as "
        "tables/<name>.safetensors (ids, rows), and manifest.json; no optimizer state. "
        "Load it with pstrain_runtime.export.load_exported(DIR, model). Exits 0 on "
        "success, 1 when the checkpoint or --out is unusable, 2 for a bad command line.",
    )
    parser.add_argument("checkpoint", metavar="CHECKPOINT",
                        help="a checkpoint file (ckpt-<step>.pt), or a checkpoint "
                        "directory: its newest intact checkpoint is exported")
    parser.add_argument("--out", required=True, metavar="DIR",
                        help="directory to write (created when missing; must be empty "
                        "unless --force)")
    parser.add_argument("--force", action="store_true",
                        help="write into a non-empty --out, replacing an export there")
    return parser


def export_main(argv: Sequence[str]) -> int:
    args = build_parser().parse_args(list(argv))
    try:
        result = export_checkpoint(args.checkpoint, args.out, force=args.force)
    except (CheckpointError, ExportError) as exc:
        print(f"pstrain export: {_one_line(str(exc))}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"pstrain export: cannot write {args.out}: {_one_line(str(exc))}",
              file=sys.stderr)
        return 1
    tables = ", ".join(f"{name} ({rows} rows)" for name, rows in result.tables.items())
    print(f"exported step {result.global_step} of {result.source} to {result.out_dir}: "
          f"{result.dense} dense parameters" + (f"; sparse tables {tables}" if tables else ""))
    for path in result.files:
        print(f"  {path}")
    return 0


def _one_line(text: str) -> str:
    """A message on one line (torch's reader errors may span several)."""
    return " ".join(text.split())
