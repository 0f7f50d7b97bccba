"""Table tests of the disruptions step (`steps/disruptions.py`): pods deleted or evicted
from outside are counted, and an announced eviction asks for a checkpoint."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from pstrain_operator.plan import RequestCheckpoint
from pstrain_operator.steps.disruptions import note

from .op_builders import make_job as J, pod
from .step_builders import begin, running

JOB = J().build()
EVICTED = dict(disruption="EvictionByEvictionAPI")


@dataclass
class Case:
    id: str
    job: Any
    pods: list[Any]
    # expected
    actions: list[Any] = field(default_factory=list)
    events: list[str] = field(default_factory=list)
    counts: tuple[int, int] = (0, 0)  # (restarts, disruptions)
    counted: list[str] = field(default_factory=list)


CASES = [
    Case("nothing from outside", J().status(phase="Running"), running(J())),
    Case("a running worker deleted from outside: counted once",
         J().status(phase="Running"),
         [*running(J(), workers=1), pod(JOB, "worker", 1, deleting=True)],
         events=["PodDisrupted"], counts=(1, 1), counted=["u-worker-1"]),
    Case("counted before: not again",
         J().status(phase="Running", countedDisruptions=["u-worker-1"]),
         [*running(J(), workers=1), pod(JOB, "worker", 1, deleting=True)],
         counted=["u-worker-1"]),
    Case("an announced eviction without checkpoints: marked, nothing asked",
         J().status(phase="Running"),
         [*running(J(), workers=1), pod(JOB, "worker", 1, **EVICTED)],
         counted=["asked:u-worker-1"]),
    Case("an announced eviction with checkpoints: the chief is asked",
         J().checkpoint().status(phase="Running"),
         [*running(J(), workers=1), pod(JOB, "worker", 1, **EVICTED)],
         actions=[RequestCheckpoint("j-ps-0.j.ns.svc:2222")], events=["CheckpointRequested"],
         counted=["asked:u-worker-1"]),
]


@pytest.mark.parametrize("case", CASES, ids=[c_.id for c_ in CASES])
def test_note(case: Case) -> None:
    out = note(begin(case.job, case.pods))
    assert list(out.actions) == case.actions
    assert [e.reason for e in out.events] == case.events
    assert (out.st.restarts, out.st.disruptions) == case.counts
    assert out.st.counted_disruptions == case.counted
