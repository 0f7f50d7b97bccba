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
        self._role(role).setdefault("template", {}).update(fields)
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


def job(name: str = "j", namespace: str | None = None) -> JobBuilder:
    return JobBuilder(name, namespace)
