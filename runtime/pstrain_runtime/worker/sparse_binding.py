"""The binding of a model's sparse tables (rows on the parameter servers) to a trainer.

`sparse.session.SparseSession` does the work; this module says where a trainer calls it,
so that a model without sparse layers runs no table code at all:
- building: the tables join the model's fingerprint, and they rule out overlapped and
  pipelined pushes (a sync step's rows must reach the servers before its dense bucket);
- every step: the layers' gradient rows are cleared before forward and pushed beside
  the dense gradients (`step`; in async mode riding on the dense push_pull where they
  can, `sparse.riding`);
- the chief: the tables (and their rows) are installed before the dense parameters, their
  rows are checkpointed beside the checkpoint file (a chain of a full write and deltas,
  written off the training thread: `sparse.chain`, `sparse.saving`), and their size goes
  into progress events and status.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch import nn

from ..optim import OptimizerConfig
from ..ps.store import PSError
from ..sparse.protocol import Encoded, Frame
from ..sparse.saving import LinkWrite
from ..sparse.session import SparseSession
from ..sparse.tiered import StorageSettings

if TYPE_CHECKING:
    from pstrain_api.model import SparseStorage


def storage_settings(storage: SparseStorage) -> StorageSettings | None:
    """`spec.training.sparseStorage` as the servers get it (None: rows all in RAM)."""
    memory = storage.memory_bytes()
    return None if memory is None else StorageSettings(memory, storage.directory)


class SparseBinding:
    def __init__(self, session: SparseSession | None) -> None:
        self.session = session  # None: the model has no sparse layers

    @classmethod
    def attach(cls, model: nn.Module, transports: Sequence[Any], namespace: str,
               optimizer: OptimizerConfig, seed: int,
               cache: tuple[int, int] | None = None,
               storage: StorageSettings | None = None) -> SparseBinding:
        return cls(SparseSession.attach(model, transports, namespace, optimizer, seed, cache,
                                        storage))

    @property
    def bound(self) -> bool:
        return self.session is not None

    def fingerprint(self, dense: str) -> str:
        """The model's fingerprint, covering the table definitions when there are any."""
        return dense if self.session is None else self.session.fingerprint(dense)

    def begin_step(self) -> None:
        if self.session is not None:
            self.session.begin_step()

    def push(self, worker: int, steps: Sequence[int]) -> None:
        if self.session is not None:
            self.session.push(worker, steps)

    def riders(self, worker: int, steps: Sequence[int]) -> list[Encoded | None] | None:
        """Async mode: this step's push as frames per server to ride on the dense
        push_pull (`sparse.riding`); None without tables, or when it cannot ride (then
        `push` after the push_pull, as before)."""
        return None if self.session is None else self.session.riders(worker, steps)

    def rode(self, replies: Sequence[list[Frame] | None]) -> None:
        """The replies of the sparse push that rode: a refusal raised (PSError)."""
        if self.session is not None:
            self.session.rode(replies)

    def install(self, rows: dict[str, Any] | None, directory: Path | None,
                only: Sequence[int] | None) -> None:
        """The chief: define the tables on the servers (`only` those), with the rows of
        a checkpoint when restoring one."""
        if self.session is not None:
            self.session.install(rows, directory, only)

    def begin_save(self, directory: Path, step: int, frozen: bool) -> LinkWrite | None:
        """The chief: start writing each table's rows beside the checkpoint of `step`
        (`sparse.saving`; `frozen`: sync mode); None without tables."""
        if self.session is None:
            return None
        return self.session.begin_save(directory, step, frozen)

    def finish_save(self, write: LinkWrite) -> dict[str, Any]:
        """Wait for the rows of `write`; what the checkpoint keeps of them."""
        assert self.session is not None  # a write exists only with tables
        return self.session.finish_save(write)

    def commit(self, write: LinkWrite, manifest: dict[str, Any]) -> None:
        """The checkpoint of `write` is on disk: the next one may write a delta on it."""
        if self.session is not None:
            self.session.commit(write, manifest)

    def restart_chain(self) -> None:
        """Abandon the rows being written, if any: the next checkpoint writes them all."""
        if self.session is not None:
            self.session.restart_chain()

    def progress_fields(self) -> dict[str, Any]:
        """Sparse tables' live rows and memory for an event (best effort, like status)."""
        if self.session is None:
            return {}
        try:
            return self.session.progress_fields()
        except PSError as exc:
            print(f"pstrain: could not read the sparse tables' size: {exc}", flush=True)
            return {}

    def close(self) -> None:
        if self.session is not None:
            self.session.close()
