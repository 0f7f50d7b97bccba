"""A job's security children: its credentials Secrets, how pods mount them (and the
TLS Secret the user names), and the per-job NetworkPolicy. Pure constructors, plus the
"get, else create" steps the executor runs: `ensure_auth_secret` before deciding,
`ensure_own_key_secret` before it creates a worker's pod.

Invariants:
- the job's Secret is named `security.secret_name(job)`, owned by the job (garbage-
  collected with it), immutable, and holds only the role keys derived from a fresh
  256-bit token (`pstrain_api.security`); it is created once and never rewritten, so
  restarted pods get the same keys;
- worker i (a trainer that is not the chief) has a Secret of its own,
  `security.worker_secret_name(job, i)`, owned by the job and immutable, holding only
  `worker-<i>`, its own key derived from the job's worker key: a worker pod holds no
  key that acts for another worker;
- a pod mounts only the keys its replica may hold, read-only, and is told the
  directory in PSTRAIN_AUTH_DIR, never a key;
- no key is logged, posted as an event, or written to the job's status.
"""

from __future__ import annotations

import base64
import copy
import logging
from collections.abc import Mapping
from typing import Any

from pstrain_api import constants as c
from pstrain_api import security
from pstrain_api.cluster import ClusterSpec, Task
from pstrain_api.model import TrainingJob

from .build import controller_uid, job_labels, owner_reference
from .kube import Kube, KubeError
from .progress import ProbeSecurity

log = logging.getLogger(__name__)

# Secret volumes are owned by root unless the pod sets an fsGroup; the runtime runs as a
# non-root user (65532), so 0400 would be unreadable. 0444 inside the pod's own mount
# namespace: only the pod's containers see the files.
KEY_FILE_MODE = 0o444


def build_auth_secret(job: TrainingJob, token: bytes) -> dict[str, Any]:
    """The job's credentials Secret: the role keys of `token` (not the token itself)."""
    keys = security.derive_keys(token)
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {
            "name": security.secret_name(job.name),
            "namespace": job.namespace,
            "labels": job_labels(job),
            "ownerReferences": [owner_reference(job)],
        },
        "type": "Opaque",
        "immutable": True,
        "data": {role: base64.b64encode(security.encode_key(key).encode()).decode()
                 for role, key in keys.items()},
    }


def build_own_key_secret(pod: Mapping[str, Any], trainer: int,
                         worker_key: bytes) -> dict[str, Any]:
    """Worker `trainer`'s own credentials Secret, for the pod that mounts it (same
    namespace, job labels and owner): only its own key, derived from `worker_key`."""
    meta = pod["metadata"]
    job_name = meta["labels"][c.LABEL_JOB]
    name = security.own_worker_name(trainer)
    key = security.own_worker_key(worker_key, trainer)
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {
            "name": security.worker_secret_name(job_name, trainer),
            "namespace": meta["namespace"],
            "labels": {k: meta["labels"][k] for k in (c.LABEL_JOB, c.LABEL_MANAGED_BY)},
            "ownerReferences": copy.deepcopy(meta["ownerReferences"]),
        },
        "type": "Opaque",
        "immutable": True,
        "data": {name: base64.b64encode(security.encode_key(key).encode()).decode()},
    }


def own_key_trainer(pod: Mapping[str, Any]) -> int | None:
    """The trainer index whose own key `pod` mounts (a worker pod that is not the
    chief's, with authentication on), else None."""
    for volume in (pod.get("spec") or {}).get("volumes") or []:
        if volume.get("name") != security.AUTH_VOLUME:
            continue
        for item in (volume.get("secret") or {}).get("items") or []:
            index = security.own_worker_index(item.get("key", ""))
            if index is not None:
                return index
    return None


def ensure_own_key_secret(kube: Kube, pod: Mapping[str, Any]) -> None:
    """Before `pod` is created: when it mounts a worker's own key, make sure that
    worker's Secret exists (created from the job's worker key if absent; never
    rewritten). Without the job's Secret nothing is made: the pod then waits for its
    volume, as it would for a missing Secret. A Secret of that name that does not hold
    exactly that worker's key (made by someone else, before the job) is never used:
    KubeError, so the pod is not created and the refusal is in the job's status."""
    trainer = own_key_trainer(pod)
    if trainer is None:
        return
    meta = pod["metadata"]
    name = security.worker_secret_name(meta["labels"][c.LABEL_JOB], trainer)
    job_secret = kube.get_secret(meta["namespace"],
                                 security.secret_name(meta["labels"][c.LABEL_JOB]))
    worker_key = worker_keys(job_secret or {}).get(security.KEY_WORKER)
    if worker_key is None:
        log.warning("%s/%s: no worker key to derive %s from", meta["namespace"],
                    meta["name"], name)
        return
    wanted = build_own_key_secret(pod, trainer, worker_key)
    found = kube.get_secret(meta["namespace"], name)
    if found is None:
        if kube.create(wanted):
            log.info("created the credentials Secret %s/%s", meta["namespace"], name)
            return
        found = kube.get_secret(meta["namespace"], name) or {}  # made meanwhile (409)
    if found.get("data") != wanted["data"]:
        raise KubeError(409, f"Secret {name} exists and does not hold worker {trainer}'s "
                        "own key: pstrain did not make it for this job; delete it")


def worker_keys(secret: Mapping[str, Any],
                role: str = security.KEY_WORKER) -> dict[str, bytes]:
    """The worker key in a credentials Secret (what the operator proves to read a job's
    status), or the key of `role` (the chief's: SetWorkers after a scale); {} when the
    Secret does not hold one."""
    raw = (secret.get("data") or {}).get(role)
    if not raw:
        return {}
    try:
        text = base64.b64decode(raw).decode()
        return {role: security.decode_key(text, f"the Secret's {role} key")}
    except ValueError as exc:
        log.warning("job credentials Secret %s: %s",
                    (secret.get("metadata") or {}).get("name"), exc)
        return {}


def stored_worker_keys(kube: Kube, job: TrainingJob,
                       role: str = security.KEY_WORKER) -> dict[str, bytes]:
    """The worker key (or `role`'s) of the job's credentials Secret as it is ({} when the
    job has no authentication or no Secret yet); never creates one."""
    if not job.spec.security.authentication:
        return {}
    return worker_keys(kube.get_secret(job.namespace, security.secret_name(job.name)) or {},
                       role)


def is_owned_by(obj: Mapping[str, Any], job: TrainingJob) -> bool:
    """`obj` names `job` as its controller (by uid; any object when the job has none yet,
    as in a dry run)."""
    uid = job.metadata.uid
    return not uid or controller_uid(obj.get("metadata") or {}) == uid


def ensure_auth_secret(kube: Kube, job: TrainingJob) -> dict[str, bytes]:
    """Make sure the job's credentials Secret exists (create it if absent); returns its
    worker key. Idempotent: the job's own Secret is used as it is. A Secret of that name
    that the job does not control (made by someone else, who would then know the keys)
    is never used: KubeError, and no pod of the job is created."""
    name = security.secret_name(job.name)
    secret = kube.get_secret(job.namespace, name)
    if secret is None:
        manifest = build_auth_secret(job, security.new_token())
        if kube.create(manifest):
            log.info("created the credentials Secret %s/%s", job.namespace, name)
            return worker_keys(manifest)
        secret = kube.get_secret(job.namespace, name)  # created meanwhile (409)
    if secret is not None and not is_owned_by(secret, job):
        raise KubeError(409, f"Secret {name} exists and is not this job's (it has no "
                        "controller reference to the job): pstrain did not make it and "
                        "will not use its keys; delete it")
    return worker_keys(secret or {})


def check_tls_secret(kube: Kube, job: TrainingJob) -> None:
    """The TLS Secret the job names (spec.security.tls.secretName) exists and holds
    every file the pods mount (tls.crt, tls.key, ca.crt); else KubeError, and no pod
    is created (a kubelet would leave each pod in ContainerCreating, and the job would
    only say it waits for its servers). Read each reconcile: cert-manager may issue it
    after the job is made."""
    tls = job.spec.security.tls
    if tls is None:
        return
    where = f"spec.security.tls.secretName is {tls.secret_name!r}"
    secret = kube.get_secret(job.namespace, tls.secret_name)
    if secret is None:
        raise KubeError(404, f"{where}; no Secret of that name in namespace "
                        f"{job.namespace}: the pods wait for it (a kubernetes.io/tls "
                        "Secret with tls.crt, tls.key and ca.crt)")
    data = secret.get("data") or {}
    missing = [key for key in security.TLS_FILES if not data.get(key)]
    if missing:
        raise KubeError(422, f"{where}; that Secret holds no {' or '.join(missing)}, "
                        "and the pods need all of tls.crt, tls.key and ca.crt (the CA "
                        "every replica trusts): the pods wait for it")


def _volume_mount(volume: str, path: str) -> dict[str, Any]:
    return {"name": volume, "mountPath": path, "readOnly": True}


def _auth_volume(job: TrainingJob, cluster: ClusterSpec, task: Task) -> dict[str, Any]:
    """The credentials volume of `task`'s pod: the job's Secret with the keys its
    replica may hold (a parameter server, the chief), or a worker's own Secret."""
    if task.role == c.ROLE_PS or cluster.is_chief(task):
        holder = security.key_holder(task.role, cluster.is_chief(task))
        name, keys = security.secret_name(job.name), security.KEYS_FOR_HOLDER[holder]
    else:
        trainer = cluster.trainer_index(task)
        name = security.worker_secret_name(job.name, trainer)
        keys = (security.own_worker_name(trainer),)
    return {"name": security.AUTH_VOLUME, "secret": {
        "secretName": name, "defaultMode": KEY_FILE_MODE,
        "items": [{"key": key, "path": key} for key in keys],
    }}


def secure_pod(pod: dict[str, Any], job: TrainingJob, cluster: ClusterSpec,
               task: Task) -> dict[str, Any]:
    """`pod` (the built pod of `task`) with its credentials mounted in its main
    container, and the TLS Secret when the job names one. Unchanged when both are off."""
    sec = job.spec.security
    if not sec.authentication and sec.tls is None:
        return pod
    out = copy.deepcopy(pod)
    spec = out["spec"]
    main = next(ctr for ctr in spec["containers"] if ctr["name"] == c.MAIN_CONTAINER)
    volumes = spec.setdefault("volumes", [])
    mounts = main.setdefault("volumeMounts", [])
    env = main.setdefault("env", [])
    if sec.authentication:
        volumes.append(_auth_volume(job, cluster, task))
        mounts.append(_volume_mount(security.AUTH_VOLUME, security.AUTH_MOUNT_PATH))
        env.insert(0, {"name": security.ENV_AUTH_DIR, "value": security.AUTH_MOUNT_PATH})
    if sec.tls is not None:
        volumes.append({"name": security.TLS_VOLUME, "secret": {
            "secretName": sec.tls.secret_name, "defaultMode": KEY_FILE_MODE,
            "items": [{"key": k, "path": k} for k in security.TLS_FILES],
        }})
        mounts.append(_volume_mount(security.TLS_VOLUME, security.TLS_MOUNT_PATH))
        env.insert(0, {"name": security.ENV_TLS_DIR, "value": security.TLS_MOUNT_PATH})
    return out


def network_policy_name(job_name: str) -> str:
    return f"{job_name}-pstrain-ps"[: c.DNS_SUBDOMAIN_MAX]


def build_network_policy(job: TrainingJob, operator_namespace: str | None) -> dict[str, Any]:
    """Ingress to the job's parameter servers only from the job's own pods (both ports),
    and to the gRPC port from the operator's namespace (the progress probe). Kubelet's
    readiness probes come from the node, which NetworkPolicies do not restrict."""
    own = {"matchLabels": job_labels(job)}
    ports = [{"protocol": "TCP", "port": c.REPLICA_PORT},
             {"protocol": "TCP", "port": c.DATA_PORT}]
    ingress: list[dict[str, Any]] = [{"from": [{"podSelector": own}], "ports": ports}]
    if operator_namespace:
        ingress.append({
            "from": [{"namespaceSelector": {"matchLabels": {
                "kubernetes.io/metadata.name": operator_namespace}}}],
            "ports": ports[:1],
        })
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {
            "name": network_policy_name(job.name),
            "namespace": job.namespace,
            "labels": job_labels(job),
            "ownerReferences": [owner_reference(job)],
        },
        "spec": {
            "podSelector": {"matchLabels": {**job_labels(job), c.LABEL_ROLE: c.ROLE_PS}},
            "policyTypes": ["Ingress"],
            "ingress": ingress,
        },
    }


def ensure_network_policy(kube: Kube, job: TrainingJob, operator_namespace: str | None) -> None:
    """Create the job's NetworkPolicy if it does not exist (never rewritten)."""
    name = network_policy_name(job.name)
    if not kube.network_policy_exists(job.namespace, name):
        if kube.create(build_network_policy(job, operator_namespace)):
            log.info("created the NetworkPolicy %s/%s", job.namespace, name)


def probe_security(kube: Kube, job: TrainingJob,
                   keys: Mapping[str, bytes] | None) -> ProbeSecurity:
    """What the status probe proves and trusts: the job's worker key, and the ca.crt of
    its TLS Secret when it names one (read when probing, never stored)."""
    ca = None
    tls = job.spec.security.tls
    if tls is not None:
        secret = kube.get_secret(job.namespace, tls.secret_name) or {}
        raw = (secret.get("data") or {}).get("ca.crt")
        ca = base64.b64decode(raw) if raw else None
    return ProbeSecurity(keys=dict(keys or {}), ca=ca)
