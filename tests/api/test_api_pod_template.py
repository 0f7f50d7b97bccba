"""The full PodTemplateSpec of a role: Kubernetes' own schema, pinned to a version, and
the fields pstrain owns, refused by `pstrain validate` and by the CRD's CEL rules with
one sentence naming the field."""

from __future__ import annotations

from typing import Any

import pytest

from pstrain_api import podschema
from pstrain_api.crd import openapi_schema
from pstrain_api.validate import check_manifest

from .job_builder import job
from .test_api_cel import cel_problems

pytest.importorskip("celpy")

W = "spec.replicas.worker.template.spec"
OWNED = [
    ("main-container-renamed", {"spec": {"containers": [{"name": "tensorflow"}]}},
     f"{W}.containers[0].name is 'tensorflow'; the first container is the replica's main "
     "container, which pstrain names 'pstrain'."),
    ("main-container-ports", {"spec": {"containers": [
        {"name": "pstrain", "ports": [{"containerPort": 8080}]}]}},
     f"{W}.containers[0].ports is set; pstrain declares the main container's ports (2222 "
     "and 2223 on a parameter server, 9400 for metrics)."),
    ("hostname", {"spec": {"hostname": "h"}},
     f"{W}.hostname is 'h'; pstrain sets it so that each replica has the DNS name its "
     "cluster spec gives."),
    ("subdomain", {"spec": {"subdomain": "s"}},
     f"{W}.subdomain is 's'; pstrain sets it so that each replica has the DNS name its "
     "cluster spec gives."),
    ("restart-policy", {"spec": {"restartPolicy": "OnFailure"}},
     f"{W}.restartPolicy is 'OnFailure'; it must be 'Never' (pstrain restarts replicas by "
     "spec.runPolicy)."),
    ("sidecar-env", {"spec": {"containers": [
        {"name": "pstrain"}, {"name": "side", "env": [{"name": "PSTRAIN_CLUSTER"}]}]}},
     f"{W}.containers[1].env[0].name is 'PSTRAIN_CLUSTER'; names starting with PSTRAIN_ and "
     "TF_CONFIG are set by pstrain and may not be overridden."),
    ("init-container-env", {"spec": {"initContainers": [
        {"name": "init", "env": [{"name": "TF_CONFIG"}]}]}},
     f"{W}.initContainers[0].env[0].name is 'TF_CONFIG'; names starting with PSTRAIN_ and "
     "TF_CONFIG are set by pstrain and may not be overridden."),
    ("gpu-limit-in-ps-container", None,
     "spec.replicas.ps.template.spec.containers[0].resources.limits.nvidia.com/gpu is 1; "
     "parameter servers keep parameters and optimizer state on the CPU, so a parameter "
     "server may not request GPUs."),
]


@pytest.mark.parametrize(("template", "sentence"),
                         [pytest.param(t, m, id=i) for i, t, m in OWNED])
def test_owned_fields_are_refused_with_one_sentence(template: dict[str, Any] | None,
                                                     sentence: str) -> None:
    builder = job()
    if template is None:
        builder.template("ps", resources={"limits": {"nvidia.com/gpu": 1}})
    else:
        builder.workers(2, template=template)
    data = builder.build()
    _, problems = check_manifest(data)
    assert [p.message for p in problems] == [sentence]
    assert cel_problems(openapi_schema(), data) == [sentence]  # kubectl apply says the same


def test_a_template_with_only_pod_fields_keeps_the_defaults() -> None:
    job_model, problems = check_manifest(job().template(
        "worker", nodeSelector={"pool": "gpu"}).build())
    assert problems == [] and job_model is not None


def test_the_committed_pod_schema_is_generated_from_kubernetes_validate() -> None:
    pytest.importorskip("kubernetes_validate")
    assert podschema.SCHEMA_FILE.read_text() == podschema.render(), (
        "the pod template schema drifted; run `python -m pstrain_api.podschema`")
