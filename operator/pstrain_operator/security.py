"""A job's security children: its credentials Secret, how pods mount it (and the TLS
Secret the user names), and the per-job NetworkPolicy. Pure constructors, plus
`ensure_auth_secret`, the one "get, else create" the executor runs before deciding.

Invariants:
- the Secret is named `security.secret_name(job)`, owned by the job (garbage-collected
  with it), immutable, and holds only the role keys derived from a fresh 256-bit token
  (`pstrain_api.security`); it is created once and never rewritten, so restarted pods
  get the same keys;
- a pod mounts only the keys its replica may hold (a non-chief worker only `worker`),
  read-only, and is told the directory in PSTRAIN_AUTH_DIR, never a key;
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
from pstrain_api.model import TrainingJob

from .build import job_labels, owner_reference
from .kube import Kube
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


def ensure_auth_secret(kube: Kube, job: TrainingJob) -> dict[str, bytes]:
    """Make sure the job's credentials Secret exists (create it if absent); returns its
    worker key. Idempotent: a Secret that exists is used as it is."""
    name = security.secret_name(job.name)
    secret = kube.get_secret(job.namespace, name)
    if secret is None:
        manifest = build_auth_secret(job, security.new_token())
        if kube.create(manifest):
            log.info("created the credentials Secret %s/%s", job.namespace, name)
            return worker_keys(manifest)
        secret = kube.get_secret(job.namespace, name)  # created meanwhile (409)
    return worker_keys(secret or {})


def _volume_mount(volume: str, path: str) -> dict[str, Any]:
    return {"name": volume, "mountPath": path, "readOnly": True}


def secure_pod(pod: dict[str, Any], job: TrainingJob, role: str,
               is_chief: bool) -> dict[str, Any]:
    """`pod` (a built replica pod) with the job's credentials mounted in its main
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
        holder = security.key_holder(role, is_chief)
        volumes.append({"name": security.AUTH_VOLUME, "secret": {
            "secretName": security.secret_name(job.name),
            "defaultMode": KEY_FILE_MODE,
            "items": [{"key": key, "path": key}
                      for key in security.KEYS_FOR_HOLDER[holder]],
        }})
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
