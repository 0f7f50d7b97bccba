"""Writes of whole rows at row indices: `put_rows` (dest[index] = src) and `fill_rows`
(dest[index] = value), for the row blocks of tables and caches.

torch's `index_copy_`, `index_put_` and `index_fill_` on CPU copy a row element by
element (32 floats: 32 strided copies), while its `index_select` copies a row with one
memcpy; a scatter of 6,600 rows x 32 into a table of millions took 4x its gather
(about 180 against 45 microseconds), and a parameter server scatters every row it
updates twice (the row, its optimizer state). Here a row of a C-contiguous block is
one numpy element of its byte width (a `void` view), so numpy's fancy assignment
copies it whole: 3.4x faster than `index_copy_`. Blocks that are not C-contiguous
CPU tensors of the same dtype and row width fall back to torch.

`index` holds row indices: int64, >= 0 and in range (numpy raises `IndexError` past
the end, as torch does, but reads a negative index from the end where torch raises);
a repeated index gets the last of its rows.
"""

from __future__ import annotations

import numpy as np
import torch


def _rows_view(t: torch.Tensor) -> np.ndarray | None:
    """A 2-D tensor's rows as a 1-D numpy array of `void` elements of one row's bytes
    (sharing its memory); None where that view does not exist."""
    if (t.dim() != 2 or t.device.type != "cpu" or t.requires_grad
            or not t.is_contiguous() or t.shape[1] == 0):
        return None
    array = t.numpy()
    return array.view(np.dtype((np.void, array.dtype.itemsize * t.shape[1]))).reshape(-1)


def put_rows(dest: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> None:
    """dest[index] = src, row by row (`src`: one row per index)."""
    if dest.dim() == 1:  # one value per row (bookkeeping): numpy's assignment
        if dest.device.type == "cpu" and dest.dtype == src.dtype and not dest.requires_grad:
            dest.numpy()[index.numpy()] = src.numpy()
            return
        dest.index_copy_(0, index, src)
        return
    rows, values = _rows_view(dest), _rows_view(src)
    if rows is None or values is None or dest.dtype != src.dtype or \
            dest.shape[1] != src.shape[1]:
        dest.index_copy_(0, index, src)
        return
    rows[index.numpy()] = values


def fill_rows(dest: torch.Tensor, index: torch.Tensor, value: float | int) -> None:
    """dest[index] = value: every element of the rows at `index`."""
    if dest.dim() == 1:
        if dest.device.type == "cpu" and not dest.requires_grad:
            dest.numpy()[index.numpy()] = value
            return
        dest.index_fill_(0, index, value)
        return
    rows = _rows_view(dest)
    if rows is None:
        dest.index_fill_(0, index, value)
        return
    row = torch.full((1, dest.shape[1]), value, dtype=dest.dtype)
    rows[index.numpy()] = _rows_view(row)[0]  # type: ignore[index]
