"""Fluent builder of TrainingJob manifests (plain dicts, as a user writes them).

    job("digits").ps(2).workers(4).chief().training(mode="sync").build()
"""

from __future__ import annotations

import copy
from typing import Any


class JobBuilder:
    def __init__(self, name: str, namespace: str | None = None):
        self._doc: dict[str, Any] = {
            "apiVersion": "pstrain.io/v1alpha1",
            "kind": "TrainingJob",
            "metadata": {"name": name},
            "spec": {},
        }
        if namespace:
            self._doc["metadata"]["namespace"] = namespace

    def _role(self, role: str) -> dict[str, Any]:
        return self._doc["spec"].setdefault("replicas", {}).setdefault(role, {})

    def ps(self, replicas: int, **fields: Any) -> JobBuilder:
        self._role("ps").update(replicas=replicas, **fields)
        return self

    def workers(self, replicas: int, **fields: Any) -> JobBuilder:
        self._role("worker").update(replicas=replicas, **fields)
        return self

    def chief(self, **fields: Any) -> JobBuilder:
        self._role("chief").update(fields)
        return self

    def template(self, role: str, **fields: Any) -> JobBuilder:
        """Set the role's PodTemplateSpec from short keyword fields (see pod_template)."""
        merge(self._role(role).setdefault("template", {}), pod_template(**fields))
        return self

    def training(self, **fields: Any) -> JobBuilder:
        self._doc["spec"].setdefault("training", {}).update(fields)
        return self

    def run_policy(self, **fields: Any) -> JobBuilder:
        self._doc["spec"].setdefault("runPolicy", {}).update(fields)
        return self

    def set(self, dotted: str, value: Any) -> JobBuilder:
        """Set any path, e.g. set("spec.replicas.ps.foo", 1)."""
        cur = self._doc
        *parents, last = dotted.split(".")
        for part in parents:
            cur = cur.setdefault(part, {})
        cur[last] = value
        return self

    def drop(self, dotted: str) -> JobBuilder:
        cur = self._doc
        *parents, last = dotted.split(".")
        for part in parents:
            cur = cur[part]
        del cur[last]
        return self

    def build(self) -> dict[str, Any]:
        return copy.deepcopy(self._doc)


MAIN_FIELDS = ("image", "imagePullPolicy", "command", "args", "env", "envFrom",
               "volumeMounts", "securityContext", "readinessProbe", "resources", "workingDir",
               "workingDirr", "ports", "livenessProbe")
POD_FIELDS = {"imagePullSecrets": "imagePullSecrets", "volumes": "volumes",
              "nodeSelector": "nodeSelector", "tolerations": "tolerations",
              "affinity": "affinity", "serviceAccountName": "serviceAccountName",
              "priorityClassName": "priorityClassName", "schedulerName": "schedulerName",
              "podSecurityContext": "securityContext", "initContainers": "initContainers",
              "runtimeClassName": "runtimeClassName"}


def pod_template(**fields: Any) -> dict[str, Any]:
    """A PodTemplateSpec from short fields: main-container fields (image, command, env,
    ...) go to the first container, named pstrain; pod fields (volumes, nodeSelector,
    podSecurityContext, ...) to the pod spec; `sidecars` become further containers;
    labels and annotations go to the metadata; `spec`/`metadata` are merged as given."""
    out: dict[str, Any] = {}
    main = {k: fields.pop(k) for k in MAIN_FIELDS if k in fields}
    sidecars = fields.pop("sidecars", None)
    if main or sidecars:
        out.setdefault("spec", {})["containers"] = [{"name": "pstrain", **main},
                                                    *(sidecars or [])]
    for key in ("labels", "annotations"):
        if key in fields:
            out.setdefault("metadata", {})[key] = fields.pop(key)
    for key in list(fields):
        if key in POD_FIELDS:
            out.setdefault("spec", {})[POD_FIELDS[key]] = fields.pop(key)
    for key in ("spec", "metadata"):
        if key in fields:
            merge(out.setdefault(key, {}), fields.pop(key))
    if fields:
        raise TypeError(f"pod_template does not know {sorted(fields)}")
    return out


def merge(into: dict[str, Any], more: dict[str, Any]) -> None:
    for key, value in more.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            merge(into[key], value)
        else:
            into[key] = copy.deepcopy(value)


def job(name: str = "j", namespace: str | None = None) -> JobBuilder:
    return JobBuilder(name, namespace)
