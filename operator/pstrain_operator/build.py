"""Pure constructors of a TrainingJob's children: one pod per replica and the headless
Service. They return plain dicts (the Kubernetes wire format) and import neither kopf
nor kubernetes, so they are tested as whole objects and shared by any executor.

Invariants of every pod:
- named `<job>-<role>-<index>` (pstrain_api.names), hostname = that name, subdomain =
  the job's Service, so it resolves at the address the cluster spec gives;
- labels job/role/index/is-chief/managed-by, an ownerReference (controller) to the job;
- the cluster-spec environment in EVERY container (main, sidecars, init containers);
- the runtime's main container declares the metrics port (9400, `metrics`) and is told it
  in PSTRAIN_METRICS_PORT; a parameter server's also declares the gRPC port and the
  data-plane port and is told the latter in PSTRAIN_DATA_PORT (`data_plane_env`); it is
  probed for
  readiness as its program allows (`readiness_probe`) and, a PS of the runtime's, for
  liveness (`liveness_probe`);
- built from the role's PodTemplateSpec: its first container (named pstrain) is the
  replica's; `command: ["pstrain", "replica"]`, the operator's runtime image and a
  restrictive security context unless the template sets them;
- `restartPolicy: Never` (the operator restarts replicas according to the run policy);
- the main container's `terminationMessagePolicy: FallbackToLogsOnError`: the replica's
  last error line (or, after a crash, the tail of its log) stays in the pod's status,
  where the operator reads it before the pod is deleted or restarted;
- annotation `pstrain.io/spec-hash` of the spec parts a pod is built from, and
  `pstrain.io/applied-spec` with those parts, so a change that cannot be applied live
  is detected and the job keeps running on what its pods were built from.
"""

from __future__ import annotations

import copy
import hashlib
import json
from collections.abc import Mapping
from typing import Any

from pstrain_api import constants as c
from pstrain_api.cluster import ClusterSpec, Task
from pstrain_api.model import ReplicaSpec, Security, TrainingJob
from pstrain_api.names import service_name
from pstrain_api.readiness import readiness_gate, runs_pstrain_runtime, user_probe

from .gang import apply_to_pod as apply_gang
from .gang import startup_env
from .settings import PodSettings

ANNOTATION_SPEC_HASH = f"{c.GROUP}/spec-hash"
ANNOTATION_APPLIED_SPEC = f"{c.GROUP}/applied-spec"
REPLICA_COMMAND = ("pstrain", "replica")

RESTRICTED_CONTAINER_SECURITY: dict[str, Any] = {
    "allowPrivilegeEscalation": False,
    "capabilities": {"drop": ["ALL"]},
    "runAsNonRoot": True,
    "seccompProfile": {"type": "RuntimeDefault"},
}
RESTRICTED_POD_SECURITY: dict[str, Any] = {
    "runAsNonRoot": True,
    "seccompProfile": {"type": "RuntimeDefault"},
}


def applied_spec(job: TrainingJob) -> dict[str, Any]:
    """The parts of the spec that pods are built from and that cannot change live.
    `security` is there only when it is not the default, so pods built before it
    existed keep their hash."""
    applied = {
        "replicas": job.spec.replicas.to_api(),
        "training": job.spec.training.to_api(),
    }
    if job.spec.security != Security():
        applied["security"] = job.spec.security.to_api()
    return applied


def spec_hash(job: TrainingJob) -> str:
    text = json.dumps(applied_spec(job), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def owner_reference(job: TrainingJob) -> dict[str, Any]:
    """Controller reference: deleting the job garbage-collects its children."""
    return {
        "apiVersion": c.API_VERSION,
        "kind": c.KIND,
        "name": job.name,
        "uid": job.metadata.uid or "",
        "controller": True,
        "blockOwnerDeletion": True,
    }


def controller_uid(meta: Mapping[str, Any]) -> str:
    """The uid of the controller an object's metadata names ("" when none)."""
    return next((str(ref.get("uid") or "") for ref in meta.get("ownerReferences") or []
                 if ref.get("controller")), "")


def job_labels(job: TrainingJob) -> dict[str, str]:
    return {c.LABEL_JOB: job.name, c.LABEL_MANAGED_BY: c.MANAGED_BY}


def job_selector(job_name: str) -> str:
    """The label selector listing one job's children on the API server."""
    return f"{c.LABEL_JOB}={job_name},{c.LABEL_MANAGED_BY}={c.MANAGED_BY}"


def replica_labels(job: TrainingJob, task: Task, is_chief: bool) -> dict[str, str]:
    return {
        **job_labels(job),
        c.LABEL_ROLE: task.role,
        c.LABEL_INDEX: str(task.index),
        c.LABEL_IS_CHIEF: "true" if is_chief else "false",
    }


def _env_list(env: dict[str, str]) -> list[dict[str, Any]]:
    return [{"name": k, "value": v} for k, v in env.items()]


def _with_cluster_env(container: dict[str, Any], env: dict[str, str]) -> dict[str, Any]:
    """`container` with the cluster-spec variables set, replacing any same-named ones."""
    out = copy.deepcopy(container)
    kept = [e for e in out.get("env") or [] if e.get("name") not in env]
    out["env"] = _env_list(env) + kept
    return out


def data_plane_env(task: Task) -> dict[str, str]:
    """Where a parameter server pod listens for tensor calls: the fixed data port its pod
    declares. Only pods get it; the local runner leaves it unset, so each of the PS that
    share one host there takes a free port and announces it in Info."""
    return {c.ENV_DATA_PORT: str(c.DATA_PORT)} if task.role == c.ROLE_PS else {}


def _resources(spec: ReplicaSpec, container: dict[str, Any]) -> dict[str, Any]:
    """The main container's resources: the template's, then the role's `resources`
    (per resource name), then the `gpus` shortcut."""
    out = copy.deepcopy(container)
    for part in ("requests", "limits"):
        values = dict(out.get(part) or {})
        values.update(getattr(spec.resources, part) or {} if spec.resources else {})
        if part == "limits" and spec.gpus:
            values[c.GPU_RESOURCE] = spec.gpus
        if values:
            out[part] = values
    return out


def metrics_env(spec: ReplicaSpec) -> dict[str, str]:
    """Where the pstrain runtime serves /metrics (the pod declares the port `metrics`);
    a program of the user's own gets neither."""
    return {c.ENV_METRICS_PORT: str(c.METRICS_PORT)} if runs_pstrain_runtime(spec) else {}


def readiness_probe(spec: ReplicaSpec, task: Task, tls: bool = False
                    ) -> dict[str, Any] | None:
    """The main container's readinessProbe: the role's readiness gate
    (pstrain_api.readiness) as a probe. A parameter server is probed on its replica port
    by default (workers start once every PS is Ready); other roles only when the user
    asks for a check by `readiness` or a probe of their own. With `tls` (the job's
    spec.security.tls) the gRPC health check is a TCP check of the port: a kubelet's
    gRPC probe speaks plaintext only, which a TLS-only server never answers."""
    gate = readiness_gate(spec)
    if gate == c.GATE_PROBE:
        return copy.deepcopy(user_probe(spec))
    if gate == c.GATE_NONE or (task.role != c.ROLE_PS and spec.readiness == "Auto"):
        return None
    check: dict[str, Any] = (
        {"grpc": {"port": c.REPLICA_PORT}} if gate == c.GATE_GRPC and not tls
        else {"tcpSocket": {"port": c.REPLICA_PORT}})
    return {**check, "periodSeconds": 2, "failureThreshold": 3}


LIVENESS_DELAY = 30  # seconds: torch's import and the server's start, on a busy node


def liveness_probe(spec: ReplicaSpec, task: Task, tls: bool, seconds: int
                   ) -> dict[str, Any] | None:
    """The main container's livenessProbe where it can tell a hung server from a busy
    one: a parameter server whose readiness is pstrain's gRPC health check, without
    TLS. A server that stops answering it (stopped, deadlocked, stuck in I/O) is killed
    by its kubelet and brought back by the job's restart policy, restored from the
    checkpoint; before, it held the job in Starting (or its workers stalled) for good.
    No probe under TLS (a TCP check passes on a hung process, whose kernel still
    accepts: the kubelet's gRPC probe speaks no TLS), nor for other roles (the stall
    watchdog restarts hung workers) or programs of their own.

    `seconds` (the operator's PSTRAIN_OPERATOR_PS_LIVENESS_SECONDS, 0: no probe): how
    long the check may go unanswered, from LIVENESS_DELAY after the start: checks a
    sixth of it apart (2 s at least), each given up to 5 s."""
    if (not seconds or task.role != c.ROLE_PS or tls
            or readiness_gate(spec) != c.GATE_GRPC):
        return None
    period = max(2, seconds // 6)
    return {"grpc": {"port": c.REPLICA_PORT}, "initialDelaySeconds": LIVENESS_DELAY,
            "periodSeconds": period, "timeoutSeconds": min(5, period),
            "failureThreshold": -(-seconds // period)}


def build_pod(
    job: TrainingJob, cluster: ClusterSpec, task: Task, settings: PodSettings
) -> dict[str, Any]:
    """The pod of replica `task`: the role's PodTemplateSpec, with pstrain's fields set
    and its defaults filled in where the template leaves a field unset."""
    spec = job.replica_spec(task.role)
    template = copy.deepcopy(spec.template or {})
    pod_spec: dict[str, Any] = template.get("spec") or {}
    name = cluster.replica_name(task)
    env = cluster.env(task)

    user_containers = pod_spec.get("containers") or [{"name": c.MAIN_CONTAINER}]
    own_env = {**data_plane_env(task), **startup_env(job, task), **metrics_env(spec)}
    main = _main_container(user_containers[0], spec, task, env, own_env, settings)
    tls = job.spec.security.tls is not None
    probe = readiness_probe(spec, task, tls)
    if probe is not None:
        main["readinessProbe"] = probe
    probe = liveness_probe(spec, task, tls, settings.ps_liveness_seconds)
    if probe is not None and "livenessProbe" not in main:  # a template's own is kept
        main["livenessProbe"] = probe
    pod_spec["containers"] = [main] + [_with_cluster_env(s, env) for s in user_containers[1:]]
    if pod_spec.get("initContainers"):
        pod_spec["initContainers"] = [_with_cluster_env(i, env)
                                      for i in pod_spec["initContainers"]]
    pod_spec.update({
        "hostname": name,
        "subdomain": service_name(job.name),
        "restartPolicy": "Never",
    })
    pod_spec.setdefault("enableServiceLinks", False)
    if settings.pod_security == "restricted":  # each container without one of its own
        pod_spec.setdefault("securityContext", copy.deepcopy(RESTRICTED_POD_SECURITY))
        for ctr in pod_spec["containers"] + pod_spec.get("initContainers", []):
            ctr.setdefault("securityContext", copy.deepcopy(RESTRICTED_CONTAINER_SECURITY))

    meta = template.get("metadata") or {}
    annotations = dict(meta.get("annotations") or {})
    annotations[ANNOTATION_SPEC_HASH] = spec_hash(job)
    annotations[ANNOTATION_APPLIED_SPEC] = json.dumps(
        applied_spec(job), sort_keys=True, separators=(",", ":")
    )
    labels = dict(meta.get("labels") or {})
    labels.update(replica_labels(job, task, cluster.is_chief(task)))
    return apply_gang(job, {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": job.namespace,
            "labels": labels,
            "annotations": annotations,
            "ownerReferences": [owner_reference(job)],
        },
        "spec": pod_spec,
    })


def _main_container(user: dict[str, Any], spec: ReplicaSpec, task: Task,
                    env: dict[str, str], own_env: dict[str, str],
                    settings: PodSettings) -> dict[str, Any]:
    """The replica's own container: the template's first container with the cluster-spec
    environment first, pstrain's ports, the GPU limit, and the defaults (runtime image,
    `pstrain replica`); `build_pod` adds the readiness probe and the security context."""
    main = copy.deepcopy(user)
    main["name"] = c.MAIN_CONTAINER
    main.setdefault("image", settings.runtime_image)
    main.setdefault("command", list(REPLICA_COMMAND))
    main["env"] = _env_list({**env, **own_env}) + list(main.get("env") or [])
    # The replica writes its last error line to /dev/termination-log (the chief its final
    # summary on success); a crash that wrote none leaves the tail of its log there.
    main.setdefault("terminationMessagePolicy", "FallbackToLogsOnError")
    resources = _resources(spec, main.get("resources") or {})
    if resources:
        main["resources"] = resources
    main["ports"] = ([{"name": c.METRICS_PORT_NAME, "containerPort": c.METRICS_PORT,
                       "protocol": "TCP"}] if metrics_env(spec) else [])
    if task.role == c.ROLE_PS:
        main["ports"][:0] = [
            {"name": c.REPLICA_PORT_NAME, "containerPort": c.REPLICA_PORT, "protocol": "TCP"},
            {"name": c.DATA_PORT_NAME, "containerPort": c.DATA_PORT, "protocol": "TCP"},
        ]
    if not main["ports"]:
        del main["ports"]
    return main


def build_service(job: TrainingJob) -> dict[str, Any]:
    """The headless Service giving every replica the DNS name the cluster spec uses.

    Not-ready addresses are published because replicas must resolve each other before
    they are Ready (a worker connects to a PS that is still starting). It names both
    ports a parameter server serves: gRPC (control, and tensors with transport grpc) and
    the data plane (tensors with transport tcp).
    """
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "name": service_name(job.name),
            "namespace": job.namespace,
            "labels": job_labels(job),
            "ownerReferences": [owner_reference(job)],
        },
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": {c.LABEL_JOB: job.name},
            "ports": [
                {
                    "name": name,
                    "port": port,
                    "targetPort": port,
                    "protocol": "TCP",
                }
                for name, port in (
                    (c.REPLICA_PORT_NAME, c.REPLICA_PORT),
                    (c.DATA_PORT_NAME, c.DATA_PORT),
                )
            ],
        },
    }
