"""Elastic workers on the parameter server, without sockets: the worker set changes
while a namespace runs (`ParameterStore.set_workers`). Steps are counted exactly once,
no step waits for a removed worker, and a removed worker's in-flight push is applied
whole or dropped whole."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from pstrain_runtime.proto import ps_pb2 as pb
from pstrain_runtime.ps.store import ParameterStore, PSError

from .test_rt_store import params, push_frames, ready_store

LR = 0.5  # SGD in ready_store
pytestmark = pytest.mark.timeout(30)


def grads_of(worker: int) -> dict[str, torch.Tensor]:
    """Worker w pushes gradient w + 1 everywhere: the applied mean names the contributors."""
    return {"b": torch.full((4,), worker + 1.0), "w": torch.full((3, 4), worker + 1.0)}


def push(store: ParameterStore, worker: int, step: int = 0,
         timeout: float = 0.01) -> pb.PushReply:
    return store.push(iter(push_frames(grads_of(worker), worker=worker, step=step)),
                      timeout=timeout)


def bias(store: ParameterStore) -> float:
    return float(store.namespace("ns").params["b"][0])


def test_async_scale_2_4_1_3_counts_every_push_once() -> None:
    store, _ = ready_store(mode="async", num_workers=2, staleness=2)
    expected_b, applied = 1.0, 0
    for live in ({0, 1}, {0, 1, 2, 3}, {0}, {0, 1, 2}):
        store.set_workers("ns", live)
        for _ in range(3):
            for worker in sorted(live):
                reply = push(store, worker)
                assert reply.applied, reply.note
                applied += 1
                expected_b -= LR * (worker + 1)
        for gone in {0, 1, 2, 3} - live:
            with pytest.raises(PSError, match=f"worker is {gone}; this job's workers are"):
                push(store, gone)
    ns = store.namespace("ns")
    assert ns.global_step == applied == 3 * (2 + 4 + 1 + 3)
    assert bias(store) == pytest.approx(expected_b)
    assert ns.members.live == {0, 1, 2} and ns.num_workers == 3


def test_async_newcomer_starts_level_with_the_slowest_so_no_one_waits_for_it() -> None:
    store, _ = ready_store(mode="async", num_workers=2, staleness=1)
    for _ in range(3):
        push(store, 0)
        push(store, 1)
    store.set_workers("ns", {0, 1, 2})
    assert push(store, 0).applied  # started at 3 done vs the newcomer's 3
    assert push(store, 0).applied  # started at 4 done vs 3: within the bound of 1
    blocked = push(store, 0, timeout=0.05)  # 5 vs 3: waits for the slowest live worker
    assert not blocked.applied
    assert push(store, 2).applied and push(store, 1).applied
    assert push(store, 0).applied


def test_async_staleness_ignores_a_removed_worker() -> None:
    store, _ = ready_store(mode="async", num_workers=2, staleness=0)
    push(store, 0)
    assert not push(store, 0, timeout=0.05).applied  # waits for worker 1
    store.set_workers("ns", {0})
    assert push(store, 0).applied


def test_sync_scale_2_4_1_3_waits_for_each_newcomer_from_its_first_push() -> None:
    store, _ = ready_store(mode="sync", num_workers=2)
    ns = store.namespace("ns")
    expected_b = 1.0

    def step(contributors: list[int]) -> None:
        nonlocal expected_b
        before = ns.global_step
        for worker in contributors:
            assert ns.global_step == before, "the step was applied before all expected pushed"
            push(store, worker, step=before)
        assert ns.global_step == before + 1
        expected_b -= LR * sum(w + 1 for w in contributors) / len(contributors)
        assert bias(store) == pytest.approx(expected_b)

    step([0, 1])
    store.set_workers("ns", {0, 1, 2, 3})  # 2 and 3 are starting: no step waits for them
    step([0, 1])
    step([2, 3, 0, 1])  # their first pushes, at step 2: from here every step waits for them
    step([0, 1, 2, 3])
    push(store, 3, step=4)
    push(store, 1, step=4)
    store.set_workers("ns", {0})  # 1 and 3 contributed to the open step 4: applied whole
    assert ns.global_step == 4
    push(store, 0, step=4)
    assert ns.global_step == 5
    expected_b -= LR * (4 + 2 + 1) / 3
    assert bias(store) == pytest.approx(expected_b)
    step([0])
    store.set_workers("ns", {0, 1, 2})
    step([0])  # the newcomers have not pushed: step 6 is applied without them
    step([1, 2, 0])
    step([0, 1, 2])
    assert ns.global_step == 9
    with pytest.raises(PSError, match="worker is 3"):
        push(store, 3, step=9)


def test_sync_removing_the_missing_worker_applies_the_open_step() -> None:
    """No step waits for a worker that is gone: the removal itself applies the step."""
    store, _ = ready_store(mode="sync", num_workers=3)
    push(store, 0)
    push(store, 1)
    assert store.namespace("ns").global_step == 0
    info = store.set_workers("ns", {0, 1})
    assert info.global_step == 1
    assert bias(store) == pytest.approx(1.0 - LR * (1 + 2) / 2)


def test_sync_a_waiting_push_ends_when_the_worker_it_waits_for_is_removed() -> None:
    store, _ = ready_store(mode="sync", num_workers=2)
    replies: list[pb.PushReply] = []
    waiting = threading.Thread(target=lambda: replies.append(push(store, 0, timeout=10)))
    waiting.start()
    store.set_workers("ns", {0})
    waiting.join(10)
    assert not waiting.is_alive()
    assert replies[0].applied and replies[0].info.global_step == 1


def held_push(worker: int, reading: threading.Event, released: threading.Event,
              step: int = 0) -> Iterator[bytes]:
    """A push whose body stops after its first chunk until `released`: in flight, past
    the store's checks of its header (`reading` tells when)."""
    frames = push_frames(grads_of(worker), worker=worker, step=step)
    yield from frames[:2]
    reading.set()  # asked for the second chunk: the body is being read
    assert released.wait(10)
    yield from frames[2:]


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_a_push_in_flight_when_its_worker_is_removed_is_dropped_whole(mode) -> None:
    store, _ = ready_store(mode=mode, num_workers=2)
    reading, released = threading.Event(), threading.Event()
    replies: list[pb.PushReply] = []

    flight = threading.Thread(target=lambda: replies.append(
        store.push(held_push(1, reading, released), timeout=0.05)))
    flight.start()
    assert reading.wait(10)
    store.set_workers("ns", {0})
    released.set()
    flight.join(10)
    assert not flight.is_alive()
    assert not replies[0].applied and "dropped whole" in replies[0].note
    ns = store.namespace("ns")
    assert ns.global_step == 0 and torch.equal(ns.params["b"], params()["b"])
    assert 0 not in ns.buckets or 1 not in ns.buckets[0].contributors


def test_set_workers_refuses_an_empty_set_and_changes_nothing() -> None:
    store, _ = ready_store(mode="async", num_workers=2)
    with pytest.raises(PSError, match="set_workers: the worker set is empty"):
        store.set_workers("ns", set())
    assert store.namespace("ns").members.live == {0, 1}


def test_init_again_resets_the_worker_set() -> None:
    store, client = ready_store(mode="async", num_workers=2)
    store.set_workers("ns", {0, 1, 2, 3})
    from .test_rt_store import FP, SGD
    client.init(params(), SGD, mode="async", num_workers=2, staleness_bound=None,
                fingerprint=FP)
    assert store.namespace("ns").members.live == {0, 1}


def test_a_returning_worker_starts_its_new_partition_from_the_beginning() -> None:
    store, _ = ready_store(mode="async", num_workers=2)
    store.push(iter(push_frames(grads_of(1), worker=1, step=6)), timeout=0.01)
    assert store.info("ns", 1).position == 7
    store.set_workers("ns", {0})
    store.set_workers("ns", {0, 1})
    assert store.info("ns", 1).position == 0


def _running_at(store: ParameterStore, step: int) -> Any:
    """The namespace once the chief created it and it applied `step` steps."""
    ns = None
    for _ in range(1200):  # the chief creates the namespace
        try:
            ns = store.namespace("ns")
            break
        except PSError:
            threading.Event().wait(0.05)
    assert ns is not None
    with ns.cond:
        assert ns.cond.wait_for(lambda: ns.global_step >= step or ns.done, timeout=60)
        assert not ns.done
    return ns


def _finish(store: ParameterStore, threads: list[threading.Thread], trainers: list[Any],
            errors: list[BaseException]) -> None:
    """Wait for every trainer (bounded), stop the store, raise a trainer's error."""
    try:
        for thread in threads:
            thread.join(90)
        assert not any(thread.is_alive() for thread in threads), "a trainer did not finish"
    finally:
        store.stop()
        for t in trainers:
            t.close()
    if errors:
        raise errors[0]


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("mode", "steps", "grown", "admitted_first"),
                         [("async", 600, 3, True), ("sync", 400, 4, True),
                          ("async", 600, 3, False), ("sync", 400, 4, False)])
def test_digits_scaled_up_mid_run_finishes_at_the_usual_accuracy(
        mode: str, steps: int, grown: int, admitted_first: bool) -> None:
    """Real trainers (threads) against one store: two workers start, more join at step
    100; the job ends at exactly the target with the usual accuracy (sync: >= 95 %, as
    test_rt_trainer's fixed-size job; async, whose result depends on thread timing:
    >= 93 %). The newcomers are admitted (`set_workers`) before their
    trainers start, or after (as the operator does once their pods are Ready): then they
    wait to be admitted and never push before. async grows to 3: digits' async settings
    (momentum 0.9) diverge with 4 fixed workers too."""
    from pstrain_runtime.examples.digits import make_task
    from pstrain_runtime.worker.client import LocalTransport
    from pstrain_runtime.worker.context import WorkerRole
    from pstrain_runtime.worker.trainer import Trainer

    from .builders import Events, digits_training

    events = Events()
    training = digits_training(steps=steps, mode=mode, evalIntervalSteps=200)
    store = ParameterStore(max_wait=10)
    transports = [LocalTransport(store)]
    errors: list[BaseException] = []
    opened: set[tuple[int, int]] = set()  # (worker, num_workers) of every batches() call

    asked = threading.Event()  # a newcomer asked a server whether it is a member

    class Watched(LocalTransport):
        def info(self, namespace: str, worker: int = 0) -> pb.StepInfo:
            if worker >= 2:
                asked.set()
            return super().info(namespace, worker)

    def trainer(worker: int, count: int) -> Trainer:
        task = make_task()
        batches = task.batches

        def recorded(w: int, n: int, *args: Any, **kwargs: Any) -> Any:
            opened.add((w, n))
            return batches(w, n, *args, **kwargs)

        task.batches = recorded
        return Trainer(training, WorkerRole("ns", worker, count),
                       [Watched(store)] if worker >= 2 else transports,
                       emit=events if worker == 0 else (lambda *a, **k: None),
                       progress_interval=0.05, task=task)

    def start(t: Trainer) -> threading.Thread:
        def go() -> None:
            try:
                t.run()
            except BaseException as exc:  # re-raised below
                errors.append(exc)
        thread = threading.Thread(target=go, daemon=True)
        thread.start()
        return thread

    trainers = [trainer(0, 2), trainer(1, 2)]
    threads = [start(t) for t in reversed(trainers)]
    try:
        ns = _running_at(store, 100)
        newcomers = [trainer(w, grown) for w in range(2, grown)]
        trainers += newcomers
        if admitted_first:
            store.set_workers("ns", set(range(grown)))
        threads += [start(t) for t in newcomers]
        if not admitted_first:  # the newcomers ask to be admitted, and are not yet
            assert asked.wait(30)
            assert not errors
            with ns.cond:
                assert not ns.done
                assert not any(w in ns.worker_pushes for w in range(2, grown))
            store.set_workers("ns", set(range(grown)))
        with ns.cond:
            joined = dict(ns.worker_pushes)
    finally:
        _finish(store, threads, trainers, errors)
    done = events.of("done")[0]
    assert done["step"] == steps and ns.global_step == steps
    # Sync is exact (0.971 every run); async depends on thread timing: 0.95-0.98 alone,
    # down to 0.944 on the 2-core machine loaded by the whole suite (measured).
    assert done["accuracy"] >= (0.95 if mode == "sync" else 0.93)
    assert ns.members.live == set(range(grown))
    # the running workers re-partitioned: they re-opened their data for the new count
    assert {(0, grown), (1, grown)} <= opened
    if mode == "async":  # the newcomers' pushes were applied
        assert all(ns.worker_pushes[w] > joined[w] for w in range(2, grown))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["async", "sync"])
def test_a_removed_worker_pushes_no_more_and_waits_without_failing(mode: str) -> None:
    """A scale-down removes worker 2 at step 100 while its trainer runs (nobody stops
    it): its pushes stop counting, the others finish the job at exactly the target,
    and its trainer waits to be admitted again rather than failing, and ends with the
    job."""
    from pstrain_runtime.examples.digits import make_task
    from pstrain_runtime.worker.client import LocalTransport
    from pstrain_runtime.worker.context import WorkerRole
    from pstrain_runtime.worker.trainer import Trainer

    from .builders import Events, digits_training

    events = Events()
    training = digits_training(steps=400, mode=mode)
    store = ParameterStore(max_wait=10)
    errors: list[BaseException] = []
    trainers = [Trainer(training, WorkerRole("ns", w, 3), [LocalTransport(store)],
                        emit=events if w == 0 else (lambda *a, **k: None),
                        progress_interval=0.05, task=make_task()) for w in range(3)]

    def go(t: Trainer) -> None:
        try:
            t.run()
        except BaseException as exc:  # re-raised below
            errors.append(exc)

    threads = [threading.Thread(target=go, args=(t,), daemon=True) for t in trainers]
    for thread in threads:
        thread.start()
    try:
        ns = _running_at(store, 100)
        store.set_workers("ns", {0, 1})
        with ns.cond:
            removed_at = ns.worker_pushes.get(2, 0)
    finally:
        _finish(store, threads, trainers, errors)
    assert events.of("done")[0]["step"] == 400 == ns.global_step
    assert ns.worker_pushes.get(2, 0) == removed_at
    assert ns.members.live == {0, 1}


def test_applied_samples_count_each_step_with_the_workers_it_applied() -> None:
    """The chief's samples/s after a scale: 10 sync steps of 2 workers x 64, then 10
    of 4 x 64; a restore takes the step back and counting goes on from there."""
    from pstrain_runtime.worker.membership import AppliedSamples

    applied = AppliedSamples(step=5)
    applied.advance(15, 2 * 64)
    assert applied.total == 10 * 128
    applied.advance(25, 4 * 64)
    assert applied.total == 10 * 128 + 10 * 256
    applied.advance(20, 4 * 64)  # restored from a checkpoint at step 20
    applied.advance(21, 4 * 64)
    assert applied.total == 10 * 128 + 11 * 256


def test_a_push_refused_for_membership_is_told_apart_from_other_refusals() -> None:
    from pstrain_runtime.worker.membership import admitted, not_a_member

    store, _ = ready_store(num_workers=2)
    store.set_workers("ns", {0})
    with pytest.raises(PSError, match="this job's workers are 0") as refused:
        push(store, 1)  # a push that starts after its worker was removed
    assert refused.value.code == "INVALID_ARGUMENT"
    assert not admitted([store.info("ns", 1)]) and admitted([store.info("ns", 0)])
    late = pb.PushReply(info=pb.StepInfo(initialized=True, member=True), applied=False)
    assert not not_a_member([late])
    dropped = pb.PushReply(info=pb.StepInfo(initialized=True, member=False), applied=False)
    assert not_a_member([dropped])
