"""Test fixtures around kmock's KubernetesEmulator: an HTTP Kubernetes API in a
background thread, a tiny JSON client for it, and the recording of every request the
operator makes (for the RBAC check).

Every emulator workaround lives here, never in the operator:
- the emulator ignores `labelSelector` on list; `SelectingEmulator` applies it;
- it assigns no uid/creationTimestamp/generation; the test client sets them when it
  creates a TrainingJob, as the API server would;
- it ignores `metadata.generateName` (kopf names Events that way); names are made up,
  and created objects get a uid and creationTimestamp (pods: phase Pending) as on a
  real server;
- it cannot parse `/api/v1/namespaces` (kopf lists and watches it); served here;
- it admits every object; `refuse` makes it answer chosen requests with an error
  Status, as a real server's validation, admission or quota would.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

import aiohttp.web
import kmock
from kmock._internal import rendering

from pstrain_api import constants as c
from pstrain_api.crd import build_crd

T = TypeVar("T")


def _selector_matches(labels: dict[str, str], selector: str) -> bool:
    for term in filter(None, selector.split(",")):
        if "!=" in term:
            key, value = term.split("!=", 1)
            if labels.get(key) == value:
                return False
        elif "=" in term:
            key, value = term.split("=", 1)
            if labels.get(key.rstrip("=")) != value:
                return False
        elif term.startswith("!"):
            if term[1:] in labels:
                return False
        elif term not in labels:
            return False
    return True


TEST_AGENT = "pstrain-operator-tests"


@dataclass(frozen=True)
class Recorded:
    method: str
    path: str
    params: dict[str, str]
    agent: str = ""

    @property
    def by_test(self) -> bool:
        """Made by the test's own client (playing user and kubelet), not the operator."""
        return self.agent == TEST_AGENT


class SelectingEmulator(kmock.KubernetesEmulator):
    """The emulator plus what the operator relies on from a real server: label
    selectors on list, and list/watch of the cluster-scoped `/api/v1/namespaces`
    (kmock 0.8 fails to parse that path; kopf lists and watches it). Also records
    every request."""

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        self.recorded: list[Recorded] = []
        self.namespaces: list[str] = []
        self.closing = asyncio.Event()
        # (method, path, body) -> (HTTP status, Status message) to refuse, or None.
        self.refuse: Callable[[str, str, Any], tuple[int, str] | None] | None = None

    async def __call__(self, raw_request: aiohttp.web.BaseRequest) -> aiohttp.web.StreamResponse:
        if raw_request.path.rstrip("/") != "/api/v1/namespaces":
            return await super().__call__(raw_request)
        await raw_request.read()
        query = dict(raw_request.query)
        self.recorded.append(Recorded(raw_request.method.upper(), raw_request.path, query,
                                      raw_request.headers.get("User-Agent", "")))
        items = [{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}}
                 for ns in self.namespaces]
        if query.get("watch") not in ("true", "1"):
            return aiohttp.web.json_response({"apiVersion": "v1", "kind": "NamespaceList",
                                              "metadata": {"resourceVersion": "1"},
                                              "items": items})
        resp = aiohttp.web.StreamResponse()
        resp.content_type = "application/json"
        await resp.prepare(raw_request)
        for item in items:
            await resp.write(json.dumps({"type": "ADDED", "object": item}).encode() + b"\n")
        # Namespaces never change in these tests: hold the stream open like a server
        # does, until its timeout or until the emulator shuts down.
        try:
            await asyncio.wait_for(self.closing.wait(),
                                   float(query.get("timeoutSeconds") or 60))
        except TimeoutError:
            pass
        return resp

    async def _handle(self, request: rendering.Request) -> Any:
        method = str(getattr(request.method, "value", request.method)).upper()
        self.recorded.append(Recorded(method, request.url.path, dict(request.params),
                                      dict(request.headers).get("User-Agent", "")))
        refusal = self.refuse(method, request.url.path, request.data) if self.refuse else None
        if refusal is not None:
            code, message = refusal
            return aiohttp.web.json_response(
                {"kind": "Status", "apiVersion": "v1", "status": "Failure",
                 "message": message, "reason": "Invalid" if code == 422 else "Forbidden",
                 "code": code}, status=code)
        if method == "POST" and isinstance(request.data, dict):
            meta = request.data.setdefault("metadata", {})
            if not meta.get("name") and meta.get("generateName"):  # kopf's Events use it
                meta["name"] = meta["generateName"] + uuid.uuid4().hex[:8]
            meta.setdefault("uid", str(uuid.uuid4()))
            if request.data.get("kind") == "Pod":
                request.data.setdefault("status", {"phase": "Pending"})
            meta.setdefault("creationTimestamp", datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"))
        return await super()._handle(request)

    async def _serve_list(self, request: rendering.Request) -> Any:
        result = await super()._serve_list(request)
        selector = dict(request.params).get("labelSelector")
        if selector and isinstance(result, dict):
            result["items"] = [
                item for item in result["items"]
                if _selector_matches((item.get("metadata") or {}).get("labels") or {}, selector)
            ]
        return result


RESOURCES = {
    f"{c.GROUP}/{c.VERSION}/{c.PLURAL}": kmock.ResourceInfo(
        kind=c.KIND, singular=c.SINGULAR, namespaced=True, shortnames={"tj"},
        subresources={"status"},
        verbs={"get", "list", "watch", "create", "patch", "update", "delete"}),
    "v1/pods": kmock.ResourceInfo(kind="Pod", singular="pod", namespaced=True,
                                  subresources={"status"},
                                  verbs={"get", "list", "watch", "create", "patch", "delete"}),
    "v1/services": kmock.ResourceInfo(kind="Service", singular="service", namespaced=True,
                                      verbs={"get", "list", "watch", "create", "delete"}),
    "v1/events": kmock.ResourceInfo(kind="Event", singular="event", namespaced=True,
                                    verbs={"get", "list", "watch", "create"}),
    "v1/namespaces": kmock.ResourceInfo(kind="Namespace", singular="namespace",
                                        namespaced=False, verbs={"get", "list", "watch"}),
    "apiextensions.k8s.io/v1/customresourcedefinitions": kmock.ResourceInfo(
        kind="CustomResourceDefinition", singular="customresourcedefinition",
        namespaced=False, verbs={"get", "list", "watch"}),
}


class EmulatorThread:
    """The emulator served over HTTP from its own event loop in a daemon thread."""

    def __init__(self, namespace: str):
        self.namespace = namespace
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.emulator: SelectingEmulator | None = None
        self._server: Any = None
        self.url = ""

    def call(self, fn: Callable[[], T]) -> T:
        """Run `fn` on the emulator's loop (its state is not thread-safe)."""
        async def run() -> T:
            return fn()
        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(timeout=10)

    def start(self) -> None:
        self.thread.start()
        fut: Future[None] = asyncio.run_coroutine_threadsafe(self._start(), self.loop)
        fut.result(timeout=20)

    async def _start(self) -> None:
        emulator = SelectingEmulator()
        await emulator.__aenter__()
        for key, info in RESOURCES.items():
            emulator.resources[key] = info
        server = kmock.Server(emulator)
        await server.__aenter__()
        crd = build_crd()
        emulator.objects["apiextensions.k8s.io/v1/customresourcedefinitions", None,
                         crd["metadata"]["name"]] = crd
        emulator.namespaces.append(self.namespace)
        self.emulator, self._server = emulator, server
        self.url = str(server.url).rstrip("/")

    def declare_peering(self, namespace: str, name: str = "pstrain") -> None:
        """Serve kopf's namespaced peering CRD with the peering object, as the chart
        creates them when leader election is on."""
        def declare() -> None:
            assert self.emulator is not None
            self.emulator.resources["kopf.dev/v1/kopfpeerings"] = kmock.ResourceInfo(
                kind="KopfPeering", singular="kopfpeering", namespaced=True,
                verbs={"get", "list", "watch", "patch", "create"})
            self.emulator.objects["kopf.dev/v1/kopfpeerings", namespace, name] = {
                "apiVersion": "kopf.dev/v1", "kind": "KopfPeering",
                "metadata": {"name": name, "namespace": namespace}}
        self.call(declare)

    def refuse(self, rule: Callable[[str, str, Any], tuple[int, str] | None] | None) -> None:
        """Refuse the requests `rule` picks (None: admit everything again)."""
        def set_rule() -> None:
            assert self.emulator is not None
            self.emulator.refuse = rule
        self.call(set_rule)

    def stop(self) -> None:
        async def stop() -> None:
            if self.emulator is not None:
                self.emulator.closing.set()
            if self._server is not None:
                await self._server.__aexit__(None, None, None)
            if self.emulator is not None:
                await self.emulator.__aexit__(None, None, None)
        try:
            asyncio.run_coroutine_threadsafe(stop(), self.loop).result(timeout=10)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout=10)

    def recorded(self) -> list[Recorded]:
        assert self.emulator is not None
        return self.call(lambda: list(self.emulator.recorded))  # type: ignore[union-attr]

    def write_kubeconfig(self, path: Path) -> Path:
        path.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config",
            "clusters": [{"name": "emulator", "cluster": {"server": self.url}}],
            "users": [{"name": "test", "user": {"token": "test-token"}}],
            "contexts": [{"name": "emulator", "context": {
                "cluster": "emulator", "user": "test", "namespace": self.namespace}}],
            "current-context": "emulator",
        }))
        return path


class HttpApi:
    """The test's own API client: JSON over HTTP, raising on errors."""

    def __init__(self, url: str):
        self.url = url

    def request(self, method: str, path: str, body: Any = None,
                content_type: str = "application/json") -> Any:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={"Content-Type": content_type,
                                              "Accept": "application/json",
                                              "User-Agent": TEST_AGENT})
        try:
            with urllib.request.urlopen(req, timeout=10) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as exc:
            if exc.code == 404:
                return None
            raise
        return json.loads(raw) if raw else None

    # --- TrainingJobs, as a user or the API server would make them ---------------
    def create_job(self, body: dict[str, Any]) -> dict[str, Any]:
        body = json.loads(json.dumps(body))
        meta = body["metadata"]
        meta.setdefault("uid", str(uuid.uuid4()))
        meta.setdefault("generation", 1)
        meta.setdefault("creationTimestamp",
                        datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"))
        ns = meta["namespace"]
        return self.request("POST", f"/apis/{c.API_VERSION}/namespaces/{ns}/{c.PLURAL}", body)

    def job(self, ns: str, name: str) -> dict[str, Any] | None:
        return self.request("GET", f"/apis/{c.API_VERSION}/namespaces/{ns}/{c.PLURAL}/{name}")

    def pods(self, ns: str) -> dict[str, dict[str, Any]]:
        items = (self.request("GET", f"/api/v1/namespaces/{ns}/pods") or {}).get("items", [])
        return {p["metadata"]["name"]: p for p in items}

    def service(self, ns: str, name: str) -> dict[str, Any] | None:
        return self.request("GET", f"/api/v1/namespaces/{ns}/services/{name}")

    def set_pod_status(self, ns: str, name: str, status: dict[str, Any]) -> None:
        self.request("PATCH", f"/api/v1/namespaces/{ns}/pods/{name}/status",
                     {"status": status}, "application/merge-patch+json")

    def events(self, ns: str) -> list[dict[str, Any]]:
        return (self.request("GET", f"/api/v1/namespaces/{ns}/events") or {}).get("items", [])


def wait_for(what: str, check: Callable[[], T], timeout: float = 30.0,
             interval: float = 0.1) -> T:
    """Poll `check` until it returns something truthy; fail naming `what` on timeout."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}; last: {last!r}")


def pod_status(phase: str, ready: bool = False, exit_code: int | None = None,
               reason: str = "", message: str = "") -> dict[str, Any]:
    """A pod status as the kubelet reports it; `message`: the container's termination
    message (what it wrote to /dev/termination-log, or its log's tail)."""
    status: dict[str, Any] = {
        "phase": phase,
        "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
        "containerStatuses": [{"name": c.MAIN_CONTAINER, "ready": ready,
                               "state": {"running": {}}}],
    }
    if exit_code is not None:
        status["containerStatuses"][0]["state"] = {"terminated": {
            "exitCode": exit_code, "reason": reason or ("Completed" if exit_code == 0
                                                         else "Error")}}
        if message:
            status["containerStatuses"][0]["state"]["terminated"]["message"] = message
    return status


def rbac_verb(rec: Recorded) -> tuple[str, str, str] | None:
    """(apiGroup, resource[/subresource], verb) of a resource request; None for
    discovery and other non-resource URLs."""
    parts = [p for p in rec.path.split("/") if p]
    if parts[:1] == ["api"] and len(parts) >= 3:
        group, rest = "", parts[2:]
    elif parts[:1] == ["apis"] and len(parts) >= 4:
        group, rest = parts[1], parts[3:]
    else:
        return None
    if rest[:1] == ["namespaces"] and len(rest) >= 3:
        rest = rest[2:]  # a namespaced resource
    elif rest[:1] == ["namespaces"]:
        pass  # the namespaces resource itself (list/watch/get)
    resource = rest[0]
    name = rest[1] if len(rest) > 1 else None
    sub = rest[2] if len(rest) > 2 else None
    if sub:
        resource = f"{resource}/{sub}"
    method = rec.method
    watch = rec.params.get("watch") in ("true", "1", "True")
    verb = {
        "GET": "watch" if watch else ("get" if name else "list"),
        "POST": "create",
        "PATCH": "patch",
        "PUT": "update",
        "DELETE": "delete" if name else "deletecollection",
    }[method]
    return group, resource, verb
