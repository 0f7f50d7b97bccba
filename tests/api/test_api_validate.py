"""Defaults of a minimal manifest, and every bad manifest with the exact message it gets."""

from __future__ import annotations

import pytest

from pstrain_api.model import TrainingJob
from pstrain_api.validate import check_manifest, parse_documents

from .job_builder import job


def test_minimal_manifest_defaults_to_one_ps_two_cpu_workers():
    parsed, problems = check_manifest(job("digits").build())
    assert problems == []
    assert parsed is not None
    assert parsed.namespace == "default"
    reps = parsed.spec.replicas
    assert (reps.ps.replicas, reps.worker.replicas, reps.chief) == (1, 2, None)
    assert (reps.ps.gpu_count, reps.worker.gpu_count) == (0, 0)
    t = parsed.spec.training
    assert (t.mode, t.optimizer.name, t.steps, t.batch_size) == ("async", "sgd", 1000, 64)
    assert t.entrypoint == "pstrain_runtime.examples.digits:make_task"
    rp = parsed.spec.run_policy
    assert (rp.restart_policy, rp.backoff_limit, rp.clean_pod_policy, rp.suspend) == (
        "OnFailure", 3, "Running", False)


def test_manifest_without_spec_is_defaulted_too():
    doc = job("digits").drop("spec").build()
    parsed, problems = check_manifest(doc)
    assert problems == [] and parsed is not None
    assert parsed.spec.replicas.worker.replicas == 2


def test_to_api_round_trips_camel_case():
    doc = (job("x").ps(2).workers(3, gpus=1).chief()
           .training(batchSize=32, mode="sync", stalenessBound=2).build())
    parsed = TrainingJob.model_validate(doc)
    again = TrainingJob.model_validate(parsed.to_api())
    assert again == parsed
    api = parsed.to_api()
    assert api["spec"]["training"]["batchSize"] == 32
    assert api["spec"]["replicas"]["worker"]["gpus"] == 1
    assert "status" not in api


def test_gpus_and_limits_give_the_gpu_count():
    doc = job("x").workers(2, resources={"limits": {"nvidia.com/gpu": 2}}).build()
    parsed, _ = check_manifest(doc)
    assert parsed is not None and parsed.spec.replicas.worker.gpu_count == 2


BAD = [
    pytest.param(job("Bad_Name").build(),
                 "metadata.name is 'Bad_Name'; it must be a DNS-1035 label: lowercase letters, "
                 "digits and '-', starting with a letter and ending with a letter or digit.",
                 id="name-not-dns"),
    pytest.param(job("a" * 64).build(),
                 f"metadata.name is '{'a' * 64}' (64 characters); the job's Service is named "
                 "after it and must be at most 63 characters.",
                 id="name-too-long"),
    pytest.param(job("1abc").build(),
                 "metadata.name is '1abc'; it must be a DNS-1035 label: lowercase letters, "
                 "digits and '-', starting with a letter and ending with a letter or digit.",
                 id="name-starts-with-digit"),
    pytest.param(job().drop("metadata").build(), "metadata is required but missing.",
                 id="no-metadata"),
    pytest.param(job().set("apiVersion", "kubeflow.org/v1").build(),
                 "apiVersion is 'kubeflow.org/v1'; it must be 'pstrain.io/v1alpha1'.",
                 id="wrong-api-version"),
    pytest.param(job().set("kind", "TFJob").build(),
                 "kind is 'TFJob'; it must be 'TrainingJob'.", id="wrong-kind"),
    pytest.param(job().drop("kind").build(), "kind is missing; it must be 'TrainingJob'.",
                 id="missing-kind"),
    pytest.param(job().ps(0).build(),
                 "spec.replicas.ps.replicas is 0; it must be at least 1.", id="zero-ps"),
    pytest.param(job().workers(-2).build(),
                 "spec.replicas.worker.replicas is -2; it must be at least 1.",
                 id="negative-workers"),
    pytest.param(job().chief(replicas=2).build(),
                 "spec.replicas.chief.replicas is 2; it must be at most 1.", id="two-chiefs"),
    pytest.param(job().set("spec.replicas.ps.replica", 2).build(),
                 "spec.replicas.ps.replica is not a known field; known fields here are: gpus, "
                 "readiness, replicas, resources, template.", id="unknown-field-typo"),
    pytest.param(job().set("spec.foo", 1).build(),
                 "spec.foo is not a known field; known fields here are: replicas, runPolicy, "
                 "training.", id="unknown-spec-field"),
    pytest.param(job().ps(1, gpus=1).build(),
                 "spec.replicas.ps.gpus is 1; parameter servers keep parameters and optimizer "
                 "state on the CPU, so a parameter server may not request GPUs.",
                 id="gpu-on-ps"),
    pytest.param(job().ps(1, resources={"limits": {"nvidia.com/gpu": 1}}).build(),
                 "spec.replicas.ps.resources.limits.nvidia.com/gpu is 1; parameter servers "
                 "keep parameters and optimizer state on the CPU, so a parameter server may "
                 "not request GPUs.", id="gpu-limit-on-ps"),
    pytest.param(job().workers(2, gpus=1, resources={"limits": {"nvidia.com/gpu": 1}}).build(),
                 "spec.replicas.worker.gpus is 1 and a container limit also sets "
                 "nvidia.com/gpu; set the GPU count in one place only.", id="gpu-twice"),
    pytest.param(job().workers(2, gpus=-1).build(),
                 "spec.replicas.worker.gpus is -1; it must be at least 0.", id="negative-gpus"),
    pytest.param(job().training(entrypoint="train.py").build(),
                 "spec.training.entrypoint is 'train.py'; it must be 'module:function', e.g. "
                 "'mypackage.model:make_task' (dotted module path, a colon, a function name).",
                 id="entrypoint-no-colon"),
    pytest.param(job().training(entrypoint="my-pkg:main").build(),
                 "spec.training.entrypoint is 'my-pkg:main'; it must be 'module:function', e.g. "
                 "'mypackage.model:make_task' (dotted module path, a colon, a function name).",
                 id="entrypoint-bad-module"),
    pytest.param(job().training(mode="fast").build(),
                 "spec.training.mode is 'fast'; it must be one of 'async' or 'sync'.",
                 id="bad-mode"),
    pytest.param(job().training(optimizer={"name": "adamw"}).build(),
                 "spec.training.optimizer.name is 'adamw'; it must be one of 'sgd', 'momentum', "
                 "'adagrad' or 'adam'.", id="bad-optimizer"),
    pytest.param(job().training(optimizer={"learningRate": 0}).build(),
                 "spec.training.optimizer.learningRate is 0; it must be greater than 0.0.",
                 id="zero-learning-rate"),
    pytest.param(job().training(steps=0).build(),
                 "spec.training.steps is 0; it must be at least 1.", id="zero-steps"),
    pytest.param(job().training(stalenessBound=-1).build(),
                 "spec.training.stalenessBound is -1; it must be at least 0.",
                 id="negative-staleness"),
    pytest.param(job().run_policy(restartPolicy="Always").build(),
                 "spec.runPolicy.restartPolicy is 'Always'; it must be one of 'Never', "
                 "'OnFailure' or 'ExitCode'.", id="bad-restart-policy"),
    pytest.param(job().run_policy(backoffLimit=-1).build(),
                 "spec.runPolicy.backoffLimit is -1; it must be at least 0.",
                 id="negative-backoff"),
    pytest.param(job().template("worker", env=[{"name": "TF_CONFIG", "value": "{}"}]).build(),
                 "spec.replicas.worker.template.spec.containers[0].env[0].name is 'TF_CONFIG'; "
                 "names starting with PSTRAIN_ and TF_CONFIG are set by pstrain and may not be "
                 "overridden.",
                 id="reserved-env"),
    pytest.param(job().workers(2, resources={"requests": {"memory": "lots"}}).build(),
                 "spec.replicas.worker.resources.requests.memory is 'lots'; it must be a "
                 "non-negative Kubernetes quantity such as 500m, 2, 4Gi.", id="bad-quantity"),
    pytest.param(job().template("ps", workingDirr="/w").build(),
                 "spec.replicas.ps.template.spec.containers[0].workingDirr is not a field of "
                 "a Kubernetes PodTemplateSpec.", id="pod-template-typo"),
    pytest.param(job().template("ps", imagePullPolicy=5).build(),
                 "spec.replicas.ps.template.spec.containers[0].imagePullPolicy is 5; it must "
                 "be of type string.", id="pod-template-type"),
    pytest.param(job().set("spec.replicas.worker.replicas", "two").build(),
                 "spec.replicas.worker.replicas is 'two'; input should be a valid integer, "
                 "unable to parse string as an integer.", id="replicas-not-int"),
]


@pytest.mark.parametrize(("doc", "message"), BAD)
def test_bad_manifest_gets_a_message_naming_field_value_and_rule(doc, message):
    parsed, problems = check_manifest(doc, "job.yaml")
    assert parsed is None
    assert message in [p.message for p in problems], [p.message for p in problems]
    assert all(str(p).startswith("job.yaml: ") for p in problems)


def test_every_problem_is_reported_not_only_the_first():
    doc = job().ps(0).workers(0).training(mode="fast").build()
    _, problems = check_manifest(doc)
    assert {p.path for p in problems} == {
        "spec.replicas.ps.replicas", "spec.replicas.worker.replicas", "spec.training.mode"}


@pytest.mark.parametrize(
    ("text", "message"),
    [
        pytest.param("a: [\n", "the file is not valid YAML at line 2, column 1: expected the "
                     "node content, but found '<stream end>'.", id="unclosed-list"),
        pytest.param("a: b: c\n", "the file is not valid YAML at line 1, column 5: mapping "
                     "values are not allowed here.", id="nested-colon"),
        pytest.param("", "the file holds no YAML document.", id="empty"),
    ],
)
def test_bad_yaml_names_the_line(text, message):
    docs, problems = parse_documents(text)
    assert docs == []
    assert [p.message for p in problems] == [message]


def test_non_mapping_document():
    _, problems = check_manifest(["a", "b"])
    assert [p.message for p in problems] == [
        "the document is list; it must be a mapping with apiVersion pstrain.io/v1alpha1 "
        "and kind TrainingJob."]
