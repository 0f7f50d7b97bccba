"""A parameter server writing its own rows of a checkpoint's link (see `saving`).

Streaming a shard's rows to the chief costs a socket copy on each side and the chief's
own write; where the server can reach the checkpoint directory itself (`pstrain run`,
or a volume mounted in the servers' pod template as in the chief's), it writes the
files there instead, and the chief only records their checks. The chief drives it a
page at a time, as it drives an export (`export` with `what` "write"):

    {dir, probe, file, start, limit, since?}   -> {next} | {next: 0, written: check}
                                                  | {reachable: false, why} | {error}
    {dir, file, abort: true}                   -> {aborted}

The first page (`start` 0) opens the file; each page appends the table's next rows
(a `rows` file) or dropped ids (a `removed` file), and the last one (`next` 0) closes
it (fsync, rename) and answers its check. `reachable` false: the server does not see
the directory the chief made (no `probe` file there: another filesystem), or cannot
write there; the chief writes that server's files itself. `error`: writing failed
midway (the file is removed), which fails the checkpoint, not the server.

What a caller may name is narrow: `dir` an existing directory named as a link's
(`ckpt-<12 digits>.sparse`, no symbolic link) holding the chief's `probe` file
(`.probe-<32 hex digits>`), `file` one of this server's (`table<k>-ps<index>.rows` or
`.removed`) that does not exist yet. Files of one link at a time are open: the first
page of another link drops what an abandoned one left.
"""

from __future__ import annotations

import os
import re
import stat
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..ps.store import PSError
from .files import MAGIC, MAGIC_IDS, FileWriter, block_parts, rows_header
from .protocol import field
from .table import RowTable
from .tiered import TieredTable

LINK_DIR = re.compile(r"ckpt-\d{12}\.sparse")
PROBE = re.compile(r"\.probe-[0-9a-f]{32}")
FILE = re.compile(r"table\d{1,6}-ps(\d{1,6})\.(rows|removed)")


@dataclass
class _Open:
    writer: FileWriter
    next: int  # the start the next page must name


def _where(header: dict[str, Any], ps_index: int) -> tuple[Path, str]:
    """The file a write call names (PSError INVALID_ARGUMENT unless it is one of this
    server's in a link directory) and its kind, rows or removed."""
    directory = Path(field(header, "dir", str, "sparse write"))
    name = field(header, "file", str, "sparse write")
    if not directory.is_absolute() or not LINK_DIR.fullmatch(directory.name):
        raise PSError("INVALID_ARGUMENT", f"sparse write: field 'dir' is {str(directory)!r}; "
                      "it must be an absolute path to a checkpoint's rows directory "
                      "(ckpt-<12 digits>.sparse)")
    match = FILE.fullmatch(name)
    if match is None or int(match.group(1)) != ps_index:
        raise PSError("INVALID_ARGUMENT", f"sparse write: field 'file' is {name!r}; it must "
                      f"be table<k>-ps{ps_index}.rows or .removed (this server's)")
    return directory / name, match.group(2)


def _unreachable(directory: Path, probe: str) -> str | None:
    """Why this server cannot write into `directory` (None: it can)."""
    if not PROBE.fullmatch(probe):
        raise PSError("INVALID_ARGUMENT", f"sparse write: field 'probe' is {probe!r}; it "
                      "must be .probe- and 32 hex digits")
    try:
        if not stat.S_ISDIR(os.lstat(directory).st_mode):
            return f"{directory} is not a directory"
        if not stat.S_ISREG(os.lstat(directory / probe).st_mode):
            return f"{directory / probe} is not a file"
    except OSError as exc:
        return f"{directory} is not reachable here: {exc.strerror}"
    return None


class ShardWrites:
    """The files of a checkpoint's link this server is writing for the chief."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.open: dict[Path, _Open] = {}

    def call(self, table: RowTable | TieredTable, header: dict[str, Any], ps_index: int,
             since: int | None) -> dict[str, Any]:
        """Answer one write call (see the module doc): its reply header."""
        path, kind = _where(header, ps_index)
        with self.lock:
            if header.get("abort"):
                dropped = self.open.pop(path, None)
                if dropped is not None:
                    dropped.writer.abort()
                return {"aborted": dropped is not None}
            start = field(header, "start", int, "sparse write")
            limit = field(header, "limit", int, "sparse write")
            if limit < 1:
                raise PSError("INVALID_ARGUMENT", f"sparse write: field 'limit' is {limit}; "
                              "it must be at least 1")
            if kind == "removed" and since is None:
                raise PSError("INVALID_ARGUMENT", "sparse write: a removed file needs "
                              "field 'since'")
            if start == 0:
                opened = self._open(path, kind, table, str(header.get("probe")))
                if opened is not None:
                    return opened
            current = self.open.get(path)
            if current is None or current.next != start:
                raise PSError("FAILED_PRECONDITION", f"sparse write: {path.name} has no "
                              f"write at row {start} in progress here")
            try:
                if kind == "rows":
                    block, after = table.export(start, limit, since)
                    current.writer.add(block_parts(block, table.slot_names))
                else:
                    ids, after = table.removed_ids(since, start, limit)  # type: ignore[arg-type]
                    current.writer.add((ids,))
                if after:
                    current.next = after
                    return {"next": after}
                del self.open[path]
                written = current.writer.finish()
            except OSError as exc:
                self.open.pop(path, None)
                current.writer.abort()
                return {"error": f"parameter server could not write {path}: {exc}"}
        return {"next": 0, "written": {"rows": written.rows, **written.check()}}

    def _open(self, path: Path, kind: str, table: RowTable | TieredTable,
              probe: str) -> dict[str, Any] | None:
        """Open `path` for its first page (the lock held); a reply when it cannot be."""
        for other in [p for p in self.open if p.parent != path.parent or p == path]:
            self.open.pop(other).writer.abort()  # of an abandoned link, or begun again
        why = _unreachable(path.parent, probe)
        if why is None:
            try:
                writer = (FileWriter(path, MAGIC, rows_header(table.spec, table.slot_names))
                          if kind == "rows" else
                          FileWriter(path, MAGIC_IDS, {"table": table.spec.name}))
            except OSError as exc:
                why = f"cannot write {path}: {exc.strerror or exc}"
            else:
                self.open[path] = _Open(writer, 0)
                return None
        return {"reachable": False, "why": why}

    def abort_all(self) -> None:
        with self.lock:
            for current in self.open.values():
                current.writer.abort()
            self.open.clear()
