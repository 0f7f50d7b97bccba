"""Gang start: every pod at once as one group (Volcano, scheduler-plugins, Kueue), the
runtime's startup barrier, and Kueue's suspend-based admission."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from pstrain_api import constants as c
from pstrain_api.cluster import Task, kubernetes_cluster_spec
from pstrain_api.model import RunPolicy
from pstrain_api.policy import decide_restart
from pstrain_operator.build import build_pod, owner_reference
from pstrain_operator.gang import build_pod_group
from pstrain_operator.reconcile import CreateObject, CreatePod, CreateService, Observed, decide
from pstrain_operator.settings import PodSettings
from pstrain_runtime.health import wait_all_serving
from pstrain_runtime.replica import startup_barrier

from .op_builders import T0, make_job


def gang_job(provider: str, **fields: Any):
    return make_job().chief().policy(gangScheduling={"provider": provider, **fields})


POD_CASES = [
    # id, gang fields, labels, annotations, schedulerName, priorityClassName
    ("volcano", {"provider": "Volcano", "queue": "q", "priorityClassName": "high"}, {},
     {"scheduling.k8s.io/group-name": "j", "scheduling.volcano.sh/queue-name": "q"},
     "volcano", "high"),
    ("scheduler-plugins", {"provider": "SchedulerPlugins"},
     {"scheduling.x-k8s.io/pod-group": "j"}, {}, "scheduler-plugins-scheduler", None),
    ("kueue", {"provider": "Kueue", "queue": "team-a"},
     {"kueue.x-k8s.io/pod-group-name": "j", "kueue.x-k8s.io/queue-name": "team-a"},
     {"kueue.x-k8s.io/pod-group-total-count": "4"}, None, None),
    ("own-scheduler", {"provider": "Volcano", "schedulerName": "my-volcano"}, {},
     {"scheduling.k8s.io/group-name": "j"}, "my-volcano", None),
]


@pytest.mark.parametrize(("gang", "labels", "annotations", "scheduler", "priority"),
                         [pytest.param(*rest, id=i) for i, *rest in POD_CASES])
def test_gang_pods(gang, labels, annotations, scheduler, priority) -> None:
    job = make_job().chief().policy(gangScheduling=gang).build()
    pod = build_pod(job, kubernetes_cluster_spec(job), Task("worker", 0), PodSettings())
    assert labels.items() <= pod["metadata"]["labels"].items()
    assert annotations.items() <= pod["metadata"]["annotations"].items()
    assert pod["spec"].get("schedulerName") == scheduler
    assert pod["spec"].get("priorityClassName") == priority
    env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
    assert env[c.ENV_STARTUP_TIMEOUT] == "600"  # trainers wait at the barrier


def test_a_template_scheduler_and_priority_win() -> None:
    job = (gang_job("Volcano", priorityClassName="high")
           .template("ps", schedulerName="other", priorityClassName="low").build())
    pod = build_pod(job, kubernetes_cluster_spec(job), Task("ps", 0), PodSettings())
    assert (pod["spec"]["schedulerName"], pod["spec"]["priorityClassName"]) == ("other", "low")
    env = {e["name"] for e in pod["spec"]["containers"][0]["env"]}
    assert c.ENV_STARTUP_TIMEOUT not in env  # parameter servers do not wait


def test_pod_groups() -> None:
    job = gang_job("Volcano", queue="q", priorityClassName="high").build()
    group = build_pod_group(job, owner_reference(job))
    assert group is not None
    assert (group["apiVersion"], group["kind"], group["metadata"]["name"]) == (
        "scheduling.volcano.sh/v1beta1", "PodGroup", "j")
    assert group["spec"] == {"minMember": 4, "queue": "q", "priorityClassName": "high"}
    assert group["metadata"]["ownerReferences"][0]["uid"] == "uid-j"
    coscheduling = build_pod_group(gang_job("SchedulerPlugins",
                                            startupTimeoutSeconds=90).build(), {})
    assert coscheduling is not None and coscheduling["spec"] == {
        "minMember": 4, "scheduleTimeoutSeconds": 90}
    assert build_pod_group(gang_job("Kueue").build(), {}) is None
    assert build_pod_group(make_job().build(), {}) is None


def plan(builder, pods=()):
    return decide(Observed(builder.build(), tuple(pods), False, T0), PodSettings())


def test_a_gang_job_creates_every_pod_at_once() -> None:
    actions = plan(gang_job("Volcano")).actions
    kinds = [type(a).__name__ for a in actions]
    assert kinds == ["CreateService", "CreateObject", *["CreatePod"] * 4]
    assert isinstance(actions[1], CreateObject) and actions[1].kind == "PodGroup"
    assert [a.name for a in actions if isinstance(a, CreatePod)] == [
        "j-ps-0", "j-worker-0", "j-worker-1", "j-chief-0"]
    ordered = plan(make_job().chief()).actions  # today's default: PS first, alone
    assert [a.name for a in ordered if isinstance(a, CreatePod)] == ["j-ps-0"]


def test_kueue_suspend_based_admission() -> None:
    """A job created suspended (as Kueue holds it) creates nothing, not even the
    Service; once Kueue resumes it, every pod is created at once."""
    suspended = plan(gang_job("Kueue", queue="team-a").policy(suspend=True))
    assert suspended.actions == () and suspended.status.phase == "Suspended"
    admitted = plan(gang_job("Kueue", queue="team-a").status(phase="Suspended"))
    created = [a for a in admitted.actions if isinstance(a, CreatePod)]
    assert len(created) == 4 and any(isinstance(a, CreateService) for a in admitted.actions)
    assert all(a.manifest["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a"
               for a in created)


def test_the_startup_barrier() -> None:
    seen: list[str] = []

    def fake_wait(address: str, stop: threading.Event, interval: float) -> bool:
        seen.append(address)
        if address == "ps-1:2222":
            return not stop.wait(5.0)  # never serves: returns False once stopped
        return True

    assert wait_all_serving(["ps-0:2222", "ps-1:2222"], 0.2, fake_wait) == ["ps-1:2222"]
    assert seen == ["ps-0:2222", "ps-1:2222"]
    assert startup_barrier(["127.0.0.1:1"], {}) is True  # ordered start: no barrier


@pytest.mark.timeout(20)
def test_the_barrier_fails_when_a_parameter_server_never_serves(capsys) -> None:
    pytest.importorskip("grpc_health")
    assert startup_barrier(["127.0.0.1:1"], {c.ENV_STARTUP_TIMEOUT: "0.5"}) is False
    assert "parameter servers 127.0.0.1:1 did not answer their health check within 0.5s" \
        in capsys.readouterr().err
    decision = decide_restart(RunPolicy(), "j-worker-0", c.EXIT_STARTUP_TIMEOUT, 0)
    assert (decision.action, decision.reason) == ("fail", "StartupTimeout")
