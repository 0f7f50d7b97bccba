"""Checkpoints: what is saved (`Checkpoint`) apart from where and how (`CheckpointStore`).

A checkpoint holds the global step, every parameter, the optimizer state of every
parameter (step count and slots), the optimizer name, a format version, the model
fingerprint (a digest of names, shapes and dtypes) and each worker's position in its
data (how many batches it had drawn; optional, so older files still load). Files are written atomically (a
temporary file in the same directory, fsync, `os.replace`) and read with
`torch.load(weights_only=True)`, so a checkpoint can never execute code. Loading
rejects a file of another format version or another model with a message that says
which, and a file whose tensors do not fit the model (whatever fingerprint it claims)
before anything is installed; such a mismatch is a configuration error
(`CheckpointMismatch`): no restart can fix it.

A damaged file (`CheckpointCorrupt`) is found when it is read: torch cannot load it, its
fields are malformed, its tensors do not match the CRC-32 written with them (torch does
not check its own, so a flipped byte would otherwise load as a wrong number), or a
parameter holds NaN or inf (which no server accepts). `CheckpointStore.latest` then
restores the newest intact checkpoint and names the damaged ones; when none is intact,
it fails with `NoUsableCheckpoint`, a configuration error: a restart reads the same
bytes, so the job fails at once with one line instead of restarting to the same end.
"""

from __future__ import annotations

import errno
import hashlib
import os
import re
import shutil
import tempfile
import threading
import time
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch

from .direct_write import DirectFile
from .failure import ConfigurationError

FORMAT = "pstrain-checkpoint"
FORMAT_VERSION = 1
FILE_RE = re.compile(r"^ckpt-(\d{12})\.pt$")
# Errors of the storage rather than of the file: reading again later may succeed.
STORAGE_ERRNOS = frozenset({errno.EIO, errno.EAGAIN, errno.EINTR, errno.ESTALE,
                            errno.ETIMEDOUT, errno.ENOTCONN, errno.ECONNRESET,
                            errno.EHOSTDOWN, errno.EHOSTUNREACH, errno.ENOLINK,
                            errno.EACCES, errno.EPERM, errno.EMFILE, errno.ENFILE,
                            errno.ENOMEM})
T = TypeVar("T")


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; the message names the file and the reason."""


class CheckpointMismatch(CheckpointError, ConfigurationError):
    """A readable checkpoint of another model or optimizer: no restart can fix it, so
    the replica that finds it reports a configuration error."""


class CheckpointCorrupt(CheckpointError):
    """A damaged file: not loadable, malformed, or not the bytes that were written."""


class NoUsableCheckpoint(CheckpointError, ConfigurationError):
    """Every checkpoint of a directory is damaged: a restart would read the same bytes."""


def content_crc32(params: Mapping[str, torch.Tensor],
                  slots: Mapping[str, Mapping[str, torch.Tensor]]) -> int:
    """CRC-32 of every tensor's bytes, parameters then slots, in name order."""
    crc = 0
    tensors = [params[name] for name in sorted(params)] + [
        slots[name][slot] for name in sorted(slots) for slot in sorted(slots[name])]
    for tensor in tensors:
        if isinstance(tensor, torch.Tensor):  # anything else is refused by check_tensors
            flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
            crc = zlib.crc32(flat.numpy(), crc)
    return crc


def fingerprint(shapes: Mapping[str, tuple[tuple[int, ...], str]]) -> str:
    """Digest of the model's parameter names, shapes and dtypes (order-independent)."""
    lines = [f"{name}:{','.join(map(str, shape))}:{dtype}"
             for name, (shape, dtype) in sorted(shapes.items())]
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()


def model_fingerprint(params: Mapping[str, torch.Tensor]) -> str:
    return fingerprint({n: (tuple(t.shape), str(t.dtype).removeprefix("torch."))
                        for n, t in params.items()})


@dataclass
class Checkpoint:
    global_step: int
    fingerprint: str
    optimizer: str
    params: dict[str, torch.Tensor]
    slots: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    slot_steps: dict[str, int] = field(default_factory=dict)
    wall_time: float = 0.0
    sparse: dict[str, object] = field(default_factory=dict)  # manifest of the table rows
    # Per worker (index = worker), the batches it had drawn from its data when these
    # parameters were saved: where its `batches` resumes. Empty in files from before.
    positions: list[int] = field(default_factory=list)
    # The CRC-32 the file says its tensors had when written (None: a file from before).
    crc32: int | None = None

    def to_dict(self) -> dict[str, object]:
        return {
            "format": FORMAT,
            "version": FORMAT_VERSION,
            "global_step": self.global_step,
            "fingerprint": self.fingerprint,
            "optimizer": self.optimizer,
            "params": self.params,
            "slots": self.slots,
            "slot_steps": self.slot_steps,
            "wall_time": self.wall_time or time.time(),
            "sparse": self.sparse,
            "positions": list(self.positions),
            "crc32": content_crc32(self.params, self.slots),
        }

    @classmethod
    def from_dict(cls, data: object, where: str) -> Checkpoint:
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise CheckpointCorrupt(f"{where} is not a pstrain checkpoint")
        if data.get("version") != FORMAT_VERSION:
            raise CheckpointCorrupt(
                f"{where} has format version {data.get('version')!r}; this runtime reads "
                f"version {FORMAT_VERSION}"
            )
        try:
            return cls(
                global_step=int(data["global_step"]),
                fingerprint=str(data["fingerprint"]),
                optimizer=str(data["optimizer"]),
                params=dict(data["params"]),
                slots={k: dict(v) for k, v in data["slots"].items()},
                slot_steps={k: int(v) for k, v in data["slot_steps"].items()},
                wall_time=float(data.get("wall_time", 0.0)),
                sparse=dict(data.get("sparse") or {}),
                positions=[_position(p) for p in data.get("positions", [])],
                crc32=None if data.get("crc32") is None else int(data["crc32"]),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise CheckpointCorrupt(f"{where} is missing or has malformed field: "
                                    f"{exc}") from exc

    def check_intact(self, where: str) -> None:
        """The tensors are those that were written (CRC-32) and every parameter is
        finite; else CheckpointCorrupt."""
        if self.crc32 is not None and content_crc32(self.params, self.slots) != self.crc32:
            raise CheckpointCorrupt(f"{where} is corrupt: its tensors do not match the "
                                    "CRC-32 written with them")
        for name, tensor in sorted(self.params.items()):
            if isinstance(tensor, torch.Tensor) and tensor.is_floating_point() and not bool(
                    torch.isfinite(tensor).all()):
                raise CheckpointCorrupt(f"{where} is corrupt: parameter {name!r} holds NaN "
                                        "or inf")

    def check_matches(self, expected_fingerprint: str, optimizer: str, where: str) -> None:
        if self.fingerprint != expected_fingerprint:
            raise CheckpointMismatch(
                f"{where} was written for a different model (fingerprint "
                f"{self.fingerprint[:12]}, this model is {expected_fingerprint[:12]}); "
                "point checkpoint.directory at this model's checkpoints or remove it"
            )
        if self.optimizer != optimizer:
            raise CheckpointMismatch(
                f"{where} holds {self.optimizer} optimizer state, but the job uses "
                f"{optimizer}; change the optimizer back or start a new checkpoint directory"
            )


    def check_tensors(self, model: Mapping[str, torch.Tensor], where: str,
                      slot_names: Sequence[str] = ()) -> None:
        """Every tensor of the file fits `model` (names, shapes, dtypes; the optimizer's
        `slot_names` present and shaped like their parameter). The fingerprint is only
        what the file claims: a file whose tensors disagree with it is refused here,
        before anything is installed."""
        problems: list[str] = []
        missing = sorted(set(model) - set(self.params))
        extra = sorted(set(self.params) - set(model))
        if missing:
            problems.append(f"parameters {missing} are missing")
        if extra:
            problems.append(f"parameters {extra} are not in the model")
        for name, want in model.items():
            tensors = [("parameter", self.params.get(name))] + [
                (f"{slot} slot of", t) for slot, t in self.slots.get(name, {}).items()]
            for what, got in tensors:
                if got is None:
                    continue
                if not isinstance(got, torch.Tensor):
                    problems.append(f"{what} {name!r} is a {type(got).__name__}, not a tensor")
                elif tuple(got.shape) != tuple(want.shape) or got.dtype != want.dtype:
                    problems.append(
                        f"{what} {name!r} is {_describe(got)} in the file, but the model's "
                        f"is {_describe(want)}")
            absent = sorted(set(slot_names) - set(self.slots.get(name, {})))
            if absent and name in self.params:
                problems.append(f"optimizer slots {absent} of {name!r} are missing")
        for name in sorted(set(self.slots) - set(model)):
            problems.append(f"optimizer slots of {name!r}, which is not in the model")
        if problems:
            shown = "; ".join(problems[:3]) + (f"; and {len(problems) - 3} more"
                                               if len(problems) > 3 else "")
            raise CheckpointMismatch(f"{where} does not fit this model: {shown}; nothing was "
                                     "restored")


def _position(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"positions holds {value!r}; each must be a whole number >= 0")
    return value


def _describe(t: torch.Tensor) -> str:
    return f"{list(t.shape)} {str(t.dtype).removeprefix('torch.')}"


def write_atomically(path: Path, write: Callable[[Any], T], direct: bool = False) -> T:
    """Call `write` on a temporary file beside `path`, fsync it, rename it to `path`:
    never a half-written file under that name. Returns what `write` returned. With
    `direct`, the file `write` gets is a `DirectFile` (its `write` only), which goes
    around the page cache where it can: for large files of rows."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        if direct:
            try:
                out = DirectFile(fd)
                result = write(out)
                out.finish()
            finally:
                os.close(fd)
        else:
            with os.fdopen(fd, "wb") as fh:
                result = write(fh)
                fh.flush()
                os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return result


def check_rows_size(path: Path, check: Mapping[str, Any] | None) -> None:
    """CheckpointCorrupt when a sparse rows file is missing or not of the size written
    (`check` as the checkpoint's manifest records it; nothing to check without one)."""
    if not check:
        return
    try:
        size = os.stat(path).st_size
    except FileNotFoundError:
        raise CheckpointCorrupt(f"sparse rows {path} are missing") from None
    except OSError as exc:
        raise CheckpointError(f"sparse rows {path} cannot be read: {exc}") from exc
    if size != check.get("bytes"):
        raise CheckpointCorrupt(f"sparse rows {path} have {size} bytes; "
                                f"{check.get('bytes')} were written")


def sparse_links(manifest: Mapping[str, Any] | None) -> list[Mapping[str, Any]]:
    """The links of a checkpoint's sparse manifest, oldest first: each {dir, full,
    tables: {name: {files, rows, checks, removed?}}}, the first a full write (a base),
    the others deltas on top of it. A manifest of before chains, {dir, tables}, is one
    full link; no manifest (a model without tables) none. CheckpointCorrupt when
    malformed."""
    if not manifest:
        return []
    if "chain" not in manifest:
        links: Any = [{"dir": manifest.get("dir"), "full": True,
                       "tables": manifest.get("tables")}]
    else:
        links = manifest["chain"]
    if not isinstance(links, list) or not links:
        raise CheckpointCorrupt(f"the sparse manifest's chain is {links!r}; it must be a "
                                "non-empty list of links")
    for k, link in enumerate(links):
        name = link.get("dir") if isinstance(link, Mapping) else None
        if (not isinstance(name, str) or not name or Path(name).name != name
                or name.startswith(".")):
            raise CheckpointCorrupt(f"link {k} of the sparse manifest names directory "
                                    f"{name!r}; it must be a directory name beside the "
                                    "checkpoint")
        if not isinstance(link.get("tables"), Mapping) or bool(link.get("full")) != (k == 0):
            raise CheckpointCorrupt(f"link {k} ({name}) of the sparse manifest is malformed: "
                                    "it needs its tables, and only the first link is full")
    return links


def sparse_dirs(manifest: Mapping[str, Any] | None) -> set[str]:
    """The row directories a checkpoint's sparse manifest names (its chain's)."""
    return {str(link["dir"]) for link in sparse_links(manifest)}


def check_sparse_files(directory: Path, manifest: Mapping[str, Any]) -> None:
    """Every rows (and removed ids) file a checkpoint's sparse manifest names, over its
    whole chain, by its recorded size."""
    for link in sparse_links(manifest):
        base = directory / str(link["dir"])
        for entry in link["tables"].values():
            if not isinstance(entry, Mapping):
                continue
            checks = entry.get("checks") or {}
            for filename in [*(entry.get("files") or []), *(entry.get("removed") or [])]:
                check_rows_size(base / filename, checks.get(filename))


def save_checkpoint(ckpt: Checkpoint, path: Path) -> Path:
    """Write `ckpt` to `path` atomically."""
    write_atomically(path, lambda fh: torch.save(ckpt.to_dict(), fh))
    return path


def load_checkpoint(path: Path) -> Checkpoint:
    """The checkpoint in `path`, intact; CheckpointCorrupt when the file is damaged,
    CheckpointError when it cannot be read now (missing, an I/O error)."""
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError as exc:
        raise CheckpointError(f"checkpoint {path} does not exist") from exc
    except OSError as exc:
        if exc.errno in STORAGE_ERRNOS:  # the storage failed: a later read may work
            raise CheckpointError(f"checkpoint {path} could not be read "
                                  f"({type(exc).__name__}: {exc})") from exc
        raise CheckpointCorrupt(  # torch's reader fails so on a truncated file (EINVAL)
            f"checkpoint {path} is corrupt or unreadable ({type(exc).__name__}: {exc})"
        ) from exc
    except Exception as exc:  # torch.load raises many types for corrupt files
        raise CheckpointCorrupt(
            f"checkpoint {path} is corrupt or unreadable ({type(exc).__name__}: {exc})"
        ) from exc
    ckpt = Checkpoint.from_dict(data, str(path))
    ckpt.check_intact(f"checkpoint {path}")
    return ckpt


REMOVAL_WAIT_S = 60.0  # how long `settle` waits for row directories being removed


def _remove_dirs(paths: Sequence[Path]) -> None:
    for path in paths:
        shutil.rmtree(path, ignore_errors=True)


class CheckpointStore:
    """Checkpoints of one job in one directory: `ckpt-<step>.pt`, newest kept, and the
    sparse row directories (`ckpt-<step>.sparse`) their chains name.

    Removing a row directory no checkpoint names any more (tens of MB freed from the
    page cache: ~13 ms for 49 MB, most of what a checkpoint stopped the chief's
    training for) can run on a thread of its own (`save(background=True)`); one at a
    time, a save finding the last still running leaves its own for the next save, and
    `settle` (the final checkpoint) waits for it, bounded, and removes what is left."""

    def __init__(self, directory: str | Path, keep: int = 3) -> None:
        if keep < 1:
            raise ValueError(f"keep is {keep}; it must be at least 1")
        self.directory = Path(directory)
        self.keep = keep
        self.chains: dict[int, set[str]] = {}  # step -> the row dirs its manifest names
        self._removal: threading.Thread | None = None  # row dirs being removed

    def path_for(self, step: int) -> Path:
        return self.directory / f"ckpt-{step:012d}.pt"

    def steps(self) -> list[int]:
        if not self.directory.is_dir():
            return []
        found = [FILE_RE.match(p.name) for p in self.directory.iterdir()]
        return sorted(int(m.group(1)) for m in found if m)

    def save(self, ckpt: Checkpoint, background: bool = False) -> Path:
        """Write `ckpt`, then drop the checkpoints past `keep` and the row directories
        none of those kept names (`background`: on a thread, see the class doc)."""
        path = save_checkpoint(ckpt, self.path_for(ckpt.global_step))
        self.chains[ckpt.global_step] = sparse_dirs(ckpt.sparse)
        for step in self.steps()[: -self.keep]:
            self.path_for(step).unlink(missing_ok=True)
            self.chains.pop(step, None)
        if not background:
            self._prune_row_dirs()
        elif self._removal is None or not self._removal.is_alive():
            doomed = self._unnamed_row_dirs()
            if doomed:
                self._removal = threading.Thread(target=_remove_dirs, args=(doomed,),
                                                 name="checkpoint-retention", daemon=True)
                self._removal.start()
        return path

    def settle(self, timeout: float = REMOVAL_WAIT_S) -> None:
        """Wait (at most `timeout`) for row directories being removed, then remove
        those no kept checkpoint names (a job's end: nothing is left behind)."""
        if self._removal is not None:
            self._removal.join(timeout)
            if self._removal.is_alive():
                return
            self._removal = None
        try:
            self._prune_row_dirs()
        except OSError:  # best effort, as every removal here: the next run prunes again
            pass

    def _named_dirs(self, steps: Sequence[int]) -> set[str] | None:
        """The row dirs the checkpoints of `steps` name; None when one of them cannot be
        read now (nothing may be removed then). A damaged one names none: it is never
        restored."""
        named: set[str] = set()
        for step in steps:
            if step not in self.chains:
                try:
                    ckpt = load_checkpoint(self.path_for(step))
                    self.chains[step] = sparse_dirs(ckpt.sparse)
                except CheckpointCorrupt:
                    self.chains[step] = set()
                except CheckpointError:
                    return None
            named |= self.chains[step]
        return named

    def _prune_row_dirs(self) -> None:
        _remove_dirs(self._unnamed_row_dirs())

    def _unnamed_row_dirs(self) -> list[Path]:
        """Sparse-row directories (`ckpt-<step>.sparse`) older than the newest
        checkpoint that no kept checkpoint's chain names (their checkpoints are gone, or
        were never completed): to remove. Newer ones may be being written."""
        kept = self.steps()
        if not kept:
            return []
        named = self._named_dirs(kept)
        if named is None:
            return []
        doomed = []
        for entry in self.directory.glob("ckpt-*.sparse"):
            step = entry.name.removeprefix("ckpt-").removesuffix(".sparse")
            if (step.isdigit() and int(step) < kept[-1] and int(step) not in kept
                    and entry.name not in named):
                doomed.append(entry)
        return doomed

    def latest(self) -> tuple[Checkpoint, Path, list[str]] | None:
        """The newest intact checkpoint and the problems with newer ones.

        A corrupt newest file (a crash outside our atomic write, a bad disk) does not
        stop a restore: the next older one is used and the problem is reported. When
        none is usable: NoUsableCheckpoint (permanent) if every file is damaged, else
        CheckpointError (a read that failed may work later).
        """
        problems: list[str] = []
        damaged = True
        for step in reversed(self.steps()):
            path = self.path_for(step)
            try:
                ckpt = load_checkpoint(path)
                check_sparse_files(self.directory, ckpt.sparse)
                self.chains[step] = sparse_dirs(ckpt.sparse)
                return ckpt, path, problems
            except CheckpointCorrupt as exc:
                problems.append(str(exc))
            except CheckpointError as exc:
                problems.append(str(exc))
                damaged = False
        if not problems:
            return None
        found = "no usable checkpoint: " + "; ".join(problems)
        if damaged:
            raise NoUsableCheckpoint(f"{found}; a restart would read the same files: "
                                     f"remove them from {self.directory} to start afresh, "
                                     "or point checkpoint.directory at intact ones")
        raise CheckpointError(found)
