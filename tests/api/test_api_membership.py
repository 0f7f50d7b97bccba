"""The shared membership rules: bounds, scale plans, and which workers a sync step
waits for across a change."""

from __future__ import annotations

import pytest

from pstrain_api.membership import (REASON_SCALED_DOWN, REASON_SCALED_UP, ScalePlan,
                                    WorkerSet, bounds_problem, plan_scale)


@pytest.mark.parametrize(("replicas", "lo", "hi", "problem"), [
    pytest.param(3, None, None, None, id="no-bounds"),
    pytest.param(3, 1, 3, None, id="at-max"),
    pytest.param(4, 1, 3, "spec.replicas.worker.replicas is 4; it must be at most "
                 "maxReplicas (3)", id="over-max"),
    pytest.param(1, 2, None, "spec.replicas.worker.replicas is 1; it must be at least "
                 "minReplicas (2)", id="under-min"),
    pytest.param(2, 3, 2, "spec.replicas.worker.minReplicas is 3; it must be at most "
                 "maxReplicas (2)", id="crossed"),
])
def test_bounds_problem(replicas, lo, hi, problem):
    assert bounds_problem(replicas, lo, hi) == problem


@pytest.mark.parametrize(("live", "desired", "plan"), [
    pytest.param({0, 1}, 4, ScalePlan(add=(2, 3)), id="up"),
    pytest.param({0, 1, 2, 3}, 1, ScalePlan(remove=(3, 2, 1)), id="down-keeps-worker-0"),
    pytest.param({0, 2}, 3, ScalePlan(add=(1,)), id="fills-a-gap"),
    pytest.param({0, 1, 2}, 3, ScalePlan(), id="noop"),
])
def test_plan_scale(live, desired, plan):
    assert plan_scale(live, desired) == plan


def test_plan_reason_and_message():
    up, down = plan_scale({0, 1}, 4), plan_scale({0, 1, 2, 3}, 1)
    assert (up.reason, down.reason) == (REASON_SCALED_UP, REASON_SCALED_DOWN)
    assert up.message(2, 4) == "workers 2 -> 4: adds worker 2, 3"
    assert down.message(4, 1) == "workers 4 -> 1: removes worker 3, 2, 1"


def test_plan_refuses_zero_workers():
    with pytest.raises(ValueError, match="at least 1"):
        plan_scale({0}, 0)


def test_worker_set_changes_at_the_next_step_boundary():
    start = WorkerSet.initial(2)
    assert start.expected(0) == {0, 1} and start.span == 2
    grown = start.changed({0, 1, 2, 3}, open_step=5)
    assert grown.expected(5) == {0, 1}  # the open step does not wait for newcomers
    assert grown.expected(6) == {0, 1, 2, 3}
    shrunk = grown.changed({0}, open_step=7)
    assert shrunk.expected(7) == {0} and shrunk.live == {0} and shrunk.span == 1
    regrown = shrunk.changed({0, 1, 2}, open_step=9)
    assert dict(regrown.since) == {0: 0, 1: 10, 2: 10}  # a returning worker is new again


def test_step_completes_when_every_expected_worker_contributed():
    ws = WorkerSet.initial(2).changed({0, 2}, open_step=3)  # 1 removed, 2 added
    assert not ws.is_complete(3, set())
    assert ws.is_complete(3, {0})  # 1 is gone, 2 is waited for from step 4
    assert ws.is_complete(3, {0, 1})  # a removed worker's earlier contribution counts
    assert not ws.is_complete(4, {0})
    assert ws.is_complete(4, {0, 2})


def test_worker_set_refuses_empty_and_negative():
    with pytest.raises(ValueError, match="empty"):
        WorkerSet.initial(1).changed(set(), 0)
    with pytest.raises(ValueError, match=">= 0"):
        WorkerSet.initial(1).changed({-1}, 0)
