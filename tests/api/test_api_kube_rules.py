"""The rules that hold on Kubernetes only (`pstrain_api.kube_rules`, through
`validate.check_for_kubernetes`, the operator's check): with sparseStorage.serverMemory,
`directory` must be set and lie at or under a writable volume mount of the parameter
servers' main container. `check_manifest` (what `pstrain run` and `pstrain validate`
use) accepts the same jobs: the local runner makes a temporary folder."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from pstrain_api.kube_rules import DIRECTORY, kubernetes_problems
from pstrain_api.model import TrainingJob
from pstrain_api.validate import check_for_kubernetes, check_manifest

from tests.test_docs import ROOT, code_blocks

from .job_builder import job

ROWS = {"name": "rows", "mountPath": "/var/lib/pstrain/rows"}


def sparse_job(storage: dict[str, Any], mounts: list[dict[str, Any]] | None = None,
               **template: Any) -> dict[str, Any]:
    builder = job("j").ps(2).workers(1).training(sparseStorage=storage)
    if mounts is not None:
        template.update(volumeMounts=mounts,
                        volumes=[{"name": m["name"], "emptyDir": {}} for m in mounts])
    if template:
        builder.template("ps", **template)
    return builder.build()


ACCEPTED = {
    "no disk tier": sparse_job({}),
    "the mount itself": sparse_job({"serverMemory": "2Gi", "directory": ROWS["mountPath"]},
                                   [ROWS]),
    "under the mount, trailing slashes": sparse_job(
        {"serverMemory": 512, "directory": "/var/lib/pstrain/rows/job-a/"},
        [{"name": "rows", "mountPath": "/var/lib/pstrain/rows/"}]),
    "a writable mount inside a read-only one": sparse_job(
        {"serverMemory": "2Gi", "directory": "/data/rows"},
        [{"name": "data", "mountPath": "/data", "readOnly": True},
         {"name": "rows", "mountPath": "/data/rows"}]),
}
REFUSED = {
    "no directory": (sparse_job({"serverMemory": "2Gi"}, [ROWS]),
                     f"{DIRECTORY} is missing; with serverMemory set"),
    "no template": (sparse_job({"serverMemory": "2Gi", "directory": "/rows"}),
                    f"{DIRECTORY} is '/rows'; it must be at or under the mountPath"),
    "another mount": (sparse_job({"serverMemory": "2Gi", "directory": "/rows"},
                                 [{"name": "ckpt", "mountPath": "/ckpt"}]),
                      "mountPaths: '/ckpt'"),
    "a sibling with the mount's prefix": (
        sparse_job({"serverMemory": "2Gi", "directory": "/var/lib/pstrain/rowsx"}, [ROWS]),
        f"{DIRECTORY} is '/var/lib/pstrain/rowsx'; it must be at or under"),
    "out of the mount through ..": (
        sparse_job({"serverMemory": "2Gi", "directory": "/var/lib/pstrain/rows/../x"},
                   [ROWS]), "it must be at or under"),
    "a relative path": (sparse_job({"serverMemory": "2Gi", "directory": "rows"},
                                   [{"name": "rows", "mountPath": "rows"}]),
                        f"{DIRECTORY} is 'rows'; it must be at or under"),
    "mounted in a sidecar only": (
        sparse_job({"serverMemory": "2Gi", "directory": "/rows"},
                   volumes=[{"name": "rows", "emptyDir": {}}],
                   sidecars=[{"name": "side", "image": "busybox",
                              "volumeMounts": [{"name": "rows", "mountPath": "/rows"}]}]),
        "mountPaths: none"),
    "a read-only mount": (
        sparse_job({"serverMemory": "2Gi", "directory": "/rows/a"},
                   [{"name": "rows", "mountPath": "/rows", "readOnly": True}]),
        f"{DIRECTORY} is '/rows/a', under the read-only mount '/rows'"),
}


@pytest.mark.parametrize("data", ACCEPTED.values(), ids=ACCEPTED.keys())
def test_a_directory_on_a_writable_mount_is_accepted(data: dict[str, Any]) -> None:
    job_, problems = check_for_kubernetes(data)
    assert problems == [] and job_ is not None


@pytest.mark.parametrize(("data", "says"), REFUSED.values(), ids=REFUSED.keys())
def test_a_disk_tier_off_a_mount_is_one_line_naming_field_value_and_rule(
        data: dict[str, Any], says: str) -> None:
    job_, problems = check_for_kubernetes(data, "job.yaml")
    assert job_ is None
    (problem,) = problems
    assert problem.path == DIRECTORY and problem.source == "job.yaml"
    assert problem.message.startswith(f"{DIRECTORY} is ") and says in problem.message
    assert "spec.replicas.ps.template" in problem.message or "readOnly" in problem.message
    assert "\n" not in problem.message and problem.message.endswith(".")
    # The API model, and with it `pstrain run` and `pstrain validate`, accepts the job.
    local, found = check_manifest(data)
    assert found == [] and local is not None


def test_an_invalid_manifest_reports_the_model_problems_only() -> None:
    data = sparse_job({"serverMemory": "lots"})
    _, problems = check_for_kubernetes(data)
    assert problems and all("serverMemory" in p.message for p in problems)


def test_kubernetes_problems_of_a_validated_job() -> None:
    data = sparse_job({"serverMemory": "2Gi"})
    assert [p for p, _ in kubernetes_problems(TrainingJob.model_validate(data))] == [DIRECTORY]


def test_the_disk_tier_manifest_of_docs_sparse_md_passes_on_kubernetes() -> None:
    blocks = [yaml.safe_load(text) for lang, text in code_blocks(ROOT / "docs" / "sparse.md")
              if lang == "yaml" and "sparseStorage:" in text]
    assert blocks, "docs/sparse.md shows no sparseStorage manifest"
    for block in blocks:
        data = {"apiVersion": "pstrain.io/v1alpha1", "kind": "TrainingJob",
                "metadata": {"name": "doc"}, **block}
        job_, problems = check_for_kubernetes(data)
        assert problems == [] and job_ is not None
