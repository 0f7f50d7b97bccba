"""A checkpoint's rows written by the parameter servers themselves, each its own
shard, where they see the chief's checkpoint directory. Otherwise the chief receives
every row of every server over its connections and writes them all (`saving.LiveRows`):
most of what a sparse checkpoint costs. Written by the servers, the rows cross no
connection, and the chief only names the files in its checkpoint. The files, their
names and their checks are the same either way, so restores and `pstrain export` read
them as before.

Where a server writes (the sparse op `save`, the chief's only; `save_shard`):
- under its own checkpoint directory: the job's `training.checkpoint.directory`, which
  every replica is given (on Kubernetes, a volume the servers' pods mount as well as
  the chief's). Never a path a call names: a call names only the link's directory
  (`ckpt-<step>.sparse`, checked) and the table's number;
- only where it reads there the probe the chief wrote for this link (`PROBE`, a random
  token): the same storage, not a folder of the same name on the server's own disk;
- only a shard of at most `MAX_SHARD_BYTES`, so that one call writes it within the
  data plane's time bound (a larger one streams to the chief, page by page).

A server that cannot (or may not: the volume is read-only in its pod, or another
user's) answers `shared: false` with the reason, and the chief writes that server's rows
itself for the rest of the link (`ServerWrites`). A server whose write fails otherwise
(its disk is full) answers the error: the checkpoint fails as one the chief could not
write, and training goes on.
"""

from __future__ import annotations

import errno
import re
import secrets
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from ..checkpoint import CheckpointError, check_rows_size
from ..ps.store import PSError
from .files import Pages, Written, row_bytes, write_ids, write_pages
from .protocol import field
from .saving import SaveCancelled, shard_name
from .spec import TableSpec
from .table import EXPORT_ROWS, Room, RowBlock

PROBE = ".pstrain-probe"  # in a link's directory while its rows are written
MAX_SHARD_BYTES = 4 << 30  # one call's file: written well within the data plane's bound
PAGE_IDS = 1 << 22
_LINK_DIR = re.compile(r"ckpt-[0-9]{12}\.sparse", re.ASCII)
_TOKEN = re.compile(r"[0-9a-f]{32}", re.ASCII)
WHAT = ("rows", "removed")
# A write refused for who or where the server is: the chief writes instead.
_NOT_OURS = frozenset({errno.EACCES, errno.EPERM, errno.EROFS})


def _paged(read: Callable[[int], tuple[Any, int]]) -> Iterator[Any]:
    """Each page `read(start)` answers, from 0 until its next start is 0 again."""
    start = 0
    while True:
        page, start = read(start)
        yield page
        if start == 0:
            return


def _pages(table: Any, since: int | None) -> Pages:
    """`table`'s pages for `write_pages`: a delta's of EXPORT_ROWS row indices (most
    of them unchanged), a whole shard's of as many as the file's buffer holds."""
    def export(start: int, room: Room | None) -> tuple[RowBlock, int]:
        limit = EXPORT_ROWS if room is None or since is not None else room.most
        return table.export(start, limit, since, room)  # type: ignore[no-any-return]
    return export


def _removed_pages(table: Any, since: int) -> Iterator[torch.Tensor]:
    return _paged(lambda start: table.removed_ids(since, start, PAGE_IDS))


def _probe_matches(link: Path, token: str) -> bool:
    try:
        return (link / PROBE).read_text(encoding="ascii")[:64] == token
    except (OSError, UnicodeDecodeError):
        return False


def save_shard(table: Any, ps_index: int, root: Path | None,
               header: dict[str, Any]) -> dict[str, Any]:
    """The server's side of `save`: write this server's shard of `table` (its rows, or
    a delta's dropped ids) into `root / header["dir"]`; the reply. PSError for a call
    malformed; `shared: false` (with `why`) where this server does not write."""
    link = field(header, "dir", str, "save")
    token = field(header, "token", str, "save")
    index = field(header, "index", int, "save")
    what = header.get("what")
    since = header.get("since")
    if not _LINK_DIR.fullmatch(link):
        raise PSError("INVALID_ARGUMENT", f"sparse save: field 'dir' is {link!r}; it must "
                      "be a link's directory, ckpt-<12 digits>.sparse")
    if not _TOKEN.fullmatch(token):
        raise PSError("INVALID_ARGUMENT", "sparse save: field 'token' must be 32 "
                      "lowercase hex digits")
    if not 0 <= index < 1 << 20:
        raise PSError("INVALID_ARGUMENT", f"sparse save: field 'index' is {index}; it "
                      "must be a table's number, 0 or more")
    if what not in WHAT:
        raise PSError("INVALID_ARGUMENT", f"sparse save: field 'what' is {what!r}; it "
                      f"must be one of {', '.join(WHAT)}")
    if since is not None and (not isinstance(since, int) or isinstance(since, bool)):
        raise PSError("INVALID_ARGUMENT", f"sparse save: field 'since' is {since!r}; it "
                      "must be an integer or absent")
    if what == "removed" and since is None:
        raise PSError("INVALID_ARGUMENT", "sparse save: removed ids need field 'since'")
    if root is None:
        return {"shared": False, "why": "this server has no checkpoint directory"}
    if not _probe_matches(root / link, token):
        return {"shared": False, "why": f"this server does not see the chief's {link} "
                "under its checkpoint directory"}
    if what == "rows":
        size = table.stats().rows * row_bytes(table.spec.embedding_dim,
                                              len(table.slot_names))
        if size > MAX_SHARD_BYTES:
            return {"shared": False, "why": f"its shard ({size} bytes) is larger than "
                    f"one call writes ({MAX_SHARD_BYTES})"}
    path = root / link / shard_name(index, ps_index, what)
    try:
        if what == "removed":
            written = write_ids(path, table.spec, _removed_pages(table, since))  # type: ignore[arg-type]
        else:
            written = write_pages(path, table.spec, table.slot_names, _pages(table, since))
    except OSError as exc:
        if exc.errno in _NOT_OURS:  # mounted read-only here, or another user's volume
            return {"shared": False, "why": f"it may not write {path}: {exc}"}
        return {"shared": True, "error": f"parameter server {ps_index} could not write "
                f"{path}: {exc}"}
    return {"shared": True, "rows": written.rows, "bytes": written.size,
            "crc32c": written.crc}


class ServerWrites:
    """The chief's side for one link: the probe written into the link's directory
    while it lasts (a context manager), and each server asked to write its shards
    until one says it does not (`write` then answers None for it: the chief writes)."""

    def __init__(self, client: Any, link: Path, cancel: threading.Event,
                 told: set[int] | None = None) -> None:
        self.client, self.link, self.cancel = client, link, cancel
        self.token = secrets.token_hex(16)
        self.refused: dict[int, str] = {}  # server -> why it does not write
        # Servers whose refusal the user was told of (one line per server and job).
        self.told = told if told is not None else set()

    def __enter__(self) -> ServerWrites:
        self.link.mkdir(parents=True, exist_ok=True)
        (self.link / PROBE).write_text(self.token, encoding="ascii")
        return self

    def __exit__(self, *exc_info: object) -> None:
        (self.link / PROBE).unlink(missing_ok=True)

    def write(self, ps: int, table_index: int, spec: TableSpec, what: str,
              since: int | None) -> Written | None:
        """Server `ps`'s shard written by it; None where it does not write (the
        chief writes it). A failed write: CheckpointError."""
        if ps in self.refused:
            return None
        if self.cancel.is_set():
            raise SaveCancelled("the checkpoint was abandoned")
        header = {"op": "save", "table": spec.name, "dir": self.link.name,
                  "token": self.token, "index": table_index, "what": what}
        if since is not None:
            header["since"] = since
        reply, _ = self.client.call(ps, header)
        if not reply.get("shared"):
            self.refused[ps] = why = str(reply.get("why", ""))
            if ps not in self.told:
                self.told.add(ps)
                print(f"pstrain: parameter server {ps} does not write its own rows of "
                      f"sparse checkpoints ({why}); the chief writes them (mount the "
                      "checkpoint volume on the servers too to spare it)", flush=True)
            return None
        if "error" in reply:
            raise CheckpointError(str(reply["error"]))
        written = Written(int(reply["rows"]), int(reply["bytes"]), int(reply["crc32c"]))
        # The file is here, whole, where the chief will read it.
        check_rows_size(self.link / shard_name(table_index, ps, what), written.check())
        return written
