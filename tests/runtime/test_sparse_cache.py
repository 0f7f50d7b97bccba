"""The worker's row cache: never a row older than S steps, always the row of the id
asked for, hot rows pulled far less often, bounded in size."""

from __future__ import annotations

import pytest
import torch

from pstrain_runtime.sparse.cache import RowCache

pytestmark = pytest.mark.timeout(60)


class Server:
    """Rows whose value says which id they are and the step they were read at."""

    def __init__(self) -> None:
        self.step = 0
        self.pulled_rows = 0

    def pull(self, ids: torch.Tensor) -> torch.Tensor:
        self.pulled_rows += ids.numel()
        return torch.stack([ids.to(torch.float32),
                            torch.full((ids.numel(),), float(self.step))], 1)


def zipf_batches(steps: int, ids_per_step: int, space: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    weights = 1.0 / torch.arange(1, space + 1, dtype=torch.float64) ** 1.1
    for _ in range(steps):
        yield torch.unique(torch.multinomial(weights, ids_per_step, replacement=True,
                                             generator=g))


@pytest.mark.parametrize(("staleness", "capacity"), [(1, 50), (3, 200), (8, 5000), (2, 7)])
def test_no_row_is_older_than_s_steps_and_every_row_is_its_ids(staleness: int,
                                                                capacity: int) -> None:
    server, cache = Server(), RowCache(dim=2, rows=capacity, staleness=staleness)
    for step, ids in enumerate(zipf_batches(300, 64, 2000)):
        server.step = step
        rows = cache.lookup(ids, step, server.pull)
        assert torch.equal(rows[:, 0], ids.to(torch.float32))  # the right row
        age = step - rows[:, 1]
        assert int(age.max()) <= staleness, f"a row {int(age.max())} steps old at step {step}"
        assert int((cache.owner >= 0).sum()) <= capacity


def test_hot_rows_are_pulled_far_less_often() -> None:
    server, cache = Server(), RowCache(dim=2, rows=4096, staleness=16)
    asked = 0
    for step, ids in enumerate(zipf_batches(200, 512, 100_000, seed=1)):
        server.step = step
        cache.lookup(ids, step, server.pull)
        asked += ids.numel()
    assert server.pulled_rows < 0.6 * asked  # 0.56 here; 0.72 with S = 4
    assert cache.hits + cache.misses == asked and cache.misses == server.pulled_rows


def test_a_full_cache_keeps_the_rows_of_the_current_step() -> None:
    server, cache = Server(), RowCache(dim=2, rows=10, staleness=5)
    first = torch.arange(8)
    cache.lookup(first, 0, server.pull)
    # 12 new ids at step 1: 2 free slots, then the 8 rows of step 0 make room.
    rows = cache.lookup(torch.arange(100, 112), 1, server.pull)
    assert torch.equal(rows[:, 0], torch.arange(100, 112, dtype=torch.float32))
    held = set(cache.owner[cache.owner >= 0].tolist())
    assert len(held) == 10 and held <= set(range(100, 112))
    # Those rows are found again at step 2 without a pull.
    before = server.pulled_rows
    again = torch.tensor(sorted(held))
    assert torch.equal(cache.lookup(again, 2, server.pull)[:, 0], again.to(torch.float32))
    assert server.pulled_rows == before


def test_the_id_map_is_rebuilt_when_stale_entries_pile_up() -> None:
    server, cache = Server(), RowCache(dim=2, rows=16, staleness=100)
    for step in range(400):  # every step new ids: constant eviction
        ids = torch.arange(step * 16, step * 16 + 16)
        server.step = step
        assert torch.equal(cache.lookup(ids, step, server.pull)[:, 0], ids.to(torch.float32))
    assert cache.index.size <= 2 * 16 + 1024 + 16


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="staleness >= 1"):
        RowCache(dim=2, rows=10, staleness=0)


class CountingTransport:
    """A LocalTransport that counts the ids its pulls ask for."""

    def __init__(self, store) -> None:  # noqa: ANN001
        from pstrain_runtime.worker.client import LocalTransport

        self.inner = LocalTransport(store)
        self.pulled = 0

    def __getattr__(self, name: str):  # noqa: ANN204
        return getattr(self.inner, name)

    def sparse(self, frames: list[bytes]) -> list[bytes]:
        import json

        if json.loads(frames[0])["op"] == "pull":
            self.pulled += sum(len(f) for f in frames[1:]) // 8
        return self.inner.sparse(frames)


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_a_trainer_with_a_cache_pulls_fewer_rows_in_async_mode_only(mode: str) -> None:
    from pstrain_runtime.ps.store import ParameterStore

    from . import sparse_tasks
    from .builders import training

    torch.set_num_threads(1)
    pulled = {}
    for staleness in (0, 4):
        job = training(steps=40, batchSize=32, mode=mode, seed=1,
                       optimizer={"name": "adagrad", "learningRate": 0.1},
                       sparseCache={"stalenessSteps": staleness})
        transports = [CountingTransport(ParameterStore(i)) for i in range(2)]
        chief = sparse_tasks.run_job(job, transports, 1)[0]
        assert chief.ctx.last_step == 40
        pulled[staleness] = sum(t.pulled for t in transports)
    if mode == "async":
        assert pulled[4] < 0.7 * pulled[0]
    else:
        assert pulled[4] == pulled[0]


def test_with_ids_that_never_repeat_the_cache_stands_aside_and_keeps_nothing() -> None:
    from pstrain_runtime.sparse import cache as cache_module

    server, cache = Server(), RowCache(dim=2, rows=1000, staleness=8)
    for step in range(cache_module.JUDGE_EVERY):
        ids = torch.arange(step * 50, step * 50 + 50)
        cache.lookup(ids, step, server.pull)
    assert cache.aside == cache_module.STAND_ASIDE
    held = int((cache.owner >= 0).sum())
    step = cache_module.JUDGE_EVERY
    rows = cache.lookup(torch.arange(5), step, server.pull)  # kept rows: pulled anyway
    assert torch.equal(rows[:, 0], torch.arange(5, dtype=torch.float32))
    assert float(rows[0, 1]) == 0.0 and int((cache.owner >= 0).sum()) == held
