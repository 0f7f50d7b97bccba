"""An in-memory `Kube` that behaves like the API server on the calls the operator makes
(label selectors, 409 on duplicate create, uid preconditions on delete)."""

from __future__ import annotations

import copy
import itertools
from collections.abc import Mapping
from typing import Any

_uids = itertools.count(1)


def matches(labels: Mapping[str, str], selector: str) -> bool:
    for term in filter(None, selector.split(",")):
        key, _, value = term.partition("=")
        if labels.get(key) != value:
            return False
    return True


class FakeKube:
    def __init__(self) -> None:
        self.jobs: dict[tuple[str, str], dict[str, Any]] = {}
        self.pods: dict[tuple[str, str], dict[str, Any]] = {}
        self.services: dict[tuple[str, str], dict[str, Any]] = {}
        self.secrets: dict[tuple[str, str], dict[str, Any]] = {}
        self.network_policies: dict[tuple[str, str], dict[str, Any]] = {}
        self.calls: list[tuple[str, str]] = []
        self.status_patches = 0

    def add_job(self, body: dict[str, Any]) -> None:
        meta = body["metadata"]
        self.jobs[(meta["namespace"], meta["name"])] = copy.deepcopy(body)

    def get_job(self, namespace: str, name: str) -> dict[str, Any] | None:
        self.calls.append(("get", f"job/{name}"))
        job = self.jobs.get((namespace, name))
        return copy.deepcopy(job) if job else None

    def list_pods(self, namespace: str, selector: str) -> list[dict[str, Any]]:
        self.calls.append(("list", "pods"))
        return [copy.deepcopy(p) for (ns, _), p in self.pods.items()
                if ns == namespace and matches(p["metadata"].get("labels", {}), selector)]

    def service_exists(self, namespace: str, name: str) -> bool:
        return (namespace, name) in self.services

    def network_policy_exists(self, namespace: str, name: str) -> bool:
        self.calls.append(("get", f"NetworkPolicy/{name}"))
        return (namespace, name) in self.network_policies

    def get_secret(self, namespace: str, name: str) -> dict[str, Any] | None:
        self.calls.append(("get", f"Secret/{name}"))
        secret = self.secrets.get((namespace, name))
        return copy.deepcopy(secret) if secret else None

    def create(self, manifest: Mapping[str, Any]) -> bool:
        meta = manifest["metadata"]
        store = {"Pod": self.pods, "Service": self.services, "Secret": self.secrets,
                 "NetworkPolicy": self.network_policies}[manifest["kind"]]
        key = (meta["namespace"], meta["name"])
        self.calls.append(("create", f"{manifest['kind']}/{meta['name']}"))
        if key in store:
            return False
        obj = copy.deepcopy(dict(manifest))
        obj["metadata"]["uid"] = f"uid-{next(_uids)}"
        obj["status"] = {"phase": "Pending"}
        store[key] = obj
        return True

    def delete_pod(self, namespace: str, name: str, uid: str) -> bool:
        self.calls.append(("delete", f"Pod/{name}"))
        pod = self.pods.get((namespace, name))
        if pod is None or (uid and pod["metadata"]["uid"] != uid):
            return False
        del self.pods[(namespace, name)]
        return True

    def patch_job_status(self, namespace: str, name: str, status: Mapping[str, Any]) -> None:
        self.status_patches += 1
        job = self.jobs[(namespace, name)]
        job["status"] = {k: copy.deepcopy(v) for k, v in status.items() if v is not None}

    def delete_job(self, namespace: str, name: str) -> bool:
        return self.jobs.pop((namespace, name), None) is not None

    # --- playing the node -------------------------------------------------------
    def set_pod(self, namespace: str, name: str, phase: str, ready: bool = False,
                exit_code: int | None = None, reason: str = "", message: str = "") -> None:
        pod = self.pods[(namespace, name)]
        status: dict[str, Any] = {"phase": phase, "conditions": [
            {"type": "Ready", "status": "True" if ready else "False"}]}
        if exit_code is not None:
            status["containerStatuses"] = [{"name": "pstrain", "state": {"terminated": {
                "exitCode": exit_code, "reason": reason, "message": message}}}]
        pod["status"] = status

    def pod_names(self) -> list[str]:
        return sorted(name for _, name in self.pods)
