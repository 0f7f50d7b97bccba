"""The schema of a role's pod template: Kubernetes' own core/v1 PodTemplateSpec, pinned
to one Kubernetes version, as a structural OpenAPI v3 schema the CRD can embed.

Source: the JSON schemas that the `kubernetes-validate` package ships offline (generated
from Kubernetes' OpenAPI definitions). `python -m pstrain_api.podschema` converts them
and writes `k8s/podtemplatespec-v<K8S_VERSION>.json` beside this module; the CRD
generator and the validator read that file, so neither needs kubernetes-validate, and a
test fails when the file drifts from its source.

The conversion: `$ref`s inlined; `type: [T, "null"]` becomes `type: T`; Kubernetes'
int-or-string types (IntOrString, Quantity) become `x-kubernetes-int-or-string: true`;
`additionalProperties: false` is dropped (the API server prunes unknown fields and
rejects them under strict field validation); the list markers (`x-kubernetes-list-type`,
`x-kubernetes-list-map-keys`) are kept where the API server accepts them (every map key
required or defaulted); the template's metadata keeps only labels and annotations,
the parts of a pod template's metadata that pstrain uses; and descriptions are kept
(first sentence, at most DESCRIPTION_MAX characters, which keeps the CRD within the
API server's size limits) so `kubectl explain` describes every field. `containers` is
optional: a template may set only pod-level fields and keep pstrain's main container.
"""

from __future__ import annotations

import copy
import functools
import json
from pathlib import Path
from typing import Any

K8S_VERSION = "1.35"
SCHEMA_FILE = Path(__file__).parent / "k8s" / f"podtemplatespec-v{K8S_VERSION}.json"
ROOT_TYPE = "io.k8s.api.core.v1.PodTemplateSpec"
INT_OR_STRING_TYPES = frozenset({"io.k8s.apimachinery.pkg.util.intstr.IntOrString",
                                 "io.k8s.apimachinery.pkg.api.resource.Quantity"})
DESCRIPTION_MAX = 200
_DROP = {"additionalProperties", "$schema", "$id", "x-kubernetes-patch-strategy",
         "x-kubernetes-patch-merge-key", "x-kubernetes-group-version-kind",
         "x-kubernetes-unions"}


def _definitions() -> dict[str, Any]:
    import kubernetes_validate

    base = Path(kubernetes_validate.__file__).parent / "kubernetes-json-schema"
    path = base / f"v{K8S_VERSION}.0-local" / "_definitions.json"
    return json.loads(path.read_text(encoding="utf-8"))["$defs"]


def _short(text: str) -> str:
    """The first sentence, at most DESCRIPTION_MAX characters."""
    first = text.split("\n\n", 1)[0].strip()
    end = first.find(". ")
    if end >= 0:
        first = first[:end + 1]
    return first if len(first) <= DESCRIPTION_MAX else first[:DESCRIPTION_MAX - 3].rstrip() + "..."


class _Converter:
    def __init__(self, defs: dict[str, Any]):
        self.defs = defs

    def convert(self, node: dict[str, Any], stack: tuple[str, ...] = ()) -> dict[str, Any]:
        node = dict(node)
        description = node.pop("description", None)
        if "$ref" in node:
            name = node.pop("$ref").rsplit("/", 1)[-1]
            if name in stack:
                raise ValueError(f"{name} is recursive; a CRD schema cannot embed it")
            if name in INT_OR_STRING_TYPES:
                out: dict[str, Any] = {"x-kubernetes-int-or-string": True}
            else:
                out = self.convert(self.defs[name], (*stack, name))
            if description:
                out["description"] = _short(description)
            return out
        out = {}
        if description:
            out["description"] = _short(description)
        kind = node.pop("type", None)
        if isinstance(kind, list):
            kinds = [k for k in kind if k != "null"]
            kind = kinds[0] if len(kinds) == 1 else None
        if kind:
            out["type"] = kind
        for key, value in node.items():
            if key in _DROP:
                if key == "additionalProperties" and isinstance(value, dict):
                    out[key] = self.convert(value, stack)
                continue
            if key == "properties":
                out[key] = {k: self.convert(v, stack) for k, v in value.items()}
            elif key == "items":
                out[key] = self.convert(value, stack)
            elif key in ("oneOf", "anyOf", "allOf"):
                raise ValueError(f"cannot express {key} structurally: {value}")
            else:
                out[key] = copy.deepcopy(value)
        if out.get("x-kubernetes-list-type") == "map":
            items = out.get("items", {})
            keys = out.get("x-kubernetes-list-map-keys", [])
            required = set(items.get("required", []))
            if not all(k in required or "default" in items.get("properties", {}).get(k, {})
                       for k in keys):
                out["x-kubernetes-list-type"] = "atomic"
                out.pop("x-kubernetes-list-map-keys", None)
        return out


def generate() -> dict[str, Any]:
    """The PodTemplateSpec schema, converted from kubernetes-validate's definitions."""
    defs = _definitions()
    schema = _Converter(defs).convert({"$ref": f"#/$defs/{ROOT_TYPE}"})
    meta = schema["properties"]["metadata"]
    meta["properties"] = {k: meta["properties"][k] for k in ("labels", "annotations")}
    # Containers may be left out: pstrain then builds the main container by its defaults.
    spec = schema["properties"]["spec"]
    spec["required"] = [r for r in spec.get("required", []) if r != "containers"]
    if not spec["required"]:
        spec.pop("required")
    return schema


@functools.cache
def pod_template_schema() -> dict[str, Any]:
    """The committed schema (read once)."""
    return json.loads(SCHEMA_FILE.read_text(encoding="utf-8"))


def render() -> str:
    return json.dumps(generate(), indent=1, sort_keys=True) + "\n"


if __name__ == "__main__":
    SCHEMA_FILE.write_text(render(), encoding="utf-8")
    print(f"wrote {SCHEMA_FILE}")
