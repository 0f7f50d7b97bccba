"""bench.sparse_ckpt's side of before session 31 (`copied100`): the servers' pages
copied into the write buffer write the same rows as the shipped path, which gathers
them straight into it (the item itself takes minutes: `python -m bench --only
sparse_ckpt`)."""

from __future__ import annotations

import torch

from bench import sparse_ckpt
from pstrain_runtime.optim import OptimizerConfig
from pstrain_runtime.sparse import files, shard_writes
from pstrain_runtime.sparse.spec import TableSpec
from pstrain_runtime.sparse.table import RowBlock, RowTable


def test_the_copied_side_writes_the_rows_of_the_shipped_one(tmp_path, monkeypatch):
    spec = TableSpec("t", None, 4, 0.01, optimizer=OptimizerConfig("adagrad", 0.05))
    t = RowTable(spec)
    ids = torch.arange(5000) * 3
    t.load(RowBlock(ids=ids, rows=torch.randn(5000, 4), slots={"sum": torch.rand(5000, 4)},
                    last=ids % 5))
    paths = {}
    for side in ("shipped", "copied"):
        if side == "copied":
            monkeypatch.setattr(shard_writes, "write_pages", shard_writes.write_pages)
            sparse_ckpt._copy_pages_into_the_buffer()
            assert shard_writes.write_pages is not files.write_pages
        link = tmp_path / side / "ckpt-000000000001.sparse"
        link.mkdir(parents=True)
        (link / shard_writes.PROBE).write_text("ab" * 16)
        header = {"dir": link.name, "token": "ab" * 16, "index": 0, "what": "rows",
                  "since": 3}
        reply = shard_writes.save_shard(t, 0, link.parent, header)
        assert reply["shared"] and reply["rows"] == int((ids % 5 >= 3).sum())
        paths[side] = (link / "table0-ps0.rows", reply)
    read = {side: list(files.read_rows(path, spec, ["sum"], {"bytes": r["bytes"],
                                                              "crc32c": r["crc32c"]}))
            for side, (path, r) in paths.items()}
    for part in ("ids", "rows", "last"):
        a, b = (torch.cat([getattr(x, part) for x in read[s]]) for s in ("shipped", "copied"))
        assert torch.equal(a, b)
