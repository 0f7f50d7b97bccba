"""End to end on a real API server: the real `pstrain operator` and `kubelet.py` (a test
node running pods as local processes, see tests/kube/node.py) drive TrainingJobs of the
digits and CTR examples, and every example as written, as a user would with kubectl.

One kubelet and one operator serve the whole module; the operator serves a pool of
namespaces made before it starts, one per test. Every wait is bounded and waits for a
state (a phase, a condition, a pod), never for time to pass.
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import signal
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from pstrain_api import constants as c
from pstrain_api import security
from tests.operator.conftest import OperatorProcess

from .conftest import Cluster, Namespace, wait_until
from .node import Kubelet, PodWatch, Pool, pod_dir, pod_log

# Run as written: every example but those that need what this node has not: a GPU,
# TensorFlow's image with a ConfigMap, the repository's own examples/ folder in the
# pods (digits-files: its header says so).
EXAMPLES = sorted(p for p in (Path(__file__).parents[2] / "examples").glob("*.yaml")
                  if p.stem not in ("gpu", "tf-ps", "digits-files"))
# Namespaces: one per test (the two on the finished digits job share one).
POOL_SIZE = 11 + len(EXAMPLES)
JOB = "digits"
LIVENESS_SECONDS = 12  # the module's operator's PSTRAIN_OPERATOR_PS_LIVENESS_SECONDS

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0, reason="kubelet.py must run as root (it edits /etc/hosts and "
    "mounts each pod's volumes in a mount namespace of its own)")


@dataclass
class E2E:
    cluster: Cluster
    kubelet: Kubelet
    operator: OperatorProcess
    pool: Pool
    work: Path

    def namespace(self) -> Namespace:
        ns = Namespace(self.cluster, self.pool.take())
        # Whatever a test leaves running stops with it (the module shares two cores).
        ns.cleanups.append(lambda: ns.kubectl("delete", "tj", "--all", "--wait=false",
                                              check=False))
        return ns

    def diagnostics(self, ns: Namespace) -> str:
        """What to read when a wait fails: the job, its pods, the operator's log."""
        pods = ns.kubectl("get", "pods", "-o", "wide", check=False).stdout
        job = ns.kubectl("get", "tj", "-o", "yaml", check=False).stdout
        logs = "\n".join(f"--- {p.parent.name}\n{p.read_text(errors='replace')[-1500:]}"
                         for p in sorted(pod_dir(ns.name, "").glob("*/*.log")))
        path = self.operator.log_dir / f"operator-{self.operator.runs}.log"
        ours = [line for line in path.read_text(errors="replace").splitlines()
                if ns.name in line and " DEBUG " not in line] if path.exists() else []
        kubelet = [line for line in self.kubelet.tail(400).splitlines() if ns.name in line]
        return (f"\n--- pods\n{pods}\n--- job\n{job[-3000:]}\n--- replica logs\n{logs}"
                "\n--- operator\n" + "\n".join(ours[-30:]) + "\n--- kubelet\n"
                + "\n".join(kubelet[-20:]))


@pytest.fixture()
def ns(e2e: E2E) -> Iterator[Namespace]:
    """A namespace of the pool for one test; its jobs are deleted afterwards."""
    namespace = e2e.namespace()
    try:
        yield namespace
    finally:
        for cleanup in namespace.cleanups:
            cleanup()


@pytest.fixture(scope="module")
def e2e(cluster: Cluster) -> Iterator[E2E]:
    work = Path(tempfile.mkdtemp(prefix="pstrain-kube-e2e-"))
    prefix = f"e2e-{uuid.uuid4().hex[:6]}"
    names = [f"{prefix}-{i}" for i in range(POOL_SIZE)]
    for name in names:
        cluster.kubectl("create", "namespace", name)
    for name in names:
        wait_until(f"the default ServiceAccount of {name}", lambda n=name: cluster.kubectl(
            "get", "serviceaccount", "default", namespace=n, check=False).returncode == 0,
            timeout=30)
    kubelet = Kubelet(cluster, work)
    operator = OperatorProcess(cluster.kubeconfig, work, {
        "PSTRAIN_OPERATOR_NAMESPACES": ",".join(names),
        "PSTRAIN_OPERATOR_PROGRESS_INTERVAL": "1",
        # Every PS of the module is probed for liveness with this window (the default
        # is 60 s): short, so that the hung-PS test is, and every other test shows
        # that a healthy server under load is never killed by it.
        "PSTRAIN_OPERATOR_PS_LIVENESS_SECONDS": str(LIVENESS_SECONDS),
    })
    try:
        kubelet.start()
        operator.start()
        yield E2E(cluster, kubelet, operator, Pool(cluster, names, list(names)), work)
    finally:
        operator.stop()
        for name in names:
            cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)

        def no_pods() -> bool:
            out = cluster.kubectl("get", "pods", "-A", "-o",
                                  "jsonpath={.items[*].metadata.namespace}", check=False)
            return not set(out.stdout.split()) & set(names)

        try:
            wait_until("the test namespaces' pods to be gone", no_pods, timeout=30)
        except AssertionError:
            pass
        kubelet.stop()
        for name in names:  # pods the kubelet could not finish: no node is left to do it
            cluster.kubectl("delete", "pods", "--all", "--force", "--grace-period=0",
                            namespace=name, check=False)
        shutil.rmtree(work, ignore_errors=True)


def digits_job(name: str = JOB, *, steps: int = 600, workers: int = 2,
               checkpoint: Path | None = None, checkpoint_every: int = 200,
               **worker: Any) -> dict[str, Any]:
    """examples/digits.yaml, shortened (and with checkpoints when `checkpoint`)."""
    training: dict[str, Any] = {
        "entrypoint": "pstrain_runtime.examples.digits:make_task",
        "steps": steps, "batchSize": 64, "mode": "async",
        "optimizer": {"name": "momentum", "learningRate": 0.05, "momentum": 0.9},
        "evalIntervalSteps": max(steps // 2, 1),
    }
    if checkpoint is not None:
        training["checkpoint"] = {"directory": str(checkpoint),
                                  "intervalSteps": checkpoint_every}
    return {
        "apiVersion": c.API_VERSION, "kind": c.KIND,
        "metadata": {"name": name},
        "spec": {
            "replicas": {"ps": {"replicas": 1}, "worker": {"replicas": workers, **worker}},
            "training": training,
            "runPolicy": {"activeDeadlineSeconds": 600},
        },
    }


def status(ns: Namespace, name: str = JOB) -> dict[str, Any]:
    proc = ns.kubectl("get", "tj", name, "-o", "json", check=False)
    if proc.returncode != 0:
        return {}
    return json.loads(proc.stdout).get("status") or {}


def wait_phase(e2e: E2E, ns: Namespace, phases: tuple[str, ...], timeout: float,
               name: str = JOB) -> dict[str, Any]:
    def reached() -> dict[str, Any] | None:
        st = status(ns, name)
        return st if st.get("phase") in phases else None

    try:
        return wait_until(f"job {name} in phase {'/'.join(phases)}", reached, timeout,
                          interval=0.3)
    except AssertionError as exc:
        raise AssertionError(f"{exc}{e2e.diagnostics(ns)}") from None


def wait_for(e2e: E2E, ns: Namespace, what: str, predicate: Any, timeout: float) -> Any:
    try:
        return wait_until(what, predicate, timeout, interval=0.3)
    except AssertionError as exc:
        raise AssertionError(f"{exc}{e2e.diagnostics(ns)}") from None


def pod(ns: Namespace, name: str) -> dict[str, Any] | None:
    proc = ns.kubectl("get", "pod", name, "-o", "json", check=False)
    return json.loads(proc.stdout) if proc.returncode == 0 else None


def job_events(ns: Namespace, name: str = JOB) -> list[dict[str, Any]]:
    return ns.get_json("events", "--field-selector",
                       f"involvedObject.kind={c.KIND},involvedObject.name={name}")["items"]


def columns(ns: Namespace, name: str = JOB) -> dict[str, str]:
    """`kubectl get tj NAME` as {column: value}."""
    lines = ns.kubectl("get", "tj", name).stdout.splitlines()
    header, row = lines[0].split(), lines[1].split()
    return dict(zip(header, row, strict=True))


# --------------------------------------------------------------------------- the tests


@dataclass
class Finished:
    """The digits job run once to Succeeded, watched from before it existed."""

    ns: Namespace
    watch: PodWatch
    status: dict[str, Any]


@pytest.fixture(scope="module")
def digits_done(e2e: E2E) -> Finished:
    ns = e2e.namespace()
    checkpoints = e2e.work / "digits-ckpt"
    with PodWatch(e2e.cluster, ns.name) as watch:
        ns.apply(digits_job(steps=600, checkpoint=checkpoints))
        final = wait_phase(e2e, ns, ("Succeeded", "Failed"), timeout=120)
        assert final["phase"] == "Succeeded", e2e.diagnostics(ns)
        wait_for(e2e, ns, "the PS to stop", lambda: watch.record(f"{JOB}-ps-0").stopped,
                 timeout=30)
    return Finished(ns, watch, final)


def terminated(obj: dict[str, Any] | None) -> dict[str, Any]:
    """The main container's `state.terminated` of a pod."""
    assert obj is not None, "the pod is gone"
    (main,) = [s for s in obj["status"]["containerStatuses"] if s["name"] == c.MAIN_CONTAINER]
    return main["state"]["terminated"]


def chief_summary(ns: Namespace) -> dict[str, Any]:
    """The chief's termination message, as kubelet.py recorded it in the pod's status."""
    return json.loads(terminated(pod(ns, f"{JOB}-worker-0"))["message"])


@pytest.mark.timeout(150)
def test_digits_succeeds_in_order_with_columns_and_events(digits_done: Finished) -> None:
    ns, watch = digits_done.ns, digits_done.watch
    ps, worker, chief = (f"{JOB}-ps-0", f"{JOB}-worker-1", f"{JOB}-worker-0")
    rec = {n: watch.record(n) for n in (ps, worker, chief)}
    assert all(len(r.uids) == 1 for r in rec.values()), rec  # nothing was restarted
    # Created, and Running, in order: the PS, then the non-chief worker, then the chief.
    assert rec[ps].created < rec[worker].created < rec[chief].created, rec
    assert rec[ps].running < rec[worker].running, rec
    assert rec[ps].running < rec[chief].running, rec
    # The PS stopped after the chief: it ran until the chief, done, shut it down (exit 0,
    # Succeeded), or the operator deleted it once the chief had Succeeded.
    assert rec[chief].final_phase == "Succeeded", rec
    events = [json.loads(line.split(" ", 1)[1]) for line in
              pod_log(ns.name, chief).splitlines() if line.startswith("PSTRAIN_EVENT ")]
    assert events[-1]["event"] == "done", events[-3:]
    if rec[ps].final_phase == "Succeeded":  # exit 0: only the chief's Shutdown does that
        finished = terminated(pod(ns, ps))["finishedAt"]
        assert finished >= time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                         time.gmtime(int(events[-1]["time"]))), finished
    else:
        assert rec[ps].stopped > rec[chief].stopped, rec
    # kubectl get tj: the Loss and Checkpoint columns are filled.
    cols = columns(ns)
    assert cols["PHASE"] == "Succeeded", cols
    assert cols["LOSS"] != "<none>" and float(cols["LOSS"]) > 0, cols
    assert cols["CHECKPOINT"] == "600", cols
    # Kubernetes Events on the job (their times have whole seconds: the order is the
    # watch's, above).
    reasons = {e["reason"] for e in job_events(ns)}
    assert reasons >= {"CreatedService", "CreatedPS", "StartedWorkers", "StartedChief",
                       "ChiefSucceeded"}, reasons


@pytest.mark.timeout(150)
def test_final_status_comes_from_the_chiefs_termination_message(
        digits_done: Finished) -> None:
    ns, final = digits_done.ns, digits_done.status
    summary = chief_summary(ns)
    assert summary["global_step"] == 600 and summary["done"] is True, summary
    assert final["progress"]["globalStep"] == summary["global_step"], final
    # The status keeps 4 significant digits of the loss (progress.LOSS_DIGITS).
    assert final["progress"]["loss"] == pytest.approx(summary["loss"], rel=1e-3), final
    assert final["lastCheckpoint"]["step"] == summary["checkpoint_step"] == 600, final
    assert final["lastCheckpoint"]["path"] == summary["checkpoint_path"], final
    assert Path(summary["checkpoint_path"]).is_file()
    assert final["completionTime"], final
    succeeded = [cond for cond in final["conditions"] if cond["type"] == c.COND_SUCCEEDED]
    assert succeeded and succeeded[0]["status"] == "True", final["conditions"]
    assert "at global step 600" in succeeded[0]["message"], succeeded


def running_job(e2e: E2E, ns: Namespace, job: dict[str, Any], min_step: int = 1,
                timeout: float = 90) -> dict[str, Any]:
    """Create `job` and wait until it runs and its progress shows `min_step`."""
    ns.apply(job)
    name = job["metadata"]["name"]

    def training() -> dict[str, Any] | None:
        st = status(ns, name)
        step = (st.get("progress") or {}).get("globalStep") or 0
        if st.get("phase") in ("Succeeded", "Failed"):
            raise AssertionError(f"job {name} ended {st.get('phase')} early: {st}"
                                 f"{e2e.diagnostics(ns)}")
        return st if st.get("phase") == "Running" and step >= min_step else None

    return wait_for(e2e, ns, f"job {name} to train to step {min_step}", training, timeout)


def volume_root(ns: Namespace, pod_name: str, volume: str) -> Path:
    """Where kubelet.py set up a pod's volume (what its container sees there)."""
    obj = pod(ns, pod_name)
    assert obj is not None, f"{pod_name} is gone"
    return pod_dir(ns.name, pod_name) / "volumes" / obj["metadata"]["uid"] / volume


def volume_files(ns: Namespace, pod_name: str, volume: str) -> dict[str, str]:
    """The files kubelet.py wrote for a pod's volume (what its container sees)."""
    return {p.name: p.read_text() for p in volume_root(ns, pod_name, volume).iterdir()
            if not p.name.startswith("..")}


@pytest.mark.timeout(150)
def test_auth_secret_is_mounted_and_a_wrong_key_is_refused(e2e: E2E, ns: Namespace) -> None:
    running_job(e2e, ns, digits_job(steps=200000))
    secret = ns.get_json("secret", security.secret_name(JOB))
    assert secret["immutable"] is True
    assert secret["metadata"]["ownerReferences"][0]["kind"] == c.KIND
    keys = {k: base64.b64decode(v).decode() for k, v in secret["data"].items()}
    assert set(keys) == set(security.KEY_ROLES)
    # Each replica sees exactly the keys it may hold, with the Secrets' values: worker 1
    # only its own key, from a Secret of its own (it cannot act for another worker).
    for pod_name, holder in ((f"{JOB}-ps-0", "ps"), (f"{JOB}-worker-0", "chief")):
        files = volume_files(ns, pod_name, security.AUTH_VOLUME)
        assert files == {k: keys[k] for k in security.KEYS_FOR_HOLDER[holder]}, pod_name
    own = ns.get_json("secret", security.worker_secret_name(JOB, 1))
    assert own["immutable"] is True
    assert own["metadata"]["ownerReferences"] == secret["metadata"]["ownerReferences"]
    worker_key = security.decode_key(keys["worker"], "worker")
    assert {k: base64.b64decode(v).decode() for k, v in own["data"].items()} == {
        "worker-1": security.encode_key(security.own_worker_key(worker_key, 1))}
    assert volume_files(ns, f"{JOB}-worker-1", security.AUTH_VOLUME) == {
        "worker-1": security.encode_key(security.own_worker_key(worker_key, 1))}

    # A replica of the job with keys of another job: the parameter server refuses it.
    other = security.derive_keys(security.new_token())[security.KEY_WORKER]
    wrong = {"worker-1": base64.b64encode(security.encode_key(
        security.own_worker_key(other, 1)).encode()).decode()}
    ns.apply({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "wrong-keys"},
              "data": wrong})
    worker = pod(ns, f"{JOB}-worker-1")
    assert worker is not None
    spec = worker["spec"]
    for field_name in ("nodeName", "hostname", "subdomain"):
        spec.pop(field_name, None)
    for volume in spec["volumes"]:
        if volume["name"] == security.AUTH_VOLUME:
            volume["secret"]["secretName"] = "wrong-keys"
    ns.apply({"apiVersion": "v1", "kind": "Pod",
              "metadata": {"name": "intruder", "labels": {"test": "intruder"}},
              "spec": spec})
    intruder = wait_for(e2e, ns, "the intruder to fail", lambda: (
        (p := pod(ns, "intruder")) and p["status"].get("phase") in ("Failed", "Succeeded")
        and p), timeout=60)
    assert intruder["status"]["phase"] == "Failed", intruder["status"]
    message = terminated(intruder).get("message", "")
    assert "credentials are not valid for this job" in message, message
    assert status(ns)["phase"] == "Running", status(ns)
    ns.kubectl("delete", "tj", JOB, "--wait=false")


def metric(address: str, name: str) -> float | None:
    try:
        with urllib.request.urlopen(f"http://{address}/metrics", timeout=2) as resp:
            text = resp.read().decode()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return None


@pytest.mark.timeout(150)
def test_a_job_with_tls_starts_and_succeeds(e2e: E2E, ns: Namespace, tmp_path: Path) -> None:
    """spec.security.tls names a kubernetes.io/tls Secret (as cert-manager would issue
    for `*.<job>.<namespace>.svc`): until it exists the job says so and makes no pod;
    then the servers serve TLS only, so their readiness probe is a TCP check (a
    kubelet's gRPC probe speaks plaintext only: with it the servers never turned
    Ready), and the job trains to Succeeded over TLS."""
    pytest.importorskip("cryptography")
    from tests.runtime.tls_certs import write_tls_dir

    job = digits_job(steps=300, workers=1)
    job["spec"]["security"] = {"tls": {"secretName": "digits-tls"}}
    ns.apply(job)  # before its Secret, as when cert-manager has not issued it yet
    rejected = wait_for(e2e, ns, "the missing Secret in the job's conditions", lambda: [
        cond for cond in status(ns).get("conditions") or []
        if cond["type"] == "CreateRejected" and cond["status"] == "True"], timeout=30)
    assert ("spec.security.tls.secretName is 'digits-tls'; no Secret of that name"
            in rejected[0]["message"]), rejected
    assert not ns.get_json("pods")["items"]
    certs = write_tls_dir(tmp_path / "tls", dns_names=(f"*.{JOB}.{ns.name}.svc",))
    ns.kubectl("create", "secret", "generic", "digits-tls", "--type=kubernetes.io/tls",
               *(f"--from-file={f}={certs / f}" for f in ("tls.crt", "tls.key", "ca.crt")))
    final = wait_phase(e2e, ns, ("Succeeded", "Failed"), timeout=120)
    assert final["phase"] == "Succeeded", f"{final}{e2e.diagnostics(ns)}"
    assert final["progress"]["globalStep"] == 300, final


@pytest.mark.timeout(150)
def test_kubectl_scale_adds_a_worker_that_trains(e2e: E2E, ns: Namespace) -> None:
    running_job(e2e, ns, digits_job(steps=200000, workers=1, minReplicas=1, maxReplicas=3))
    assert pod(ns, f"{JOB}-worker-1") is None
    ns.kubectl("scale", f"tj/{JOB}", "--replicas=2")
    newcomer = f"{JOB}-worker-1"

    def joined() -> bool:
        return "pstrain: worker 1 joins at step" in pod_log(ns.name, newcomer)

    wait_for(e2e, ns, "the new worker to join", joined, timeout=60)
    st = wait_for(e2e, ns, "the worker set [0, 1] on the servers", lambda: (
        (st := status(ns)).get("workers", {}).get("members") == [0, 1] and st), timeout=30)
    assert st["workers"]["desired"] == 2 and st["workers"]["live"] == 2, st["workers"]
    ip = pod(ns, newcomer)["status"]["podIP"]
    wait_for(e2e, ns, "the new worker's steps", lambda: (
        metric(f"{ip}:{c.METRICS_PORT}", "pstrain_worker_steps_total") or 0) > 10, timeout=30)
    reasons = [e["reason"] for e in job_events(ns)]
    assert "WorkersScaledUp" in reasons, reasons
    ns.kubectl("delete", "tj", JOB, "--wait=false")


def chief_events(ns: Namespace, kind: str, job: str = JOB) -> list[dict[str, Any]]:
    """The runtime's events of `kind` in the log of the chief's current pod."""
    out = []
    for line in pod_log(ns.name, f"{job}-worker-0").splitlines():
        if line.startswith("PSTRAIN_EVENT "):
            event = json.loads(line.split(" ", 1)[1])
            if event["event"] == kind:
                out.append(event)
    return out


ROUTINE_EVENTS = tuple(f'PSTRAIN_EVENT {{"event":"{kind}"'
                       for kind in ("progress", "loss", "checkpoint"))


def log_tail(path: Path, lines: int = 40) -> str:
    """The last `lines` lines of a replica's log, its routine events (progress, loss,
    checkpoint) left out; "" when there is none."""
    if not path.exists():
        return ""
    kept = [line for line in path.read_text(errors="replace").splitlines()
            if not line.startswith(ROUTINE_EVENTS)]
    return "\n".join(kept[-lines:])


def assert_restored_server_0(ns: Namespace, restored: list[dict[str, Any]],
                             job: str = JOB) -> None:
    """The chief's last restore re-initialised server 0 from a checkpoint of step 50 or
    later. A restore without `servers` is one at the chief's own start: the chief failed
    and started again, so the message shows why, from the log it left (the log of an
    earlier pod of that name is kept as pstrain.log.prev; a restarted container's is
    in pstrain.log, before its restore)."""
    last = restored[-1]
    if "servers" not in last:
        where = pod_dir(ns.name, f"{job}-worker-0")
        raise AssertionError(
            f"the chief's last restore was at its own start, not of a replaced server: it "
            f"failed and started again; restored events {restored}\n"
            f"--- {where / 'pstrain.log.prev'}\n{log_tail(where / 'pstrain.log.prev')}\n"
            f"--- {where / 'pstrain.log'}\n{log_tail(where / 'pstrain.log')}")
    assert last["servers"] == [0] and last["step"] >= 50, restored


def set_suspend(ns: Namespace, value: bool) -> None:
    ns.kubectl("patch", "tj", JOB, "--type=merge", "-p",
               json.dumps({"spec": {"runPolicy": {"suspend": value}}}))


def step_beyond(ns: Namespace, step: int, job: str = JOB) -> bool:
    return ((status(ns, job).get("progress") or {}).get("globalStep") or 0) > step


@pytest.mark.timeout(150)
def test_suspend_and_resume_continues_from_the_checkpoint(e2e: E2E, ns: Namespace,
                                                          tmp_path: Path) -> None:
    job = digits_job(steps=200000, workers=1, checkpoint=tmp_path / "ckpt",
                     checkpoint_every=100000)
    running_job(e2e, ns, job, min_step=100)
    set_suspend(ns, True)
    suspended = wait_phase(e2e, ns, ("Suspended",), timeout=60)
    # The chief wrote a checkpoint on request before its pods were deleted.
    step = suspended["lastCheckpoint"]["step"]
    assert step >= 100, suspended
    assert (tmp_path / "ckpt").is_dir()
    reasons = {e["reason"] for e in job_events(ns)}
    assert {"CheckpointRequested", "CheckpointConfirmed", "JobSuspended"} <= reasons, reasons
    wait_for(e2e, ns, "no pods", lambda: not ns.get_json("pods")["items"], timeout=60)

    set_suspend(ns, False)
    wait_for(e2e, ns, "the resume", lambda: status(ns).get("resumedFromStep") == step,
             timeout=30)
    # The new chief restored exactly that checkpoint, and training goes on from it.
    restored = wait_for(e2e, ns, "the new chief to restore the checkpoint",
                        lambda: chief_events(ns, "restored"), timeout=60)
    assert [e["step"] for e in restored] == [step], restored
    wait_for(e2e, ns, "training beyond the checkpoint", lambda: step_beyond(ns, step),
             timeout=60)
    assert status(ns)["phase"] == "Running"
    assert "JobResumed" in {e["reason"] for e in job_events(ns)}


@pytest.mark.timeout(150)
def test_a_deleted_ps_pod_is_recovered(e2e: E2E, ns: Namespace, tmp_path: Path) -> None:
    job = digits_job(steps=200000, workers=1, checkpoint=tmp_path / "ckpt",
                     checkpoint_every=50)
    running_job(e2e, ns, job, min_step=60)
    wait_for(e2e, ns, "a checkpoint", lambda: chief_events(ns, "checkpoint"), timeout=30)
    ps = f"{JOB}-ps-0"
    old_uid = pod(ns, ps)["metadata"]["uid"]
    chief_uid = pod(ns, f"{JOB}-worker-0")["metadata"]["uid"]
    ns.kubectl("delete", "pod", ps, "--wait=false")

    def replaced() -> bool:
        p = pod(ns, ps)
        return bool(p and p["metadata"]["uid"] != old_uid
                    and p["status"].get("phase") == "Running")

    wait_for(e2e, ns, "a new PS pod", replaced, timeout=60)
    # The chief re-initialised the new server from the last checkpoint, and training
    # goes on from there with the same chief.
    restored = wait_for(e2e, ns, "the chief to restore the new PS",
                        lambda: chief_events(ns, "restored"), timeout=90)
    assert_restored_server_0(ns, restored)
    wait_for(e2e, ns, "training beyond the restored step",
             lambda: step_beyond(ns, restored[-1]["step"]), timeout=60)
    final = status(ns)
    assert final["phase"] == "Running", final
    assert pod(ns, f"{JOB}-worker-0")["metadata"]["uid"] == chief_uid  # not restarted
    reasons = {e["reason"] for e in job_events(ns)}
    assert "CreatedPS" in reasons, reasons


def container_pid(e2e: E2E, ns: Namespace, pod_name: str) -> int | None:
    """The pid of the latest start of a pod's main container, from kubelet.py's log."""
    pattern = re.compile(rf"{re.escape(ns.name)}/{re.escape(pod_name)}: container "
                         rf"{c.MAIN_CONTAINER} started, pid (\d+)")
    found = pattern.findall(e2e.kubelet.log.read_text(errors="replace"))
    return int(found[-1]) if found else None


@pytest.mark.timeout(150)
def test_a_hung_ps_is_killed_by_its_liveness_probe_and_restored(
        e2e: E2E, ns: Namespace, tmp_path: Path) -> None:
    """A parameter server that stops answering (SIGSTOP: its process is there, its port
    accepts, nothing answers) fails its livenessProbe (the module's operator gives it
    LIVENESS_SECONDS), its kubelet kills it, the restart policy makes a new PS pod and
    the chief restores it from the checkpoint, with the same chief. Before, the job
    stalled for good."""
    job = digits_job(steps=200000, workers=1, checkpoint=tmp_path / "ckpt",
                     checkpoint_every=50)
    job["spec"]["replicas"]["ps"]["template"] = {"spec": {"terminationGracePeriodSeconds": 2}}
    job["spec"]["runPolicy"]["restartPolicy"] = "OnFailure"
    running_job(e2e, ns, job, min_step=60)
    wait_for(e2e, ns, "a checkpoint", lambda: chief_events(ns, "checkpoint"), timeout=30)
    ps = f"{JOB}-ps-0"
    probe = pod(ns, ps)["spec"]["containers"][0]["livenessProbe"]
    assert probe["grpc"]["port"] == c.REPLICA_PORT, probe  # the server defaults service ""
    old_uid = pod(ns, ps)["metadata"]["uid"]
    chief_uid = pod(ns, f"{JOB}-worker-0")["metadata"]["uid"]
    pid = container_pid(e2e, ns, ps)
    assert pid is not None, e2e.kubelet.tail(40)
    os.killpg(pid, signal.SIGSTOP)  # hung: alive, its sockets open, silent

    def replaced() -> bool:
        p = pod(ns, ps)
        return bool(p and p["metadata"]["uid"] != old_uid
                    and p["status"].get("phase") == "Running")

    wait_for(e2e, ns, "a new PS pod", replaced, timeout=LIVENESS_SECONDS + 40)
    assert f"{ns.name}/{ps}: container {c.MAIN_CONTAINER} failed its liveness probe" in (
        e2e.kubelet.log.read_text(errors="replace"))
    restored = wait_for(e2e, ns, "the chief to restore the new PS",
                        lambda: chief_events(ns, "restored"), timeout=90)
    assert_restored_server_0(ns, restored)
    wait_for(e2e, ns, "training beyond the restored step",
             lambda: step_beyond(ns, restored[-1]["step"]), timeout=60)
    assert status(ns)["phase"] == "Running"
    assert pod(ns, f"{JOB}-worker-0")["metadata"]["uid"] == chief_uid  # not restarted
    restarts = [e for e in job_events(ns) if e["reason"] == "RestartingReplica"]
    assert restarts and ps in restarts[-1]["message"], restarts


def disk_tier_job(checkpoint: Path) -> dict[str, Any]:
    """examples/ctr.yaml, small, with uniform ids over 104,000 rows of dim 8 (about
    6.6 MB with Adagrad's state) on one server whose memory budget is 4 MiB: the rows
    beyond it live in an emptyDir, as docs/sparse.md declares it."""
    return {
        "apiVersion": c.API_VERSION, "kind": c.KIND,
        "metadata": {"name": "ctrdisk"},
        "spec": {
            "replicas": {
                "ps": {"replicas": 1, "template": {"spec": {
                    "containers": [{"name": c.MAIN_CONTAINER, "volumeMounts": [
                        {"name": "rows", "mountPath": "/var/lib/pstrain/rows"}]}],
                    "volumes": [{"name": "rows", "emptyDir": {}}]}}},
                "worker": {"replicas": 1}},
            "training": {
                "entrypoint": "pstrain_runtime.examples.ctr:make_task",
                "args": {"rows": 4000, "embedding_dim": 8, "zipf": 0, "eval_size": 512},
                "steps": 200000, "batchSize": 64, "mode": "async",
                "optimizer": {"name": "adagrad", "learningRate": 0.05},
                "evalIntervalSteps": 100000,
                "checkpoint": {"directory": str(checkpoint), "intervalSteps": 50},
                "sparseStorage": {"serverMemory": "4Mi",
                                  "directory": "/var/lib/pstrain/rows"}},
            "runPolicy": {"activeDeadlineSeconds": 600},
        },
    }


def disk_rows(ns: Namespace, pod_name: str) -> list[Path]:
    """The disk tier's files in a PS pod's emptyDir (what kubelet.py set up for it)."""
    root = volume_root(ns, pod_name, "rows")
    return sorted(root.glob("pstrain-ps0/rows-*/*")) if root.is_dir() else []


@pytest.mark.timeout(180)
def test_a_ps_with_a_disk_tier_restarted_on_a_new_node_restores_from_the_checkpoint(
        e2e: E2E, ns: Namespace, tmp_path: Path) -> None:
    """Issue 25 goal 4 on a real API server: the disk tier is declared in the PS's pod
    template (an emptyDir), the server keeps the rows beyond its budget there; its pod
    deleted, the new pod gets a new, empty emptyDir (as on a new node), and the chief
    restores the server's rows from the last checkpoint; the new server's rows beyond
    its budget go to its new volume, and training goes on with the same chief."""
    job, ps, chief = "ctrdisk", "ctrdisk-ps-0", "ctrdisk-worker-0"
    running_job(e2e, ns, disk_tier_job(tmp_path / "ckpt"), min_step=120, timeout=120)
    wait_for(e2e, ns, "a checkpoint", lambda: chief_events(ns, "checkpoint", job), timeout=60)
    old = pod(ns, ps)
    assert old is not None
    spilled = wait_for(e2e, ns, "rows on the PS's disk tier", lambda: disk_rows(ns, ps),
                       timeout=30)
    old_volume = spilled[0].parents[2]
    chief_uid = pod(ns, chief)["metadata"]["uid"]  # type: ignore[index]
    ns.kubectl("delete", "pod", ps, "--wait=false")

    def replaced() -> bool:
        p = pod(ns, ps)
        return bool(p and p["metadata"]["uid"] != old["metadata"]["uid"]
                    and p["status"].get("phase") == "Running")

    wait_for(e2e, ns, "a new PS pod", replaced, timeout=60)
    restored = wait_for(e2e, ns, "the chief to restore the new PS",
                        lambda: chief_events(ns, "restored", job), timeout=90)
    assert_restored_server_0(ns, restored, job)
    wait_for(e2e, ns, "training beyond the restored step",
             lambda: step_beyond(ns, restored[-1]["step"], job), timeout=60)
    # The new server's rows beyond its budget are on its own, new volume.
    fresh = wait_for(e2e, ns, "rows on the new PS's disk tier", lambda: disk_rows(ns, ps),
                     timeout=30)
    assert fresh[0].parents[2] != old_volume, (fresh[0], old_volume)
    # Starting until the new server is Ready again, then Running.
    final = wait_phase(e2e, ns, ("Running",), timeout=30, name=job)
    assert pod(ns, chief)["metadata"]["uid"] == chief_uid  # type: ignore[index]
    assert (final.get("progress") or {}).get("sparseRows", 0) > 0, final
    ns.kubectl("delete", "tj", job, "--wait=false")


@pytest.mark.timeout(180)
@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_the_example_succeeds_as_written(e2e: E2E, ns: Namespace, path: Path) -> None:
    """`kubectl apply -f examples/NAME.yaml`, as the README and the examples' own
    headers tell a user: the job reaches Succeeded."""
    ns.kubectl("apply", "-f", str(path))
    name = yaml.safe_load(path.read_text())["metadata"]["name"]
    final = wait_phase(e2e, ns, ("Succeeded", "Failed"), timeout=150, name=name)
    assert final["phase"] == "Succeeded", f"{final}{e2e.diagnostics(ns)}"


@pytest.mark.timeout(120)
def test_deleting_the_job_removes_every_child(e2e: E2E, ns: Namespace) -> None:
    running_job(e2e, ns, digits_job(steps=200000))
    selector = f"{c.LABEL_JOB}={JOB}"
    kinds = "pods,services,secrets,networkpolicies"

    def children() -> list[str]:
        items = ns.get_json(kinds, "-l", selector)["items"]
        return sorted(f"{i['kind']}/{i['metadata']['name']}" for i in items)

    found = children()
    assert {k.split("/")[0] for k in found} == {"Pod", "Service", "Secret", "NetworkPolicy"}, \
        found
    # No finalizer holds the job (kopf adds one for timers, daemons and deletion handlers).
    assert not ns.get_json("tj", JOB)["metadata"].get("finalizers")
    ns.kubectl("delete", "tj", JOB, "--wait=true", "--timeout=30s", timeout=40)
    wait_for(e2e, ns, "every child of the job to be gone", lambda: not children(),
             timeout=60)


@pytest.mark.timeout(120)
def test_a_refused_scale_then_a_good_one_leaves_no_invalid_spec(e2e: E2E, ns: Namespace) -> None:
    running_job(e2e, ns, digits_job(steps=200000, workers=1, minReplicas=1, maxReplicas=2))
    bad = ns.kubectl("scale", f"tj/{JOB}", "--replicas=5", check=False)
    assert bad.returncode != 0, bad.stdout
    assert "replicas is 5; it must be at most maxReplicas" in bad.stderr, bad.stderr
    ns.kubectl("scale", f"tj/{JOB}", "--replicas=2")
    wait_for(e2e, ns, "the second worker", lambda: (
        p := pod(ns, f"{JOB}-worker-1")) and p["status"].get("phase") == "Running",
        timeout=60)
    st = wait_for(e2e, ns, "the scale in the status", lambda: (
        (st := status(ns)).get("workers", {}).get("desired") == 2 and st), timeout=30)
    invalid = [cond for cond in st["conditions"] if cond.get("reason") == "InvalidSpec"]
    assert not invalid, st["conditions"]
    created = [cond for cond in st["conditions"] if cond["type"] == c.COND_CREATED]
    assert created and created[0]["status"] == "True", st["conditions"]
    assert st["phase"] == "Running", st
    assert "InvalidSpec" not in {e["reason"] for e in job_events(ns)}
    ns.kubectl("delete", "tj", JOB, "--wait=false")


def invalid_spec(e2e: E2E, ns: Namespace, says: str) -> dict[str, Any]:
    """The job's InvalidSpec condition once its message says `says`."""
    def found() -> dict[str, Any] | None:
        conds = [cond for cond in status(ns).get("conditions") or []
                 if cond.get("reason") == "InvalidSpec" and says in cond.get("message", "")]
        return conds[0] if conds else None

    return wait_for(e2e, ns, f"InvalidSpec saying {says!r}", found, timeout=30)


@pytest.mark.timeout(150)
def test_a_disk_tier_off_a_mounted_volume_is_refused_before_any_pod(
        e2e: E2E, ns: Namespace) -> None:
    """spec.training.sparseStorage.serverMemory without a directory, then with one that
    no volume of the PS's main container holds: the API server stores the job (no CEL
    rule: `pstrain run` accepts it), the operator refuses it before it creates anything,
    in one line naming the field, the value and the rule, and changes nothing of the
    user's; with a volume mounted there, the job starts."""
    field = "spec.training.sparseStorage.directory"
    job = digits_job(steps=200000, workers=1)
    storage: dict[str, Any] = {"serverMemory": "256Mi"}
    job["spec"]["training"]["sparseStorage"] = storage
    ns.apply(job)
    cond = invalid_spec(e2e, ns, f"{field} is missing; with serverMemory set")
    assert "spec.replicas.ps.template" in cond["message"] and "\n" not in cond["message"]
    storage["directory"] = "/var/lib/pstrain/rows"
    ns.apply(job)
    cond = invalid_spec(e2e, ns, f"{field} is '/var/lib/pstrain/rows'; it must be at or "
                        "under the mountPath of a volumeMounts entry")
    assert cond["status"] == "False" and cond["type"] == c.COND_CREATED, cond
    kinds = "pods,services,secrets,networkpolicies"
    assert ns.get_json(kinds, "-l", f"{c.LABEL_JOB}={JOB}")["items"] == []
    assert ns.get_json("tj", JOB)["spec"]["training"]["sparseStorage"] == storage
    assert "InvalidSpec" in {e["reason"] for e in job_events(ns)}

    job["spec"]["replicas"]["ps"]["template"] = {"spec": {
        "containers": [{"name": c.MAIN_CONTAINER, "volumeMounts": [
            {"name": "rows", "mountPath": "/var/lib/pstrain"}]}],
        "volumes": [{"name": "rows", "emptyDir": {}}]}}
    st = running_job(e2e, ns, job, min_step=1)
    assert "InvalidSpec" not in {cond.get("reason") for cond in st["conditions"]}, st
    ns.kubectl("delete", "tj", JOB, "--wait=false")
