"""`pstrain convert`: Kubeflow TFJobs (kubeflow.org/v1) as TrainingJobs.

The manifests in tests/api/tfjobs/ are modelled on Kubeflow's own examples; each one that
converts must give a TrainingJob that `pstrain validate` accepts, and a note for every
field it could not carry over.
"""

from __future__ import annotations

import copy
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from pstrain_api.convert import ConversionError, convert_tfjob
from pstrain_api.names import DNS_1035_RULE
from pstrain_api.validate import check_manifest

HERE = Path(__file__).resolve().parent
TFJOBS = HERE / "tfjobs"
TENSORFLOW_DOC = HERE.parents[1] / "docs" / "tensorflow.md"
CONVERTIBLE = ("dist-mnist.yaml", "tfjob-docs.yaml", "estimator-chief.yaml")


def load(name: str) -> dict[str, Any]:
    return yaml.safe_load((TFJOBS / name).read_text(encoding="utf-8"))


def main_container(image: str, **fields: Any) -> dict[str, Any]:
    return {"name": "pstrain", "image": image, **fields}


def role(replicas: int, *containers: dict[str, Any], **template: Any) -> dict[str, Any]:
    return {"replicas": replicas,
            "template": {**template, "spec": {"containers": list(containers)}}}


def tfjob(**replica_specs: Any) -> dict[str, Any]:
    """A minimal TFJob: the given replica specs (PS=..., Worker=...), or one PS and one
    worker with a command; a spec given as an int is that many replicas."""
    specs = replica_specs or {"PS": 1, "Worker": 1}
    out = {}
    for rtype, spec in specs.items():
        if isinstance(spec, int):
            spec = {"replicas": spec, "template": {"spec": {"containers": [
                {"name": "tensorflow", "image": "tf:1", "command": ["python", "t.py"],
                 "securityContext": {"runAsUser": 1000}}]}}}
        out[rtype] = spec
    return {"apiVersion": "kubeflow.org/v1", "kind": "TFJob", "metadata": {"name": "tf"},
            "spec": {"tfReplicaSpecs": out}}


# --------------------------------------------------------------------------- whole jobs


EXPECTED_JOBS = {
    "dist-mnist.yaml": {
        "apiVersion": "pstrain.io/v1alpha1", "kind": "TrainingJob",
        "metadata": {"name": "dist-mnist-for-e2e-test"},
        "spec": {
            "replicas": {
                "ps": role(2, main_container("kubeflow/tf-dist-mnist-test:latest")),
                "worker": role(4, main_container("kubeflow/tf-dist-mnist-test:latest")),
            },
            "runPolicy": {"restartPolicy": "Never", "cleanPodPolicy": "None"},
        },
    },
    "tfjob-docs.yaml": {
        "apiVersion": "pstrain.io/v1alpha1", "kind": "TrainingJob",
        "metadata": {"name": "tfjob", "namespace": "your-user-namespace"},
        "spec": {
            "replicas": {
                role_name: role(count, main_container(
                    "gcr.io/your-project/your-image",
                    command=["python", "-m", "trainer.task", "--batch_size=32",
                             "--training_steps=1000"]),
                    metadata={"annotations": {"sidecar.istio.io/inject": "false"}})
                for role_name, count in (("ps", 1), ("worker", 3))
            },
            "runPolicy": {"restartPolicy": "OnFailure", "cleanPodPolicy": "None"},
        },
    },
}


@pytest.mark.parametrize("name", sorted(EXPECTED_JOBS))
def test_docs_tfjob_converts_to_the_expected_trainingjob(name):
    assert convert_tfjob(load(name)).job == EXPECTED_JOBS[name]


def test_chief_ps_worker_evaluator_job_keeps_its_roles_run_policy_and_gang():
    job = convert_tfjob(load("estimator-chief.yaml")).job
    replicas = job["spec"]["replicas"]
    assert list(replicas) == ["ps", "worker", "chief"]
    assert [replicas[r]["replicas"] for r in replicas] == [2, 3, 1]
    command = ["python", "/opt/census/train.py", "--model-dir=/models/census"]
    pod = {"securityContext": {"runAsUser": 1000},
           "volumes": [{"name": "models",
                        "persistentVolumeClaim": {"claimName": "census-models"}}]}
    mounts = [{"name": "models", "mountPath": "/models"}]
    image = "gcr.io/kubeflow-examples/census-estimator:v1"
    assert replicas["ps"]["template"] == {"spec": {**pod, "containers": [main_container(
        image, command=command, resources={"limits": {"cpu": "4"}}, volumeMounts=mounts)]}}
    assert replicas["chief"]["template"] == {"spec": {**pod, "containers": [main_container(
        image, command=command, resources={"limits": {"nvidia.com/gpu": 1}},
        volumeMounts=mounts)]}}
    assert replicas["worker"]["template"] == replicas["chief"]["template"]
    assert job["spec"]["runPolicy"] == {
        "restartPolicy": "ExitCode", "cleanPodPolicy": "Running",
        "ttlSecondsAfterFinished": 3600, "activeDeadlineSeconds": 86400, "backoffLimit": 5,
        "gangScheduling": {"provider": "Volcano", "queue": "research",
                           "priorityClassName": "high-priority"},
    }
    assert job["metadata"] == {"name": "estimator-census", "namespace": "kubeflow",
                               "labels": {"team": "ranking"}}


@pytest.mark.parametrize("name", CONVERTIBLE)
def test_every_converted_tfjob_validates(name):
    job, problems = check_manifest(convert_tfjob(load(name)).job, name)
    assert problems == [] and job is not None


# --------------------------------------------------------------------------- notes

RENAMED = "template.spec.containers[0].name"


def note_paths(notes: list[str]) -> list[str]:
    return [n.split(": ", 1)[0] for n in notes]


@pytest.mark.parametrize(("name", "paths"), [
    pytest.param("dist-mnist.yaml", [
        f"spec.tfReplicaSpecs.{{PS,Worker}}.{RENAMED}",
        "spec.tfReplicaSpecs.{PS,Worker}.template.spec.containers[0].command",
        "spec.tfReplicaSpecs.{PS,Worker}.template.spec.securityContext",
    ], id="dist-mnist"),
    pytest.param("tfjob-docs.yaml", [
        "metadata.generateName",
        f"spec.tfReplicaSpecs.{{PS,Worker}}.{RENAMED}",
        "spec.runPolicy.backoffLimit",
        "spec.tfReplicaSpecs.{PS,Worker}.template.spec.securityContext",
    ], id="tfjob-docs"),
    pytest.param("estimator-chief.yaml", [
        f"spec.tfReplicaSpecs.{{PS,Worker,Chief}}.{RENAMED}",
        "spec.tfReplicaSpecs.{PS,Worker,Chief}.template.spec.containers[0].ports",
        "spec.tfReplicaSpecs.PS.template.spec.containers[0].resources.limits.nvidia.com/gpu",
        "spec.tfReplicaSpecs.Evaluator",
        "spec.tfReplicaSpecs.PS.restartPolicy",
        "spec.tfReplicaSpecs.{Worker,Chief}.restartPolicy",
        "spec.runPolicy.schedulingPolicy",
        "spec.successPolicy",
    ], id="estimator-chief"),
])
def test_notes_name_each_field_not_carried_over(name, paths):
    assert note_paths(convert_tfjob(load(name)).notes) == paths


def test_notes_say_why_in_one_line():
    notes = convert_tfjob(load("estimator-chief.yaml")).notes
    assert all("\n" not in n and n.endswith(".") for n in notes)
    by_path = dict(n.split(": ", 1) for n in notes)
    assert by_path["spec.tfReplicaSpecs.PS.restartPolicy"] == (
        "'Always' not carried over; a TrainingJob has one restart policy for every role "
        "(spec.runPolicy.restartPolicy), which takes the Worker's, 'ExitCode'.")
    assert by_path["spec.successPolicy"].startswith("'AllWorkers' not carried over;")
    assert by_path["spec.tfReplicaSpecs.Evaluator"].startswith(
        "not carried over; a TrainingJob has no evaluator role")


def _set(doc: dict[str, Any], dotted: str, value: Any) -> dict[str, Any]:
    out = copy.deepcopy(doc)
    cur = out
    *parents, last = dotted.split(".")
    for part in parents:
        cur = cur[int(part)] if isinstance(cur, list) else cur.setdefault(part, {})
    cur[last] = value
    return out


W = "spec.tfReplicaSpecs.Worker"
WT = f"{W}.template.spec"


@pytest.mark.parametrize(("path", "value", "changed", "notes"), [
    pytest.param(f"{WT}.containers.0.env", [{"name": "TF_CONFIG", "value": "{}"},
                                            {"name": "A", "value": "1"}],
                 {"replicas.worker.template.spec.containers.0.env": [{"name": "A",
                                                                      "value": "1"}]},
                 [f"{WT}.containers[0].env: TF_CONFIG dropped"], id="tf-config-env"),
    pytest.param(f"{WT}.hostname", "w", {}, [f"{WT}.hostname: 'w' dropped"], id="hostname"),
    pytest.param(f"{WT}.restartPolicy", "OnFailure", {}, [], id="template-restart-policy"),
    pytest.param(f"{WT}.containers.0.ports", [{"name": "tfjob-port", "containerPort": 3333}],
                 {}, [f"{WT}.containers[0].ports: 3333 (tfjob-port) dropped; pstrain declares"],
                 id="other-tf-port"),
    pytest.param("spec.cleanPodPolicy", "All", {"runPolicy.cleanPodPolicy": "All"}, [],
                 id="legacy-top-level-run-policy"),
    pytest.param("spec.runPolicy.suspend", True, {"runPolicy.suspend": True}, [],
                 id="suspend"),
    pytest.param("spec.enableDynamicWorker", True, {},
                 ["spec.enableDynamicWorker: not carried over"], id="dynamic-worker"),
    pytest.param("spec.runPolicy.schedulingPolicy",
                 {"minAvailable": 1, "scheduleTimeoutSeconds": 60, "minResources": {"cpu": 4},
                  "queue": "q", "priorityClass": "high"},
                 {"runPolicy.gangScheduling": {"provider": "Volcano", "queue": "q",
                                               "priorityClassName": "high"}},
                 ["spec.runPolicy.schedulingPolicy: Kubeflow's gang scheduler is the training "
                  "operator's --gang-scheduler-name",
                  "spec.runPolicy.schedulingPolicy.scheduleTimeoutSeconds: not carried over",
                  "spec.runPolicy.schedulingPolicy.minAvailable: 1 not carried over; pstrain's "
                  "pod group is every pod of the job (2).",
                  "spec.runPolicy.schedulingPolicy.minResources: not carried over"],
                 id="scheduling-policy"),
    pytest.param(f"{WT}.schedulerName", "scheduler-plugins-scheduler",
                 {"runPolicy.gangScheduling": {"provider": "SchedulerPlugins"},
                  "replicas.worker.template.spec.schedulerName": "scheduler-plugins-scheduler"},
                 [], id="scheduler-plugins"),
    pytest.param("metadata.labels", {"kueue.x-k8s.io/queue-name": "team-a"},
                 {"runPolicy.gangScheduling": {"provider": "Kueue", "queue": "team-a"}},
                 ["metadata.labels.kueue.x-k8s.io/queue-name: its LocalQueue"], id="kueue"),
    pytest.param("spec.runPolicy.managedBy", "kueue.x-k8s.io/multikueue", {},
                 ["spec.runPolicy.managedBy: not carried over"], id="managed-by"),
])
def test_one_field(path, value, changed, notes):
    """One TFJob field set on a minimal job: what changes in the TrainingJob's spec, and
    the notes it adds (each given by its start)."""
    base = convert_tfjob(tfjob())
    result = convert_tfjob(_set(tfjob(), path, value))
    want = base.job["spec"]
    for dotted, new in changed.items():
        want = _set(want, dotted, new)
    assert result.job["spec"] == want
    extra = [n for n in result.notes if n not in base.notes]
    assert len(extra) == len(notes), extra
    assert all(n.startswith(start) for n, start in zip(extra, notes)), extra
    assert check_manifest(result.job)[1] == []


def test_always_becomes_on_failure_and_restarts_are_bounded():
    doc = tfjob()
    for spec in doc["spec"]["tfReplicaSpecs"].values():
        spec["restartPolicy"] = "Always"
    result = convert_tfjob(doc)
    assert result.job["spec"]["runPolicy"]["restartPolicy"] == "OnFailure"
    assert result.notes[1:] == [
        "spec.tfReplicaSpecs.{PS,Worker}.restartPolicy: 'Always' became 'OnFailure'; pstrain "
        "restarts a replica that fails, never one that exits 0.",
        "spec.runPolicy.backoffLimit: unset: Kubeflow restarts replicas without limit, a "
        "TrainingJob at most 3 times (its default); set backoffLimit for more.",
    ]


def test_master_becomes_the_chief_and_the_ps_gpu_is_dropped():
    doc = tfjob(PS=1, Worker=2, Master=1)
    ps = doc["spec"]["tfReplicaSpecs"]["PS"]["template"]["spec"]["containers"][0]
    ps["resources"] = {"limits": {"nvidia.com/gpu": 1, "memory": "1Gi"}}
    result = convert_tfjob(doc)
    assert result.job["spec"]["replicas"]["chief"]["replicas"] == 1
    assert result.job["spec"]["replicas"]["ps"]["template"]["spec"]["containers"][0][
        "resources"] == {"limits": {"memory": "1Gi"}}
    assert "spec.tfReplicaSpecs.Master: became spec.replicas.chief; TF_CONFIG names its task " \
           "'chief', not 'master' (TensorFlow treats both as the chief)." in result.notes


def test_the_tensorflow_container_moves_first_beside_its_sidecars():
    doc = tfjob()
    spec = doc["spec"]["tfReplicaSpecs"]["Worker"]["template"]["spec"]
    spec["containers"].insert(0, {"name": "proxy", "image": "envoy:1"})
    result = convert_tfjob(doc)
    containers = result.job["spec"]["replicas"]["worker"]["template"]["spec"]["containers"]
    assert [c["name"] for c in containers] == ["pstrain", "proxy"]
    assert (f"{W}.template.spec.containers[1].name: 'tensorflow' became 'pstrain', the first "
            "container: pstrain's main container (kubectl logs -c pstrain).") in result.notes


def test_the_input_is_not_changed():
    doc = load("estimator-chief.yaml")
    before = copy.deepcopy(doc)
    convert_tfjob(doc)
    assert doc == before


# --------------------------------------------------------------------------- errors


def _errors(doc: Any) -> list[str]:
    with pytest.raises(ConversionError) as info:
        convert_tfjob(doc)
    return info.value.errors


NO_PS = ("spec.tfReplicaSpecs has no PS; pstrain runs parameter-server jobs, so a TFJob "
         "without parameter servers (a single worker, or MultiWorkerMirroredStrategy) has no "
         "TrainingJob equivalent: run it with Kubeflow Trainer.")


@pytest.mark.parametrize(("doc", "errors"), [
    pytest.param(load("mnist-worker-only.yaml"), [NO_PS], id="docs-worker-only"),
    pytest.param(["a"], ["the document is list; it must be a mapping with apiVersion "
                         "kubeflow.org/v1 and kind TFJob."], id="not-a-mapping"),
    pytest.param({**tfjob(), "apiVersion": "kubeflow.org/v1alpha2"},
                 ["apiVersion is 'kubeflow.org/v1alpha2'; pstrain convert reads a TFJob of "
                  "kubeflow.org/v1 (Kubeflow's training operator)."], id="old-api-version"),
    pytest.param({**tfjob(), "kind": "PyTorchJob"},
                 ["kind is 'PyTorchJob'; pstrain convert reads a TFJob of kubeflow.org/v1 "
                  "(Kubeflow's training operator)."], id="pytorchjob"),
    pytest.param({"apiVersion": "pstrain.io/v1alpha1", "kind": "TrainingJob"},
                 ["apiVersion is 'pstrain.io/v1alpha1'; pstrain convert reads a TFJob of "
                  "kubeflow.org/v1 (Kubeflow's training operator).",
                  "kind is 'TrainingJob'; pstrain convert reads a TFJob of kubeflow.org/v1 "
                  "(Kubeflow's training operator)."], id="already-a-trainingjob"),
    pytest.param(tfjob(PS=1), ["spec.tfReplicaSpecs has no Worker; a TrainingJob needs at "
                               "least one worker."], id="no-worker"),
    pytest.param(tfjob(PS=1, Worker=0), ["spec.tfReplicaSpecs.Worker.replicas is 0; a "
                                         "TrainingJob needs at least one worker."],
                 id="zero-workers"),
    pytest.param(tfjob(PS=1, Worker=1, Chief=2),
                 ["spec.tfReplicaSpecs.Chief.replicas is 2; a TFJob (and a TrainingJob) has "
                  "exactly one chief."], id="two-chiefs"),
    pytest.param(tfjob(PS=1, Worker=1, Launcher=1),
                 ["spec.tfReplicaSpecs.Launcher is not a TFJob replica type; they are PS, "
                  "Worker, Chief, Master, Evaluator."], id="unknown-replica-type"),
    pytest.param(_set(tfjob(), f"{WT}.containers.0.name", "trainer"),
                 ["spec.tfReplicaSpecs.Worker.template.spec.containers has no container named "
                  "'tensorflow'; a TFJob runs TensorFlow in that container."],
                 id="no-tensorflow-container"),
    pytest.param(_set(tfjob(), f"{W}.restartPolicy", "Sometimes"),
                 ["spec.tfReplicaSpecs.Worker.restartPolicy is 'Sometimes'; it must be one of "
                  "Always, OnFailure, ExitCode, Never."], id="bad-restart-policy"),
    pytest.param({**tfjob(), "metadata": {}},
                 ["metadata.name is missing; the TFJob needs a name (or a generateName)."],
                 id="no-name"),
    pytest.param({**tfjob(), "metadata": {"name": "Census_Job"}},
                 ["the TrainingJob made from it is not valid: metadata.name is 'Census_Job'; "
                  f"{DNS_1035_RULE}."],
                 id="invalid-result"),
])
def test_what_is_not_a_convertible_tfjob_is_refused_in_one_line_each(doc, errors):
    found = _errors(doc)
    assert found == errors
    assert all("\n" not in e for e in found)


# --------------------------------------------------------------------------- the command


def pstrain(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pstrain_api.cli", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=120)


def test_command_writes_yaml_to_stdout_and_the_notes_to_stderr(tmp_path):
    source = TFJOBS / "estimator-chief.yaml"
    done = pstrain("convert", str(source), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert yaml.safe_load(done.stdout) == convert_tfjob(load("estimator-chief.yaml")).job
    notes = convert_tfjob(load("estimator-chief.yaml")).notes
    assert done.stderr.splitlines() == [f"{source}: {n}" for n in notes]


def test_command_writes_out_and_its_output_passes_pstrain_validate(tmp_path):
    out = tmp_path / "job.yaml"
    done = pstrain("convert", str(TFJOBS / "dist-mnist.yaml"), "-o", str(out), cwd=tmp_path)
    assert done.returncode == 0 and done.stdout == ""
    checked = pstrain("validate", str(out), cwd=tmp_path)
    assert checked.returncode == 0, checked.stderr
    assert f"{out}: valid (default/dist-mnist-for-e2e-test)" in checked.stdout


def test_command_refuses_a_tfjob_without_ps_with_one_line_and_no_output(tmp_path):
    source = TFJOBS / "mnist-worker-only.yaml"
    out = tmp_path / "job.yaml"
    done = pstrain("convert", str(source), "-o", str(out), cwd=tmp_path)
    assert done.returncode == 1
    assert done.stderr == f"{source}: {NO_PS}\n"
    assert done.stdout == "" and not out.exists()


def test_command_reports_an_unreadable_file(tmp_path):
    done = pstrain("convert", "missing.yaml", cwd=tmp_path)
    assert done.returncode == 1
    assert done.stderr.startswith("missing.yaml: cannot read the file")
    assert "Traceback" not in done.stderr


# --------------------------------------------------------------------------- the doc


def doc_example() -> tuple[str, str, str]:
    """(TFJob, TrainingJob, stderr) of docs/tensorflow.md's conversion example."""
    text = TENSORFLOW_DOC.read_text(encoding="utf-8")
    body = text.split("\n## Coming from Kubeflow's TFJob\n", 1)[1]
    blocks = re.findall(r"^```(\w*)\n(.*?)^```$", body, re.M | re.S)
    (l1, tfjob_text), (l2, command), (l3, job_text), (l4, notes) = blocks[:4]
    assert (l1, l2, l3, l4) == ("yaml", "bash", "yaml", "text")
    assert command == "pstrain convert tfjob.yaml > trainingjob.yaml\n"
    return tfjob_text, job_text, notes


def test_doc_example_is_what_the_command_prints(tmp_path):
    tfjob_text, job_text, notes = doc_example()
    (tmp_path / "tfjob.yaml").write_text(tfjob_text, encoding="utf-8")
    done = pstrain("convert", "tfjob.yaml", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout == job_text
    assert done.stderr == notes
