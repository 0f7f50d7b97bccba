"""The CustomResourceDefinition, generated from the pydantic models.

pydantic emits JSON Schema (2020-12 flavour, with $refs, anyOf-null and numeric
exclusive bounds); Kubernetes wants a *structural* OpenAPI v3 schema: no $ref, a type on
every node, boolean exclusive bounds, no additionalProperties beside properties. This
module converts one into the other, adds API-server defaults so that a minimal manifest
is defaulted by the server as pydantic defaults it, and wraps it in the CRD with the
status subresource and printer columns. `crds/trainingjob.yaml` is exactly
`render_crd_yaml()`; a test fails when they drift.
"""

from __future__ import annotations

import copy
from typing import Any

import yaml

from . import constants as c
from . import rules
from .model import POD_TEMPLATE_MARK, TrainingJob
from .podschema import pod_template_schema

_DROP_KEYS = {"title", "$defs", "discriminator"}

# The CRD's size budget, as compact JSON: a client-side `kubectl apply` keeps a copy in
# an annotation, and annotations may hold at most 256 KiB (etcd's limit, 1.5 MiB, is
# further). The three embedded pod templates are most of the CRD; they keep the
# descriptions of the template's own fields and of the pod spec's (`kubectl explain
# trainingjob.spec.replicas.worker.template.spec.volumes`), none deeper (Kubernetes'
# reference documents those; controller-gen's maxDescLen does the same).
SIZE_BUDGET = 256 * 1024
TEMPLATE_DESCRIPTION_DEPTH = 2


def _descriptions_to_depth(node: Any, depth: int) -> Any:
    """`node` without the descriptions of properties nested deeper than `depth`."""
    if isinstance(node, list):
        return [_descriptions_to_depth(item, depth) for item in node]
    if not isinstance(node, dict):
        return node
    out = {}
    for key, value in node.items():
        if key == "description" and depth < 0:
            continue
        if key == "properties":
            out[key] = {name: _descriptions_to_depth(sub, depth - 1)
                        for name, sub in value.items()}
        else:
            out[key] = _descriptions_to_depth(value, depth)
    return out


class _Converter:
    def __init__(self, defs: dict[str, Any]):
        self.defs = defs

    def convert(self, node: Any) -> Any:
        if not isinstance(node, dict):
            return node
        node = dict(node)
        if "$ref" in node:
            ref = node.pop("$ref").split("/")[-1]
            merged = {**copy.deepcopy(self.defs[ref]), **node}
            return self.convert(merged)
        if node.get(POD_TEMPLATE_MARK):
            embedded = _descriptions_to_depth(pod_template_schema(),
                                              TEMPLATE_DESCRIPTION_DEPTH)
            if "description" in node:
                embedded["description"] = node["description"]
            return embedded
        if node.get("x-kubernetes-int-or-string"):
            keep = {k: node[k] for k in ("description", "default") if k in node}
            return {"x-kubernetes-int-or-string": True, **keep}
        if "anyOf" in node:
            branches = [b for b in node.pop("anyOf") if b.get("type") != "null"]
            if node.get("default", "absent") is None:
                node.pop("default")
            if len(branches) != 1:
                raise ValueError(f"cannot express anyOf {branches} structurally")
            outer = {k: v for k, v in node.items() if k in ("description", "default")}
            inner = self.convert(branches[0])
            inner.update(outer)
            return inner
        if "const" in node:
            node["enum"] = [node.pop("const")]
        for bound, base in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
            if bound in node and not isinstance(node[bound], bool):
                node[base] = node.pop(bound)
                node[bound] = True
        out: dict[str, Any] = {}
        for key, value in node.items():
            if key in _DROP_KEYS:
                continue
            if key == "properties":
                out[key] = {name: self.convert(sub) for name, sub in value.items()}
            elif key == "items":
                out[key] = self.convert(value)
            elif key == "additionalProperties":
                if isinstance(value, dict) and "properties" not in node:
                    out[key] = self.convert(value)
            else:
                out[key] = value
        if out.get("x-kubernetes-preserve-unknown-fields"):
            out.pop("additionalProperties", None)
        if out.get("default", "absent") is None:
            out.pop("default")
        return out


def _add_object_defaults(schema: dict[str, Any]) -> None:
    """Give optional nested objects that pydantic fills by default_factory a `default: {}`
    so the API server defaults their fields too (it only defaults inside objects that
    exist)."""
    required = set(schema.get("required", []))
    for name, sub in schema.get("properties", {}).items():
        if sub.get("type") == "object" and "properties" in sub:
            _add_object_defaults(sub)
            if name not in required and "default" not in sub and sub.get("_factory"):
                sub["default"] = {}
        sub.pop("_factory", None)
        if sub.get("type") == "array" and isinstance(sub.get("items"), dict):
            _add_object_defaults(sub["items"])


def _mark_factories(model: Any, schema: dict[str, Any], defs: dict[str, Any]) -> None:
    """Flag, in the pydantic schema, fields whose default comes from a default_factory."""
    from pydantic import BaseModel

    props = schema.get("properties", {})
    for name, field in model.model_fields.items():
        key = field.alias or name
        if key not in props:
            continue
        ann = field.annotation
        if field.default_factory is not None and isinstance(ann, type) and issubclass(
            ann, BaseModel
        ):
            props[key]["_factory"] = True
            ref = props[key].get("$ref", "").split("/")[-1]
            target = defs.get(ref, props[key])
            _mark_factories(ann, target, defs)


def openapi_schema() -> dict[str, Any]:
    """The structural openAPIV3Schema of TrainingJob."""
    raw = TrainingJob.model_json_schema(by_alias=True, mode="validation")
    defs = raw.get("$defs", {})
    _mark_factories(TrainingJob, raw, defs)
    schema = _Converter(defs).convert(raw)
    _add_object_defaults(schema)
    props = schema["properties"]
    props["apiVersion"] = {"type": "string", "description": "pstrain.io/v1alpha1"}
    props["kind"] = {"type": "string", "description": "TrainingJob"}
    # The API server refuses anything but name and generateName under the root metadata
    # (a description included); the job name's rules are CEL rules at the root.
    props["metadata"] = {"type": "object"}
    schema.pop("required", None)
    spec = props["spec"]
    spec["default"] = {}
    props["status"].pop("default", None)
    for path, bounds in rules.CRD_BOUNDS:
        schema_at(schema, path).update(bounds)
    for path, rule in rules.CRD_RULES:
        schema_at(schema, path).setdefault("x-kubernetes-validations", []).append(
            rule.to_crd())
    return schema


def schema_at(schema: dict[str, Any], path: tuple[str, ...]) -> dict[str, Any]:
    """The schema node at `path`: property names, "[]" for array items, "{}" for map
    values."""
    node = schema
    for part in path:
        node = (node["items"] if part == "[]" else node["additionalProperties"]
                if part == "{}" else node["properties"][part])
    return node


# `kubectl scale trainingjob/NAME --replicas=N` sets the worker count.
SCALE_SUBRESOURCE = {
    "specReplicasPath": ".spec.replicas.worker.replicas",
    "statusReplicasPath": ".status.workers.live",
    "labelSelectorPath": ".status.workers.selector",
}

PRINTER_COLUMNS = [
    {"name": "Phase", "type": "string", "jsonPath": ".status.phase",
     "description": "Lifecycle phase."},
    {"name": "PS", "type": "string", "jsonPath": ".status.psReady",
     "description": "Ready/total parameter servers."},
    {"name": "Workers", "type": "string", "jsonPath": ".status.workersReady",
     "description": "Ready/total workers, the chief included."},
    {"name": "Live", "type": "integer", "jsonPath": ".status.workers.live",
     "description": "Live workers (elastic scaling)."},
    {"name": "Step", "type": "integer", "jsonPath": ".status.progress.globalStep",
     "description": "Global training step."},
    {"name": "Loss", "type": "number", "jsonPath": ".status.progress.loss",
     "description": "Latest training loss."},
    {"name": "Checkpoint", "type": "integer", "jsonPath": ".status.lastCheckpoint.step",
     "description": "Global step of the most recent checkpoint."},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]


def build_crd() -> dict[str, Any]:
    """The apiextensions.k8s.io/v1 CustomResourceDefinition of TrainingJob."""
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": c.CRD_NAME,
            "labels": {"app.kubernetes.io/name": "pstrain", "app.kubernetes.io/part-of": "pstrain"},
        },
        "spec": {
            "group": c.GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": c.KIND,
                "listKind": f"{c.KIND}List",
                "plural": c.PLURAL,
                "singular": c.SINGULAR,
                "shortNames": list(c.SHORT_NAMES),
                "categories": list(c.CATEGORIES),
            },
            "versions": [
                {
                    "name": c.VERSION,
                    "served": True,
                    "storage": True,
                    "schema": {"openAPIV3Schema": openapi_schema()},
                    "subresources": {"status": {}, "scale": SCALE_SUBRESOURCE},
                    "additionalPrinterColumns": PRINTER_COLUMNS,
                }
            ],
        },
    }


HEADER = "# Generated by `pstrain crd` from the pydantic models in api/pstrain_api/model.py.\n" \
         "# Do not edit by hand: run `pstrain crd > crds/trainingjob.yaml`.\n"


def render_crd_yaml() -> str:
    return HEADER + yaml.safe_dump(build_crd(), sort_keys=False, width=100)
