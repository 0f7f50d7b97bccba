"""The rules of a TrainingJob that span fields or constrain values beyond a type, each
written once with its sentence, and enforced in two places:

- offline and in the operator: `replica_problems` runs on the manifest data (the API
  model's validators call it, and `pstrain validate` calls it to report every problem of
  a replica spec, not only the first);
- at `kubectl apply`: `CRD_RULES` are the same rules as CEL (`x-kubernetes-validations`),
  attached to the CRD by `pstrain_api.crd`, with the same sentence as message, so the
  API server refuses the job with the words `pstrain validate` prints. A value rule's
  message is the sentence after the field path ("is 'lots'; it must be ..."), an object
  rule's the sentence after the object's path ("gpus and resources.limits ...").

Pure: plain data in, (relative path, sentence) pairs out.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from . import constants as c
from .quote import MAX_QUOTED, quote
from . import template as tpl
from .membership import AT_LEAST_MIN, AT_MOST_MAX
from .names import (DNS_1035_LABEL, DNS_1035_RULE, DNS_SUBDOMAIN_MAX, LABEL_KEY,
                    LABEL_KEY_RULE, NAME_TOO_LONG)
from .template import RESERVED_ENV_RULE

# Kubernetes' own Quantity pattern (resource.Quantity in the OpenAPI definitions),
# without the minus sign: requests and limits are never negative.
QUANTITY_PATTERN = (r"^\+?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|"
                    r"([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$")
QUANTITY_RE = re.compile(QUANTITY_PATTERN)
QUANTITY_MAX_LENGTH = 64

QUANTITY_RULE = "it must be a non-negative Kubernetes quantity such as 500m, 2, 4Gi"
GPUS_ONCE = (f"and a container limit also sets {c.GPU_RESOURCE}; set the GPU count in one "
             "place only")
PS_NO_GPU = ("parameter servers keep parameters and optimizer state on the CPU, so a "
             "parameter server may not request GPUs")
GPU_LIMIT = f"resources.limits.{c.GPU_RESOURCE}"

Found = list[tuple[str, str]]  # (path relative to the checked object, sentence)


def is_quantity(value: Any) -> bool:
    """A non-negative Kubernetes quantity: an integer, or a string such as '500m'."""
    if isinstance(value, bool):
        return False
    if isinstance(value, int):
        return value >= 0
    return (isinstance(value, str) and len(value) <= QUANTITY_MAX_LENGTH
            and QUANTITY_RE.match(value) is not None)


_QUANTITY_SUFFIX = {"": 1, "n": 1e-9, "u": 1e-6, "m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15,
                    "E": 1e18, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40,
                    "Pi": 2**50, "Ei": 2**60}


def quantity_value(value: str) -> float:
    """The number a quantity string stands for ('2Gi' -> 2147483648.0, '1e3' -> 1000.0);
    the caller has checked `is_quantity`."""
    text = value.lstrip("+")
    match = re.fullmatch(r"([0-9.]+)([eE][+-]?[0-9.]+)?([KMGTPE]i|[numkMGTPE])?", text)
    if match is None:
        raise ValueError(f"{value!r} is not a quantity")
    number, exponent, suffix = match.groups()
    scale = float("1" + exponent) if exponent else 1.0
    return float(number) * scale * _QUANTITY_SUFFIX[suffix or ""]


def _map(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def _gpu_limits(role: Mapping[str, Any]) -> list[tuple[str, Any]]:
    """(path, value) of each nvidia.com/gpu limit: the role's resources, the template's
    main container."""
    out = []
    for path, resources in (("resources", role.get("resources")),
                            ("template.spec.containers[0].resources",
                             tpl.main_container(_map(role.get("template"))).get("resources"))):
        limits = _map(_map(resources).get("limits"))
        if c.GPU_RESOURCE in limits:
            out.append((f"{path}.limits.{c.GPU_RESOURCE}", limits[c.GPU_RESOURCE]))
    return out


def quantity_problems(resources: Mapping[str, Any]) -> Found:
    found: Found = []
    for part in ("requests", "limits"):
        for name, qty in _map(resources.get(part)).items():
            # A value of another type is a type error (reported as such), not a quantity.
            if isinstance(qty, (int, str)) and not is_quantity(qty):
                found.append((f"{part}.{name}", f"is {quote(qty)}; {QUANTITY_RULE}"))
    return found


def replica_problems(role: Mapping[str, Any], is_ps: bool) -> Found:
    """Every rule broken by one replica spec (`spec.replicas.<role>`, as data)."""
    found: Found = [(f"resources.{p}", s) for p, s in quantity_problems(
        _map(role.get("resources")))]
    template = role.get("template")
    if isinstance(template, Mapping):
        found += [(f"template.{p}", s) for p, s in (*tpl.schema_problems(template),
                                                    *tpl.owned_field_problems(template),
                                                    *tpl.name_problems(template))]
    gpus = role.get("gpus")
    limits = _gpu_limits(role)
    if gpus is not None and limits:
        found.append(("gpus", f"is {quote(gpus)} {GPUS_ONCE}"))
    if is_ps and gpus not in (None, 0):
        found.append(("gpus", f"is {quote(gpus)}; {PS_NO_GPU}"))
    for path, limit in limits:
        if is_ps and str(limit) != "0":
            found.append((path, f"is {quote(limit)}; {PS_NO_GPU}"))
    return found


def manifest_problems(data: Any) -> Found:
    """Every rule broken by any replica spec of a manifest, with full field paths."""
    replicas = _map(_map(_map(data).get("spec")).get("replicas"))
    found: Found = []
    for role in c.ROLES:
        spec = replicas.get(role)
        if isinstance(spec, Mapping):
            base = f"spec.replicas.{role}"
            found += [(f"{base}.{p}" if p else base, s)
                      for p, s in replica_problems(spec, role == c.ROLE_PS)]
    return found


def sentence(path: str, text: str) -> str:
    """A problem as `pstrain validate` prints it: 'PATH is VALUE; RULE.' (an object
    rule's text starts with the field it is about: 'gpus is 2; ...')."""
    if not path:
        return f"{text}."
    if text.startswith(("is ", "has ")):
        return f"{path} {text}."
    return f"{path}.{text}."


def joined(path: str, text: str) -> str:
    """(relative path, text) as the one clause a model validator raises."""
    return f"{path} {text}" if path else text


# --------------------------------------------------------------------------- CEL
# Kubernetes 1.28 estimates every rule's cost before it accepts the CRD. Its estimator
# does not know how long `string(int)` or `string(int-or-string)` is, so a message that
# concatenates such a value is refused ("exceeds budget by factor of more than 100x").
# One `'TEXT {}'.replace('{}', VALUE)` is estimated from TEXT alone, so every message
# here names at most one value, through `_with_value`. A quantity (int-or-string) rule
# in CEL is refused for the same reason: quantities are checked by the schema
# (QUANTITY_SCHEMA) instead.


def _cel_string(text: str) -> str:
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _with_value(template: str, value: str) -> str:
    """CEL for `template` with its one `{}` replaced by the string expression `value`."""
    assert template.count("{}") == 1, template
    return f"{_cel_string(template)}.replace('{{}}', {value})"


@dataclass(frozen=True)
class CelRule:
    """One `x-kubernetes-validations` entry. With `message_expression` the API server
    prints its value (which names the bad value), else `message`."""

    rule: str
    message: str
    message_expression: str | None = None

    def to_crd(self) -> dict[str, str]:
        out = {"rule": self.rule, "message": self.message}
        if self.message_expression:
            out["messageExpression"] = self.message_expression
        return out


_HAS_GPU_LIMIT = (f"has(self.resources) && has(self.resources.limits) && "
                  f"'{c.GPU_RESOURCE}' in self.resources.limits")
_MAIN = "self.template.spec.containers[0]"
_HAS_MAIN_GPU_LIMIT = (
    "has(self.template) && has(self.template.spec) && has(self.template.spec.containers) "
    f"&& self.template.spec.containers.size() > 0 && has({_MAIN}.resources) && "
    f"has({_MAIN}.resources.limits) && '{c.GPU_RESOURCE}' in {_MAIN}.resources.limits")
_HAS_MAIN = "has(self.containers) && self.containers.size() > 0"


def _named_value(template: str, expr: str) -> str:
    """CEL for `template` naming string `expr` as `quote.named` does: 'VALUE' when it is
    short and on one line, else by its length."""
    short = f"{expr}.size() <= {MAX_QUOTED} && !{expr}.contains('\\n')"
    quoted = _with_value(template.replace("{}", "'{}'"), expr)
    counted = _with_value(template.replace("{}", "a string of {} characters"),
                          f"string({expr}.size())")
    return f"{short} ? {quoted} : {counted}"


def _value_rule(field: str, rule: str, text: str) -> CelRule:
    """A rule about string field `field` of self: 'FIELD is 'VALUE'; TEXT'."""
    return CelRule(rule=rule, message=f"{field} {text}",
                   message_expression=_named_value(f"{field} is {{}}; {text}", f"self.{field}"))


def _quoted_value(template: str, expr: str) -> str:
    """CEL naming int-or-string `expr` as Python's repr does: 2, or '2'."""
    quoted = template.replace("{}", "'{}'")
    return (f"type({expr}) == string ? {_with_value(quoted, expr)}"
            f" : {_with_value(template, f'string({expr})')}")


# Quantities (requests and limits values): Kubernetes' pattern, as schema bounds.
QUANTITY_SCHEMA = {"pattern": QUANTITY_PATTERN, "maxLength": QUANTITY_MAX_LENGTH,
                   "minimum": 0}
RESERVED_ENV_CEL = _value_rule(
    "name", f"!self.name.startsWith({_cel_string(c.RESERVED_ENV_PREFIX)}) && "
    + " && ".join(f"self.name != {_cel_string(n)}" for n in sorted(c.RESERVED_ENV_NAMES)),
    RESERVED_ENV_RULE)
GPUS_ONCE_CEL = CelRule(
    rule=f"!(has(self.gpus) && (({_HAS_GPU_LIMIT}) || ({_HAS_MAIN_GPU_LIMIT})))",
    message=f"gpus {GPUS_ONCE}",
    message_expression=_with_value(f"gpus is {{}} {GPUS_ONCE}", "string(self.gpus)"),
)
PS_NO_GPUS_CEL = CelRule(
    rule="!has(self.gpus) || self.gpus == 0",
    message=f"gpus: {PS_NO_GPU}",
    message_expression=_with_value(f"gpus is {{}}; {PS_NO_GPU}", "string(self.gpus)"),
)


def _no_gpu_limit(has: str, where: str, path: str) -> CelRule:
    limit = f"{where}.resources.limits['{c.GPU_RESOURCE}']"
    return CelRule(
        rule=f"!({has}) || string({limit}) == '0'",
        message=f"{path}: {PS_NO_GPU}",
        message_expression=_quoted_value(f"{path} is {{}}; {PS_NO_GPU}", limit),
    )


PS_NO_GPU_LIMIT_CEL = _no_gpu_limit(_HAS_GPU_LIMIT, "self", GPU_LIMIT)
PS_NO_MAIN_GPU_LIMIT_CEL = _no_gpu_limit(_HAS_MAIN_GPU_LIMIT, _MAIN,
                                         f"template.spec.containers[0].{GPU_LIMIT}")
MAIN_NAME_CEL = CelRule(
    rule=f"!({_HAS_MAIN}) || self.containers[0].name == {_cel_string(c.MAIN_CONTAINER)}",
    message=f"containers[0].name: {tpl.MAIN_NAME_RULE}",
    message_expression=_named_value(f"containers[0].name is {{}}; {tpl.MAIN_NAME_RULE}",
                                    "self.containers[0].name"),
)
MAIN_PORTS_CEL = CelRule(rule=f"!({_HAS_MAIN}) || !has(self.containers[0].ports)",
                         message=f"containers[0].ports {tpl.PORTS_RULE}")
POD_RULES = [
    *(_value_rule(f, f"!has(self.{f})", tpl.DNS_NAME_RULE) for f in tpl.OWNED_POD_FIELDS),
    _value_rule("restartPolicy", "!has(self.restartPolicy) || self.restartPolicy == 'Never'",
                tpl.RESTART_RULE),
    MAIN_NAME_CEL,
    MAIN_PORTS_CEL,
]


# A pod template's label keys (names.label_key_problem): the first bad key is named.
_LABEL_KEY_OK = (f"k.matches({_cel_string(LABEL_KEY.pattern)}) && "
                 f"k.lastIndexOf('/') <= {DNS_SUBDOMAIN_MAX}")
TEMPLATE_LABEL_KEYS_CEL = CelRule(
    rule=f"self.all(k, {_LABEL_KEY_OK})",
    message=f"has a key that is not a label key; {LABEL_KEY_RULE}",
    message_expression=_named_value(f"has the key {{}}; {LABEL_KEY_RULE}",
                                    f"self.filter(k, !({_LABEL_KEY_OK}))[0]"),
)


def _bound_rule(field: str, rule: str, text: str) -> CelRule:
    """A worker-count bound on self (spec.replicas.worker): 'FIELD is N; TEXT'."""
    return CelRule(rule=rule, message=f"{field} {text.removeprefix('it ')}",
                   message_expression=_with_value(f"{field} is {{}}; {text}",
                                                  f"string(self.{field})"))


# Elastic workers (membership.bounds_problem): the scale subresource writes
# spec.replicas.worker.replicas without pydantic, so the API server itself keeps it within
# minReplicas..maxReplicas. As bounds_problem, crossed bounds are the one problem reported.
_CROSSED = ("has(self.minReplicas) && has(self.maxReplicas) && "
            "self.minReplicas > self.maxReplicas")
WORKER_BOUNDS_CEL = [
    _bound_rule("minReplicas", f"!({_CROSSED})", AT_MOST_MAX),
    _bound_rule("replicas", f"!has(self.minReplicas) || ({_CROSSED}) || "
                "self.replicas >= self.minReplicas", AT_LEAST_MIN),
    _bound_rule("replicas", f"!has(self.maxReplicas) || ({_CROSSED}) || "
                "self.replicas <= self.maxReplicas", AT_MOST_MAX),
]

# The job name (names.check_job_name): the CRD can see metadata.name from the root.
NAME_LENGTH_CEL = CelRule(
    rule=f"self.metadata.name.size() <= {c.DNS_LABEL_MAX}",
    message=f"metadata.name {NAME_TOO_LONG}",
    message_expression=_with_value(f"metadata.name has {{}} characters; {NAME_TOO_LONG}",
                                   "string(self.metadata.name.size())"),
)
NAME_LABEL_CEL = _value_rule(
    "metadata.name", (f"self.metadata.name.size() > {c.DNS_LABEL_MAX} || "
                      f"self.metadata.name.matches({_cel_string(DNS_1035_LABEL.pattern)})"),
    DNS_1035_RULE)

# Where each rule sits in the CRD's openAPIV3Schema: a path of property names, where
# "[]" means the items of an array and "{}" the values of a map.
CRD_RULES: list[tuple[tuple[str, ...], CelRule]] = [((), NAME_LENGTH_CEL),
                                                     ((), NAME_LABEL_CEL)]
# Schema rules the CRD adds: quantities, and a pod template's labels (the values as
# Kubernetes checks them when it creates the pod; at most TEMPLATE_LABELS_MAX, which
# keeps the CEL rule on their keys within the API server's cost budget).
CRD_BOUNDS: list[tuple[tuple[str, ...], dict[str, Any]]] = []
for _role in c.ROLES:
    _base = ("spec", "replicas", _role)
    _pod = (*_base, "template", "spec")
    CRD_RULES.append((_base, GPUS_ONCE_CEL))
    CRD_RULES += [(_pod, rule) for rule in POD_RULES]
    CRD_RULES.append(((*_base, "template", "metadata", "labels"), TEMPLATE_LABEL_KEYS_CEL))
    for _kind in ("containers", "initContainers"):
        CRD_RULES.append(((*_pod, _kind, "[]", "env", "[]"), RESERVED_ENV_CEL))
    for _part in ("requests", "limits"):
        CRD_BOUNDS.append(((*_base, "resources", _part, "{}"), QUANTITY_SCHEMA))
    CRD_BOUNDS += [((*_base, "template", *path), bounds)
                   for path, bounds in tpl.TEMPLATE_BOUNDS]
CRD_BOUNDS.append((("spec", "training", "sparseStorage", "serverMemory"), QUANTITY_SCHEMA))
CRD_RULES += [((*("spec", "replicas", c.ROLE_PS),), rule) for rule in (
    PS_NO_GPUS_CEL, PS_NO_GPU_LIMIT_CEL, PS_NO_MAIN_GPU_LIMIT_CEL)]
CRD_RULES += [(("spec", "replicas", c.ROLE_WORKER), rule)
              for rule in WORKER_BOUNDS_CEL]
