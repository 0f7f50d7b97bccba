"""End to end: the digits example trains to completion through the operator.

- On this machine (default): kmock's emulated API, the real `pstrain operator`, and a
  fake node (tests/operator/fake_node.py) that runs each created pod as a local
  process at the address the cluster spec gives. Needs root (it maps the pods' DNS
  names to loopback addresses in /etc/hosts, and restores the file).
- On a real cluster: `pytest -m e2e tests/operator` runs the same scenario against the
  cluster in $KUBECONFIG (skipped when none is configured); see docs/operator.md.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest

from pstrain_api import constants as c
from pstrain_api.cluster import kubernetes_cluster_spec
from pstrain_api.events import parse_event
from pstrain_api.model import TrainingJob

from .conftest import NAMESPACE, OperatorProcess
from .emulator import EmulatorThread, HttpApi, wait_for
from .fake_node import FakeNode, hosts_entries, hosts_writable

# Long enough for several progress refreshes (every 1 s here, but the first can come up
# to 5 s after the job is Running: the operator looks again every 5 s while it starts):
# 12-15 s of training on the 2-core machines of 2026-11, where 3000 steps took under 4 s
# and ended before the first probe; about a minute on machines 4x slower.
STEPS = 12_000


def digits_job(namespace: str, name: str = "digits") -> dict[str, Any]:
    """examples/digits.yaml, shortened, with two parameter servers: each binds its data
    plane on the fixed port 2223 of its own pod address."""
    return {
        "apiVersion": c.API_VERSION, "kind": c.KIND,
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "replicas": {"ps": {"replicas": 2}, "worker": {"replicas": 2}},
            "training": {
                "entrypoint": "pstrain_runtime.examples.digits:make_task",
                "steps": STEPS, "batchSize": 64, "mode": "async",
                "optimizer": {"name": "momentum", "learningRate": 0.05, "momentum": 0.9},
                "evalIntervalSteps": 1000,
            },
            "runPolicy": {"restartPolicy": "Never", "activeDeadlineSeconds": 600},
        },
    }


def on_the_fake_node(body: dict[str, Any], operator_process: OperatorProcess, first_ip: int,
                     ) -> tuple[dict[str, str], dict[str, str], dict[str, str]]:
    """Each pod's own 127.0.0.x address (from `first_ip` on), the /etc/hosts entries for
    their DNS names, and the environment of the replicas; the operator reads progress
    every second."""
    cluster = kubernetes_cluster_spec(TrainingJob.model_validate(body))
    tasks = cluster.tasks()
    pod_ip = {cluster.replica_name(t): f"127.0.0.{first_ip + i}" for i, t in enumerate(tasks)}
    hosts = {cluster.addresses[t].host: pod_ip[cluster.replica_name(t)] for t in tasks}
    env = {"GRPC_DNS_RESOLVER": "native", "PSTRAIN_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
    operator_process.extra_env.update({**env, "PSTRAIN_OPERATOR_PROGRESS_INTERVAL": "1"})
    return pod_ip, hosts, env


@pytest.mark.timeout(480)
@pytest.mark.skipif(not hosts_writable(),
                    reason="the fake node maps pod DNS names in /etc/hosts, which needs root")
def test_digits_trains_to_completion_through_the_operator(
    emulator: EmulatorThread, operator_process: OperatorProcess, tmp_path: Path
) -> None:
    body = digits_job(NAMESPACE)
    pod_ip, hosts, env = on_the_fake_node(body, operator_process, first_ip=100)
    api = HttpApi(emulator.url)

    with hosts_entries(hosts, tag=f"{os.getpid()}-{tmp_path.name}"):
        operator_process.start()
        with FakeNode(api, NAMESPACE, pod_ip, tmp_path, env) as node:
            started = time.monotonic()
            api.create_job(body)

            def finished() -> str | None:
                phase = ((api.job(NAMESPACE, "digits") or {}).get("status") or {}).get("phase")
                return phase if phase in ("Succeeded", "Failed") else None

            phase = wait_for("the job to finish", finished, timeout=420, interval=0.5)
            elapsed = time.monotonic() - started
            logs = {p.name: p.read_text(errors="replace")[-1500:]
                    for p in tmp_path.glob("digits-*.log")}
            status = api.job(NAMESPACE, "digits")["status"]
            assert phase == "Succeeded", (status, logs, operator_process.log_tail())
            wait_for("the PS processes to stop", lambda: all(
                name not in node.replicas or node.replicas[name].proc.poll() is not None
                for name in ("digits-ps-0", "digits-ps-1")))

    # PS first, the non-chief worker, the chief last.
    assert sorted(node.started[:2]) == ["digits-ps-0", "digits-ps-1"], node.started
    assert node.started[2:] == ["digits-worker-1", "digits-worker-0"]
    # Both PS served their data plane on the port their pods declare, each on its own
    # address; the workers' tensor calls went there (transport tcp has no fallback).
    assert node.data_ports == {"digits-ps-0": c.DATA_PORT, "digits-ps-1": c.DATA_PORT}
    assert node.exits["digits-worker-0"] == 0, logs
    # The PS shut down cleanly (exit 0) or were deleted: none is left running.
    assert {node.exits.get(f"digits-ps-{i}") for i in (0, 1)} <= {0, -15}, node.exits
    assert [n for n, p in api.pods(NAMESPACE).items() if n.startswith("digits-ps")
            and p["status"]["phase"] in ("Pending", "Running")] == []
    assert status["conditions"] and status["completionTime"]
    # Progress was read from PS 0 through the runtime's status client while Running.
    assert status["progress"]["globalStep"] > 0, status
    print(f"\ndigits ({STEPS} steps) through the operator: Succeeded in {elapsed:.1f}s; "
          f"progress {status.get('progress')}")


@pytest.mark.timeout(600)
@pytest.mark.skipif(not hosts_writable(),
                    reason="the fake node maps pod DNS names in /etc/hosts, which needs root")
def test_suspend_checkpoints_first_and_resume_continues_from_it(
    emulator: EmulatorThread, operator_process: OperatorProcess, tmp_path: Path
) -> None:
    """Real replicas: suspending a running job asks the chief (through PS 0) for a
    checkpoint and deletes the pods only once it is written; on resume the chief
    restores it, and the status says from which step."""
    body = digits_job(NAMESPACE, "sus")
    body["spec"]["replicas"]["ps"]["replicas"] = 1
    body["spec"]["training"]["steps"] = 12_000  # still running at the suspend (STEPS)
    body["spec"]["training"]["checkpoint"] = {"directory": str(tmp_path / "ckpt"),
                                              "intervalSteps": 100000}
    pod_ip, hosts, env = on_the_fake_node(body, operator_process, first_ip=120)
    api = HttpApi(emulator.url)
    path = f"/apis/{c.API_VERSION}/namespaces/{NAMESPACE}/{c.PLURAL}/sus"

    def status() -> dict[str, Any]:
        return (api.job(NAMESPACE, "sus") or {}).get("status") or {}

    def suspend(value: bool) -> None:
        api.request("PATCH", path, {"spec": {"runPolicy": {"suspend": value}}},
                    "application/merge-patch+json")

    with hosts_entries(hosts, tag=f"{os.getpid()}-{tmp_path.name}"):
        operator_process.start()
        with FakeNode(api, NAMESPACE, pod_ip, tmp_path, env):
            api.create_job(body)
            wait_for("training under way", lambda: (status().get("progress") or {})
                     .get("globalStep", 0) >= 200, timeout=120, interval=0.5)
            suspend(True)
            wait_for("Suspended", lambda: status().get("phase") == "Suspended", timeout=60,
                     interval=0.5)
            at_suspend = status()
            reasons = [e.get("reason") for e in api.events(NAMESPACE)]
            assert "CheckpointRequested" in reasons and "CheckpointConfirmed" in reasons, (
                reasons, operator_process.log_tail())
            step = at_suspend["lastCheckpoint"]["step"]
            assert step >= 200 and (tmp_path / "ckpt").is_dir()
            wait_for("no pods", lambda: not api.pods(NAMESPACE), timeout=60)

            suspend(False)
            wait_for("resumed", lambda: status().get("resumedFromStep") == step, timeout=30)
            # The rest of 12 000 steps: about 10 s on the machines of 2026-11, a minute on
            # ones 4x slower, several minutes at load average 10.
            wait_for("Succeeded", lambda: status().get("phase") in ("Succeeded", "Failed"),
                     timeout=480, interval=0.5)
    final = status()
    chief_log = (tmp_path / "sus-worker-0.log").read_text(errors="replace")
    assert final["phase"] == "Succeeded", (final, chief_log[-2000:])
    # The second chief restored exactly the checkpoint written for the suspend.
    restored = [e for e in map(parse_event, chief_log.splitlines())
                if e is not None and e.get("event") == "restored"]
    assert [e["step"] for e in restored] == [step], chief_log[-2000:]


# --------------------------------------------------------------------------- real cluster


def _kubeconfig() -> str | None:
    path = os.environ.get("KUBECONFIG") or str(Path.home() / ".kube" / "config")
    first = path.split(os.pathsep)[0]
    return first if first and Path(first).is_file() else None


@pytest.mark.e2e
@pytest.mark.timeout(900)
@pytest.mark.skipif(_kubeconfig() is None, reason="no cluster: $KUBECONFIG is not configured")
def test_digits_on_a_real_cluster(tmp_path: Path) -> None:
    """The same scenario against the cluster in $KUBECONFIG.

    Expects the CRD installed (`kubectl apply -f crds/`) and an operator running, either
    in the cluster (the Helm chart) or locally (PSTRAIN_E2E_LOCAL_OPERATOR=1 runs
    `pstrain operator` from this checkout against the cluster). The job's pods use
    PSTRAIN_E2E_IMAGE (default: the operator's default runtime image).
    """
    from kubernetes import client, config

    config.load_kube_config(config_file=_kubeconfig())
    namespace = os.environ.get("PSTRAIN_E2E_NAMESPACE", "default")
    name = f"digits-e2e-{int(time.time()) % 100000}"
    body = digits_job(namespace, name)
    image = os.environ.get("PSTRAIN_E2E_IMAGE")
    if image:
        for role in ("ps", "worker"):
            body["spec"]["replicas"][role]["template"] = {"image": image,
                                                         "imagePullPolicy": "IfNotPresent"}
    custom = client.CustomObjectsApi()
    core = client.CoreV1Api()
    local = None
    if os.environ.get("PSTRAIN_E2E_LOCAL_OPERATOR") == "1":
        local = OperatorProcess(Path(_kubeconfig() or ""), tmp_path,
                                {"PSTRAIN_OPERATOR_NAMESPACES": namespace})
        local.start()
    try:
        custom.create_namespaced_custom_object(c.GROUP, c.VERSION, namespace, c.PLURAL, body)

        def finished() -> str | None:
            obj = custom.get_namespaced_custom_object(c.GROUP, c.VERSION, namespace,
                                                      c.PLURAL, name)
            phase = (obj.get("status") or {}).get("phase")
            return phase if phase in ("Succeeded", "Failed") else None

        phase = wait_for("the job to finish", finished, timeout=840, interval=2)
        obj = custom.get_namespaced_custom_object(c.GROUP, c.VERSION, namespace, c.PLURAL,
                                                  name)
        assert phase == "Succeeded", obj.get("status")

        def ps_gone() -> bool:
            pods = core.list_namespaced_pod(
                namespace, label_selector=f"{c.LABEL_JOB}={name},{c.LABEL_ROLE}=ps")
            return not [p for p in pods.items if p.status.phase in ("Pending", "Running")]

        wait_for("the PS to stop", ps_gone, timeout=120, interval=2)
    finally:
        custom.delete_namespaced_custom_object(c.GROUP, c.VERSION, namespace, c.PLURAL, name)
        if local is not None:
            local.stop()
