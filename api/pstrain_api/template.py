"""A role's pod template: a full Kubernetes core/v1 PodTemplateSpec (`metadata` with
labels and annotations, `spec` a PodSpec), checked against Kubernetes' own schema
(pstrain_api.podschema) and against the fields pstrain owns.

What pstrain owns, and so refuses in a template (each refusal names the field):
- the main container's name: the first container is the replica's main container and
  must be named `pstrain` (other containers are sidecars);
- the main container's `ports`: pstrain declares the replica port (2222) and, on a
  parameter server, the data port (2223);
- the injected environment: names starting with PSTRAIN_, and TF_CONFIG, in any
  container or init container;
- the pod's `hostname` and `subdomain` (the replica's DNS name) and a `restartPolicy`
  other than Never (pstrain restarts replicas by its run policy).

What is unset gets today's defaults when the pod is built (operator/build.py): the
operator's runtime image, `pstrain replica`, a restrictive security context.

Pure: plain data in, (path, sentence) pairs out.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Iterable, Mapping
from typing import Any

from . import constants as c
from .quote import named, quote
from . import names
from .podschema import pod_template_schema
from .spelling import spelling_hint

Found = list[tuple[str, str]]
KIND = "PodTemplateSpec"

OWNED_POD_FIELDS = ("hostname", "subdomain")
MAIN_NAME_RULE = (f"the first container is the replica's main container, which pstrain "
                  f"names {c.MAIN_CONTAINER!r}")
PORTS_RULE = (f"is set; pstrain declares the main container's ports ({c.REPLICA_PORT} and "
              f"{c.DATA_PORT} on a parameter server, {c.METRICS_PORT} for metrics)")
DNS_NAME_RULE = "pstrain sets it so that each replica has the DNS name its cluster spec gives"
RESTART_RULE = "it must be 'Never' (pstrain restarts replicas by spec.runPolicy)"
# What the CRD adds to Kubernetes' schema of a template (paths as crd.schema_at takes
# them, "{}" the values of a map), checked here too: label values as Kubernetes checks
# them when it creates the pod, and at most TEMPLATE_LABELS_MAX labels (a bound that
# keeps the CEL rule on label keys within the API server's cost budget).
TEMPLATE_LABELS_MAX = 64
TEMPLATE_BOUNDS: list[tuple[tuple[str, ...], dict[str, Any]]] = [
    (("metadata", "labels"), {"maxProperties": TEMPLATE_LABELS_MAX}),
    (("metadata", "labels", "{}"), {"maxLength": c.DNS_LABEL_MAX,
                                    "pattern": names.LABEL_VALUE.pattern}),
]
LABELS_MAX_RULE = f"a pod template may have at most {TEMPLATE_LABELS_MAX} labels"


def _map(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def _list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def pod_spec(template: Mapping[str, Any] | None) -> Mapping[str, Any]:
    return _map(_map(template).get("spec"))


def main_container(template: Mapping[str, Any] | None) -> Mapping[str, Any]:
    """The first container of the template (the replica's own), or {} when none."""
    containers = _list(pod_spec(template).get("containers"))
    return _map(containers[0]) if containers else {}


def containers(template: Mapping[str, Any] | None) -> Iterable[tuple[str, Mapping[str, Any]]]:
    """(path, container) of every container and init container."""
    spec = pod_spec(template)
    for kind in ("containers", "initContainers"):
        for i, container in enumerate(_list(spec.get(kind))):
            yield f"spec.{kind}[{i}]", _map(container)


def _shown(value: Any) -> str:
    """A value as the CRD's CEL messages name it (`named`, for a string)."""
    return named(value) if isinstance(value, str) else quote(value)


def owned_field_problems(template: Mapping[str, Any]) -> Found:
    """Every pstrain-owned field the template sets (paths relative to the template)."""
    found: Found = []
    spec = pod_spec(template)
    main = main_container(template)
    if main and main.get("name") != c.MAIN_CONTAINER:
        found.append(("spec.containers[0].name", f"is {_shown(main.get('name'))}; {MAIN_NAME_RULE}"))
    if "ports" in main:
        found.append(("spec.containers[0].ports", PORTS_RULE))
    for field in OWNED_POD_FIELDS:
        if field in spec:
            found.append((f"spec.{field}", f"is {_shown(spec[field])}; {DNS_NAME_RULE}"))
    if spec.get("restartPolicy", "Never") != "Never":
        found.append(("spec.restartPolicy", f"is {_shown(spec['restartPolicy'])}; {RESTART_RULE}"))
    for path, container in containers(template):
        for i, var in enumerate(_list(container.get("env"))):
            name = _map(var).get("name")
            if isinstance(name, str) and is_reserved_env(name):
                found.append((f"{path}.env[{i}].name", f"is {named(name)}; {RESERVED_ENV_RULE}"))
    return found


RESERVED_ENV_RULE = (f"names starting with {c.RESERVED_ENV_PREFIX} and "
                     f"{', '.join(sorted(c.RESERVED_ENV_NAMES))} are set by pstrain and may "
                     "not be overridden")


def is_reserved_env(name: str) -> bool:
    return name.startswith(c.RESERVED_ENV_PREFIX) or name in c.RESERVED_ENV_NAMES


# --------------------------------------------------------------------------- schema


def _closed(node: Any) -> Any:
    """The schema as the API server applies it: every object that lists its properties
    closed to others (strict field validation), and an int-or-string (a quantity, a
    port) refused when it is neither (the server refuses `cpu: 1.5`)."""
    if isinstance(node, list):
        return [_closed(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {k: _closed(v) for k, v in node.items()}
    if "properties" in out and "additionalProperties" not in out:
        out["additionalProperties"] = False
    if out.get("x-kubernetes-int-or-string") and "type" not in out:
        out["type"] = ["integer", "string"]
    return out


def _bounded(schema: dict[str, Any]) -> dict[str, Any]:
    """`schema` (a copy) with TEMPLATE_BOUNDS added where they go."""
    out = copy.deepcopy(schema)
    for path, bounds in TEMPLATE_BOUNDS:
        node = out
        for part in path:
            node = node["additionalProperties"] if part == "{}" else node["properties"][part]
        node.update(bounds)
    return out


@functools.cache
def _validator() -> Any:
    import jsonschema

    return jsonschema.Draft202012Validator(_closed(_bounded(pod_template_schema())))


def _label_bound(err: Any) -> Found | None:
    """A TEMPLATE_BOUNDS refusal as pstrain says it ([] for a label value, which
    `name_problems` names), or None for any other error."""
    where = list(err.absolute_path)
    if where[:2] != ["metadata", "labels"]:
        return None
    if err.validator == "maxProperties":
        return [("metadata.labels", f"has {len(err.instance)} labels; {LABELS_MAX_RULE}")]
    return [] if err.validator in ("maxLength", "pattern") else None


def _where(parts: Iterable[Any]) -> str:
    out = ""
    for part in parts:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


_TYPE_WORDS = {"string": "a string", "array": "a list", "object": "a mapping",
               "integer": "an integer", "number": "a number", "boolean": "a boolean"}


def _kind_of(value: Any) -> str:
    if value is None:
        return "null"
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string",
            list: "a list", dict: "a mapping"}.get(type(value), type(value).__name__)


def name_problems(template: Mapping[str, Any]) -> Found:
    """Kubernetes names the pod schema cannot check: service account, priority class,
    volume and volume-mount names, label keys and values."""
    found: Found = []
    spec = pod_spec(template)
    for field in ("serviceAccountName", "priorityClassName"):
        value = spec.get(field)
        if isinstance(value, str) and (why := names.dns_subdomain_problem(value)):
            found.append((f"spec.{field}", f"is {quote(value)}; {why}"))
    for i, volume in enumerate(_list(spec.get("volumes"))):
        value = _map(volume).get("name")
        if isinstance(value, str) and (why := names.dns_label_problem(value)):
            found.append((f"spec.volumes[{i}].name", f"is {quote(value)}; {why}"))
    for path, container in containers(template):
        for i, mount in enumerate(_list(container.get("volumeMounts"))):
            value = _map(mount).get("name")
            if isinstance(value, str) and (why := names.dns_label_problem(value)):
                found.append((f"{path}.volumeMounts[{i}].name", f"is {quote(value)}; {why}"))
    labels = _map(_map(_map(template).get("metadata")).get("labels"))
    bad_key = next((k for k in labels if isinstance(k, str) and names.label_key_problem(k)),
                   None)
    if bad_key is not None:  # the first, as the CRD's rule names it
        found.append(("metadata.labels", f"has the key {named(bad_key)}; "
                                         f"{names.LABEL_KEY_RULE}"))
    for key, value in labels.items():
        if (isinstance(key, str) and isinstance(value, str)
                and (why := names.label_value_problem(value))):
            found.append((f"metadata.labels.{key}", f"is {quote(value)}; {why}"))
    return found


def _key_of(item: Mapping[str, Any], keys: list[str], schema: Mapping[str, Any]) -> Any:
    """The values of a list-map item's keys (a key's default where it is unset)."""
    props = _map(schema.get("properties"))
    return tuple(item.get(k, _map(props.get(k)).get("default")) for k in keys)


def _duplicates(path: str, field: str, value: list[Any], schema: Mapping[str, Any]) -> Found:
    """Items of a list-map with the keys of an earlier item, or of a set equal to an
    earlier item: the API server refuses them as duplicate values."""
    found: Found = []
    seen: dict[Any, int] = {}
    kind = schema.get("x-kubernetes-list-type")
    keys = list(schema.get("x-kubernetes-list-map-keys") or [])
    item_schema = _map(schema.get("items"))
    for i, item in enumerate(value):
        if kind == "map" and isinstance(item, Mapping):
            key = _key_of(item, keys, item_schema)
            if None in key:
                continue  # a missing key: the schema's `required` reports it
            shown = " and ".join(f"{k} {quote(v)}" for k, v in zip(keys, key))
            rule = f"each item of {field} must have a unique {' and '.join(keys)}"
        elif kind == "set" and isinstance(item, (str, int, float, bool)):
            key, shown, rule = item, quote(item), f"the items of {field} must be unique"
        else:
            continue
        first = seen.setdefault(key, i)
        if first != i:
            where = f"{path}[{first}]"
            found.append((f"{path}[{i}]", f"has {shown}, as {where} has; {rule}"))
    return found


def list_map_problems(value: Any, schema: Mapping[str, Any], path: str = "") -> Found:
    """Duplicate items anywhere in `value` of lists that `schema` declares list-maps
    (containers, env, volumes, ports, ... keyed by name) or sets."""
    found: Found = []
    if isinstance(value, Mapping):
        props = _map(schema.get("properties"))
        extra = schema.get("additionalProperties")
        for key, item in value.items():
            sub = props.get(key, extra if isinstance(extra, Mapping) else None)
            if isinstance(sub, Mapping):
                where = f"{path}.{key}" if path else str(key)
                found += list_map_problems(item, sub, where)
    elif isinstance(value, list):
        field = path.rsplit(".", 1)[-1]
        found += _duplicates(path, field, value, schema)
        items = _map(schema.get("items"))
        for i, item in enumerate(value):
            found += list_map_problems(item, items, f"{path}[{i}]")
    return found


def schema_problems(template: Any) -> Found:
    """Where the template departs from Kubernetes' PodTemplateSpec schema, duplicate
    list items (as the API server refuses them) included."""
    found: Found = []
    for err in sorted(_validator().iter_errors(template), key=lambda e: list(e.absolute_path)):
        path = _where(err.absolute_path)
        bound = _label_bound(err)
        if bound is not None:
            found += bound
        elif err.validator == "additionalProperties":
            known = sorted(_map(err.schema).get("properties", {}))
            for extra in sorted(set(_map(err.instance)) - set(known)):
                found.append((_where([*err.absolute_path, extra]),
                              f"is not a field of a Kubernetes {KIND}"
                              f"{spelling_hint(str(extra), known)}"))
        elif err.validator == "required":
            for name in err.validator_value:
                if name not in _map(err.instance):
                    found.append((_where([*err.absolute_path, name]), "is required but missing"))
        elif err.validator == "type":
            want = (" or ".join(_TYPE_WORDS[t] for t in err.validator_value)
                    if isinstance(err.validator_value, list)
                    else _TYPE_WORDS.get(str(err.validator_value), str(err.validator_value)))
            found.append((path, f"is {quote(err.instance)}; it must be {want}, not "
                                f"{_kind_of(err.instance)}"))
        elif err.validator == "enum":
            found.append((path, f"is {quote(err.instance)}; it must be one of {err.validator_value}"))
        else:
            found.append((path, f"is {quote(err.instance)}; {err.message}"))
    return found + list_map_problems(template, pod_template_schema())
