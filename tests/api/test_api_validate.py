"""Defaults of a minimal manifest, and every bad manifest with the exact message it gets."""

from __future__ import annotations

import pytest

from pstrain_api.model import TrainingJob
from pstrain_api.validate import check_manifest, load_jobs, parse_documents

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
                 "metadata.name has 64 characters; the job's Service is named "
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
    pytest.param(job().workers(5, maxReplicas=4).build(),
                 "spec.replicas.worker.replicas is 5; it must be at most maxReplicas.",
                 id="workers-over-max"),
    pytest.param(job().workers(1, minReplicas=2).build(),
                 "spec.replicas.worker.replicas is 1; it must be at least minReplicas.",
                 id="workers-under-min"),
    pytest.param(job().workers(3, minReplicas=4, maxReplicas=2).build(),
                 "spec.replicas.worker.minReplicas is 4; it must be at most maxReplicas.",
                 id="worker-bounds-crossed"),
    pytest.param(job().workers(2, maxReplicas=0).build(),
                 "spec.replicas.worker.maxReplicas is 0; it must be at least 1.",
                 id="worker-max-zero"),
    pytest.param(job().workers(-2).build(),
                 "spec.replicas.worker.replicas is -2; it must be at least 1.",
                 id="negative-workers"),
    pytest.param(job().chief(replicas=2).build(),
                 "spec.replicas.chief.replicas is 2; it must be at most 1.", id="two-chiefs"),
    pytest.param(job().set("spec.replicas.ps.replica", 2).build(),
                 "spec.replicas.ps.replica is not a known field; the closest known field is replicas. Known fields here are: gpus, "
                 "readiness, replicas, resources, template.", id="unknown-field-typo"),
    pytest.param(job().set("spec.training.batch_size", 32).build(),
                 "spec.training.batch_size is not a known field; it is spelled batchSize.",
                 id="snake-case-field"),
    pytest.param(job().set("spec.training.optimizer.learning_rate", 0.1).build(),
                 "spec.training.optimizer.learning_rate is not a known field; it is spelled "
                 "learningRate.", id="snake-case-nested-field"),
    pytest.param(job().set("spec.run_policy", {}).build(),
                 "spec.run_policy is not a known field; it is spelled runPolicy.",
                 id="snake-case-object"),
    pytest.param(job().set("metadata.lables", {"a": "b"}).build(),
                 "metadata.lables is not a known field; the closest known field is labels. "
                 "Known fields here are: annotations, creationTimestamp, "
                 "deletionGracePeriodSeconds, "
                 "deletionTimestamp, finalizers, generateName, generation, labels, "
                 "managedFields, name, namespace, ownerReferences, resourceVersion, selfLink, "
                 "uid.", id="unknown-metadata-field"),
    pytest.param(job().set("spec.foo", 1).build(),
                 "spec.foo is not a known field. Known fields here are: replicas, runPolicy, "
                 "security, training.", id="unknown-spec-field"),
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
                 "a Kubernetes PodTemplateSpec; the closest known field is workingDir.",
                 id="pod-template-typo"),
    pytest.param(job().set("spec.replicas.ps.template", {"spec": {"containers": [
                     {"name": "pstrain", "resources": {"limits": {"cpu": 1.5}}}]}}).build(),
                 "spec.replicas.ps.template.spec.containers[0].resources.limits.cpu is 1.5; it "
                 "must be an integer or a string, not a number.", id="pod-template-float-quantity"),
    pytest.param(job().set("spec.replicas.ps.template", {"spec": {"node_selector": {}}})
                 .build(),
                 "spec.replicas.ps.template.spec.node_selector is not a field of a Kubernetes "
                 "PodTemplateSpec; it is spelled nodeSelector.", id="pod-template-snake-case"),
    pytest.param(job().template("ps", imagePullPolicy=5).build(),
                 "spec.replicas.ps.template.spec.containers[0].imagePullPolicy is 5; it must "
                 "be a string, not an integer.", id="pod-template-type"),
    pytest.param(job().set("spec.replicas.worker.replicas", "two").build(),
                 "spec.replicas.worker.replicas is 'two'; it must be an integer, not a string.",
                 id="replicas-not-int"),
    # Types as strict as the CRD's: the API server refuses each of these.
    pytest.param(job().training(steps="200").build(),
                 "spec.training.steps is '200'; it must be an integer, not a string.",
                 id="steps-quoted"),
    pytest.param(job().training(steps=True).build(),
                 "spec.training.steps is true; it must be an integer, not a boolean.",
                 id="steps-bool"),
    pytest.param(job().training(steps=1e30).build(),
                 "spec.training.steps is 1e+30; it must be an integer, not a number.",
                 id="steps-float"),
    pytest.param(job().training(optimizer={"learningRate": "0.1"}).build(),
                 "spec.training.optimizer.learningRate is '0.1'; it must be a number, not a "
                 "string.", id="learning-rate-quoted"),
    pytest.param(job().training(optimizer={"nesterov": "yes"}).build(),
                 "spec.training.optimizer.nesterov is 'yes'; it must be true or false, not a "
                 "string.", id="bool-quoted"),
    pytest.param(job().run_policy(suspend=1).build(),
                 "spec.runPolicy.suspend is 1; it must be true or false, not an integer.",
                 id="bool-as-int"),
    pytest.param(job().template("worker", image=5).build(),
                 "spec.replicas.worker.template.spec.containers[0].image is 5; it must be a string, not an integer.",
                 id="image-int"),
    pytest.param(job().template("worker", args=["--lr", 0.1]).build(),
                 "spec.replicas.worker.template.spec.containers[0].args[1] is 0.1; it must be a string, not a "
                 "number.", id="args-item-number"),
    pytest.param(job().template("worker", nodeSelector={"disk": True}).build(),
                 "spec.replicas.worker.template.spec.nodeSelector.disk is true; it must be a string, "
                 "not a boolean.", id="node-selector-bool"),
    pytest.param(job().workers(2, resources={"requests": {"cpu": 0.5}}).build(),
                 "spec.replicas.worker.resources.requests.cpu is 0.5; it must be an integer or "
                 "a string, not a number.", id="quantity-float"),
    pytest.param(job().set("spec.training", [1, 2]).build(),
                 "spec.training is [1, 2]; it must be a mapping, not a list.",
                 id="training-a-list"),
    pytest.param(job().template("worker", command="python train.py").build(),
                 "spec.replicas.worker.template.spec.containers[0].command is 'python train.py'; it must be a "
                 "list, not a string.", id="command-a-string"),
    # Rules the CRD's schema cannot say: finite numbers, int64, Kubernetes names.
    pytest.param(job().training(optimizer={"learningRate": float("inf")}).build(),
                 "spec.training.optimizer.learningRate is .inf; it must be a finite number.",
                 id="learning-rate-inf"),
    pytest.param(job().training(optimizer={"momentum": float("nan")}).build(),
                 "spec.training.optimizer.momentum is .nan; it must be a finite number.",
                 id="momentum-nan"),
    pytest.param(job().training(steps=10**20).build(),
                 "spec.training.steps is 100000000000000000000; it must fit in a 64-bit integer "
                 "(at most 9223372036854775807).", id="steps-over-int64"),
    pytest.param(job().training(args={"n": -(10**30)}).build(),
                 "spec.training.args.n is -1000000000000000000000000000000; it must fit in a "
                 "64-bit integer (at most 9223372036854775807).", id="args-over-int64"),
    pytest.param(job(namespace="Bad_NS!").build(),
                 "metadata.namespace is 'Bad_NS!'; it must be a DNS-1123 label: at most 63 "
                 "lowercase letters, digits and '-', starting and ending with a letter or "
                 "digit.", id="namespace-not-dns"),
    pytest.param(job().template("worker", serviceAccountName="Trainer_SA").build(),
                 "spec.replicas.worker.template.spec.serviceAccountName is 'Trainer_SA'; it must be a "
                 "DNS-1123 subdomain: at most 253 lowercase letters, digits, '-' and '.', "
                 "starting and ending with a letter or digit.", id="service-account-not-dns"),
    pytest.param(job().template("ps", priorityClassName="high priority").build(),
                 "spec.replicas.ps.template.spec.priorityClassName is 'high priority'; it must be a "
                 "DNS-1123 subdomain: at most 253 lowercase letters, digits, '-' and '.', "
                 "starting and ending with a letter or digit.", id="priority-class-not-dns"),
    pytest.param(job().template("worker", volumeMounts=[{"name": "Data",
                                                         "mountPath": "/d"}]).build(),
                 "spec.replicas.worker.template.spec.containers[0].volumeMounts[0].name is 'Data'; it must be a "
                 "DNS-1123 label: at most 63 lowercase letters, digits and '-', starting and "
                 "ending with a letter or digit.", id="volume-name-not-dns"),
    pytest.param(job().template("worker", labels={"team name": "ml"}).build(),
                 "spec.replicas.worker.template.metadata.labels has the key 'team name'; it must be a "
                 "label key: an optional DNS subdomain and '/', then at most 63 letters, "
                 "digits, '-', '_' and '.', starting and ending with a letter or digit.",
                 id="label-key-space"),
    pytest.param(job().template("worker", labels={"team": "ml ops"}).build(),
                 "spec.replicas.worker.template.metadata.labels.team is 'ml ops'; it must be a label "
                 "value: empty, or at most 63 letters, digits, '-', '_' and '.', starting and "
                 "ending with a letter or digit.", id="label-value-space"),
    pytest.param(job().set("metadata.labels", {"Example.com/x": "y"}).build(),
                 "metadata.labels has the key 'Example.com/x'; it must be a label key: an "
                 "optional DNS subdomain and '/', then at most 63 letters, digits, '-', '_' "
                 "and '.', starting and ending with a letter or digit.",
                 id="label-key-bad-prefix"),
    # What would not fit in the environment every replica starts with.
    pytest.param(job().training(args={"blob": "x" * 200_000}).build(),
                 "spec.training is 200468 bytes as JSON; every replica receives it in the "
                 "PSTRAIN_TRAINING environment variable, and Linux allows one variable at most "
                 "131072 bytes ('Argument list too long'); pass large data through a file or a "
                 "volume, e.g. a path in spec.training.args.", id="training-args-200kb"),
    pytest.param(job().workers(4000).build(),
                 "spec.replicas asks for 4001 replicas; every replica receives all their "
                 "addresses in the PSTRAIN_CLUSTER environment variable, which would be 139078 "
                 "bytes, and Linux allows one variable at most 131072 bytes ('Argument list "
                 "too long').", id="workers-4000"),
    pytest.param(job().workers(10**9).build(),
                 "spec.replicas asks for 1000000001 replicas; every replica receives all their "
                 "addresses in the PSTRAIN_CLUSTER environment variable, which would be at "
                 "least 22000000022 bytes, and Linux allows one variable at most 131072 bytes "
                 "('Argument list too long').", id="workers-a-billion"),
    # Long values are shortened in the message, not repeated in full.
    pytest.param(job().training(entrypoint="x" * 100_000).build(),
                 "spec.training.entrypoint is 'xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx...xxxxxxxxxxxx"
                 "xxxxxxxxxxxxxxxxxxxxxxxxxx' (100000 characters); it must be 'module:function', "
                 "e.g. 'mypackage.model:make_task' (dotted module path, a colon, a function "
                 "name).", id="long-value-shortened"),
    pytest.param(job().set("spec." + "k" * 100_000, 1).build(),
                 f"spec.'{'k' * 37}...{'k' * 38}' (100000 characters) is not a known field. "
                 "Known fields here are: replicas, runPolicy, security, training.", id="long-key-shortened"),
    pytest.param(job().set("spec.replicas.worker.replicas", list(range(100_000))).build(),
                 "spec.replicas.worker.replicas is [0, 1, 2, 3, 4, 5, ...]; it must be an "
                 "integer, not a list.", id="long-list-shortened"),
]


@pytest.mark.parametrize(("doc", "message"), BAD)
def test_bad_manifest_gets_a_message_naming_field_value_and_rule(doc, message):
    parsed, problems = check_manifest(doc, "job.yaml")
    assert parsed is None
    assert message in [p.message for p in problems], [p.message for p in problems]
    assert all(str(p).startswith("job.yaml: ") for p in problems)


def test_problem_messages_are_one_short_line():
    for param in BAD:
        doc, _ = param.values
        _, problems = check_manifest(doc, "job.yaml")
        for problem in problems:
            assert "\n" not in str(problem) and len(str(problem)) < 400, param.id


@pytest.mark.parametrize(
    "doc",
    [
        pytest.param(job().template("worker", command=list(range(10_000))).build(),
                     id="type-errors"),
        pytest.param(job().training(args={"xs": [2**70] * 10_000}).build(), id="int64"),
    ],
)
def test_a_flood_of_problems_is_cut_to_twenty_and_a_count(doc):
    _, problems = check_manifest(doc)
    assert len(problems) == 21
    assert problems[-1].message == "... and 9980 more problems like these."


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


HEAD = "apiVersion: pstrain.io/v1alpha1\nkind: TrainingJob\nmetadata: {name: j}\n"
BOMB = "a: &a [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{b}: &{b} [{', '.join([f'*{a}'] * 10)}]\n" for a, b in zip("abcdefgh", "bcdefghi"))

# Files that break the reader's limits, each with its one line. Each used to crash
# (UnicodeDecodeError, RecursionError), hang (the alias bomb) or pass silently.
BAD_FILES = [
    pytest.param(b"\xff\xfeapiVersion: x\n",
                 "the file is not UTF-8 text (byte 0xff at offset 0); a manifest must be YAML "
                 "in UTF-8.", id="utf16-bom"),
    pytest.param(HEAD.encode() + b"spec: {training: {args: {name: caf\xe9}}}\n",
                 "the file is not UTF-8 text (byte 0xe9 at offset 104); a manifest must be YAML "
                 "in UTF-8.", id="latin1"),
    pytest.param(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR",
                 "the file is not UTF-8 text (byte 0x89 at offset 0); a manifest must be YAML "
                 "in UTF-8.", id="binary"),
    pytest.param(b"a: b\x00c\n",
                 "the file is not valid YAML: character '\\x00' at offset 4 may not appear in "
                 "YAML text.", id="nul-byte"),
    pytest.param(b"a: " + b"#" * (3 * 1024 * 1024),
                 "the file is 3145731 bytes; a manifest may be at most 3145728 bytes (3 MiB, "
                 "the API server's request limit).", id="over-3-mib"),
    pytest.param(("a: " + "[" * 20_000 + "]" * 20_000).encode(),
                 "line 1, column 103: the values nest more than 100 levels deep; a manifest may "
                 "nest at most 100.", id="nested-20000-deep"),
    pytest.param(("a: " + "{b: " * 101 + "1" + "}" * 101).encode(),
                 "line 1, column 397: the values nest more than 100 levels deep; a manifest may "
                 "nest at most 100.", id="nested-101-deep"),
    pytest.param(BOMB.encode(),
                 "line 5, column 4: its aliases expand the document to more than 1000000 "
                 "values; a manifest may hold at most 1000000.", id="alias-bomb"),
    pytest.param(("x: &x [[[[[[[[[[1]]]]]]]]]]\n" + "".join(
        f"x{i}: &x{i} [[[[[[[[[[*x{i - 1 if i else ''}]]]]]]]]]]\n" for i in range(10))).encode(),
                 "line 9, column 5: its aliases nest the values more than 100 levels deep; "
                 "a manifest may nest at most 100.", id="alias-deep"),
    pytest.param(b"a: &a [1, *a]\n",
                 "line 1, column 4: an alias refers to a value that contains it; a manifest may "
                 "not refer to itself.", id="alias-recursive"),
    pytest.param((HEAD + "spec:\n  training:\n    steps: 200\n    steps: 999999\n").encode(),
                 "line 7, column 5: the key 'steps' appears twice in one mapping (first at "
                 "line 6, column 5); each key may appear once.", id="duplicate-key"),
    pytest.param((HEAD + "metadata: {name: k}\n").encode(),
                 "line 4, column 1: the key 'metadata' appears twice in one mapping (first at "
                 "line 3, column 1); each key may appear once.", id="duplicate-top-level-key"),
    pytest.param((HEAD + "spec: {training: {steps: 1e30}}\n").encode(),
                 "spec.training.steps is 1e+30; it must be an integer, not a number.",
                 id="exponent-is-a-number"),
    pytest.param((HEAD + "spec: {training: {optimizer: {learningRate: .inf}}}\n").encode(),
                 "spec.training.optimizer.learningRate is .inf; it must be a finite number.",
                 id="yaml-inf"),
    pytest.param((HEAD + "spec: {training: {steps: '200'}}\n").encode(),
                 "spec.training.steps is '200'; it must be an integer, not a string.",
                 id="yaml-quoted-int"),
]


@pytest.mark.timeout(30)
@pytest.mark.parametrize(("content", "message"), BAD_FILES)
def test_bad_file_gets_one_line(tmp_path, content, message):
    path = tmp_path / "job.yaml"
    path.write_bytes(content)
    jobs, problems = load_jobs(path)
    assert jobs == []
    assert [str(p) for p in problems] == [f"{path}: {message}"]


@pytest.mark.parametrize(
    "text",
    [
        pytest.param(HEAD + "x: &n 2\nspec: {replicas: {worker: {replicas: *n}}}\n",
                     id="alias"),
        pytest.param(HEAD + "x: &t {steps: 5, batchSize: 8}\nspec: {training: {<<: *t, "
                     "steps: 7}}\n", id="merge-key-overridden"),
    ],
)
def test_anchors_and_merge_keys_within_bounds_still_work(text):
    docs, problems = parse_documents(text)
    assert problems == []
    doc = docs[0]
    doc.pop("x")
    parsed, problems = check_manifest(doc)
    assert problems == [] and parsed is not None


def test_a_manifest_is_read_as_the_api_server_reads_it() -> None:
    """Whole floats in integer fields are integers, null fields are dropped (then
    defaulted), and `status` is ignored on create: the API server accepts all three."""
    data = (job().training(batchSize=200.0, seed=None)
            .set("spec.replicas.worker.replicas", None)
            .set("status", {"phase": "Bogus"}).build())
    found, problems = check_manifest(data)
    assert problems == [] and found is not None
    assert found.spec.training.batch_size == 200
    absent = job().set("spec.replicas.worker.template", {}).build()
    del absent["spec"]["replicas"]["worker"]["template"]
    default, _ = check_manifest(absent)
    assert default is not None
    assert found.spec.replicas.worker.replicas == default.spec.replicas.worker.replicas
    assert found.status is None
