"""The generated CRD: drift against crds/, structure, and that its schema (as a JSON-schema
validator sees it) accepts every example and rejects the bad manifests."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from pstrain_api import crd
from pstrain_api.crd import build_crd, openapi_schema, render_crd_yaml
from pstrain_api.validate import check_manifest

from .job_builder import job
from .test_api_validate import BAD

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))


def test_crds_dir_is_exactly_the_generated_crd():
    on_disk = (ROOT / "crds" / "trainingjob.yaml").read_text()
    assert on_disk == render_crd_yaml(), (
        "crds/trainingjob.yaml drifted from the models; run `pstrain crd > crds/trainingjob.yaml`")


def test_crd_names_subresource_and_printer_columns():
    crd = build_crd()
    spec = crd["spec"]
    assert crd["metadata"]["name"] == "trainingjobs.pstrain.io"
    assert spec["names"]["shortNames"] == ["tj"]
    assert "pstrain" in spec["names"]["categories"]
    (version,) = spec["versions"]
    assert version["subresources"] == {"status": {}, "scale": {
        "specReplicasPath": ".spec.replicas.worker.replicas",
        "statusReplicasPath": ".status.workers.live",
        "labelSelectorPath": ".status.workers.selector",
    }}
    columns = {c["name"]: c["jsonPath"] for c in version["additionalPrinterColumns"]}
    assert columns == {
        "Phase": ".status.phase",
        "PS": ".status.psReady",
        "Workers": ".status.workersReady",
        "Live": ".status.workers.live",
        "Step": ".status.progress.globalStep",
        "Loss": ".status.progress.loss",
        "Checkpoint": ".status.lastCheckpoint.step",
        "Age": ".metadata.creationTimestamp",
    }


def _undescribed(node: dict[str, Any], path: str = "") -> list[str]:
    out = []
    for name, sub in (node.get("properties") or {}).items():
        here = f"{path}.{name}"
        if not sub.get("description"):
            out.append(here)
        out += _undescribed(sub, here)
    for key, mark in (("items", "[]"), ("additionalProperties", "{}")):
        if isinstance(node.get(key), dict):
            out += _undescribed(node[key], path + mark)
    return out


def test_every_crd_field_has_a_description():
    """`kubectl explain trainingjob.spec...` shows a description for every field, but
    below the second level of the embedded pod templates (crd.SIZE_BUDGET)."""
    found = _undescribed(openapi_schema())
    pod_fields = [p for p in found if ".template." in p]
    # The root metadata may carry no description (the API server refuses one); kubectl
    # explain shows Kubernetes' own ObjectMeta there.
    assert [p for p in found if p not in pod_fields] == [".metadata"]
    for path in pod_fields:
        inside = path.split(".template.", 1)[1]
        assert inside.count(".") + inside.count("[]") >= crd.TEMPLATE_DESCRIPTION_DEPTH, path


def _walk(node: Any, path: str = ""):
    if isinstance(node, dict):
        yield path, node
        for key, sub in node.get("properties", {}).items():
            yield from _walk(sub, f"{path}.{key}")
        if isinstance(node.get("items"), dict):
            yield from _walk(node["items"], f"{path}[]")
        if isinstance(node.get("additionalProperties"), dict):
            yield from _walk(node["additionalProperties"], f"{path}{{}}")


def test_schema_is_structural():
    """Kubernetes' structural-schema rules that pydantic output would break."""
    for path, node in _walk(openapi_schema()):
        for banned in ("$ref", "anyOf", "oneOf", "allOf", "$defs", "const", "title"):
            assert banned not in node, f"{path} has {banned}"
        assert (
            "type" in node
            or node.get("x-kubernetes-int-or-string")
            or node.get("x-kubernetes-preserve-unknown-fields")
        ), f"{path} has no type"
        assert not ("properties" in node and "additionalProperties" in node), path
        for key in ("exclusiveMinimum", "exclusiveMaximum"):
            assert isinstance(node.get(key, True), bool), f"{path}.{key} must be boolean"


def test_preserve_unknown_fields_only_on_pod_template_subtrees():
    preserved = [p for p, n in _walk(openapi_schema())
                 if n.get("x-kubernetes-preserve-unknown-fields")]
    assert preserved, "free-form pod-template fields must survive pruning"
    for path in preserved:
        assert ".template." in path or path == ".spec.training.args", path
    assert not openapi_schema()["properties"]["spec"].get("x-kubernetes-preserve-unknown-fields")


def test_schema_carries_defaults_for_a_minimal_manifest():
    spec = openapi_schema()["properties"]["spec"]
    reps = spec["properties"]["replicas"]
    assert spec["default"] == {}
    assert reps["default"] == {}
    assert reps["properties"]["ps"]["properties"]["replicas"]["default"] == 1
    assert reps["properties"]["worker"]["properties"]["replicas"]["default"] == 2
    assert spec["properties"]["training"]["properties"]["mode"]["enum"] == ["async", "sync"]
    assert "default" not in reps["properties"]["chief"], "no chief unless asked for"


def _strict(schema: dict[str, Any]) -> dict[str, Any]:
    """The schema as the API server applies it with strict field validation (kubectl
    --validate=strict): unknown fields are errors wherever unknown fields are not
    preserved."""
    schema = copy.deepcopy(schema)
    for path, node in _walk(schema):
        if "properties" in node and not node.get("x-kubernetes-preserve-unknown-fields"):
            if path != ".metadata":
                node["additionalProperties"] = False
    schema["properties"]["metadata"] = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 63,
                                "pattern": "^[a-z]([-a-z0-9]*[a-z0-9])?$"}},
    }
    return schema


VALIDATOR = jsonschema.Draft4Validator(_strict(openapi_schema()))


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_crd_schema_accepts_every_example(path):
    errors = list(VALIDATOR.iter_errors(yaml.safe_load(path.read_text())))
    assert errors == []


def test_examples_exist():
    names = {p.name for p in EXAMPLES}
    assert {"digits.yaml", "gpu.yaml"} <= names


# Cross-field rules that live in pydantic validators (and, for the PS GPU rule, in a CEL
# x-kubernetes-validations rule that a JSON-schema validator does not evaluate); and what
# the API server checks itself before any schema: apiVersion/kind route the request, and
# metadata is the server's own.
# Also what never reaches the schema: JSON has no .inf or .nan (kubectl cannot send them)
# and the server's decoder refuses integers beyond int64; x-kubernetes-int-or-string,
# which the server enforces, is only a marker to jsonschema; label keys, which the server
# checks when the operator creates the pod (the CRD cannot: no patternProperties); and
# the size of the cluster-spec environment, which only fails when a replica starts.
NOT_IN_SCHEMA = {"gpu-on-ps", "gpu-limit-on-ps", "gpu-twice", "reserved-env", "bad-quantity",
                 "pod-template-type", "service-account-not-dns", "priority-class-not-dns",
                 "volume-name-not-dns", "label-value-space",
                 "no-metadata", "wrong-api-version", "wrong-kind", "missing-kind",
                 "namespace-not-dns", "learning-rate-inf", "momentum-nan", "steps-over-int64",
                 "args-over-int64", "quantity-float", "label-key-space",
                 "label-key-bad-prefix", "training-args-200kb", "workers-4000",
                 "workers-a-billion", "workers-over-max", "workers-under-min",
                 "worker-bounds-crossed", "unknown-metadata-field",
                 "pod-template-float-quantity"}


@pytest.mark.parametrize(
    ("doc", "message"),
    [p for p in BAD if p.id not in NOT_IN_SCHEMA],
)
def test_crd_schema_rejects_bad_manifests(doc, message):
    assert list(VALIDATOR.iter_errors(doc)), f"schema accepted a manifest that gets: {message}"


def test_ps_gpu_rule_is_a_cel_validation_in_the_crd():
    ps = openapi_schema()["properties"]["spec"]["properties"]["replicas"]["properties"]["ps"]
    assert {"rule": "!has(self.gpus) || self.gpus == 0"}.items() <= (
        ps["x-kubernetes-validations"][1].items())


def test_pod_template_fields_survive_in_schema():
    """Fields of a full pod template that the old hand-picked subset refused."""
    affinity = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [{"matchExpressions": [
            {"key": "gpu", "operator": "In", "values": ["a100"]}]}]}}}
    doc = job().template(
        "worker", affinity=affinity, volumes=[{"name": "v", "emptyDir": {}}],
        runtimeClassName="nvidia", workingDir="/work",
        livenessProbe={"exec": {"command": ["true"]}, "periodSeconds": 5},
        spec={"topologySpreadConstraints": [{"maxSkew": 1, "topologyKey": "zone",
                                             "whenUnsatisfiable": "DoNotSchedule"}]},
    ).build()
    assert list(VALIDATOR.iter_errors(doc)) == []
    assert check_manifest(doc)[1] == []


def test_crd_embeds_the_kubernetes_pod_template_schema():
    worker = openapi_schema()["properties"]["spec"]["properties"]["replicas"]["properties"][
        "worker"]["properties"]["template"]
    pod = worker["properties"]["spec"]["properties"]
    assert {"runtimeClassName", "topologySpreadConstraints", "containers"} <= set(pod)
    container = pod["containers"]["items"]["properties"]
    assert {"workingDir", "livenessProbe", "readinessProbe", "startupProbe"} <= set(container)
    assert pod["containers"]["x-kubernetes-list-type"] == "map"
    assert pod["containers"]["items"]["properties"]["resources"]["properties"]["limits"][
        "additionalProperties"] == {"x-kubernetes-int-or-string": True}
    assert "x-kubernetes-preserve-unknown-fields" not in worker


def test_worker_bounds_are_cel_validations_in_the_crd():
    """The scale subresource writes spec.replicas.worker.replicas without pydantic: the API
    server itself must refuse a count outside minReplicas..maxReplicas (what each rule
    refuses, and with which sentence: test_api_cel)."""
    worker = (openapi_schema()["properties"]["spec"]["properties"]["replicas"]
              ["properties"]["worker"])
    messages = [rule["message"] for rule in worker["x-kubernetes-validations"]]
    assert messages[-3:] == ["minReplicas must be at most maxReplicas",
                             "replicas must be at least minReplicas",
                             "replicas must be at most maxReplicas"]
