"""`python -m bench.export_moves`: a disk tier's checkpoint exports while it trains, at a
small size; each gives every row it must (a row coming back from disk meanwhile was
given by no page before session 19)."""

from __future__ import annotations

import pytest

pytest.importorskip("rocksdict")

from bench import export_moves  # noqa: E402


def test_a_chain_of_exports_while_training_misses_no_row(
        capsys: pytest.CaptureFixture[str]) -> None:
    got = export_moves.main(["--rows", "200000", "--budget-mib", "18", "--steps", "300"])
    # (Rows on disk, and some coming back between pages: 557, 120 and 157 missing
    # before session 19.)
    assert [e["kind"] for e in got] == ["full", "delta", "delta"]
    assert all(e["pages"] > 2 and e["wanted"] > 0 and e["missing"] == 0 for e in got), got
    assert capsys.readouterr().out.count("missing") == 3
