"""What the CRD promises, checked on a real API server (v1.28, ../shared/k8s).

- every CEL rule refuses its bad job with the sentence `pstrain validate` prints, and
  the schema's own rules (quantities, unknown fields under strict field validation,
  types) are refused by both;
- every example manifest is accepted unchanged;
- the API server's defaults are pydantic's: what `kubectl get` returns is what the
  operator reads (`TrainingJob.model_validate(...).to_api()`), and unknown fields are
  pruned when validation is off;
- the status and scale subresources, `kubectl get` columns, short names and categories,
  `kubectl explain`;
- the CRD's size budget, and the CEL cost budget, by what the API server accepts.

The tables of bad jobs are created as a server-side dry run (full validation, defaulting
and admission, nothing stored; what `kubectl create --dry-run=server` sends) through the
Python client, whose Status names each field error: a kubectl process per case would
cost seconds. What a user sees through kubectl (`apply`, `scale`, `get`, `explain`) is
tested with kubectl. One namespace serves the module; tests that store a job name their
own.
"""

from __future__ import annotations

import copy
import json
import re
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from pstrain_api import constants as c
from pstrain_api import crd, rules
from pstrain_api.manifest_yaml import load_all
from pstrain_api.model import TrainingJob
from pstrain_api.validate import check_manifest

from ..api.job_builder import JobBuilder, job
from ..api.test_api_cel import BAD
from .conftest import CRD_FILE, CRD_NAME, Cluster, Namespace
from .server_errors import JobServer, ServerError, invalid_entries, unknown_fields

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))


@pytest.fixture(scope="module")
def ns(cluster: Cluster) -> Iterator[Namespace]:
    """One namespace for this module's jobs (each test names its own)."""
    found = Namespace(cluster, f"api-{uuid.uuid4().hex[:10]}")
    cluster.kubectl("create", "namespace", found.name)
    try:
        yield found
    finally:
        cluster.kubectl("delete", "namespace", found.name, "--wait=false", check=False)


@pytest.fixture(scope="module")
def server(cluster: Cluster) -> JobServer:
    return JobServer(cluster.kubeconfig)


def kubectl_dry_run(ns: Namespace, data: dict[str, Any], *args: str) -> tuple[bool, str]:
    """`kubectl create --dry-run=server` (strict field validation): accepted?, output."""
    proc = ns.kubectl("create", "--dry-run=server", "-f", "-", *args,
                      input=json.dumps(data), check=False)
    return proc.returncode == 0, proc.stdout + proc.stderr


def names_field(sentence: str, path: str) -> bool:
    """Whether `sentence` is about the field at `path` (not only a parent of it)."""
    return re.search(re.escape(path) + r"(?![\w.\[/-])", sentence) is not None


def pstrain_says(data: dict[str, Any]) -> list[str]:
    """What `pstrain validate` prints for the manifest (the problems' sentences)."""
    job_, problems = check_manifest(data)
    assert (job_ is None) == bool(problems)
    return sorted(p.message for p in problems)


# --------------------------------------------------------------------------- CEL rules

TF_CONFIG = {"name": "TF_CONFIG", "value": "x"}
GPU = c.GPU_RESOURCE


def _with_role(role: str, builder: JobBuilder, **fields: Any) -> JobBuilder:
    if role == c.ROLE_PS:
        return builder.ps(1, **fields)
    if role == c.ROLE_WORKER:
        return builder.workers(2, **fields)
    return builder.chief(**fields)


def _pod_rule_job(role: str, rule: rules.CelRule) -> JobBuilder:
    """A job that breaks one of rules.POD_RULES in `role`'s pod template."""
    for field in ("hostname", "subdomain"):
        if rule.message.startswith(f"{field} "):
            return job().template(role, spec={field: "x"})
    if rule.message.startswith("restartPolicy "):
        return job().template(role, spec={"restartPolicy": "Always"})
    if rule is rules.MAIN_NAME_CEL:
        return job().template(role, spec={"containers": [{"name": "main"}]})
    if rule is rules.MAIN_PORTS_CEL:
        return job().template(role, ports=[{"containerPort": 8080}])
    raise AssertionError(f"no bad job for the pod rule {rule.message!r}: add one here")


def bad_job_for(path: tuple[str, ...], rule: rules.CelRule) -> JobBuilder:
    """A job that breaks `rule` where rules.CRD_RULES puts it, and nothing else of the
    schema. A rule added to the CRD without a case here fails the test."""
    role = path[2] if len(path) > 2 else ""
    if rule is rules.NAME_LENGTH_CEL:
        return job("a" * (c.DNS_LABEL_MAX + 1))
    if rule is rules.NAME_LABEL_CEL:
        return job("9lives")
    if rule is rules.GPUS_ONCE_CEL:
        return _with_role(role, job(), gpus=0, resources={"limits": {GPU: 0}})
    if rule in rules.POD_RULES:
        return _pod_rule_job(role, rule)
    if rule is rules.RESERVED_ENV_CEL and "initContainers" in path:
        return job().template(role, initContainers=[
            {"name": "init", "env": [{"name": "PSTRAIN_X", "value": "1"}]}])
    if rule is rules.RESERVED_ENV_CEL:
        return job().template(role, env=[TF_CONFIG, {"name": "A", "value": "1"}])
    if rule is rules.PS_NO_GPUS_CEL:
        return job().ps(1, gpus=2)
    if rule is rules.PS_NO_GPU_LIMIT_CEL:
        return job().ps(1, resources={"limits": {GPU: "2"}})
    if rule is rules.PS_NO_MAIN_GPU_LIMIT_CEL:
        return job().template(c.ROLE_PS, resources={"limits": {GPU: 1}})
    if rule is rules.TEMPLATE_LABEL_KEYS_CEL:
        return job().set(f"spec.replicas.{role}.template",
                         {"metadata": {"labels": {"ok": "1", "not ok": "2"}}})
    if rule is rules.WORKER_BOUNDS_CEL[0]:
        return job().workers(3, minReplicas=4, maxReplicas=2)
    if rule is rules.WORKER_BOUNDS_CEL[1]:
        return job().workers(2, minReplicas=3)
    if rule is rules.WORKER_BOUNDS_CEL[2]:
        return job().workers(5, maxReplicas=4)
    raise AssertionError(f"no bad job for the CEL rule {rule.message!r} at {path}: "
                         "add one to bad_job_for")


def _server_path(path: tuple[str, ...]) -> str:
    """A CRD_RULES path as the API server names the node (first item of each list)."""
    out = ""
    for part in path:
        out += "[0]" if part == "[]" else f".{part}" if out else part
    return out


_RULE_TAGS = {id(rule): tag for rule, tag in (
    (rules.NAME_LENGTH_CEL, "name-length"), (rules.NAME_LABEL_CEL, "name-label"),
    (rules.GPUS_ONCE_CEL, "gpus-once"), (rules.RESERVED_ENV_CEL, "reserved-env"),
    (rules.PS_NO_GPUS_CEL, "no-gpus"), (rules.PS_NO_GPU_LIMIT_CEL, "no-gpu-limit"),
    (rules.PS_NO_MAIN_GPU_LIMIT_CEL, "no-main-gpu-limit"),
    (rules.MAIN_NAME_CEL, "main-name"), (rules.MAIN_PORTS_CEL, "main-ports"),
    (rules.TEMPLATE_LABEL_KEYS_CEL, "label-keys"),
    (rules.WORKER_BOUNDS_CEL[0], "bounds-crossed"),
    (rules.WORKER_BOUNDS_CEL[1], "at-least-min"), (rules.WORKER_BOUNDS_CEL[2], "at-most-max"))}


def _rule_case_id(path: tuple[str, ...], rule: rules.CelRule) -> str:
    tag = _RULE_TAGS.get(id(rule)) or rule.message.split()[0]
    where = ".".join(p for p in path if p not in ("[]", "spec", "replicas", "template"))
    return f"{where or 'root'}:{tag}"


RULE_CASES = [pytest.param(path, rule, id=_rule_case_id(path, rule))
              for path, rule in rules.CRD_RULES]


def _assert_same_sentences(server: list[ServerError], data: dict[str, Any]) -> None:
    """The server's CEL refusals, as sentences, are exactly pstrain validate's (but for
    quantities, which the schema checks with its own words)."""
    printed = [p for p in pstrain_says(data) if rules.QUANTITY_RULE not in p]
    assert printed, "pstrain validate accepted a job the CRD's rules refuse"
    assert sorted(e.sentence for e in server if e.cel_message is not None) == printed


@pytest.mark.parametrize("path,rule", RULE_CASES)
def test_every_cel_rule_refuses_its_bad_job_with_the_sentence_of_pstrain_validate(
        server: JobServer, ns: Namespace, path: tuple[str, ...], rule: rules.CelRule) -> None:
    data = bad_job_for(path, rule).build()
    answer = server.create(ns.name, data)
    assert not answer.accepted, f"the API server accepted a job that breaks {rule.rule!r}"
    errors = answer.errors
    assert errors and all(e.cel_message is not None for e in errors), answer.message
    field = "" if rule.message.startswith("has ") else rule.message.split()[0].rstrip(":")
    assert any(e.path == _server_path(path) and e.cel_message.startswith(field)
               for e in errors), f"no refusal at {_server_path(path)}: {answer.message}"
    _assert_same_sentences(errors, data)


@pytest.mark.parametrize("builder", [pytest.param(b, id=i) for i, b in BAD])
def test_bad_jobs_of_the_cel_tests_are_refused_with_the_same_sentences(
        server: JobServer, ns: Namespace, builder: JobBuilder) -> None:
    data = builder.build()
    answer = server.create(ns.name, data)
    assert not answer.accepted
    errors = answer.errors
    _assert_same_sentences(errors, data)
    # What is not CEL here is a quantity, refused by the schema's pattern.
    for error in errors:
        if error.cel_message is None:
            assert "should match" in error.text and error.path.startswith("spec.replicas.")
            assert any(p.startswith(f"{error.path} is ") and rules.QUANTITY_RULE in p
                       for p in pstrain_says(data))


def test_kubectl_prints_the_sentences_of_pstrain_validate(ns: Namespace) -> None:
    """What a user sees: `kubectl apply` of a job that breaks several rules."""
    data = dict(BAD)["every-error-of-one-replica-spec"].build()
    proc = ns.apply(data, check=False)
    assert proc.returncode != 0
    errors = invalid_entries(proc.stderr)
    assert len(errors) == 5, proc.stderr  # four CEL rules and the quantity's pattern
    _assert_same_sentences(errors, data)


# ------------------------------------------------------------------------ schema rules

GOOD_JOB = job().ps(1).workers(2)
SCHEMA_BAD = [
    # Quantities: Kubernetes' pattern, minimum 0 and a length bound, as schema rules.
    ("quantity-pattern", job().workers(2, resources={"limits": {"memory": "lots"}})),
    ("quantity-negative-string", job().workers(2, resources={"requests": {"cpu": "-1"}})),
    ("quantity-negative-integer", job().workers(2, resources={"requests": {"cpu": -1}})),
    ("quantity-too-long", job().workers(2, resources={"requests": {"cpu": "1" * 65}})),
    ("quantity-a-number", job().ps(1, resources={"requests": {"cpu": 1.5}})),
    # Types and bounds of pstrain's own fields.
    ("steps-a-string", job().training(steps="200")),
    ("replicas-a-boolean", job().workers(True)),
    ("learning-rate-zero", job().training(optimizer={"learningRate": 0})),
    ("entrypoint-without-colon", job().training(entrypoint="nocolon")),
    ("mode-unknown", job().training(mode="weird")),
    ("ps-zero", job().ps(0)),
    ("chief-two", job().chief(replicas=2)),
    ("env-without-name", job().template("worker", env=[{"value": "x"}])),
]
UNKNOWN = [
    ("snake-case-batch-size", job().training(batch_size=64), "spec.training.batch_size"),
    ("snake-case-learning-rate", job().training(optimizer={"learning_rate": 0.1}),
     "spec.training.optimizer.learning_rate"),
    ("spec-typo", job().set("spec.trainig", {}), "spec.trainig"),
    ("replica-spec-typo", job().workers(2, replica=3), "spec.replicas.worker.replica"),
    ("container-typo", job().template("worker", workingDirr="/x"),
     "spec.replicas.worker.template.spec.containers[0].workingDirr"),
    ("template-metadata-name", job().set("spec.replicas.worker.template",
                                         {"metadata": {"name": "x"}}),
     "spec.replicas.worker.template.metadata.name"),
    ("metadata-typo", job().set("metadata.lables", {"a": "b"}), "metadata.lables"),
]


def test_the_good_job_of_the_schema_cases_is_accepted(server: JobServer,
                                                     ns: Namespace) -> None:
    assert server.create(ns.name, GOOD_JOB.build()).accepted
    assert pstrain_says(GOOD_JOB.build()) == []


@pytest.mark.parametrize("builder", [pytest.param(b, id=i) for i, b in SCHEMA_BAD])
def test_schema_rules_refuse_in_both_places(server: JobServer, ns: Namespace,
                                           builder: JobBuilder) -> None:
    data = builder.build()
    answer = server.create(ns.name, data)
    assert not answer.accepted
    errors = answer.errors
    assert errors and all(e.cel_message is None for e in errors), answer.message
    printed = pstrain_says(data)
    assert printed, "pstrain validate accepted what the API server refuses"
    for error in errors:
        if error.path:  # "<nil>: ... some validation rules were not checked"
            assert any(names_field(p, error.path) for p in printed), (error, printed)


@pytest.mark.parametrize("builder,field", [pytest.param(b, f, id=i) for i, b, f in UNKNOWN])
def test_unknown_fields_are_refused_in_both_places(server: JobServer, ns: Namespace,
                                                   builder: JobBuilder, field: str) -> None:
    data = builder.build()
    answer = server.create(ns.name, data)  # strict field validation
    assert not answer.accepted
    assert unknown_fields(answer.message) == [field], answer.message
    printed = pstrain_says(data)
    assert any(names_field(p, field) for p in printed), printed


def test_kubectl_refuses_a_snake_case_field(ns: Namespace) -> None:
    """Both kubectl paths a user takes: create/apply (strict decoding) and server-side
    apply (the typed patch)."""
    data = job().training(batch_size=64).build()
    accepted, output = kubectl_dry_run(ns, data)
    assert not accepted
    assert 'strict decoding error: unknown field "spec.training.batch_size"' in output
    proc = ns.apply(data, "--dry-run=server", check=False)
    assert proc.returncode != 0
    assert ".spec.training.batch_size: field not declared in schema" in proc.stderr


# ------------------------------------------------------------ the same verdict
# Issue 20 (5): `pstrain validate` refuses exactly what the API server refuses: the
# bounds the CRD adds, what Kubernetes' own schema and ObjectMeta say, and what the
# server forgives (nulls, whole floats, a status on create) is forgiven by both.

MANY_ENV = [{"name": f"E{i}", "value": "x"} for i in range(300)]
SAME_VERDICT = [
    # Accepted by both: the CRD bounds no list, map or string a pod does not bound.
    pytest.param(job().template("worker", env=MANY_ENV), id="300-env-vars"),
    pytest.param(job().template("worker", env=[{"name": "E" * 300}]), id="long-env-name"),
    pytest.param(job().template("worker", sidecars=[{"name": f"s{i}"} for i in range(40)]),
                 id="40-containers"),
    pytest.param(job().workers(2, resources={"requests": {
        f"example.com/r{i}": 1 for i in range(40)}}), id="40-resources"),
    pytest.param(job().template("worker", labels={f"l{i}": "v" for i in range(64)}),
                 id="64-template-labels"),
    pytest.param(job().training(seed=None), id="null-field"),
    pytest.param(job().training(steps=100.0), id="integer-written-as-float"),
    pytest.param(job().set("status", {"phase": "Bogus"}), id="status-in-a-manifest"),
    # Refused by both.
    pytest.param(job().template("worker", sidecars=[{"name": "pstrain"}]),
                 id="duplicate-container-names"),
    pytest.param(job().template("worker", env=[{"name": "A", "value": "1"},
                                               {"name": "A", "value": "2"}]),
                 id="duplicate-env-names"),
    pytest.param(job().template("worker", volumes=[{"name": "v", "emptyDir": {}},
                                                   {"name": "v", "emptyDir": {}}]),
                 id="duplicate-volume-names"),
    pytest.param(job().set("metadata.annotations", {"a": "x" * (256 * 1024)}),
                 id="annotations-over-256KiB"),
    pytest.param(job().set("spec.replicas.worker.template", {
        "metadata": {"labels": {"a": "b c"}}}), id="template-label-value"),
    pytest.param(job().set("spec.replicas.worker.template", {
        "metadata": {"labels": {"a b": "c"}}}), id="template-label-key"),
    pytest.param(job().set("spec.replicas.worker.template", {
        "metadata": {"labels": {"x" * 254 + "/a": "c"}}}), id="template-label-key-prefix"),
    pytest.param(job().template("worker", labels={f"l{i}": "v" for i in range(65)}),
                 id="65-template-labels"),
    pytest.param(job().training(steps=1e30), id="float-beyond-int64"),
]
REFUSED = {"duplicate-container-names", "duplicate-env-names", "duplicate-volume-names",
           "annotations-over-256KiB", "template-label-value", "template-label-key",
           "template-label-key-prefix", "65-template-labels", "float-beyond-int64"}


@pytest.mark.parametrize("builder", SAME_VERDICT)
def test_pstrain_validate_refuses_what_the_server_refuses(
        server: JobServer, ns: Namespace, builder: JobBuilder,
        request: pytest.FixtureRequest) -> None:
    data = builder.build()
    answer = server.create(ns.name, data)
    printed = pstrain_says(data)
    assert answer.accepted == (not printed), (answer.message[:500], printed)
    assert answer.accepted == (request.node.callspec.id not in REFUSED), answer.message[:500]


QUOTED = [
    pytest.param(job().template("worker", env=[{"name": "PSTRAIN_" + "X" * 100}]),
                 id="long-value"),
    pytest.param(job().template("worker", spec={"containers": [{"name": "it's"}]}),
                 id="value-with-a-quote"),
    pytest.param(job().template("worker", env=[{"name": "PSTRAIN_a\\b"}]),
                 id="value-with-a-backslash"),
    pytest.param(job().template("worker", env=[{"name": "PSTRAIN_A\n"}]),
                 id="value-with-a-line-break"),
    pytest.param(job().set("spec.replicas.worker.template", {
        "metadata": {"labels": {"it's": "c"}}}), id="label-key-with-a-quote"),
    pytest.param(job().set("spec.replicas.worker.template", {
        "metadata": {"labels": {"k" * 100: "c"}}}), id="long-label-key"),
]


@pytest.mark.parametrize("builder", QUOTED)
def test_cel_sentences_show_any_value_as_pstrain_validate_does(
        server: JobServer, ns: Namespace, builder: JobBuilder) -> None:
    data = builder.build()
    answer = server.create(ns.name, data)
    assert not answer.accepted
    _assert_same_sentences(answer.errors, data)


# --------------------------------------------------------------------------- examples


def _documents(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def _contains(stored: Any, given: Any) -> bool:
    """Every value of `given` is in `stored` as written (the server may add defaults)."""
    if isinstance(given, dict):
        return isinstance(stored, dict) and all(
            k in stored and _contains(stored[k], v) for k, v in given.items())
    if isinstance(given, list):
        return (isinstance(stored, list) and len(stored) == len(given)
                and all(_contains(s, g) for s, g in zip(stored, given)))
    return stored == given


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_every_example_is_accepted_unchanged(ns: Namespace, path: Path) -> None:
    docs = _documents(path)
    assert docs and all(d.get("kind") == c.KIND for d in docs), "not only TrainingJobs"
    proc = ns.kubectl("apply", "--server-side", "--validate=strict", "-f", str(path))
    assert "Warning" not in proc.stderr, proc.stderr
    for doc in docs:
        stored = ns.get_json(f"{c.PLURAL}.{c.GROUP}/{doc['metadata']['name']}")
        assert _contains(stored["spec"], doc["spec"]), "the server changed the example"


# ------------------------------------------------------------------ defaults, pruning

MINIMAL = {"apiVersion": c.API_VERSION, "kind": c.KIND, "metadata": {"name": "minimal"}}


def _operator_reads(stored: dict[str, Any]) -> dict[str, Any]:
    return TrainingJob.model_validate(stored).to_api()


def test_the_servers_defaults_are_what_the_operator_reads(ns: Namespace) -> None:
    ns.apply(MINIMAL)
    # Read as pstrain reads YAML (kubectl writes 1e-08, a string to plain PyYAML).
    [stored] = load_all(ns.kubectl("get", "tj", "minimal", "-o", "yaml").stdout)
    assert stored["spec"], "the API server defaulted nothing"
    assert stored["spec"] == _operator_reads(stored)["spec"]


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_the_servers_defaults_of_every_example_are_what_the_operator_reads(
        server: JobServer, ns: Namespace, path: Path) -> None:
    for doc in _documents(path):
        doc["metadata"]["name"] += "-dry"  # the example itself may be stored already
        answer = server.create(ns.name, doc)
        assert answer.accepted, answer.message
        assert answer.body["spec"] == _operator_reads(answer.body)["spec"]


def test_unknown_fields_are_pruned_when_validation_is_off(ns: Namespace) -> None:
    data = copy.deepcopy(MINIMAL)
    data["metadata"]["name"] = "pruned"
    data["spec"] = {"training": {"batch_size": 7, "steps": 50},
                    "replicas": {"worker": {"replicas": 3, "replica": 9}},
                    "bogus": {"x": 1}}
    proc = ns.kubectl("create", "--validate=false", "-f", "-", input=json.dumps(data))
    assert "created" in proc.stdout
    stored = ns.get_json("tj", "pruned")
    assert "bogus" not in stored["spec"]
    assert "batch_size" not in stored["spec"]["training"]
    assert stored["spec"]["training"]["steps"] == 50
    assert stored["spec"]["training"]["batchSize"] == 64  # the default, not 7
    assert "replica" not in stored["spec"]["replicas"]["worker"]
    assert stored["spec"] == _operator_reads(stored)["spec"]


# ------------------------------------------------------------- status and scale

STATUS = {"phase": "Running", "psReady": "1/1", "workersReady": "3/3",
          "workers": {"desired": 3, "live": 2, "selector": "pstrain.io/job-name=x"},
          "progress": {"globalStep": 420, "loss": 0.125},
          "lastCheckpoint": {"step": 400, "path": "/ckpt/400"}}


def _stored_job(ns: Namespace, name: str, builder: JobBuilder | None = None) -> dict[str, Any]:
    data = (builder or job()).build()
    data["metadata"]["name"] = name
    ns.apply(data)
    return ns.get_json("tj", name)


def _without_empty(data: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in data.items() if v not in ([], {})}


def _patch_status(ns: Namespace, name: str, body: dict[str, Any],
                  ) -> Any:
    return ns.kubectl("patch", "tj", name, "--subresource=status", "--type=merge",
                      "-p", json.dumps(body))


def test_status_is_written_through_the_status_subresource_only(ns: Namespace) -> None:
    before = _stored_job(ns, "status-only")
    _patch_status(ns, "status-only", {"status": STATUS, "spec": {"training": {"steps": 5}}})
    after = ns.get_json("tj", "status-only")
    assert _contains(after["status"], STATUS)
    assert after["spec"] == before["spec"], "the status subresource changed the spec"
    assert after["metadata"]["generation"] == before["metadata"]["generation"]
    # ... and the main resource ignores a status.
    ns.kubectl("patch", "tj", "status-only", "--type=merge",
               "-p", json.dumps({"status": {"phase": "Failed"}}))
    assert ns.get_json("tj", "status-only")["status"]["phase"] == "Running"
    # The status defaults agree too; pydantic writes the empty lists and maps that the
    # CRD gives no default.
    assert _without_empty(_operator_reads(after)["status"]) == after["status"]


def test_an_unknown_status_field_is_pruned(ns: Namespace) -> None:
    _stored_job(ns, "status-pruned")
    proc = _patch_status(ns, "status-pruned",
                         {"status": {"phase": "Running", "bogus": 1,
                                     "progress": {"globalStep": 3, "lossy": 2}}})
    assert 'unknown field "status.bogus"' in proc.stderr
    status = ns.get_json("tj", "status-pruned")["status"]
    assert "bogus" not in status and status["progress"] == {"globalStep": 3}
    assert status["phase"] == "Running"


def _scale(ns: Namespace, name: str, replicas: int) -> Any:
    return ns.kubectl("scale", f"tj/{name}", f"--replicas={replicas}", check=False)


def test_kubectl_scale_within_the_bounds_sets_the_workers(ns: Namespace) -> None:
    _stored_job(ns, "scaled", job().workers(2, minReplicas=1, maxReplicas=4))
    for replicas in (4, 1, 3):
        proc = _scale(ns, "scaled", replicas)
        assert proc.returncode == 0, proc.stderr
        worker = ns.get_json("tj", "scaled")["spec"]["replicas"]["worker"]
        assert worker["replicas"] == replicas


@pytest.mark.parametrize("replicas", [5, 1, 0])
def test_kubectl_scale_outside_the_bounds_is_refused_with_the_cel_sentence(
        ns: Namespace, replicas: int) -> None:
    name = f"bounded-{replicas}"
    bounds = job().workers(3, minReplicas=2, maxReplicas=4)
    _stored_job(ns, name, bounds)
    proc = _scale(ns, name, replicas)
    assert proc.returncode != 0
    errors = invalid_entries(proc.stderr)
    assert ns.get_json("tj", name)["spec"]["replicas"]["worker"]["replicas"] == 3
    wanted = bounds.build()
    wanted["spec"]["replicas"]["worker"]["replicas"] = replicas
    printed = pstrain_says(wanted)
    cel = sorted(e.sentence for e in errors if e.cel_message is not None)
    assert cel, proc.stderr
    if replicas == 0:
        # Also below the schema's minimum (1): pstrain validate names that bound; the
        # server both.
        assert printed == ["spec.replicas.worker.replicas is 0; it must be at least 1."]
        assert any(e.path == "spec.replicas.worker.replicas" and "greater than or equal "
                   "to 1" in e.text for e in errors), proc.stderr
    else:
        assert cel == printed


def test_the_scale_subresource_shows_the_replicas(ns: Namespace) -> None:
    _stored_job(ns, "scale-view", job().workers(3))
    _patch_status(ns, "scale-view", {"status": STATUS})
    scale = json.loads(ns.kubectl("get", "--raw", f"/apis/{c.GROUP}/{c.VERSION}/namespaces/"
                                  f"{ns.name}/{c.PLURAL}/scale-view/scale").stdout)
    assert scale["kind"] == "Scale"
    assert scale["spec"]["replicas"] == 3
    assert scale["status"]["replicas"] == STATUS["workers"]["live"]
    assert scale["status"]["selector"] == STATUS["workers"]["selector"]


# ------------------------------------------------------------ kubectl get and explain


def _table(output: str) -> list[dict[str, str]]:
    lines = output.strip().splitlines()
    header = lines[0].split()
    return [dict(zip(header, line.split())) for line in lines[1:]]


def test_kubectl_get_shows_the_columns(ns: Namespace) -> None:
    _stored_job(ns, "columns")
    _patch_status(ns, "columns", {"status": STATUS})
    rows = _table(ns.kubectl("get", "trainingjobs", "columns").stdout)
    assert list(rows[0]) == ["NAME"] + [col["name"].upper() for col in crd.PRINTER_COLUMNS]
    assert rows[0] | {"AGE": ""} == {
        "NAME": "columns", "PHASE": "Running", "PS": "1/1", "WORKERS": "3/3", "LIVE": "2",
        "STEP": "420", "LOSS": "0.125", "CHECKPOINT": "400", "AGE": ""}
    assert re.fullmatch(r"\d+s", rows[0]["AGE"])


def test_short_names_and_categories_list_the_jobs(ns: Namespace) -> None:
    _stored_job(ns, "named")
    for name in (c.PLURAL, c.SINGULAR, c.KIND, *c.SHORT_NAMES, *c.CATEGORIES):
        out = ns.kubectl("get", name, "-o", "name").stdout.split()
        assert f"{c.SINGULAR}.{c.GROUP}/named" in out, (name, out)


def _words(text: str) -> str:
    return " ".join(text.split())


def _explained(cluster: Cluster, field: str) -> str:
    return _words(cluster.kubectl("explain", field).stdout)


def test_kubectl_explain_describes_the_training_fields(cluster: Cluster) -> None:
    out = _explained(cluster, f"{c.SINGULAR}.spec.training")
    node = crd.schema_at(crd.openapi_schema(), ("spec", "training"))
    assert _words(node["description"]) in out
    for name, sub in node["properties"].items():
        assert f"{name} <" in out
        assert _words(sub["description"]) in out, name


def test_kubectl_explain_describes_the_pod_template(cluster: Cluster) -> None:
    out = _explained(cluster, f"{c.SINGULAR}.spec.replicas.worker.template.spec.volumes")
    node = crd.schema_at(crd.openapi_schema(),
                         ("spec", "replicas", "worker", "template", "spec", "volumes"))
    assert "FIELD: volumes <[]Object>" in out
    assert _words(node["description"]) in out
    for name in node["items"]["properties"]:
        assert f"{name} <" in out
    out = _explained(cluster, f"{c.SHORT_NAMES[0]}.spec.replicas.worker.template")
    template = crd.schema_at(crd.openapi_schema(), ("spec", "replicas", "worker", "template"))
    assert _words(template["description"]) in out


# ---------------------------------------------------------------- size and cost


def _compact(data: Any) -> int:
    return len(json.dumps(data, separators=(",", ":")))


def test_the_stored_crd_is_within_the_size_budget(cluster: Cluster) -> None:
    stored = json.loads(cluster.kubectl("get", f"crd/{CRD_NAME}", "-o", "json",
                                        "--show-managed-fields").stdout)
    assert _compact(stored) <= crd.SIZE_BUDGET, _compact(stored)


def test_client_side_apply_of_the_crd_fits_its_annotation(cluster: Cluster) -> None:
    """`kubectl apply` (client-side) keeps the whole CRD in an annotation, which the API
    server limits to 256 KiB (test_pstrain_validate_refuses_what_the_server_refuses
    [annotations-over-256KiB] shows that limit at work)."""
    proc = cluster.kubectl("apply", "-f", str(CRD_FILE), "--dry-run=server", "-o", "json")
    annotation = json.loads(proc.stdout)["metadata"]["annotations"][
        "kubectl.kubernetes.io/last-applied-configuration"]
    assert len(annotation) <= crd.SIZE_BUDGET


def _renamed_crd(group: str) -> dict[str, Any]:
    """The CRD under another group, so creating it checks it as new (CEL cost included)."""
    out = crd.build_crd()
    out["metadata"]["name"] = f"{c.PLURAL}.{group}"
    out["spec"]["group"] = group
    return out


def test_every_cel_rule_fits_the_cost_budget(cluster: Cluster) -> None:
    """The API server estimates each rule's cost when it is created; the CRD (created
    afresh under another group) is accepted, and the same CRD with one message that
    concatenates a number, as rules.py explains, is refused for its cost."""
    fresh = _renamed_crd("costcheck.pstrain.io")
    proc = cluster.kubectl("create", "--dry-run=server", "-f", "-", input=json.dumps(fresh),
                           check=False)
    assert proc.returncode == 0, proc.stderr
    costly = _renamed_crd("costcheck.pstrain.io")
    ps = crd.schema_at(costly["spec"]["versions"][0]["schema"]["openAPIV3Schema"],
                       ("spec", "replicas", "ps"))
    rule = next(r for r in ps["x-kubernetes-validations"]
                if r == rules.PS_NO_GPUS_CEL.to_crd())
    rule["messageExpression"] = "'gpus is ' + string(self.gpus) + '; not on a PS'"
    proc = cluster.kubectl("create", "--dry-run=server", "-f", "-", input=json.dumps(costly),
                           check=False)
    assert proc.returncode != 0
    assert "estimated messageExpression cost exceeds budget" in proc.stderr
