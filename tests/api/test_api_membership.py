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
                 "maxReplicas", id="over-max"),
    pytest.param(1, 2, None, "spec.replicas.worker.replicas is 1; it must be at least "
                 "minReplicas", id="under-min"),
    pytest.param(2, 3, 2, "spec.replicas.worker.minReplicas is 3; it must be at most "
                 "maxReplicas", id="crossed"),
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


def test_worker_set_waits_for_a_newcomer_from_its_first_push():
    start = WorkerSet.initial(2)
    assert start.expected(0) == {0, 1} and start.span == 2
    grown = start.changed({0, 1, 2, 3})
    assert grown.expected(5) == grown.expected(50) == {0, 1}  # still starting: no wait
    assert grown.live == {0, 1, 2, 3} and grown.span == 4
    joined = grown.joined(2, 6).joined(3, 8)
    assert joined.expected(6) == {0, 1, 2} and joined.expected(8) == {0, 1, 2, 3}
    assert joined.joined(2, 9) is joined  # only the first push sets it
    assert joined.joined(7, 9) is joined  # not a member: nothing
    shrunk = joined.changed({0})
    assert shrunk.expected(9) == {0} and shrunk.live == {0} and shrunk.span == 1
    regrown = shrunk.changed({0, 1, 2})
    assert dict(regrown.since) == {0: 0, 1: None, 2: None}  # a returning worker is new again


def test_step_completes_when_every_expected_worker_contributed():
    ws = WorkerSet.initial(2).changed({0, 2})  # 1 removed, 2 added
    assert not ws.is_complete(3, set())
    assert ws.is_complete(3, {0})  # 1 is gone, 2 has not pushed yet
    assert ws.is_complete(3, {0, 1})  # a removed worker's earlier contribution counts
    ws = ws.joined(2, 4)
    assert not ws.is_complete(4, {0})
    assert ws.is_complete(4, {0, 2})


def test_worker_set_refuses_empty_and_negative():
    with pytest.raises(ValueError, match="empty"):
        WorkerSet.initial(1).changed(set())
    with pytest.raises(ValueError, match=">= 0"):
        WorkerSet.initial(1).changed({-1})
