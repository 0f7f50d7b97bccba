"""A server's shard written by `files.write_pages`, each page's rows gathered by the
table straight into the file's write buffer (`RowTable.export`'s `into`): the rows
read back are the table's, each once, in the order of `write_rows` over the same
pages, with the file's check; whole shards and deltas, tables with holes, every size
of the buffer's room, with O_DIRECT and without, and a table that gathers nothing
into the room (written by copy)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pstrain_runtime import direct_write
from pstrain_runtime.optim import OptimizerConfig
from pstrain_runtime.sparse import files, shard_writes
from pstrain_runtime.sparse.spec import TableSpec
from pstrain_runtime.sparse.table import RowBlock, RowTable

ROWS = 3000


def table(optimizer: str = "adagrad", dim: int = 5) -> RowTable:
    """ROWS rows of random values, one in seven removed again (holes), the rows of
    every third id last updated at clock 7 (the rest at 2)."""
    spec = TableSpec("t", None, dim, 0.01, optimizer=OptimizerConfig(optimizer, 0.05))
    t = RowTable(spec)
    g = torch.Generator().manual_seed(dim)
    ids = torch.randperm(10 * ROWS, generator=g)[:ROWS]
    t.load(RowBlock(ids=ids, rows=torch.randn(ROWS, dim, generator=g),
                    slots={n: torch.rand(ROWS, dim, generator=g) for n in t.slot_names},
                    last=torch.where(ids % 3 == 0, 7, 2)))
    assert t.remove(ids[::7]) == len(ids[::7])
    return t


def joined(blocks: list[RowBlock], slots: list[str]) -> list[torch.Tensor]:
    return [torch.cat([getattr(b, part) for b in blocks]) for part in ("ids", "rows", "last")] + [
        torch.cat([b.slots[n] for b in blocks]) for n in slots]


def live(t: RowTable, since: int | None) -> dict[int, int]:
    block, _ = t.export(0, 1 << 30, since)
    return {int(i): int(last) for i, last in zip(block.ids, block.last)}


def written(path: Path, t: RowTable, since: int | None) -> tuple[files.Written, list[RowBlock]]:
    out = files.write_pages(path, t.spec, t.slot_names, shard_writes._pages(t, since))
    return out, list(files.read_rows(path, t.spec, t.slot_names, out.check()))


@pytest.mark.parametrize("room_rows", [1, 7, 1000, None], ids=lambda r: f"room-{r}")
@pytest.mark.parametrize("since", [None, 7], ids=["whole", "delta"])
@pytest.mark.parametrize("optimizer", ["adagrad", "sgd"])
def test_pages_gathered_into_the_buffer_are_the_tables_rows(tmp_path, monkeypatch,
                                                            room_rows, since, optimizer):
    t = table(optimizer)
    if room_rows is not None:  # a buffer of that many rows: pages cut, claims drained
        size = files.row_bytes(t.spec.embedding_dim, len(t.slot_names))
        monkeypatch.setattr(files, "ROOM", 8 + room_rows * size)
        stage = direct_write.ALIGN * (2 + files.ROOM // direct_write.ALIGN)
        monkeypatch.setattr(direct_write, "STAGE", stage)
        monkeypatch.setattr(direct_write, "ROOM", stage - direct_write.ALIGN)
    out, blocks = written(tmp_path / "f", t, since)
    ids = torch.cat([b.ids for b in blocks]).tolist()
    assert len(ids) == len(set(ids)) == out.rows
    assert {i: int(last) for b in blocks for i, last in zip(b.ids.tolist(), b.last)} == live(t, since)
    if room_rows is not None:
        assert max(int(b.ids.numel()) for b in blocks) <= room_rows
    # The same rows as the table's own tensors give, page by page, in the same order.
    monkeypatch.setattr(files, "DIRECT", False)  # no room: pages copied in
    copied, copied_blocks = written(tmp_path / "g", t, since)
    assert copied.rows == out.rows
    for a, b in zip(joined(blocks, t.slot_names), joined(copied_blocks, t.slot_names)):
        assert torch.equal(a, b)
    whole, _ = t.export(0, 1 << 30, since)
    for a, b in zip(joined(blocks, t.slot_names), joined([whole], t.slot_names)):
        assert torch.equal(a, b)


def test_a_table_without_rows_writes_an_empty_file(tmp_path):
    t = table()
    out, blocks = written(tmp_path / "f", t, since=100)  # nothing changed since 100
    assert out.rows == 0 and blocks == []
    assert out.size == (tmp_path / "f").stat().st_size


def test_an_export_ends_its_page_where_the_room_is_full():
    t = table()

    class Room:
        most = 10
        calls: list[int] = []

        def block(self, count: int) -> RowBlock:
            self.calls.append(count)
            dim = t.spec.embedding_dim
            return RowBlock(ids=torch.empty(count, dtype=torch.int64),
                            rows=torch.empty(count, dim),
                            slots={n: torch.empty(count, dim) for n in t.slot_names},
                            last=torch.empty(count, dtype=torch.int64))

    room = Room()
    block, after = t.export(0, 1 << 30, None, room)
    mine, _ = t.export(0, 1 << 30)
    assert room.calls == [10] and torch.equal(block.ids, mine.ids[:10])
    assert after == int(t._where(mine.ids[10:11])[0])  # the first live row left out
    rest, _ = t.export(after, 1 << 30)
    assert torch.equal(rest.ids, mine.ids[10:])


def test_a_page_that_is_not_the_rooms_is_written_by_copy(tmp_path):
    """A table that does not gather into the room (a disk tier joins its pages from
    both tiers) has its pages written by copy: the same file."""
    t = table()

    def own_tensors(start: int, room: object) -> tuple[RowBlock, int]:
        return t.export(start, 500)

    out = files.write_pages(tmp_path / "f", t.spec, t.slot_names, own_tensors)
    blocks = list(files.read_rows(tmp_path / "f", t.spec, t.slot_names, out.check()))
    whole, _ = t.export(0, 1 << 30)
    for a, b in zip(joined(blocks, t.slot_names), joined([whole], t.slot_names)):
        assert torch.equal(a, b)


def test_a_page_that_gathers_into_the_room_and_gives_another_block_is_refused(tmp_path):
    t = table()

    def two_faced(start: int, room) -> tuple[RowBlock, int]:
        room.block(3)
        return t.export(0, 3)[0], 0

    with pytest.raises(RuntimeError, match="gave another"):
        files.write_pages(tmp_path / "f", t.spec, t.slot_names, two_faced)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("since", [None, 7], ids=["whole", "delta"])
def test_no_disk_write_while_the_table_is_locked(tmp_path, monkeypatch, since):
    """The table gathers a page into the buffer under its lock, which training waits
    on: the buffer is drained before the page, never while the lock is held."""
    t = table()
    size = files.row_bytes(t.spec.embedding_dim, len(t.slot_names))
    monkeypatch.setattr(files, "ROOM", 8 + 100 * size)  # many pages, many drains
    stage = direct_write.ALIGN * (2 + files.ROOM // direct_write.ALIGN)
    monkeypatch.setattr(direct_write, "STAGE", stage)
    monkeypatch.setattr(direct_write, "ROOM", stage - direct_write.ALIGN)
    real, locked = direct_write.os.write, []

    def write(fd: int, data: memoryview) -> int:
        locked.append(t.lock.locked())
        return real(fd, data)

    monkeypatch.setattr(direct_write.os, "write", write)
    out, blocks = written(tmp_path / "f", t, since)
    assert out.rows == len(live(t, since)) and len(locked) > 5
    assert not any(locked)
