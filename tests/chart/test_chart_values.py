"""values.yaml and values.schema.json: every key documented, every object closed, and a
typo anywhere refused both by the schema and by `helm template` itself."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import jsonschema
import pytest
import yaml

from .helm import CHART, K8S_VERSION, RELEASE_NAMESPACE, require_helm, run_helm

SCHEMA = json.loads((CHART / "values.schema.json").read_text(encoding="utf-8"))
VALUES_TEXT = (CHART / "values.yaml").read_text(encoding="utf-8")
VALUES = yaml.safe_load(VALUES_TEXT)

# Blocks whose contents are Kubernetes objects (documented upstream, typed from
# Kubernetes' own schema): their inner keys need no comment of their own.
K8S_TYPED = ("resources", "podSecurityContext", "securityContext")


def _walk(node: Any, path: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    if isinstance(node, dict):
        yield path, node
        for key, value in node.items():
            if key == "properties":
                for name, sub in value.items():
                    yield from _walk(sub, f"{path}.{name}")
            elif key in ("items", "additionalProperties", "not"):
                yield from _walk(value, f"{path}[{key}]")
            elif key in ("oneOf", "anyOf", "allOf"):
                for i, sub in enumerate(value):
                    yield from _walk(sub, f"{path}[{key}{i}]")


def _is_object(node: dict[str, Any]) -> bool:
    kind = node.get("type")
    return kind == "object" or (isinstance(kind, list) and "object" in kind)


def test_every_object_in_the_schema_is_closed() -> None:
    """A record (with properties) forbids unknown keys; a map (user-chosen keys) types its
    values. Nothing accepts arbitrary keys silently."""
    open_nodes = []
    for path, node in _walk(SCHEMA):
        if not _is_object(node):
            continue
        extra = node.get("additionalProperties", True)
        if "properties" in node and extra is not False:
            open_nodes.append(path or "<root>")
        if "properties" not in node and not isinstance(extra, dict):
            open_nodes.append(path or "<root>")
    assert open_nodes == []


def test_the_chart_own_keys_are_described_in_the_schema() -> None:
    """Every key of the chart's own (the inlined Kubernetes types are described upstream;
    their top-level key is described here)."""
    inlined = ("resources", "podSecurityContext", "securityContext", "affinity")
    undocumented = [
        path for path, node in _walk(SCHEMA)
        if path and "[" not in path
        and (path.count(".") == 1 or path.split(".")[1] not in inlined)
        and not node.get("description")
    ]
    assert undocumented == []


def test_values_yaml_is_valid_against_its_schema() -> None:
    jsonschema.Draft7Validator.check_schema(SCHEMA)
    jsonschema.validate(VALUES, SCHEMA)


def test_values_yaml_documents_every_key() -> None:
    """Every key line is preceded by a `# --` comment, except inside Kubernetes-typed
    blocks."""
    lines = VALUES_TEXT.splitlines()
    undocumented = []
    typed_indent: int | None = None
    for i, line in enumerate(lines):
        match = re.match(r"^(\s*)([A-Za-z][\w.-]*):", line)
        if not match:
            continue
        indent = len(match.group(1))
        if typed_indent is not None and indent > typed_indent:
            continue
        typed_indent = indent if match.group(2) in K8S_TYPED and indent == 0 else None
        previous = [p for p in lines[:i] if p.strip()][-1:]
        comment_block = [p for p in lines[max(0, i - 6):i] if p.strip().startswith("# --")]
        if not previous or not previous[0].strip().startswith("#") or not comment_block:
            undocumented.append(f"line {i + 1}: {line.strip()}")
    assert undocumented == []


def test_every_schema_key_appears_in_values_yaml() -> None:
    """values.yaml shows every key of the chart's own schema with its default."""
    missing = []

    def visit(schema: dict[str, Any], values: Any, path: str) -> None:
        for name, sub in schema.get("properties", {}).items():
            if name in K8S_TYPED and not path:
                continue
            if not isinstance(values, dict) or name not in values:
                missing.append(f"{path}{name}")
            elif sub.get("type") == "object" and "properties" in sub:
                visit(sub, values[name], f"{path}{name}.")

    visit(SCHEMA, VALUES, "")
    assert missing == []


TYPOS = [
    ("top-level", {"imagee": {"tag": "x"}}),
    ("image", {"image": {"tagg": "x"}}),
    ("runtime-image", {"runtimeImage": {"repo": "x"}}),
    ("leader-election", {"leaderElection": {"enable": True}}),
    ("service-monitor", {"metrics": {"serviceMonitor": {"interva": "1m"}}}),
    ("security-context", {"securityContext": {"runAsNonroot": True}}),
    ("pod-security-context", {"podSecurityContext": {"seccompProfile": {"typ": "x"}}}),
    ("resources", {"resources": {"request": {"cpu": "1"}}}),
    ("affinity", {"affinity": {"nodeAfinity": {}}}),
    ("toleration", {"tolerations": [{"keyy": "a"}]}),
    ("log-level", {"logLevel": "verbose"}),
    ("job-pod-security", {"jobPodSecurity": "baseline"}),
    ("namespace-name", {"watchNamespaces": ["Team_A"]}),
    ("reserved-env", {"extraEnv": [{"name": "PSTRAIN_OPERATOR_LOG_LEVEL", "value": "x"}]}),
    ("digest", {"image": {"digest": "latest"}}),
    ("port", {"metrics": {"port": 0}}),
    ("replicas", {"replicaCount": 0}),
    ("progress-interval", {"progressInterval": 60}),
    ("ps-liveness-range", {"psLivenessSeconds": 5}),
    ("ps-liveness-fraction", {"psLivenessSeconds": 30.5}),
]


@pytest.mark.parametrize("values", [pytest.param(v, id=i) for i, v in TYPOS])
def test_schema_rejects_typos_and_bad_values(values: dict[str, Any]) -> None:
    merged = _merge(VALUES, values)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(merged, SCHEMA)


@pytest.mark.parametrize("values", [pytest.param(v, id=i) for i, v in TYPOS[:6]])
def test_helm_refuses_typos(values: dict[str, Any]) -> None:
    require_helm()
    result = run_helm("template", "pstrain", str(CHART), "--namespace", RELEASE_NAMESPACE,
                      "--kube-version", f"{K8S_VERSION}.0", values=values)
    assert result.returncode != 0
    assert "values don't meet the specifications of the schema" in result.stderr
    assert "Additional property" in result.stderr


def _merge(base: Any, override: Any) -> Any:
    if isinstance(base, dict) and isinstance(override, dict):
        out = dict(base)
        for key, value in override.items():
            out[key] = _merge(base.get(key), value) if key in base else value
        return out
    return override
