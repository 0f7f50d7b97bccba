"""The thin I/O edge to the Kubernetes API: the few calls the operator makes besides
kopf's own, on plain dicts (the wire format the pure builders produce).

`Kube` is the seam; `RestKube` implements it with the official client's transport
(kubeconfig or in-cluster credentials, TLS) and raw JSON, so objects are never
converted to and from the generated models. Every call here is listed in
`rbac.PERMISSIONS`.

Semantics that make the operator idempotent:
- create: 409 AlreadyExists means "someone (maybe an earlier us) made it": fine;
- delete: 404 means already gone, 409 (uid precondition failed) means the name now
  belongs to a newer object that must not be deleted: both fine;
- status patch: a JSON merge patch on the status subresource, retried on 409.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from typing import Any, Protocol
from urllib.parse import quote

from pstrain_api import constants as c

log = logging.getLogger(__name__)

MERGE_PATCH = "application/merge-patch+json"
STATUS_PATCH_ATTEMPTS = 5
REQUEST_TIMEOUT_S = 30


class KubeError(RuntimeError):
    """A Kubernetes API call failed in a way the caller must handle (or retry).

    `api_message`: the API server's own message (what a user should read);
    `causes`: the `details.causes[].type` of its Status object."""

    def __init__(self, status: int, message: str, api_message: str = "",
                 causes: tuple[str, ...] = ()):
        self.status = status
        self.api_message = api_message or message
        self.causes = causes
        super().__init__(message)

    @property
    def namespace_terminating(self) -> bool:
        """The namespace is being deleted: nothing new can be made in it, ever."""
        return "NamespaceTerminating" in self.causes or (
            self.status == 403 and "because it is being terminated" in self.api_message)


class Kube(Protocol):
    def get_job(self, namespace: str, name: str) -> dict[str, Any] | None: ...
    def list_pods(self, namespace: str, selector: str) -> list[dict[str, Any]]: ...
    def service_exists(self, namespace: str, name: str) -> bool: ...
    def get_secret(self, namespace: str, name: str) -> dict[str, Any] | None: ...
    def network_policy_exists(self, namespace: str, name: str) -> bool: ...
    def create(self, manifest: Mapping[str, Any]) -> bool: ...
    def delete_pod(self, namespace: str, name: str, uid: str) -> bool: ...
    def patch_job_status(self, namespace: str, name: str, status: Mapping[str, Any]) -> None: ...
    def delete_job(self, namespace: str, name: str) -> bool: ...


def job_path(namespace: str, name: str | None = None) -> str:
    path = f"/apis/{c.GROUP}/{c.VERSION}/namespaces/{quote(namespace)}/{c.PLURAL}"
    return f"{path}/{quote(name)}" if name else path


def core_path(namespace: str, plural: str, name: str | None = None) -> str:
    path = f"/api/v1/namespaces/{quote(namespace)}/{plural}"
    return f"{path}/{quote(name)}" if name else path


_PLURALS = {"Pod": "pods", "Service": "services", "Secret": "secrets",
            "PodGroup": "podgroups"}


def network_policy_path(namespace: str, name: str | None = None) -> str:
    path = f"/apis/networking.k8s.io/v1/namespaces/{quote(namespace)}/networkpolicies"
    return f"{path}/{quote(name)}" if name else path


def collection_path(kind: str, namespace: str, api_version: str = "v1") -> str:
    """Where objects of `kind` (one the operator creates) are POSTed: /api/v1 for the
    core group, else /apis/<group>/<version> (a gang's PodGroup)."""
    if kind == "NetworkPolicy":
        return network_policy_path(namespace)
    if api_version != "v1":
        return f"/apis/{api_version}/namespaces/{quote(namespace)}/{_PLURALS[kind]}"
    return core_path(namespace, _PLURALS[kind])


def _api_status(raw: bytes | str) -> dict[str, Any]:
    """The API server's error Status object, reduced to its message and cause types."""
    text = raw.decode(errors="replace") if isinstance(raw, bytes) else raw
    try:
        data = json.loads(text) if text else None
    except ValueError:
        data = None
    if not isinstance(data, dict):
        return {"message": text[:200], "causes": ()}
    details = data.get("details")
    causes = (details.get("causes") if isinstance(details, dict) else None) or []
    return {"message": str(data.get("message") or ""),
            "causes": tuple(str(c["type"]) for c in causes
                            if isinstance(c, dict) and c.get("type"))}


class RestKube:
    """`Kube` over the kubernetes client's REST transport."""

    def __init__(self, api_client: Any):
        self.api = api_client

    @classmethod
    def from_environment(cls) -> RestKube:
        """In-cluster credentials when running in a pod, else $KUBECONFIG / ~/.kube."""
        from kubernetes import client, config

        try:
            config.load_incluster_config()
        except config.ConfigException:
            config.load_kube_config()
        return cls(client.ApiClient())

    def _call(
        self,
        method: str,
        path: str,
        query: Mapping[str, str] | None = None,
        body: Any = None,
        content_type: str = "application/json",
    ) -> tuple[int, Any]:
        from kubernetes.client.exceptions import ApiException

        headers = {"Accept": "application/json"}
        if body is not None:
            headers["Content-Type"] = content_type
        params = self.api.param_serialize(
            method=method,
            resource_path=path,
            query_params=list((query or {}).items()),
            header_params=headers,
            body=body,
            auth_settings=["BearerToken"],
        )
        try:
            response = self.api.call_api(*params, _request_timeout=REQUEST_TIMEOUT_S)
            response.read()
        except ApiException as exc:
            if not exc.status:
                raise KubeError(0, f"{method} {path} failed: {exc.reason}") from exc
            return exc.status, _api_status(exc.body or b"")
        raw = response.data or b""
        if response.status >= 400:
            return response.status, _api_status(raw)
        try:
            data = json.loads(raw) if raw else None
        except ValueError:
            data = None
        return response.status, data

    def _check(self, method: str, path: str, status: int, data: Any) -> None:
        if status >= 400:
            raise KubeError(status, f"{method} {path} returned {status}: {data.get('message')}",
                            str(data.get("message") or ""), tuple(data.get("causes") or ()))

    def get_job(self, namespace: str, name: str) -> dict[str, Any] | None:
        status, data = self._call("GET", job_path(namespace, name))
        if status == 404:
            return None
        self._check("GET", job_path(namespace, name), status, data)
        return data

    def list_pods(self, namespace: str, selector: str) -> list[dict[str, Any]]:
        path = core_path(namespace, "pods")
        status, data = self._call("GET", path, {"labelSelector": selector})
        self._check("GET", path, status, data)
        return list(data.get("items") or [])

    def _get(self, path: str) -> dict[str, Any] | None:
        """The object at `path`, or None on 404."""
        status, data = self._call("GET", path)
        if status == 404:
            return None
        self._check("GET", path, status, data)
        return data if isinstance(data, dict) else {}

    def service_exists(self, namespace: str, name: str) -> bool:
        return self._get(core_path(namespace, "services", name)) is not None

    def network_policy_exists(self, namespace: str, name: str) -> bool:
        return self._get(network_policy_path(namespace, name)) is not None

    def get_secret(self, namespace: str, name: str) -> dict[str, Any] | None:
        """A Secret, or None when there is none. Its data is never logged."""
        return self._get(core_path(namespace, "secrets", name))

    def create(self, manifest: Mapping[str, Any]) -> bool:
        kind = manifest["kind"]
        meta = manifest["metadata"]
        path = collection_path(kind, meta["namespace"], manifest.get("apiVersion", "v1"))
        status, data = self._call("POST", path, body=dict(manifest))
        if status == 409:
            log.debug("%s %s already exists", kind, meta["name"])
            return False
        self._check("POST", path, status, data)
        return True

    def delete_pod(self, namespace: str, name: str, uid: str) -> bool:
        path = core_path(namespace, "pods", name)
        body: dict[str, Any] = {"apiVersion": "v1", "kind": "DeleteOptions",
                                "propagationPolicy": "Background"}
        if uid:
            body["preconditions"] = {"uid": uid}
        status, data = self._call("DELETE", path, body=body)
        if status in (404, 409):
            return False
        self._check("DELETE", path, status, data)
        return True

    def patch_job_status(self, namespace: str, name: str, status: Mapping[str, Any]) -> None:
        path = job_path(namespace, name) + "/status"
        for attempt in range(1, STATUS_PATCH_ATTEMPTS + 1):
            code, data = self._call("PATCH", path, body={"status": dict(status)},
                                    content_type=MERGE_PATCH)
            if code == 409 and attempt < STATUS_PATCH_ATTEMPTS:
                log.info("status of %s/%s: conflict, retrying (%d)", namespace, name, attempt)
                continue
            if code == 404:
                return  # the job is gone; nothing to report on
            self._check("PATCH", path, code, data)
            return

    def delete_job(self, namespace: str, name: str) -> bool:
        path = job_path(namespace, name)
        body = {"apiVersion": "v1", "kind": "DeleteOptions", "propagationPolicy": "Background"}
        status, data = self._call("DELETE", path, body=body)
        if status == 404:
            return False
        self._check("DELETE", path, status, data)
        return True
