"""The CRD's CEL rules (x-kubernetes-validations), evaluated with cel-python the way the
API server applies them: at every node of a manifest that has rules, with `self` bound
to that node. The emulator used by the operator tests runs no CEL, so this is where the
rules are tested: each bad manifest must be refused by the CRD with exactly the
sentences `pstrain validate` prints, and every example must pass."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from pstrain_api import rules
from pstrain_api.crd import openapi_schema
from pstrain_api.validate import check_manifest

from .job_builder import job

celpy = pytest.importorskip("celpy")

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))
ENV = celpy.Environment()
# Kubernetes' CEL has the strings extension's replace(); cel-python does not.
FUNCTIONS = {"replace": lambda text, old, new: celpy.celtypes.StringType(
    str(text).replace(str(old), str(new)))}


def _evaluate(expression: str, value: Any) -> Any:
    program = ENV.program(ENV.compile(expression), functions=FUNCTIONS)
    return program.evaluate({"self": celpy.json_to_cel(value)})


def cel_problems(schema: dict[str, Any], data: Any, path: str = "") -> list[str]:
    """Every rule of `schema` that `data` breaks, as the sentence `pstrain validate`
    prints (the rule's message after the path where the API server reports it)."""
    out: list[str] = []
    for entry in schema.get("x-kubernetes-validations", []):
        if not bool(_evaluate(entry["rule"], data)):
            message = (str(_evaluate(entry["messageExpression"], data))
                       if "messageExpression" in entry else entry["message"])
            out.append(rules.sentence(path, message))
    if isinstance(data, dict):
        for key, value in data.items():
            sub = (schema.get("properties") or {}).get(key)
            if sub is None and isinstance(schema.get("additionalProperties"), dict):
                sub = schema["additionalProperties"]
            if sub is not None:
                out += cel_problems(sub, value, f"{path}.{key}" if path else key)
    elif isinstance(data, list) and isinstance(schema.get("items"), dict):
        for i, value in enumerate(data):
            out += cel_problems(schema["items"], value, f"{path}[{i}]")
    return out


TF_CONFIG = {"name": "TF_CONFIG", "value": "x"}
BAD = [
    ("gpu-limit-on-ps", job().ps(1, resources={"limits": {"nvidia.com/gpu": 1}})),
    ("gpus-on-ps", job().ps(1, gpus=2)),
    ("gpus-set-twice", job().workers(2, gpus=1, resources={"limits": {"nvidia.com/gpu": 1}})),
    ("reserved-env", job().template("worker", env=[{"name": "A"}, TF_CONFIG])),
    ("reserved-prefix", job().template("chief", env=[{"name": "PSTRAIN_X", "value": "1"}])),
    ("workers-over-max", job().workers(5, maxReplicas=4)),
    ("workers-under-min", job().workers(2, minReplicas=3)),
    ("worker-bounds-crossed", job().workers(3, minReplicas=4, maxReplicas=2)),
    ("every-error-of-one-replica-spec",
     job().ps(1, gpus=1, resources={"limits": {"memory": "lots", "nvidia.com/gpu": 1}})
     .template("ps", env=[TF_CONFIG])),
]


@pytest.mark.parametrize("builder", [pytest.param(b, id=i) for i, b in BAD])
def test_crd_refuses_with_the_sentences_pstrain_validate_prints(builder) -> None:
    data = builder.build()
    _, problems = check_manifest(data)
    printed = sorted(p.message for p in problems)
    assert printed, "pstrain validate accepted a bad manifest"
    # Quantities are schema rules (pattern, minimum), not CEL: tests/kube checks them on
    # the real API server.
    assert sorted(cel_problems(openapi_schema(), data)) == [
        p for p in printed if rules.QUANTITY_RULE not in p]


def test_pstrain_validate_reports_every_error_of_a_replica_spec() -> None:
    data = dict(BAD)["every-error-of-one-replica-spec"].build()
    _, problems = check_manifest(data)
    assert sorted(p.message for p in problems) == [
        "spec.replicas.ps.gpus is 1 and a container limit also sets nvidia.com/gpu; set "
        "the GPU count in one place only.",
        "spec.replicas.ps.gpus is 1; parameter servers keep parameters and optimizer state "
        "on the CPU, so a parameter server may not request GPUs.",
        "spec.replicas.ps.resources.limits.memory is 'lots'; it must be a non-negative "
        "Kubernetes quantity such as 500m, 2, 4Gi.",
        "spec.replicas.ps.resources.limits.nvidia.com/gpu is 1; parameter servers keep "
        "parameters and optimizer state on the CPU, so a parameter server may not request "
        "GPUs.",
        "spec.replicas.ps.template.spec.containers[0].env[0].name is 'TF_CONFIG'; names "
        "starting with PSTRAIN_ and TF_CONFIG are set by pstrain and may not be overridden.",
    ]


GOOD = [
    ("quantities", job().workers(2, resources={"requests": {"cpu": "500m", "memory": "4Gi"},
                                               "limits": {"cpu": 2, "memory": "1.5e9"}})),
    ("gpu-limit-zero-on-ps", job().ps(1, resources={"limits": {"nvidia.com/gpu": 0}})),
    ("gpus-zero-on-ps", job().ps(1, gpus=0)),
    ("plain-env", job().template("worker", env=[{"name": "TF_CPP_MIN_LOG_LEVEL", "value": "2"}])),
]


@pytest.mark.parametrize("data", [pytest.param(b.build(), id=i) for i, b in GOOD] + [
    pytest.param(yaml.safe_load(p.read_text()), id=p.name) for p in EXAMPLES])
def test_good_manifests_pass_every_rule(data: dict[str, Any]) -> None:
    assert check_manifest(data)[1] == []
    assert cel_problems(openapi_schema(), data) == []


def test_every_role_carries_the_rules() -> None:
    replicas = openapi_schema()["properties"]["spec"]["properties"]["replicas"]["properties"]
    for role, spec in replicas.items():
        found = [r.to_crd() for r in (rules.GPUS_ONCE_CEL, rules.PS_NO_GPUS_CEL,
                                      rules.PS_NO_GPU_LIMIT_CEL)
                 if r.to_crd() in spec["x-kubernetes-validations"]]
        assert len(found) == (3 if role == "ps" else 1), role
        pod = spec["properties"]["template"]["properties"]["spec"]
        labels = spec["properties"]["template"]["properties"]["metadata"]["properties"][
            "labels"]
        assert labels["maxProperties"] == 64  # bounds the key rule's estimated cost
        assert labels["x-kubernetes-validations"] == [rules.TEMPLATE_LABEL_KEYS_CEL.to_crd()]
        assert [r.to_crd() for r in rules.POD_RULES] == pod["x-kubernetes-validations"]


@pytest.mark.parametrize("name", [pytest.param("x" * 64, id="too-long"),
                                  pytest.param("My_Job", id="not-a-label"),
                                  pytest.param("9lives", id="starts-with-digit")])
def test_crd_refuses_bad_job_names_with_the_same_sentence(name: str) -> None:
    data = job(name).build()
    _, problems = check_manifest(data)
    assert [p.message for p in problems] == cel_problems(openapi_schema(), data) != []
