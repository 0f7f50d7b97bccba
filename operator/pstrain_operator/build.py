"""Pure constructors of a TrainingJob's children: one pod per replica and the headless
Service. They return plain dicts (the Kubernetes wire format) and import neither kopf
nor kubernetes, so they are tested as whole objects and shared by any executor.

Invariants of every pod:
- named `<job>-<role>-<index>` (pstrain_api.names), hostname = that name, subdomain =
  the job's Service, so it resolves at the address the cluster spec gives;
- labels job/role/index/is-chief/managed-by, an ownerReference (controller) to the job;
- the cluster-spec environment in EVERY container (main, sidecars, init containers);
- a parameter server's main container declares the gRPC port and the data-plane port
  and is told the latter in PSTRAIN_DATA_PORT (`data_plane_env`); it is probed for
  readiness as its program allows (`readiness_probe`);
- `command: ["pstrain", "replica"]` unless the template overrides it;
- `restartPolicy: Never` (the operator restarts replicas according to the run policy);
- annotation `pstrain.io/spec-hash` of the spec parts a pod is built from, and
  `pstrain.io/applied-spec` with those parts, so a change that cannot be applied live
  is detected and the job keeps running on what its pods were built from.
"""

from __future__ import annotations

import copy
import hashlib
import json
from typing import Any

from pstrain_api import constants as c
from pstrain_api.cluster import ClusterSpec, Task
from pstrain_api.model import ReplicaSpec, TrainingJob
from pstrain_api.names import service_name
from pstrain_api.readiness import readiness_gate, user_probe

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
    """The parts of the spec that pods are built from and that cannot change live."""
    return {
        "replicas": job.spec.replicas.to_api(),
        "training": job.spec.training.to_api(),
    }


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


def _resources(spec: ReplicaSpec) -> dict[str, Any]:
    requests = dict(spec.resources.requests or {}) if spec.resources else {}
    limits = dict(spec.resources.limits or {}) if spec.resources else {}
    if spec.gpus:
        limits[c.GPU_RESOURCE] = spec.gpus
    out: dict[str, Any] = {}
    if requests:
        out["requests"] = requests
    if limits:
        out["limits"] = limits
    return out


def readiness_probe(spec: ReplicaSpec, task: Task) -> dict[str, Any] | None:
    """The main container's readinessProbe: the role's readiness gate
    (pstrain_api.readiness) as a probe. A parameter server is probed on its replica port
    by default (workers start once every PS is Ready); other roles only when the user
    asks for a check by `readiness` or a probe of their own."""
    gate = readiness_gate(spec)
    if gate == c.GATE_PROBE:
        return copy.deepcopy(user_probe(spec))
    if gate == c.GATE_NONE or (task.role != c.ROLE_PS and spec.readiness == "Auto"):
        return None
    check: dict[str, Any] = (
        {"grpc": {"port": c.REPLICA_PORT}} if gate == c.GATE_GRPC
        else {"tcpSocket": {"port": c.REPLICA_PORT}})
    return {**check, "periodSeconds": 2, "failureThreshold": 3}


def build_pod(
    job: TrainingJob, cluster: ClusterSpec, task: Task, settings: PodSettings
) -> dict[str, Any]:
    """The pod of replica `task`."""
    spec = job.replica_spec(task.role)
    tpl = spec.template.model_copy() if spec.template else None
    name = cluster.replica_name(task)
    env = cluster.env(task)
    restricted = settings.pod_security == "restricted"

    main: dict[str, Any] = {
        "name": c.MAIN_CONTAINER,
        "image": (tpl.image if tpl and tpl.image else settings.runtime_image),
        "command": list(tpl.command) if tpl and tpl.command else list(REPLICA_COMMAND),
        "env": _env_list({**env, **data_plane_env(task)})
        + [e.to_api() for e in (tpl.env or [] if tpl else [])],
    }
    if tpl and tpl.args:
        main["args"] = list(tpl.args)
    if tpl and tpl.image_pull_policy:
        main["imagePullPolicy"] = tpl.image_pull_policy
    if tpl and tpl.env_from:
        main["envFrom"] = copy.deepcopy(tpl.env_from)
    if tpl and tpl.volume_mounts:
        main["volumeMounts"] = [m.to_api() for m in tpl.volume_mounts]
    resources = _resources(spec)
    if resources:
        main["resources"] = resources
    if task.role == c.ROLE_PS:
        main["ports"] = [
            {"name": c.REPLICA_PORT_NAME, "containerPort": c.REPLICA_PORT, "protocol": "TCP"},
            {"name": c.DATA_PORT_NAME, "containerPort": c.DATA_PORT, "protocol": "TCP"},
        ]
    probe = readiness_probe(spec, task)
    if probe is not None:
        main["readinessProbe"] = probe
    if tpl and tpl.security_context is not None:
        main["securityContext"] = copy.deepcopy(tpl.security_context)
    elif restricted:
        main["securityContext"] = copy.deepcopy(RESTRICTED_CONTAINER_SECURITY)

    containers = [main] + [_with_cluster_env(s, env) for s in (tpl.sidecars or [] if tpl else [])]
    pod_spec: dict[str, Any] = {
        "hostname": name,
        "subdomain": service_name(job.name),
        "restartPolicy": "Never",
        "enableServiceLinks": False,
        "containers": containers,
    }
    if tpl and tpl.init_containers:
        pod_spec["initContainers"] = [_with_cluster_env(i, env) for i in tpl.init_containers]
    if tpl and tpl.volumes:
        pod_spec["volumes"] = copy.deepcopy(tpl.volumes)
    if tpl and tpl.node_selector:
        pod_spec["nodeSelector"] = dict(tpl.node_selector)
    if tpl and tpl.tolerations:
        pod_spec["tolerations"] = [t.to_api() for t in tpl.tolerations]
    if tpl and tpl.affinity:
        pod_spec["affinity"] = copy.deepcopy(tpl.affinity)
    if tpl and tpl.service_account_name:
        pod_spec["serviceAccountName"] = tpl.service_account_name
    if tpl and tpl.priority_class_name:
        pod_spec["priorityClassName"] = tpl.priority_class_name
    if tpl and tpl.scheduler_name:
        pod_spec["schedulerName"] = tpl.scheduler_name
    if tpl and tpl.image_pull_secrets:
        pod_spec["imagePullSecrets"] = [s.to_api() for s in tpl.image_pull_secrets]
    if tpl and tpl.pod_security_context is not None:
        pod_spec["securityContext"] = copy.deepcopy(tpl.pod_security_context)
    elif restricted:
        pod_spec["securityContext"] = copy.deepcopy(RESTRICTED_POD_SECURITY)

    annotations = dict(tpl.annotations or {}) if tpl else {}
    annotations[ANNOTATION_SPEC_HASH] = spec_hash(job)
    annotations[ANNOTATION_APPLIED_SPEC] = json.dumps(
        applied_spec(job), sort_keys=True, separators=(",", ":")
    )
    labels = dict(tpl.labels or {}) if tpl else {}
    labels.update(replica_labels(job, task, cluster.is_chief(task)))
    return {
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
    }


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
