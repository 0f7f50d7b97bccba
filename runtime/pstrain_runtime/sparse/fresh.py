"""The initial rows a table shard computed for ids read without a row, kept for the
update that follows: a worker pulls a batch's rows, then pushes gradients for the same
ids, and for a new id computing its initial value (`ids.initial_rows`: two hashes and
a Box-Muller draw per pair of values) is most of what the read and the row's creation
cost. `RecentReads` keeps the last few reads' blocks (ids sorted, as workers send
them) and hands their rows to the creation instead of computing them again. The values
are the same either way (a pure function of the id), so a miss only costs time.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import torch

KEEP_READS = 4  # a read per worker in flight, two workers per server (and slack)
MAX_ROWS = 1 << 16  # rows kept per read at most (a larger read is not kept)


class RecentReads:
    def __init__(self, initial: Callable[[torch.Tensor], torch.Tensor],
                 keep: int = KEEP_READS) -> None:
        self.initial = initial
        self.blocks: deque[tuple[torch.Tensor, torch.Tensor]] = deque(maxlen=keep)

    def read(self, ids: torch.Tensor) -> torch.Tensor:
        """The initial rows of `ids`, computed, and kept when `ids` are sorted and
        unique (what a pull sends) and few enough."""
        rows = self.initial(ids)
        n = ids.numel()
        if 0 < n <= MAX_ROWS and (n == 1 or bool((ids[1:] > ids[:-1]).all())):
            self.blocks.append((ids, rows))
        return rows

    def create(self, ids: torch.Tensor) -> torch.Tensor:
        """The initial rows of `ids` (unique), taken from the kept reads where there
        (a kept block itself when `ids` are its ids: the caller copies, never writes)."""
        if not self.blocks or not ids.numel():
            return self.initial(ids)
        blocks = tuple(self.blocks)  # appended to unlocked
        for block_ids, block_rows in reversed(blocks):
            # The usual case: the push creates exactly the rows its pull read.
            if block_ids.numel() == ids.numel() and torch.equal(block_ids, ids):
                return block_rows
        missing = torch.ones(ids.numel(), dtype=torch.bool)
        out: torch.Tensor | None = None
        for block_ids, block_rows in reversed(blocks):
            pos = torch.searchsorted(block_ids, ids).clamp_(max=block_ids.numel() - 1)
            hit = missing & (block_ids[pos] == ids)
            if bool(hit.any()):
                if out is None:
                    out = torch.empty((ids.numel(), block_rows.shape[1]), dtype=torch.float32)
                out[hit] = block_rows[pos[hit]]
                missing &= ~hit
                if not bool(missing.any()):
                    return out
        if out is None:
            return self.initial(ids)
        out[missing] = self.initial(ids[missing])
        return out

    def clear(self) -> None:
        self.blocks.clear()
