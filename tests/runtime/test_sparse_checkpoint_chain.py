"""Sparse checkpoints as chains (`sparse.chain`, `sparse.saving`): a full write, then
deltas of the rows changed since (and the ids evicted since), restored exactly (rows,
optimizer slots, update clocks), a full write again at the chain's bound, retention that
keeps every directory a kept checkpoint's chain names, damaged links found by their
checks, checkpoints from before chains still restored, and a job killed and restored
from a chain that ends as the uninterrupted one does."""

from __future__ import annotations

import shutil
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from pstrain_runtime.checkpoint import (Checkpoint, CheckpointStore, NoUsableCheckpoint,
                                        check_sparse_files, load_checkpoint, sparse_dirs)
from pstrain_runtime.optim import OptimizerConfig
from pstrain_runtime.ps.store import ParameterStore
from pstrain_runtime.sparse import chain as chain_rules
from pstrain_runtime.sparse.client import SparseClient
from pstrain_runtime.sparse.files import read_ids, read_rows, write_rows
from pstrain_runtime.sparse.ids import split_by_owner
from pstrain_runtime.sparse.session import SparseSession
from pstrain_runtime.sparse.spec import ROW_SLOTS, TableSpec
from pstrain_runtime.worker.client import LocalTransport

from . import sparse_tasks
from .builders import KillableTransport, training
from .sparse_tasks import Events, run_job

pytestmark = pytest.mark.timeout(120)
State = dict[str, dict[int, tuple[torch.Tensor, ...]]]
BULK = 1000  # rows a test's base holds beside the few its steps change


@pytest.fixture(autouse=True)
def one_thread() -> None:
    torch.set_num_threads(1)


def make_spec(name: str, optimizer: str, evict: int | None = 2) -> TableSpec:
    return TableSpec(name, None, 4, 0.1, evict_after_steps=evict,
                     optimizer=OptimizerConfig(name=optimizer, learning_rate=0.1))


class Servers:
    """Parameter servers holding sparse tables, driven by hand: `step` updates rows the
    way sync mode does (clock = global step + 1, then the step moves on), `save` writes
    a checkpoint's rows through the chief's session, `state` is every live row."""

    def __init__(self, specs: list[TableSpec], num_ps: int = 2) -> None:
        self.specs = {spec.name: spec for spec in specs}
        self.stores = [ParameterStore(i) for i in range(num_ps)]
        client = SparseClient([LocalTransport(s) for s in self.stores], "ns")
        self.session = SparseSession([], self.specs, client)
        self.session.install(None, None)

    def step(self, name: str, ids: list[int]) -> None:
        ids_t = torch.tensor(sorted(set(ids)), dtype=torch.int64)
        for ps, pos in enumerate(split_by_owner(ids_t, len(self.stores))):
            ns = self.stores[ps].namespace("ns")
            grads = torch.linspace(-1, 1, len(pos) * 4).reshape(-1, 4)
            ns.sparse.tables[name].apply(ids_t[pos], grads, t=ns.global_step + 1,
                                         now=ns.global_step + 1)
        for store in self.stores:
            store.namespace("ns").global_step += 1

    def save(self, directory: Path, step: int, frozen: bool = True) -> dict[str, Any]:
        write = self.session.begin_save(directory, step, frozen)
        manifest = self.session.finish_save(write)
        self.session.commit(write, manifest)
        return manifest

    def state(self) -> State:
        out: State = {}
        for name in self.specs:
            rows = out.setdefault(name, {})
            for store in self.stores:
                table = store.namespace("ns").sparse.tables[name]
                block, _ = table.export(0, 1 << 30)
                for k, i in enumerate(block.ids.tolist()):
                    rows[i] = (block.rows[k], block.last[k],
                               *(block.slots[n][k] for n in table.slot_names))
        return out

    def close(self) -> None:
        self.session.close()


def restored(specs: list[TableSpec], manifest: dict[str, Any] | None, directory: Path,
             num_ps: int = 2) -> State:
    fresh = Servers(specs, num_ps)
    fresh.session.install(manifest, directory)
    state = fresh.state()
    fresh.close()
    return state


def assert_same(got: State, want: State) -> None:
    assert got.keys() == want.keys()
    for name in want:
        assert got[name].keys() == want[name].keys(), name
        for i, values in want[name].items():
            assert all(torch.equal(a, b) for a, b in zip(got[name][i], values, strict=True))


def link_ids(directory: Path, link: dict[str, Any], spec: TableSpec, kind: str) -> set[int]:
    """The ids of a link's rows files (`files`) or removed-ids files (`removed`)."""
    entry = link["tables"][spec.name]
    out: set[int] = set()
    for filename in entry.get(kind) or []:
        path = directory / link["dir"] / filename
        if kind == "files":
            blocks = [b.ids for b in read_rows(path, spec, ROW_SLOTS[spec.optimizer.name])]
        else:
            blocks = list(read_ids(path, spec))
        out |= {int(i) for b in blocks for i in b.tolist()}
    return out


@pytest.mark.parametrize("frozen", [True, False], ids=["sync-capture", "async-thread"])
def test_a_delta_holds_only_the_rows_changed_since_the_last_link(tmp_path: Path,
                                                                 frozen: bool) -> None:
    spec = make_spec("t", "adagrad", evict=None)
    servers = Servers([spec])
    servers.step("t", list(range(20)))
    base = servers.save(tmp_path, 1, frozen)
    servers.step("t", [3, 5, 7, 40, 41])  # three rows change, two are new
    servers.step("t", [5, 42])
    delta = servers.save(tmp_path, 2, frozen)

    assert [link["full"] for link in delta["chain"]] == [True, False]
    assert delta["chain"][0] == base["chain"][0]
    assert link_ids(tmp_path, base["chain"][0], spec, "files") == set(range(20))
    assert link_ids(tmp_path, delta["chain"][1], spec, "files") == {3, 5, 7, 40, 41, 42}
    assert link_ids(tmp_path, delta["chain"][1], spec, "removed") == set()
    assert delta["tables"] == {"t": {"rows": 23}}
    # The chain's bound counts the rows the table has grown to since its base (20).
    assert servers.session.chain.rows == {"t": 23}
    assert servers.session.chain.full_bytes() == pytest.approx(
        chain_rules.link_bytes(base["chain"][0]) * 23 / 20, rel=0.01)
    # Nothing changed: the next delta is empty.
    assert link_ids(tmp_path, servers.save(tmp_path, 3, frozen)["chain"][2], spec,
                    "files") == set()
    servers.close()


def _train_and_check(servers: Servers, directory: Path, specs: list[TableSpec],
                     saves: int, frozen: bool) -> list[dict[str, Any]]:
    """Train a few random steps before each of `saves` checkpoints; after each, a
    restore on fresh servers equals the live tables. Returns the manifests. (The last
    table gets BULK rows first: a base large beside the deltas.)"""
    gen = torch.Generator().manual_seed(0)
    servers.step(specs[-1].name, list(range(BULK)))
    manifests = []
    for step in range(1, saves + 1):
        for _ in range(3):
            for spec in specs:
                servers.step(spec.name, torch.randint(0, 30, (8,), generator=gen).tolist())
        manifests.append(servers.save(directory, step, frozen))
        assert_same(restored(specs, manifests[-1], directory), servers.state())
    return manifests


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad"])
@pytest.mark.parametrize("frozen", [True, False], ids=["sync-capture", "async-thread"])
def test_base_and_deltas_restore_the_live_tables_with_eviction(tmp_path: Path, optimizer: str,
                                                               frozen: bool) -> None:
    specs = [make_spec("a", optimizer), make_spec("b", optimizer, evict=None)]
    servers = Servers(specs)
    manifests = _train_and_check(servers, tmp_path, specs, 6, frozen)
    assert [len(m["chain"]) for m in manifests] == [1, 2, 3, 4, 5, 6]
    chain = manifests[-1]["chain"]
    assert [link["full"] for link in chain] == [True] + [False] * 5
    # Rows were evicted (table a) and their ids carried by the deltas; b keeps its rows.
    removed = [link_ids(tmp_path, link, specs[0], "removed") for link in chain[1:]]
    assert any(removed)
    assert not any(link_ids(tmp_path, link, specs[1], "removed") for link in chain[1:])
    # Onto three servers: the rows go to their new owners.
    assert_same(restored(specs, manifests[-1], tmp_path, num_ps=3), servers.state())
    servers.close()


def test_a_full_write_comes_back_at_the_chains_bound_and_restores(tmp_path: Path) -> None:
    specs = [make_spec("a", "adagrad"), make_spec("bulk", "sgd", evict=None)]
    servers = Servers(specs)
    manifests = _train_and_check(servers, tmp_path, specs, chain_rules.MAX_DELTAS + 3,
                                 frozen=True)
    lengths = [len(m["chain"]) for m in manifests]
    assert lengths == [*range(1, chain_rules.MAX_DELTAS + 2), 1, 2]
    full_again = chain_rules.MAX_DELTAS + 2  # the step of the second full write
    assert manifests[-2]["chain"][0]["dir"] == f"ckpt-{full_again:012d}.sparse"
    servers.close()


@pytest.mark.parametrize(("base", "deltas", "due"), [
    pytest.param(100, [], False, id="base-only"),
    pytest.param(100, [30, 30, 30], False, id="deltas-below-base"),
    pytest.param(100, [60, 41], False, id="deltas-above-base-within-the-bound"),
    pytest.param(100, [50] * (2 * chain_rules.DELTAS_PER_BASE), False, id="deltas-at-the-bound"),
    pytest.param(100, [50] * (2 * chain_rules.DELTAS_PER_BASE) + [1], True,
                 id="deltas-above-the-bound"),
    pytest.param(1000, [1] * chain_rules.MAX_DELTAS, True, id="max-deltas"),
    pytest.param(1000, [1] * (chain_rules.MAX_DELTAS - 1), False, id="one-below-max"),
])
def test_when_a_full_write_is_due(base: int, deltas: list[int], due: bool) -> None:
    assert chain_rules.Chain([_link(base), *map(_link, deltas)]).full_due() == due
    assert chain_rules.Chain().full_due()


def _link(size: int, rows: int = 0) -> dict[str, Any]:
    return {"tables": {"t": {"rows": rows, "checks": {"f": {"bytes": size, "crc32c": 0}}}}}


def test_the_bound_grows_with_the_tables_rows_since_the_base() -> None:
    """A base of 10 rows in 100 bytes: with 30 rows now a full write would take about
    300 bytes, and deltas may add up to DELTAS_PER_BASE times that; with fewer rows
    than the base, the base's bytes count."""
    per = chain_rules.DELTAS_PER_BASE
    for rows_now, full, deltas, due in ((30, 300, 300 * per, False),
                                        (30, 300, 300 * per + 1, True),
                                        (5, 100, 100 * per + 1, True)):
        chain = chain_rules.Chain([_link(100, rows=10), _link(deltas)], rows={"t": rows_now})
        assert chain.full_bytes() == full
        assert chain.full_due() == due


def test_a_restore_or_a_new_generation_starts_a_new_chain(tmp_path: Path) -> None:
    specs = [make_spec("a", "sgd", evict=None)]
    servers = Servers(specs)
    servers.step("a", list(range(BULK)))
    servers.save(tmp_path, 1)
    servers.step("a", [1])
    manifest = servers.save(tmp_path, 2)
    assert len(manifest["chain"]) == 2
    # A server re-initialised behind the chief's back: a full write, not a delta.
    servers.stores[1].namespace("ns").generation += 1
    assert len(servers.save(tmp_path, 3)["chain"]) == 1
    # The chief restores (reinstalls the tables): its next checkpoint is full too.
    servers.session.install(manifest, tmp_path)
    servers.step("a", [2])
    assert len(servers.save(tmp_path, 4)["chain"]) == 1
    servers.close()


@pytest.mark.parametrize(("manifest", "problem"), [
    pytest.param({"chain": []}, "must be a non-empty list", id="empty-chain"),
    pytest.param({"chain": [{"dir": "../x", "full": True, "tables": {}}]},
                 "must be a directory name beside the checkpoint", id="outside"),
    pytest.param({"chain": [{"dir": "a", "full": False, "tables": {}}]},
                 "only the first link is full", id="delta-first"),
    pytest.param({"chain": [{"dir": "a", "full": True, "tables": {}},
                            {"dir": "b", "full": True, "tables": {}}]},
                 "only the first link is full", id="two-bases"),
    pytest.param({"dir": "ckpt-1.sparse"}, "it needs its tables", id="old-without-tables"),
])
def test_a_malformed_chain_is_a_damaged_checkpoint(manifest: dict[str, Any],
                                                   problem: str) -> None:
    from pstrain_runtime.checkpoint import CheckpointCorrupt, sparse_links

    with pytest.raises(CheckpointCorrupt, match=problem):
        sparse_links(manifest)


def _commit(store: CheckpointStore, step: int, manifest: dict[str, Any]) -> None:
    store.save(Checkpoint(global_step=step, fingerprint="f", optimizer="sgd",
                          params={"w": torch.zeros(2)}, sparse=manifest))


def test_retention_keeps_every_directory_a_kept_chain_names(tmp_path: Path) -> None:
    specs = [make_spec("a", "sgd", evict=None)]
    servers = Servers(specs)
    servers.step("a", list(range(BULK)))
    store = CheckpointStore(tmp_path, keep=2)
    for step in range(1, 5):  # a base at 1, deltas at 2, 3, 4
        servers.step("a", [step, step + 10])
        _commit(store, step, servers.save(tmp_path, step))
    assert store.steps() == [3, 4]
    assert sorted(p.name for p in tmp_path.glob("*.sparse")) == [
        chain_rules.link_dir(s) for s in (1, 2, 3, 4)]

    # A new chain (a full write at 5): once no kept checkpoint names the old one, it goes
    # (a fresh store, as a restarted chief has, reads the chains from the files).
    servers.session.restart_chain()
    store = CheckpointStore(tmp_path, keep=2)
    for step in (5, 6):
        servers.step("a", [step])
        _commit(store, step, servers.save(tmp_path, step))
    assert store.steps() == [5, 6]
    assert sorted(p.name for p in tmp_path.glob("*.sparse")) == [
        chain_rules.link_dir(5), chain_rules.link_dir(6)]
    ckpt, _, problems = store.latest()
    assert problems == [] and sparse_dirs(ckpt.sparse) == {chain_rules.link_dir(5),
                                                           chain_rules.link_dir(6)}
    assert_same(restored(specs, ckpt.sparse, tmp_path), servers.state())
    servers.close()


def test_retention_removes_old_row_directories_on_a_thread_of_its_own(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A save in the background returns while the row directories it dropped are still
    being removed (the chief trains on); a save meanwhile leaves its own to the next;
    `settle` waits for the removal and removes what is left."""
    from pstrain_runtime import checkpoint as checkpoint_module

    release, removing = threading.Event(), threading.Event()
    removed: list[str] = []

    def slow(paths: list[Path]) -> None:
        removing.set()
        assert release.wait(30)
        removed.extend(p.name for p in paths)
        for path in paths:
            shutil.rmtree(path)

    monkeypatch.setattr(checkpoint_module, "_remove_dirs", slow)
    store = CheckpointStore(tmp_path, keep=1)
    for step in range(1, 4):  # each a chain of its own (a full link): one dir each
        (tmp_path / chain_rules.link_dir(step)).mkdir()
        manifest = {"format": 1, "chain": [{"dir": chain_rules.link_dir(step), "step": step,
                                            "full": True, "tables": {}}], "tables": {}}
        store.save(Checkpoint(global_step=step, fingerprint="f", optimizer="sgd",
                              params={"w": torch.zeros(2)}, sparse=manifest),
                   background=True)
        if step == 2:  # the directory of step 1 is being removed, not yet gone
            assert removing.wait(30) and (tmp_path / chain_rules.link_dir(1)).exists()
    # Step 3's save found step 1's removal running: step 2's directory waits for settle.
    assert (tmp_path / chain_rules.link_dir(2)).exists()
    release.set()
    store.settle(timeout=30)
    assert removed == [chain_rules.link_dir(1), chain_rules.link_dir(2)]
    assert sorted(p.name for p in tmp_path.glob("*.sparse")) == [chain_rules.link_dir(3)]


@pytest.mark.parametrize("kind", ["files", "removed"])
def test_a_damaged_delta_file_is_caught_by_its_check(tmp_path: Path, kind: str) -> None:
    specs = [make_spec("a", "sgd"), make_spec("bulk", "sgd", evict=None)]
    servers = Servers(specs)
    servers.step("bulk", list(range(BULK)))
    store = CheckpointStore(tmp_path, keep=5)
    for step in range(1, 5):  # each step 3 ids come, 3 go (evicted 2 steps later)
        servers.step("a", list(range(3 * step, 3 * step + 6)))
        _commit(store, step, servers.save(tmp_path, step))
    newest = load_checkpoint(store.path_for(4)).sparse
    link = newest["chain"][-1]
    assert len(newest["chain"]) == 4 and link_ids(tmp_path, link, specs[0], kind)
    damaged = max((tmp_path / link["dir"] / f for f in link["tables"]["a"][kind]),
                  key=lambda p: p.stat().st_size)
    intact = damaged.read_bytes()

    damaged.write_bytes(intact[:-3])  # short: found before the restore picks step 4
    ckpt, _, problems = store.latest()
    assert ckpt.global_step == 3 and problems == [
        f"sparse rows {damaged} have {len(intact) - 3} bytes; {len(intact)} were written"]

    flipped = bytearray(intact)
    flipped[-12] ^= 0xFF  # same size, other bytes: found while the rows stream back
    damaged.write_bytes(bytes(flipped))
    check_sparse_files(tmp_path, newest)
    with pytest.raises(NoUsableCheckpoint) as caught:
        restored(specs, newest, tmp_path)
    assert str(caught.value).startswith(f"sparse rows {damaged} are not the bytes written")
    assert str(caught.value).endswith(f"remove {link['dir']} and its checkpoint file from "
                                      f"{tmp_path} to restore the previous checkpoint")
    servers.close()


def test_a_damaged_base_names_every_checkpoint_built_on_it(tmp_path: Path) -> None:
    specs = [make_spec("a", "sgd", evict=None)]
    servers = Servers(specs)
    servers.step("a", list(range(BULK)))
    for step in range(1, 4):
        servers.step("a", [step, 7])
        manifest = servers.save(tmp_path, step)
    base = manifest["chain"][0]
    damaged = tmp_path / base["dir"] / base["tables"]["a"]["files"][0]
    data = bytearray(damaged.read_bytes())
    data[-12] ^= 0xFF
    damaged.write_bytes(bytes(data))
    with pytest.raises(NoUsableCheckpoint, match=f"remove {base['dir']} and the checkpoint "
                       r"files whose rows build on it \(steps 1 to 3\)"):
        restored(specs, manifest, tmp_path)
    servers.close()


def test_a_checkpoint_from_before_chains_still_restores(tmp_path: Path) -> None:
    """The manifest of before chains, {dir, tables}, as the chief wrote it: every row of
    every server, one file per (table, server)."""
    specs = [make_spec("a", "adagrad"), make_spec("b", "sgd", evict=None)]
    servers = Servers(specs)
    for step in range(4):
        servers.step("a", [step, step + 1, 9])
        servers.step("b", [2 * step])
    sub = "ckpt-000000000004.sparse"
    tables: dict[str, Any] = {}
    client = servers.session.client
    for k, (name, spec) in enumerate(sorted(servers.specs.items())):
        slots = ROW_SLOTS[spec.optimizer.name]
        entry: dict[str, Any] = {"files": [], "rows": 0, "checks": {}}
        for ps in range(client.num_ps):
            filename = f"table{k}-ps{ps}.rows"
            written = write_rows(tmp_path / sub / filename, spec, slots,
                                 client.export(ps, spec, slots))
            entry["files"].append(filename)
            entry["rows"] += written.rows
            entry["checks"][filename] = written.check()
        tables[name] = entry
    old = {"dir": sub, "tables": tables}
    check_sparse_files(tmp_path, old)
    assert sparse_dirs(old) == {sub}
    assert_same(restored(specs, old, tmp_path), servers.state())
    servers.close()


def test_the_chief_trains_on_while_a_checkpoints_rows_are_written(tmp_path: Path,
                                                                  monkeypatch) -> None:
    """async: the rows are written on a thread of their own, the checkpoint file only
    once they are on disk, and a checkpoint due meanwhile waits for them (postponed)."""
    from pstrain_runtime.sparse import saving

    release = threading.Event()
    started = threading.Event()
    real = saving.write_link

    def slow_write(*args: Any, **kwargs: Any) -> dict[str, Any]:
        started.set()
        assert release.wait(timeout=30)
        return real(*args, **kwargs)

    monkeypatch.setattr(saving, "write_link", slow_write)
    monkeypatch.setattr("pstrain_runtime.sparse.session.write_link", slow_write)
    job = training(steps=30, batchSize=8, mode="async",
                   checkpoint={"directory": str(tmp_path), "intervalSteps": 5})
    events = Events()
    seen: dict[str, Any] = {}

    def watch(kind: str, fields: dict[str, Any]) -> None:
        if kind == "progress" and started.is_set() and "held" not in seen:
            seen["held"] = fields["step"]
        if kind == "progress" and "held" in seen and fields["step"] >= seen["held"] + 12:
            seen.setdefault("files", sorted(p.name for p in tmp_path.glob("*.pt")))
            release.set()

    events.hooks.append(watch)
    run_job(job, [LocalTransport(ParameterStore(i)) for i in range(2)], emit=events,
            progress_interval=0.0)
    # Twelve steps went by while the first checkpoint's rows were held: no file yet, and
    # no second checkpoint started (the one due at the next multiple was postponed).
    assert seen["files"] == []
    steps = [e["step"] for e in events.of("checkpoint")]
    assert steps[0] == 5 and steps[1] >= seen["held"] + 12 - 5 and steps[-1] == 30
    assert all(s % 5 == 0 for s in steps)
    final = load_checkpoint(CheckpointStore(tmp_path).path_for(30))
    check_sparse_files(tmp_path, final.sparse)


def test_a_checkpoint_that_holds_a_later_step_than_the_chief_saw_is_not_taken_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """async: other workers' pushes can take the servers past the next multiple before
    the chief reads them, so a checkpoint holds a later step than the one due. The next
    one is due after it: two checkpoints of one step shared one directory of rows, the
    second overwrote the first's files, and every later checkpoint of the chain was
    damaged (found with `pstrain run`, the CTR example, a checkpoint every 100 steps)."""
    from pstrain_runtime.worker.chief.checkpoint_schedule import CheckpointSchedule

    real = CheckpointSchedule._pull
    moved: list[int] = []

    def ahead(self: CheckpointSchedule, at_step: int = 0) -> Checkpoint:
        ckpt = real(self, at_step)
        if at_step == 5 and not moved:  # the servers moved on to the next multiple
            ckpt.global_step = at_step + self.every
            moved.append(ckpt.global_step)
        return ckpt

    monkeypatch.setattr(CheckpointSchedule, "_pull", ahead)
    job = training(steps=30, batchSize=8, mode="async",
                   checkpoint={"directory": str(tmp_path), "intervalSteps": 5, "keep": 10})
    events = Events()
    run_job(job, [LocalTransport(ParameterStore(i)) for i in range(2)], emit=events)
    steps = [e["step"] for e in events.of("checkpoint")]
    assert moved == [10] and steps[0] == 10
    assert steps == sorted(set(steps))  # each step once
    for step in steps:
        ckpt = load_checkpoint(CheckpointStore(tmp_path).path_for(step))
        dirs = [link["dir"] for link in ckpt.sparse["chain"]]
        assert len(dirs) == len(set(dirs)), dirs
        check_sparse_files(tmp_path, ckpt.sparse)


def _rows_of(transports: list[Any]) -> State:
    out: State = {}
    for name in ("items", "tags"):
        rows = out.setdefault(name, {})
        for t in transports:
            table = t.store.namespace("ns").sparse.tables[name]
            block, _ = table.export(0, 1 << 30)
            for k, i in enumerate(block.ids.tolist()):
                rows[i] = (block.rows[k], block.last[k],
                           *(block.slots[n][k] for n in table.slot_names))
    return out


def test_a_killed_server_is_restored_from_a_chain_to_the_rows_of_its_step(
        tmp_path: Path) -> None:
    """sync: at each step the servers hold that step's rows while the chief checks its
    duties, so the state there is recorded; a server killed after a checkpoint made of
    a base and deltas (with evicted ids) is restored, with the other one, to exactly
    the rows, optimizer slots and update clocks recorded at that checkpoint's step."""
    job = training(steps=40, batchSize=8, mode="sync",
                   optimizer={"name": "adagrad", "learningRate": 0.1},
                   checkpoint={"directory": str(tmp_path), "intervalSteps": 3})
    transports = [KillableTransport(0), KillableTransport(1)]
    tags = TableSpec("tags", None, sparse_tasks.TAG_DIM, 0.0)
    events = Events()
    at_step: dict[int, State] = {}
    seen: dict[str, Any] = {}

    def watch(kind: str, fields: dict[str, Any]) -> None:
        if kind == "progress" and "killed" not in seen:
            at_step[fields["step"]] = _rows_of(transports)
        # At the first checkpoint made of a base and deltas (not the final one): the
        # chief's next call finds ps 1 empty and restores this checkpoint.
        chain = (load_checkpoint(Path(fields["path"])).sparse["chain"]
                 if kind == "checkpoint" and "killed" not in seen else [])
        if len(chain) > 1 and fields["step"] < job.steps:
            seen["killed"] = fields["step"]
            seen["evicted"] = [link_ids(tmp_path, link, tags, "removed") for link in chain[1:]]
            transports[1].kill()
            transports[1].restart()
        if kind == "restored":
            seen["restored"] = _rows_of(transports)

    events.hooks.append(watch)
    run_job(job, transports, emit=events, table_options={"evict_after_steps": 2},
            progress_interval=0.0)
    (restore,) = events.of("restored")
    assert restore["step"] == seen["killed"]
    assert_same(seen["restored"], at_step[seen["killed"]])
    assert any(seen["evicted"])  # the deltas carried evicted ids
    assert events.of("done")[0]["step"] == 40
