"""`sparse.scatter`: whole-row writes through numpy views, against torch's own
index_copy_ / index_fill_ (which they replace on the tables' and caches' hot paths)."""

from __future__ import annotations

import pytest
import torch

from pstrain_runtime.sparse.scatter import fill_rows, put_rows

pytestmark = pytest.mark.timeout(60)


def _index(n: int, rows: int, seed: int) -> torch.Tensor:
    return torch.randperm(rows, generator=torch.Generator().manual_seed(seed))[:n]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int32, torch.int64])
@pytest.mark.parametrize("width", [None, 1, 3, 32])
def test_put_rows_writes_what_index_copy_writes(dtype: torch.dtype, width: int | None) -> None:
    shape = (500,) if width is None else (500, width)
    dest = (torch.arange(500 * (width or 1)) * 7 % 1000).to(dtype).reshape(shape)
    src = (-torch.arange(120 * (width or 1))).to(dtype).reshape((120, *shape[1:]))
    index = _index(120, 500, 1)
    want = dest.clone().index_copy_(0, index, src)
    put_rows(dest, index, src)
    assert torch.equal(dest, want)


@pytest.mark.parametrize("dtype,value", [(torch.float32, 0.1), (torch.int64, 1 << 40),
                                         (torch.int32, -3)])
@pytest.mark.parametrize("width", [None, 32])
def test_fill_rows_writes_what_index_fill_writes(dtype: torch.dtype, value: float,
                                                 width: int | None) -> None:
    shape = (300,) if width is None else (300, width)
    dest = torch.zeros(shape, dtype=dtype)
    index = _index(77, 300, 2)
    want = dest.clone().index_fill_(0, index, value)
    fill_rows(dest, index, value)
    assert torch.equal(dest, want)


def test_blocks_numpy_cannot_view_fall_back_to_torch() -> None:
    """A column slice (rows not contiguous), another dtype or row width: torch's own
    copy, with the same result (or torch's own error)."""
    base = torch.zeros(50, 8)
    view = base[:, :4]
    index = torch.tensor([3, 7, 1])
    put_rows(view, index, torch.ones(3, 4))
    assert float(base[:, :4][index].sum()) == 12 and float(base[:, 4:].sum()) == 0
    fill_rows(view, torch.tensor([9]), 2.0)
    assert torch.equal(base[9], torch.tensor([2.0] * 4 + [0.0] * 4))
    with pytest.raises(RuntimeError):
        put_rows(torch.zeros(5, 4), index, torch.ones(3, 4, dtype=torch.float64))


def test_an_empty_index_writes_nothing_and_an_index_past_the_end_raises() -> None:
    dest = torch.zeros(10, 4)
    put_rows(dest, torch.empty(0, dtype=torch.int64), torch.empty(0, 4))
    fill_rows(dest, torch.empty(0, dtype=torch.int64), 1.0)
    assert float(dest.abs().sum()) == 0
    with pytest.raises(IndexError):
        put_rows(dest, torch.tensor([10]), torch.ones(1, 4))
    with pytest.raises(IndexError):
        fill_rows(dest, torch.tensor([12]), 1.0)


def test_rows_written_share_the_tensors_memory() -> None:
    """The write lands in the tensor itself (and its views), not in a copy."""
    table = torch.zeros(20, 6)
    alias = table.view(-1)
    put_rows(table, torch.tensor([4]), torch.full((1, 6), 5.0))
    assert float(alias[24:30].sum()) == 30
