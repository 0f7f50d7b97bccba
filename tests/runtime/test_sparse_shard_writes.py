"""Parameter servers writing their own rows of a sparse checkpoint (`sparse.shard_writes`):
where they see the chief's directory, the files are the ones the chief would have
written (same bytes, same manifest), restores are exact, and the chief streams no row;
where they do not (another directory, none, a shard too large) or may not write there
(read-only, another user's), the chief writes those shards as before; a server's failed
write fails the checkpoint; the call is the chief's only and names no path of its own."""

from __future__ import annotations

import errno
import json
import os
import re
import threading
from pathlib import Path
from typing import Any

import pytest

from pstrain_runtime.checkpoint import CheckpointError
from pstrain_runtime.ps.store import PSError
from pstrain_runtime.replica import _checkpoint_dir
from pstrain_runtime.sparse import saving, service, shard_writes
from pstrain_runtime.sparse.protocol import encode, header_of
from pstrain_runtime.sparse.saving import SaveCancelled

from .test_sparse_checkpoint_chain import Servers, _train_and_check, make_spec

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def chief_writes(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The rows files the chief itself writes (the servers' writes are not counted)."""
    seen: list[str] = []
    real = saving.write_rows

    def counted(path: Path, *args: Any, **kw: Any) -> Any:
        seen.append(path.name)
        return real(path, *args, **kw)

    monkeypatch.setattr(saving, "write_rows", counted)
    return seen


def _files(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes()
            for p in sorted(directory.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad"])
@pytest.mark.parametrize("frozen", [True, False], ids=["sync", "async"])
def test_servers_that_share_the_directory_write_the_chiefs_files_and_restores_are_exact(
        tmp_path: Path, chief_writes: list[str], optimizer: str, frozen: bool) -> None:
    specs = [make_spec("a", optimizer), make_spec("b", optimizer, evict=None)]
    by_chief, by_servers = tmp_path / "chief", tmp_path / "servers"
    one, two = Servers(specs), Servers(specs)
    for store in two.stores:
        store.checkpoint_dir = by_servers
    # The same steps on both; every checkpoint restored and compared as it is written.
    want = _train_and_check(one, by_chief, specs, 4, frozen)
    chief_wrote = len(chief_writes)
    got = _train_and_check(two, by_servers, specs, 4, frozen)

    assert got == want  # the same manifests: files, rows, sizes, CRC-32C
    assert _files(by_servers) == _files(by_chief)  # byte for byte, no probe left
    # Sync deltas are captured by the chief at their step (a server's file would be of
    # a later one); its full links and every async link: written by the servers.
    assert chief_wrote > 0
    if frozen:
        deltas = sum(not link["full"] for m in want for link in m["chain"][-1:])
        assert len(chief_writes) - chief_wrote == deltas * 2 * len(specs)
    else:
        assert len(chief_writes) == chief_wrote
    one.close()
    two.close()


def test_a_server_that_does_not_see_the_chiefs_directory_leaves_its_rows_to_the_chief(
        tmp_path: Path, chief_writes: list[str]) -> None:
    """Server 0 shares the directory; server 1 has one of the same name on "its own
    disk" (another folder), which holds no probe: the chief writes server 1's rows."""
    specs = [make_spec("a", "adagrad"), make_spec("b", "sgd", evict=None)]
    servers = Servers(specs)
    servers.stores[0].checkpoint_dir = tmp_path / "ckpt"
    servers.stores[1].checkpoint_dir = tmp_path / "elsewhere"
    manifests = _train_and_check(servers, tmp_path / "ckpt", specs, 3, frozen=False)
    assert chief_writes and all("-ps1." in name for name in chief_writes)
    assert len(chief_writes) == 3 * len(specs)  # every link, every table, once
    assert not (tmp_path / "elsewhere").exists()
    assert all((tmp_path / "ckpt" / link["dir"] / name).is_file()
               for link in manifests[-1]["chain"]
               for entry in link["tables"].values() for name in entry["files"])
    servers.close()


def test_servers_without_a_directory_or_with_too_large_a_shard_leave_it_to_the_chief(
        tmp_path: Path, chief_writes: list[str], monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    specs = [make_spec("a", "adagrad", evict=None)]
    servers = Servers(specs)
    servers.stores[1].checkpoint_dir = tmp_path  # server 0 has none
    monkeypatch.setattr(shard_writes, "MAX_SHARD_BYTES", 1)  # server 1's is too large
    _train_and_check(servers, tmp_path, specs, 2, frozen=False)
    assert sorted(chief_writes) == ["table0-ps0.rows", "table0-ps0.rows",
                                    "table0-ps1.rows", "table0-ps1.rows"]
    # The user is told once per server, with the reason, not at every checkpoint.
    told = [line for line in capsys.readouterr().out.splitlines()
            if "does not write its own rows" in line]
    assert len(told) == 2
    assert "parameter server 0" in told[0] and "has no checkpoint directory" in told[0]
    assert "parameter server 1" in told[1] and "larger than one call writes" in told[1]
    servers.close()


def test_a_servers_failed_write_fails_the_checkpoint_with_its_reason(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    specs = [make_spec("a", "adagrad", evict=None)]
    servers = Servers(specs)
    for store in servers.stores:
        store.checkpoint_dir = tmp_path
    servers.step("a", list(range(10)))

    def full(*args: Any, **kw: Any) -> Any:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(shard_writes, "write_pages", full)
    with pytest.raises(CheckpointError, match="parameter server 0 could not write .*"
                       "No space left on device"):
        servers.save(tmp_path, 1, frozen=False)
    assert not (tmp_path / "ckpt-000000000001.sparse" / shard_writes.PROBE).exists()
    servers.close()


@pytest.mark.parametrize("errno_", [errno.EACCES, errno.EROFS])
def test_a_server_that_may_not_write_there_leaves_its_rows_to_the_chief(
        tmp_path: Path, chief_writes: list[str], monkeypatch: pytest.MonkeyPatch,
        errno_: int) -> None:
    """The volume read-only in the servers' pods, or owned by another user: the
    checkpoint is written, by the chief, and restores exact."""
    specs = [make_spec("a", "adagrad", evict=None)]
    servers = Servers(specs)
    for store in servers.stores:
        store.checkpoint_dir = tmp_path

    def refused(*args: Any, **kw: Any) -> Any:
        raise OSError(errno_, os.strerror(errno_))

    monkeypatch.setattr(shard_writes, "write_pages", refused)
    _train_and_check(servers, tmp_path, specs, 2, frozen=False)
    assert sorted(chief_writes) == ["table0-ps0.rows", "table0-ps0.rows",
                                    "table0-ps1.rows", "table0-ps1.rows"]
    servers.close()


def test_an_abandoned_checkpoint_asks_no_server_to_write(tmp_path: Path) -> None:
    specs = [make_spec("a", "adagrad", evict=None)]
    servers = Servers(specs)
    servers.stores[0].checkpoint_dir = tmp_path
    cancel = threading.Event()
    cancel.set()
    with shard_writes.ServerWrites(servers.session.client, tmp_path / "ckpt-000000000001.sparse",
                                   cancel) as writes, pytest.raises(SaveCancelled):
        writes.write(0, 0, specs[0], "rows", None)
    assert not list((tmp_path / "ckpt-000000000001.sparse").iterdir())
    servers.close()


def _call(store: Any, role: str | None = "chief", **fields: Any) -> dict[str, Any]:
    header = {"op": "save", "namespace": "ns", "table": "a", "dir": "ckpt-000000000001.sparse",
              "token": "0" * 32, "index": 0, "what": "rows", **fields}
    return header_of(service.handle(store, encode(header), role))


@pytest.mark.parametrize(("fields", "message"), [
    ({"dir": "../../etc"}, "field 'dir' is '../../etc'"),
    ({"dir": "ckpt-000000000001.sparse/../x"}, "it must be a link's directory"),
    ({"token": "x" * 32}, "field 'token' must be 32 lowercase hex digits"),
    ({"index": -1}, "field 'index' is -1"),
    ({"index": True}, "field 'index' is True"),
    ({"what": "everything"}, "field 'what' is 'everything'"),
    ({"what": "removed"}, "removed ids need field 'since'"),
    ({"since": "1"}, "field 'since' is '1'"),
], ids=["traversal", "subpath", "token", "index", "bool-index", "what", "no-since", "since"])
def test_a_malformed_save_is_refused_and_writes_nothing(tmp_path: Path, fields: dict[str, Any],
                                                        message: str) -> None:
    servers = Servers([make_spec("a", "sgd")])
    store = servers.stores[0]
    store.checkpoint_dir = tmp_path
    with pytest.raises(PSError, match="sparse save: .*" + re.escape(message)) as exc:
        _call(store, **fields)
    assert exc.value.code == "INVALID_ARGUMENT"
    assert not list(tmp_path.iterdir())
    servers.close()


def test_only_the_chief_may_ask_a_server_to_write_and_only_with_the_links_probe(
        tmp_path: Path) -> None:
    servers = Servers([make_spec("a", "sgd")])
    store = servers.stores[0]
    with pytest.raises(PSError, match="sparse save needs the chief's credentials") as exc:
        _call(store, role="worker")
    assert exc.value.code == "PERMISSION_DENIED"
    assert _call(store) == {"shared": False, "why": "this server has no checkpoint directory"}
    store.checkpoint_dir = tmp_path
    link = tmp_path / "ckpt-000000000001.sparse"
    link.mkdir()
    (link / shard_writes.PROBE).write_text("1" * 32)  # another link's token
    assert _call(store)["shared"] is False
    assert [p.name for p in link.iterdir()] == [shard_writes.PROBE]
    (link / shard_writes.PROBE).write_text("0" * 32)
    reply = _call(store)
    assert reply["shared"] is True and (link / "table0-ps0.rows").stat().st_size == reply["bytes"]
    servers.close()


def test_a_server_reads_the_checkpoint_directory_from_its_training_settings() -> None:
    settings = {"steps": 10, "checkpoint": {"directory": "/ckpt/job", "intervalSteps": 5}}
    assert _checkpoint_dir({"PSTRAIN_TRAINING": json.dumps(settings)}) == Path("/ckpt/job")
    assert _checkpoint_dir({"PSTRAIN_TRAINING": json.dumps({"steps": 10})}) is None
    assert _checkpoint_dir({}) is None
    assert _checkpoint_dir({"PSTRAIN_TRAINING": "{not json"}) is None
