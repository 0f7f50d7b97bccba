"""The CTR benchmark item's harness: its pure parts (sizes, `ss` parsing, ratios,
targets) as table tests, and smoke runs of its real measurements at tiny sizes (no
numbers are judged here)."""

from __future__ import annotations

import os
import socket
import threading

import pytest

from bench import ctr
from bench.core import Config, Figure, run_parts
from bench.report import evaluate_targets, render_markdown

pytestmark = pytest.mark.timeout(240)  # the smoke run spawns 5 processes

SS_OUTPUT = """\
0      0      127.0.0.1:44335 127.0.0.1:47408 users:(("python",pid=11,fd=19))
\t bbr wscale:10,10 rto:212 bytes_sent:1000 bytes_acked:1000 bytes_received:250 segs_out:24
0      0      127.0.0.1:46852 127.0.0.1:43441 users:(("python",pid=11,fd=4))
\t bbr bytes_sent:5 bytes_acked:5 segs_out:25
0      0      127.0.0.1:43896 127.0.0.1:44335 users:(("pstrain",pid=12,fd=24),("pstrain",pid=13,fd=24))
\t bbr bytes_received:7 segs_in:2
0      0      127.0.0.1:1 127.0.0.1:2
\t bbr bytes_sent:99
"""


def fig(key: str, median: float, unit: str = "samples/s", note: str = "") -> Figure:
    return Figure(key, key, unit, median, median, median, 5, note)


def test_parse_ss_sums_sent_and_received_per_process():
    # the shared socket counts once (first owner); a socket without owner is skipped
    assert ctr.parse_ss(SS_OUTPUT) == {11: 1255, 12: 7}


def test_wire_bytes_reads_this_process_sockets():
    server = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(server.getsockname())
    conn, _ = server.accept()
    before = ctr.wire_bytes([os.getpid()])
    got = bytearray()
    reader = threading.Thread(target=lambda: [got.extend(conn.recv(1 << 16))
                                              for _ in iter(lambda: len(got) < 100_000, False)])
    reader.start()
    client.sendall(b"x" * 100_000)
    reader.join(timeout=10)
    moved = ctr.wire_bytes([os.getpid()]) - before
    for s in (client, conn, server):
        s.close()
    assert moved >= 2 * 100_000, "sent by one socket and received by the other, same pid"


@pytest.mark.parametrize(("total", "name", "per_table"), [
    (1_000_000, "1M", 38_462), (10_000_000, "10M", 384_616), (50_000_000, "50M", 1_923_077),
    (26_000, "26k", 1_000)])
def test_sizes(total, name, per_table):
    assert ctr.size_name(total) == name
    assert ctr.size_rows(name) == total
    assert ctr.rows_per_table(total) == per_table
    assert ctr.table_bytes(total) == per_table * 26 * 32 * 4


def test_derive_ratios_and_spread():
    figs = {f.key: f for f in [fig("ctr.ps.1M", 1200.0), fig("ctr.ps.10M", 1000.0),
                               fig("ctr.ddp_dense.10M", 250.0),
                               fig("ctr.ddp_sparse.10M", 500.0), fig("ctr.ps.10M.cpu", 9.0)]}
    got = {f.key: f.median for f in ctr.derive(figs)}
    assert got == pytest.approx({"ctr.ps.10M.vs_ddp_dense": 4.0,
                                 "ctr.ps.10M.vs_ddp_sparse": 2.0, "ctr.ps.spread": 0.2})


@pytest.mark.parametrize(("figures", "expected"), [
    pytest.param([fig("ctr.ps.10M.vs_ddp_dense", 3.5, "x"), fig("ctr.ps.spread", 0.1, "x"),
                  fig("ctr.ps.10M.worker_rss", 300.0, "MB")],
                 ["met", "met", "met"], id="all-met"),
    pytest.param([fig("ctr.ps.1M.vs_ddp_dense", 5.0, "x"),
                  fig("ctr.ps.10M.vs_ddp_dense", 2.0, "x"), fig("ctr.ps.spread", 0.3, "x"),
                  fig("ctr.ps.10M.worker_rss", 400.0, "MB")],
                 ["missed", "missed", "missed"], id="largest-size-judged"),
    pytest.param([fig("ctr.ps.1M", 1.0), fig("ctr.ps.1M.worker_rss", 900.0, "MB")],
                 ["not measured", "not measured", "not measured"], id="small-only"),
])
def test_ctr_targets(figures, expected):
    targets = [t for t in evaluate_targets(figures) if t.name.startswith("CTR")]
    assert [t.status for t in targets] == expected


def test_markdown_has_the_ctr_section():
    figs = [fig("ctr.ps.10M", 1000.0), fig("ctr.ddp_dense.10M", 200.0)]
    allf = [*figs, *ctr.derive({f.key: f for f in figs})]
    md = render_markdown({"figures": [f.as_json() for f in allf],
                          "targets": [t.__dict__ for t in evaluate_targets(allf)]})
    assert "## 7. CTR model with sparse embedding tables" in md
    assert "| 10M rows: pstrain / ddp dense samples/s | 5.00 x |" in md


def test_unique_ids_and_ddp_memory_rule():
    ids = ctr.unique_ids(26_000, 64, batches=3)
    assert len(ids) == 3 and all(26 <= n <= 64 * 26 for n in ids)
    assert ctr.ddp_bytes_needed(10_000_000, sparse=False) == 2 * 4 * ctr.table_bytes(10_000_000)


def test_row_fill_counts_rows_and_bytes():
    got = ctr._fill_rows(0, 5000)
    assert got["rows"] == 5000 and got["bytes"] >= 0


def test_lookup_smoke():
    """The real lookup path (2 PS processes, a sparse client, loopback TCP between two
    more), one repetition: it runs and produces every figure."""
    figs = {f.key: f for f in ctr.lookup_path(Config.build(quick=True, repeats=1))}
    assert set(figs) == {"ctr.lookup.pull", "ctr.lookup.pull_gbs", "ctr.lookup.tcp",
                         "ctr.lookup.tcp_gbs", "ctr.lookup.vs_tcp"}
    assert all(f.median is not None and f.median > 0 for f in figs.values())


def test_run_parts_keeps_going_after_a_failed_part():
    def broken() -> list[Figure]:
        raise RuntimeError("rank 1 failed:\nTraceback ...\nMemoryError: no room")

    got = run_parts("ctr", [("ddp 10M dense", broken), ("ok", lambda: [fig("ctr.x", 1.0)])])
    assert [(f.key, f.median, f.note) for f in got] == [
        ("ctr.failed.ddp_10M_dense", None, "MemoryError: no room"), ("ctr.x", 1.0, "")]
