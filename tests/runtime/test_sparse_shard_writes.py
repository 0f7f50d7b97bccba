"""Parameter servers that see the checkpoint directory write their own rows of a link
(`sparse.shard_writes`): the files are those the chief would have written, the chief
streams the rows of the servers that do not see it, a cancelled or failed write leaves
no file behind, and a write call may name nothing but a server's own file in a link's
directory."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from pstrain_runtime.checkpoint import CheckpointError
from pstrain_runtime.ps.store import ParameterStore, PSError
from pstrain_runtime.sparse import client as sparse_client
from pstrain_runtime.sparse import files, saving, shard_writes
from pstrain_runtime.sparse import service as sparse_service
from pstrain_runtime.sparse.client import SparseClient
from pstrain_runtime.sparse.protocol import encode, header_of
from pstrain_runtime.sparse.saving import LiveRows, SaveCancelled, start_link, write_link

from .test_sparse_checkpoint_chain import Servers, _train_and_check, make_spec

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(autouse=True)
def one_thread() -> None:
    torch.set_num_threads(1)


class Calls:
    """Counts, over a test, the pages of rows streamed to the chief and the pages
    the servers wrote themselves (by server)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.streamed: dict[int, int] = {}
        self.written: dict[int, int] = {}
        export, write_page = SparseClient.export, SparseClient.write_page

        def counted_export(client: SparseClient, ps: int, *args: Any, **kwargs: Any) -> Any:
            for block in export(client, ps, *args, **kwargs):
                self.streamed[ps] = self.streamed.get(ps, 0) + 1
                yield block

        def counted_write(client: SparseClient, ps: int, *args: Any, **kwargs: Any
                          ) -> dict[str, Any]:
            reply = write_page(client, ps, *args, **kwargs)
            if "next" in reply:
                self.written[ps] = self.written.get(ps, 0) + 1
            return reply

        monkeypatch.setattr(SparseClient, "export", counted_export)
        monkeypatch.setattr(SparseClient, "write_page", counted_write)


def elsewhere(monkeypatch: pytest.MonkeyPatch, servers: set[int]) -> None:
    """Servers `servers` do not see the checkpoint directory (another filesystem)."""
    real = shard_writes.ShardWrites.call

    def call(self: Any, table: Any, header: dict[str, Any], ps_index: int,
             since: int | None) -> dict[str, Any]:
        if ps_index in servers and not header.get("abort"):
            return {"reachable": False, "why": "not mounted here"}
        return real(self, table, header, ps_index, since)

    monkeypatch.setattr(shard_writes.ShardWrites, "call", call)


def checks(manifests: list[dict[str, Any]]) -> list[Any]:
    return [link["tables"] for m in manifests for link in m["chain"]]


def leftovers(directory: Path) -> list[str]:
    """Temporary files and probes left anywhere under `directory`."""
    return sorted(p.name for p in directory.rglob(".*"))


@pytest.mark.parametrize("apart", [set(), {1}, {0, 1}], ids=["servers", "mixed", "chief"])
def test_a_link_is_the_same_whoever_writes_its_files(tmp_path: Path, apart: set[int],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sparse_client, "EXPORT_ROWS", 7)  # many pages per file
    calls = Calls(monkeypatch)
    elsewhere(monkeypatch, apart)
    specs = [make_spec("a", "adagrad"), make_spec("b", "sgd", evict=None)]
    servers = Servers(specs)
    # Each checkpoint restores to the live tables (base, deltas with evicted ids).
    manifests = _train_and_check(servers, tmp_path / "got", specs, 4, frozen=False)
    servers.close()
    assert leftovers(tmp_path) == []
    # Each server's pages went one way only: written where it sees the directory.
    assert set(calls.written) == {0, 1} - apart and all(calls.written.values())
    assert set(calls.streamed) == apart

    # The same steps with the chief writing every file: the same bytes.
    monkeypatch.undo()
    monkeypatch.setattr(sparse_client, "EXPORT_ROWS", 7)
    elsewhere(monkeypatch, {0, 1})
    again = Servers(specs)
    want = _train_and_check(again, tmp_path / "want", specs, 4, frozen=False)
    again.close()
    assert checks(manifests) == checks(want)


def _link_call(store: ParameterStore, fields: dict[str, Any], role: str | None = None
               ) -> dict[str, Any]:
    header = {"op": "export", "what": "write", "namespace": "ns", "table": "t", **fields}
    return header_of(sparse_service.handle(store, encode(header), role))


@pytest.fixture
def served(tmp_path: Path):
    """One server (index 0) holding table t with rows, and a link directory with a probe."""
    servers = Servers([make_spec("t", "adagrad", evict=None)], num_ps=1)
    servers.step("t", list(range(50)))
    link = tmp_path / "ckpt-000000000007.sparse"
    link.mkdir()
    (link / ".probe-" f"{'ab' * 16}").touch()
    yield servers.stores[0], link
    servers.close()


def _page(link: Path, **extra: Any) -> dict[str, Any]:
    return {"dir": str(link), "probe": ".probe-" + "ab" * 16, "file": "table0-ps0.rows",
            "start": 0, "limit": 10, **extra}


@pytest.mark.parametrize(("fields", "rule"), [
    ({"dir": "relative/ckpt-000000000007.sparse"}, "absolute path"),
    ({"dir": "/etc"}, "ckpt-<12 digits>.sparse"),
    ({"file": "table0-ps1.rows"}, "this server's"),
    ({"file": "../table0-ps0.rows"}, "this server's"),
    ({"file": "table0-ps0.rows/x"}, "this server's"),
    ({"file": "passwd"}, "this server's"),
    ({"probe": "../../etc/passwd"}, "32 hex digits"),
    ({"limit": 0}, "at least 1"),
    ({"file": "table0-ps0.removed"}, "needs field 'since'"),
    ({"start": 10}, "no write at row 10"),
    ({"dir": 5}, "'dir'"),
])
def test_a_write_call_names_only_the_servers_own_file_in_a_link_directory(
        served: tuple[ParameterStore, Path], fields: dict[str, Any], rule: str) -> None:
    store, link = served
    fields = {**_page(link), **fields}
    with pytest.raises(PSError) as caught:
        _link_call(store, fields)
    assert rule in caught.value.message
    assert sorted(p.name for p in link.iterdir()) == [".probe-" + "ab" * 16]


def test_only_the_chief_may_have_a_server_write(served: tuple[ParameterStore, Path]) -> None:
    store, link = served
    with pytest.raises(PSError) as caught:
        _link_call(store, _page(link), role="worker")
    assert caught.value.code == "PERMISSION_DENIED"
    assert _link_call(store, _page(link, limit=1000), role="chief")["next"] == 0


def test_a_server_that_does_not_see_the_directory_says_so(
        served: tuple[ParameterStore, Path], tmp_path: Path) -> None:
    store, link = served
    # No probe there (the chief's directory is on another filesystem).
    assert _link_call(store, _page(link, probe=".probe-" + "cd" * 16))["reachable"] is False
    # Not a directory of its own: a symbolic link to one.
    alias = tmp_path / "ckpt-000000000008.sparse"
    alias.symlink_to(link)
    assert _link_call(store, _page(alias))["reachable"] is False
    # A file already there is never overwritten by the server.
    (link / "table0-ps0.rows").write_bytes(b"keep")
    reply = _link_call(store, _page(link))
    assert reply["reachable"] is False and "exists" in reply["why"]
    assert (link / "table0-ps0.rows").read_bytes() == b"keep"


def test_a_file_written_by_pages_reads_back_with_its_check(
        served: tuple[ParameterStore, Path]) -> None:
    store, link = served
    start, pages = 0, 0
    while True:
        reply = _link_call(store, _page(link, start=start))
        pages += 1
        if reply["next"] == 0:
            break
        start = reply["next"]
        assert (link / "table0-ps0.rows").exists() is False  # under a temporary name
    check = reply.pop("written")
    rows = check.pop("rows")
    assert rows == 50 and pages == 5
    table = store.namespace("ns").sparse.tables["t"]
    got = list(files.read_rows(link / "table0-ps0.rows", table.spec, table.slot_names,
                               check))
    assert torch.equal(torch.cat([b.ids for b in got]), torch.arange(50))
    assert leftovers(link) == [".probe-" + "ab" * 16]


def test_a_new_link_drops_the_file_an_abandoned_one_left_open(
        served: tuple[ParameterStore, Path], tmp_path: Path) -> None:
    store, link = served
    assert _link_call(store, _page(link))["next"] == 10  # then the chief went away
    assert len(leftovers(link)) == 2  # the probe and the temporary file
    other = tmp_path / "ckpt-000000000009.sparse"
    other.mkdir()
    (other / (".probe-" + "ab" * 16)).touch()
    assert _link_call(store, _page(other, limit=1000))["next"] == 0
    assert leftovers(link) == [".probe-" + "ab" * 16]
    assert store.namespace("ns").sparse.writes.open == {}


def _one_link(servers: Servers, directory: Path, cancel: threading.Event) -> dict[str, Any]:
    plan = start_link(servers.session.client, servers.specs, servers.session.chain, 1)
    return write_link(servers.specs, 2, directory, plan,
                      LiveRows(servers.session.client, cancel))


def test_a_cancelled_link_leaves_no_file_open_or_behind(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sparse_client, "EXPORT_ROWS", 3)
    servers = Servers([make_spec("t", "adagrad", evict=None)])
    servers.step("t", list(range(40)))
    cancel = threading.Event()
    write_page = SparseClient.write_page

    def then_cancel(client: SparseClient, ps: int, *args: Any) -> Any:
        reply = write_page(client, ps, *args)
        cancel.set()  # a restore began after the first page
        return reply

    monkeypatch.setattr(SparseClient, "write_page", then_cancel)
    with pytest.raises(SaveCancelled):
        _one_link(servers, tmp_path, cancel)
    assert leftovers(tmp_path) == []
    assert all(s.namespace("ns").sparse.writes.open == {} for s in servers.stores)
    servers.close()


def test_a_server_that_cannot_finish_a_file_fails_the_checkpoint_not_itself(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sparse_client, "EXPORT_ROWS", 3)
    servers = Servers([make_spec("t", "adagrad", evict=None)])
    servers.step("t", list(range(40)))
    add, pages = files.FileWriter.add, []

    def full_disk(writer: files.FileWriter, tensors: Any) -> None:
        pages.append(1)
        if len(pages) == 3:
            raise OSError(28, os.strerror(28))
        add(writer, tensors)

    monkeypatch.setattr(files.FileWriter, "add", full_disk)
    with pytest.raises(CheckpointError, match="could not write .*No space left"):
        _one_link(servers, tmp_path, threading.Event())
    assert leftovers(tmp_path) == []
    # The servers serve on, and the next link is written whole.
    monkeypatch.setattr(files.FileWriter, "add", add)
    manifest = saving.write_link(
        servers.specs, 2, tmp_path,
        start_link(servers.session.client, servers.specs, servers.session.chain, 2),
        LiveRows(servers.session.client, threading.Event()))
    assert manifest["tables"]["t"]["rows"] == 40
    servers.close()
