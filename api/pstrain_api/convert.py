"""`pstrain convert`: a Kubeflow TFJob (kubeflow.org/v1) as the equivalent TrainingJob.

Kubeflow's TFJob is in maintenance and its successor (Kubeflow Trainer) has no parameter
servers; a TFJob's PS/Worker/Chief program runs under pstrain unchanged, because every
replica gets the same TF_CONFIG (docs/tensorflow.md). The mapping:

| TFJob (kubeflow.org/v1)                          | TrainingJob (pstrain.io/v1alpha1)          |
|--------------------------------------------------|--------------------------------------------|
| metadata.name (or generateName), namespace,      | metadata, the same                         |
| labels, annotations                              |                                            |
| tfReplicaSpecs.PS / .Worker                      | spec.replicas.ps / .worker                 |
| tfReplicaSpecs.Chief, or .Master                 | spec.replicas.chief (TF_CONFIG says chief) |
| tfReplicaSpecs.Evaluator                         | not carried over (no evaluator role)       |
| <role>.replicas (default 1)                      | <role>.replicas, always written            |
| <role>.template, container `tensorflow`          | <role>.template, that container first and  |
|                                                  | named `pstrain`; its ports, TF_CONFIG and  |
|                                                  | PSTRAIN_* env, hostname, subdomain and     |
|                                                  | restartPolicy dropped (pstrain owns them)  |
| <role>.restartPolicy (default Never)             | runPolicy.restartPolicy (one for the job:  |
|                                                  | the Worker's; Always becomes OnFailure)    |
| runPolicy.cleanPodPolicy (default None)          | runPolicy.cleanPodPolicy, always written   |
| runPolicy.ttlSecondsAfterFinished,               | the same fields of runPolicy               |
| activeDeadlineSeconds, backoffLimit, suspend     |                                            |
| runPolicy.schedulingPolicy.{queue, priorityClass}| runPolicy.gangScheduling.{queue,           |
|                                                  | priorityClassName}                         |
| scheduleTimeoutSeconds (scheduler-plugins)       | gangScheduling.startupTimeoutSeconds       |
| label kueue.x-k8s.io/queue-name                  | gangScheduling provider Kueue, that queue  |
| successPolicy, enableDynamicWorker,              | not carried over                           |
| minAvailable, minResources, managedBy            |                                            |

`convert_tfjob` is pure: the parsed TFJob in, a `Conversion` out (the TrainingJob as
plain data, which `validate.check_manifest` accepts, and one note per field that could
not be carried over as it was), or `ConversionError` whose `errors` are one-line
sentences. Reading files and printing is `cli_commands.convert_main`'s.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from . import constants as c
from .quote import quote
from .template import is_reserved_env
from .validate import check_manifest

TFJOB_API_VERSION = "kubeflow.org/v1"
TFJOB_KIND = "TFJob"
TF_CONTAINER = "tensorflow"  # the container a TFJob runs TensorFlow in (and sets TF_CONFIG on)
TF_PORT_NAME = "tfjob-port"
TF_DEFAULT_RESTART = "Never"  # Kubeflow's default per replica type
TF_DEFAULT_CLEAN_POD = "None"  # Kubeflow's default for TFJobs (pstrain's is Running)
TF_RESTART_POLICIES = ("Always", "OnFailure", "ExitCode", "Never")
# TFJob replica type (matched case-insensitively, as Kubeflow does) -> pstrain role.
ROLE_OF = {"PS": c.ROLE_PS, "Worker": c.ROLE_WORKER, "Chief": c.ROLE_CHIEF,
           "Master": c.ROLE_CHIEF, "Evaluator": None}
# runPolicy fields that mean the same in both APIs.
SAME_RUN_POLICY = ("cleanPodPolicy", "ttlSecondsAfterFinished", "activeDeadlineSeconds",
                   "backoffLimit", "suspend")
# Early kubeflow.org/v1 TFJobs set these on the spec itself; later ones under runPolicy.
LEGACY_RUN_POLICY = ("cleanPodPolicy", "ttlSecondsAfterFinished", "activeDeadlineSeconds",
                     "backoffLimit")
# Metadata the API server sets: dropped without a note.
SERVER_METADATA = ("uid", "resourceVersion", "creationTimestamp", "generation",
                   "managedFields", "selfLink", "deletionTimestamp",
                   "deletionGracePeriodSeconds")
LAST_APPLIED = "kubectl.kubernetes.io/last-applied-configuration"
KUEUE_QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
VOLCANO_GROUP_ANNOTATION = "scheduling.k8s.io/group-name"
SCHEDULER_PROVIDERS = {"volcano": "Volcano", "scheduler-plugins-scheduler": "SchedulerPlugins"}
GPU_FIELDS = ("limits", "requests")


class ConversionError(ValueError):
    """The input cannot become a TrainingJob; `errors` says why, one sentence each."""

    def __init__(self, errors: list[str]):
        self.errors = list(errors)
        super().__init__("\n".join(self.errors))


@dataclass
class Conversion:
    """The TrainingJob (plain data, as a manifest holds it) and the notes: one line per
    TFJob field that could not be carried over as it was."""

    job: dict[str, Any]
    notes: list[str] = field(default_factory=list)


@dataclass
class _Notes:
    """Notes as they are found; a note about several replica types with the same words is
    written once, naming them all (spec.tfReplicaSpecs.{PS,Worker}.…)."""

    items: list[tuple[str | None, str, str]] = field(default_factory=list)

    def add(self, path: str, text: str, rtype: str | None = None) -> None:
        self.items.append((rtype, path, text))

    def lines(self) -> list[str]:
        grouped: dict[tuple[str, str], list[str | None]] = {}
        for rtype, path, text in self.items:
            grouped.setdefault((path, text), []).append(rtype)
        out = []
        for (path, text), rtypes in grouped.items():
            if rtypes == [None]:
                out.append(f"{path}: {text}")
                continue
            names = [r for r in rtypes if r is not None]
            shown = names[0] if len(names) == 1 else "{" + ",".join(names) + "}"
            where = f"spec.tfReplicaSpecs.{shown}" + (f".{path}" if path else "")
            out.append(f"{where}: {text}")
        return out


def _map(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def convert_tfjob(tfjob: Any) -> Conversion:
    """The TrainingJob equivalent to `tfjob` (a parsed kubeflow.org/v1 TFJob), and a note
    for each field not carried over; ConversionError when it is no such TFJob, has no PS or
    no Worker, or would make an invalid TrainingJob."""
    if not isinstance(tfjob, Mapping):
        raise ConversionError([f"the document is {type(tfjob).__name__}; it must be a mapping "
                               f"with apiVersion {TFJOB_API_VERSION} and kind {TFJOB_KIND}."])
    errors: list[str] = []
    for key, want in (("apiVersion", TFJOB_API_VERSION), ("kind", TFJOB_KIND)):
        if tfjob.get(key) != want:
            shown = quote(tfjob[key]) if key in tfjob else "missing"
            errors.append(f"{key} is {shown}; pstrain convert reads a {TFJOB_KIND} of "
                          f"{TFJOB_API_VERSION} (Kubeflow's training operator).")
    if errors:
        raise ConversionError(errors)
    notes = _Notes()
    spec = _map(tfjob.get("spec"))
    metadata = _metadata(_map(tfjob.get("metadata")), notes, errors)
    specs = _replica_specs(spec, errors)
    replicas: dict[str, Any] = {}
    for rtype, rspec in specs.items():
        role = ROLE_OF[rtype]
        if role is None:
            notes.add("", "not carried over; a TrainingJob has no evaluator role (run the "
                          "evaluator as a Job of its own that reads the checkpoints).", rtype)
            continue
        if rtype == "Master":
            notes.add("", "became spec.replicas.chief; TF_CONFIG names its task 'chief', not "
                          "'master' (TensorFlow treats both as the chief).", rtype)
        replicas[role] = _replica(rtype, role, rspec, notes, errors)
    run_policy = _run_policy(spec, specs, tfjob, replicas, notes, errors)
    for key in spec:
        if key not in ("tfReplicaSpecs", "runPolicy", "successPolicy", "enableDynamicWorker",
                       *LEGACY_RUN_POLICY):
            notes.add(f"spec.{key}", "not carried over; it is not a field of a TFJob.")
    _success_and_dynamic(spec, notes)
    if errors:
        raise ConversionError(errors)
    ordered = {role: replicas[role] for role in c.ROLES if role in replicas}
    job = {"apiVersion": c.API_VERSION, "kind": c.KIND, "metadata": metadata,
           "spec": {"replicas": ordered, "runPolicy": run_policy}}
    _security_note(specs, ordered, notes)
    _, problems = check_manifest(copy.deepcopy(job))
    if problems:
        raise ConversionError([f"the TrainingJob made from it is not valid: {p.message}"
                               for p in problems])
    return Conversion(job, notes.lines())


# --------------------------------------------------------------------------- metadata


def _metadata(meta: Mapping[str, Any], notes: _Notes, errors: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    name = meta.get("name")
    if name is None and isinstance(meta.get("generateName"), str):
        name = meta["generateName"].rstrip("-")
        notes.add("metadata.generateName", f"became metadata.name {quote(name)}; a "
                  "TrainingJob needs a fixed name (its pods and Service are named after it).")
    if name is None:
        errors.append("metadata.name is missing; the TFJob needs a name (or a generateName).")
    else:
        out["name"] = name
    for key in ("namespace", "labels", "annotations"):
        if key in meta:
            out[key] = copy.deepcopy(meta[key])
    annotations = out.get("annotations")
    if isinstance(annotations, dict):
        annotations.pop(LAST_APPLIED, None)  # it describes the TFJob
        if not annotations:
            del out["annotations"]
    for key in meta:
        if key not in ("name", "generateName", "namespace", "labels", "annotations",
                       *SERVER_METADATA):
            notes.add(f"metadata.{key}", "not carried over; it refers to the TFJob.")
    return out


# --------------------------------------------------------------------------- replicas


def _replica_specs(spec: Mapping[str, Any], errors: list[str]) -> dict[str, Mapping[str, Any]]:
    """The replica specs by their TFJob type, checked for what a TrainingJob needs."""
    given = spec.get("tfReplicaSpecs")
    if not isinstance(given, Mapping) or not given:
        errors.append("spec.tfReplicaSpecs is missing; a TFJob lists its PS and Worker "
                      "replicas there.")
        return {}
    out: dict[str, Mapping[str, Any]] = {}
    by_lower = {t.lower(): t for t in ROLE_OF}
    for key, value in given.items():
        rtype = by_lower.get(str(key).lower())
        if rtype is None:
            errors.append(f"spec.tfReplicaSpecs.{key} is not a TFJob replica type; they are "
                          f"{', '.join(ROLE_OF)}.")
        elif not isinstance(value, Mapping):
            errors.append(f"spec.tfReplicaSpecs.{key} is {quote(value)}; it must be a mapping "
                          "with replicas and a template.")
        else:
            out[rtype] = value
    out = {rtype: out[rtype] for rtype in ROLE_OF if rtype in out}  # PS, Worker, Chief...
    if "Chief" in out and "Master" in out:
        errors.append("spec.tfReplicaSpecs sets both Chief and Master; a TFJob has one chief.")
    for rtype, why in (("Worker", "a TrainingJob needs at least one worker"),
                       ("PS", "pstrain runs parameter-server jobs, so a TFJob without "
                              "parameter servers (a single worker, or "
                              "MultiWorkerMirroredStrategy) has no TrainingJob equivalent: "
                              "run it with Kubeflow Trainer")):
        if rtype not in out and not errors:
            errors.append(f"spec.tfReplicaSpecs has no {rtype}; {why}.")
        elif rtype in out and out[rtype].get("replicas") == 0:
            errors.append(f"spec.tfReplicaSpecs.{rtype}.replicas is 0; {why}.")
    for rtype in ("Chief", "Master"):
        count = out.get(rtype, {}).get("replicas", 1)
        if isinstance(count, int) and count > 1:
            errors.append(f"spec.tfReplicaSpecs.{rtype}.replicas is {count}; a TFJob (and a "
                          "TrainingJob) has exactly one chief.")
    return out


def _replica(rtype: str, role: str, rspec: Mapping[str, Any], notes: _Notes,
             errors: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {"replicas": rspec.get("replicas", 1)}
    template = rspec.get("template")
    if not isinstance(template, Mapping):
        errors.append(f"spec.tfReplicaSpecs.{rtype}.template is missing; it must be a pod "
                      f"template with a container named {TF_CONTAINER!r}.")
        return out
    converted = _template(rtype, role, copy.deepcopy(dict(template)), notes, errors)
    if converted is not None:
        out["template"] = converted
    for key in rspec:
        if key not in ("replicas", "template", "restartPolicy"):
            notes.add(key, "not carried over; it is not a field of a TFJob replica spec.", rtype)
    return out


def _template(rtype: str, role: str, template: dict[str, Any], notes: _Notes,
              errors: list[str]) -> dict[str, Any] | None:
    """The TFJob pod template as a pstrain one: the `tensorflow` container first and named
    pstrain, and every field pstrain owns (template.owned_field_problems) dropped."""
    pod = template.get("spec")
    containers = pod.get("containers") if isinstance(pod, dict) else None
    if not isinstance(pod, dict) or not isinstance(containers, list):
        containers = []
    names = [_map(x).get("name") for x in containers]
    if TF_CONTAINER not in names:
        errors.append(f"spec.tfReplicaSpecs.{rtype}.template.spec.containers has no container "
                      f"named {TF_CONTAINER!r}; a TFJob runs TensorFlow in that container.")
        return None
    for kind in ("initContainers", "containers"):  # before the main container moves
        for i, container in enumerate(pod.get(kind) or []):
            env = container.get("env") if isinstance(container, dict) else None
            if not isinstance(env, list):
                continue
            dropped = [str(_map(v).get("name")) for v in env
                       if is_reserved_env(str(_map(v).get("name")))]
            if dropped:
                container["env"] = [v for v in env if str(_map(v).get("name")) not in dropped]
                notes.add(f"template.spec.{kind}[{i}].env", f"{', '.join(dropped)} dropped; "
                          "pstrain sets it in every container.", rtype)
                if not container["env"]:
                    del container["env"]
    index = names.index(TF_CONTAINER)
    where = f"template.spec.containers[{index}]"
    main = containers.pop(index)
    containers.insert(0, main)
    main["name"] = c.MAIN_CONTAINER
    notes.add(f"{where}.name", f"{TF_CONTAINER!r} became {c.MAIN_CONTAINER!r}, the first "
              "container: pstrain's main container (kubectl logs -c pstrain).", rtype)
    if "ports" in main:
        notes.add(f"{where}.ports", _ports_note(main.pop("ports")), rtype)
    if not main.get("command"):
        notes.add(f"{where}.command", "unset; a TFJob runs the image's own entrypoint, a "
                  "TrainingJob runs `pstrain replica` instead: set command to the program "
                  "the image runs.", rtype)
    for key in ("hostname", "subdomain"):
        if key in pod:
            notes.add(f"template.spec.{key}", f"{quote(pod.pop(key))} dropped; pstrain sets "
                      "it so that each replica has the DNS name TF_CONFIG gives.", rtype)
    pod.pop("restartPolicy", None)  # Kubeflow overrides it with the replica's restartPolicy
    if role == c.ROLE_PS:
        _drop_ps_gpus(rtype, where, main, notes)
    annotations = _map(template.get("metadata")).get("annotations")
    if isinstance(annotations, dict) and VOLCANO_GROUP_ANNOTATION in annotations:
        notes.add(f"template.metadata.annotations.{VOLCANO_GROUP_ANNOTATION}",
                  f"{quote(annotations.pop(VOLCANO_GROUP_ANNOTATION))} dropped; pstrain names "
                  "the pod group itself (spec.runPolicy.gangScheduling).", rtype)
        if not annotations:
            del template["metadata"]["annotations"]
            if not template["metadata"]:
                del template["metadata"]
    return template


def _ports_note(ports: Any) -> str:
    shown = []
    tf_port = c.REPLICA_PORT
    for port in ports if isinstance(ports, list) else []:
        number = _map(port).get("containerPort")
        name = _map(port).get("name")
        shown.append(f"{number} ({name})" if name else str(number))
        if name == TF_PORT_NAME and isinstance(number, int):
            tf_port = number
    moved = (f" TF_CONFIG now gives port {c.REPLICA_PORT}, not {tf_port}."
             if tf_port != c.REPLICA_PORT else "")
    return (f"{', '.join(shown) or quote(ports)} dropped; pstrain declares the main "
            f"container's ports itself ({c.REPLICA_PORT}, the port TF_CONFIG gives).{moved}")


def _drop_ps_gpus(rtype: str, where: str, main: dict[str, Any], notes: _Notes) -> None:
    """pstrain's parameter servers may not ask for GPUs (rules.PS_NO_GPU)."""
    resources = main.get("resources")
    if not isinstance(resources, dict):
        return
    for part in GPU_FIELDS:
        amounts = resources.get(part)
        if isinstance(amounts, dict) and c.GPU_RESOURCE in amounts:
            notes.add(f"{where}.resources.{part}.{c.GPU_RESOURCE}",
                      f"{quote(amounts.pop(c.GPU_RESOURCE))} dropped; pstrain's parameter "
                      "servers keep parameters on the CPU and may not ask for GPUs.", rtype)
            if not amounts:
                del resources[part]
    if not resources:
        del main["resources"]


# --------------------------------------------------------------------------- run policy


def _run_policy(spec: Mapping[str, Any], specs: Mapping[str, Mapping[str, Any]],
                tfjob: Mapping[str, Any], replicas: Mapping[str, Any], notes: _Notes,
                errors: list[str]) -> dict[str, Any]:
    given = dict(_map(spec.get("runPolicy")))
    for key in LEGACY_RUN_POLICY:
        if key in spec:
            given.setdefault(key, spec[key])
    out: dict[str, Any] = {"restartPolicy": _restart_policy(specs, given, notes, errors)}
    for key in SAME_RUN_POLICY:
        if key in given:
            out[key] = given[key]
    out.setdefault("cleanPodPolicy", TF_DEFAULT_CLEAN_POD)
    gang = _gang(given.get("schedulingPolicy"), specs, tfjob, replicas, notes)
    if gang is not None:
        out["gangScheduling"] = gang
    for key in given:
        if key not in (*SAME_RUN_POLICY, "schedulingPolicy"):
            why = ("the TrainingJob is managed by the pstrain operator" if key == "managedBy"
                   else "a TrainingJob has no such field")
            notes.add(f"spec.runPolicy.{key}", f"not carried over; {why}.")
    return out


def _restart_policy(specs: Mapping[str, Mapping[str, Any]], run_policy: Mapping[str, Any],
                    notes: _Notes, errors: list[str]) -> str:
    """The job's one restart policy: the Worker's (Always is pstrain's OnFailure); a role
    whose policy differs gets a note."""
    given = {}
    for rtype, rspec in specs.items():
        if ROLE_OF[rtype] is None:
            continue
        policy = rspec.get("restartPolicy", TF_DEFAULT_RESTART)
        if policy not in TF_RESTART_POLICIES:
            errors.append(f"spec.tfReplicaSpecs.{rtype}.restartPolicy is {quote(policy)}; it "
                          f"must be one of {', '.join(TF_RESTART_POLICIES)}.")
        given[rtype] = policy
    as_pstrain = {r: "OnFailure" if p == "Always" else p for r, p in given.items()}
    chosen = as_pstrain.get("Worker", TF_DEFAULT_RESTART)
    if chosen not in TF_RESTART_POLICIES:
        return TF_DEFAULT_RESTART
    for rtype, policy in given.items():
        if as_pstrain[rtype] != chosen:
            notes.add("restartPolicy", f"{policy!r} not carried over; a TrainingJob has one "
                      "restart policy for every role (spec.runPolicy.restartPolicy), which "
                      f"takes the Worker's, {given['Worker']!r}.", rtype)
        elif policy == "Always":
            notes.add("restartPolicy", "'Always' became 'OnFailure'; pstrain restarts a "
                      "replica that fails, never one that exits 0.", rtype)
        elif policy == "ExitCode":
            notes.add("restartPolicy", "'ExitCode' kept, but Kubeflow restarts on exit codes "
                      "128-255 and pstrain only on 130, 137 and 143 (SIGINT, SIGKILL or the "
                      "OOM killer, SIGTERM).", rtype)
    if chosen != "Never" and "backoffLimit" not in run_policy:
        notes.add("spec.runPolicy.backoffLimit", "unset: Kubeflow restarts replicas without "
                  "limit, a TrainingJob at most 3 times (its default); set backoffLimit for "
                  "more.")
    return chosen


def _gang(policy: Any, specs: Mapping[str, Mapping[str, Any]], tfjob: Mapping[str, Any],
          replicas: Mapping[str, Any], notes: _Notes) -> dict[str, Any] | None:
    """spec.runPolicy.gangScheduling from Kubeflow's schedulingPolicy, the templates'
    schedulerName and Kueue's queue label; None when the TFJob asks for no gang."""
    policy = _map(policy)
    labels = _map(_map(tfjob.get("metadata")).get("labels"))
    schedulers = {_map(_map(s.get("template")).get("spec")).get("schedulerName")
                  for s in specs.values()}
    volcano_group = any(VOLCANO_GROUP_ANNOTATION in _map(_map(_map(s.get("template"))
                                                              .get("metadata")).get("annotations"))
                        for s in specs.values())
    hinted = sorted(SCHEDULER_PROVIDERS[s] for s in schedulers if s in SCHEDULER_PROVIDERS)
    gang: dict[str, Any] = {}
    if isinstance(labels.get(KUEUE_QUEUE_LABEL), str):
        gang = {"provider": "Kueue", "queue": labels[KUEUE_QUEUE_LABEL]}
        notes.add(f"metadata.labels.{KUEUE_QUEUE_LABEL}", "its LocalQueue became "
                  "spec.runPolicy.gangScheduling (provider Kueue): Kueue admits the job's "
                  "pods as one pod group.")
    elif policy or hinted or volcano_group:
        provider = hinted[0] if hinted else "Volcano"
        gang = {"provider": provider}
        if not hinted and not volcano_group:
            notes.add("spec.runPolicy.schedulingPolicy", "Kubeflow's gang scheduler is the "
                      "training operator's --gang-scheduler-name, which a TFJob does not say; "
                      "Volcano was assumed (change spec.runPolicy.gangScheduling.provider to "
                      "SchedulerPlugins or Kueue if your cluster uses that).")
    else:
        return None
    if isinstance(policy.get("queue"), str) and policy["queue"]:
        if gang["provider"] == "SchedulerPlugins":
            notes.add("spec.runPolicy.schedulingPolicy.queue", f"{quote(policy['queue'])} not "
                      "carried over; scheduler-plugins has no queues.")
        else:
            gang.setdefault("queue", policy["queue"])
    if isinstance(policy.get("priorityClass"), str) and policy["priorityClass"]:
        gang["priorityClassName"] = policy["priorityClass"]
    if "scheduleTimeoutSeconds" in policy:
        if gang["provider"] == "SchedulerPlugins":
            gang["startupTimeoutSeconds"] = policy["scheduleTimeoutSeconds"]
        else:
            notes.add("spec.runPolicy.schedulingPolicy.scheduleTimeoutSeconds", "not carried "
                      f"over; only scheduler-plugins' PodGroup has it, not {gang['provider']}.")
    total = sum(r["replicas"] for r in replicas.values() if isinstance(r.get("replicas"), int))
    if "minAvailable" in policy and policy["minAvailable"] != total:
        notes.add("spec.runPolicy.schedulingPolicy.minAvailable", f"{quote(policy['minAvailable'])}"
                  f" not carried over; pstrain's pod group is every pod of the job ({total}).")
    if "minResources" in policy:
        notes.add("spec.runPolicy.schedulingPolicy.minResources", "not carried over; pstrain's "
                  "pod group asks for its pods, not for an amount of resources.")
    return gang


def _success_and_dynamic(spec: Mapping[str, Any], notes: _Notes) -> None:
    if spec.get("successPolicy") not in (None, ""):
        notes.add("spec.successPolicy", f"{quote(spec['successPolicy'])} not carried over; a "
                  "TrainingJob succeeds when its chief (worker 0 without one) exits 0, and the "
                  "workers still running are stopped.")
    if spec.get("enableDynamicWorker"):
        notes.add("spec.enableDynamicWorker", "not carried over, and not needed: a "
                  "TrainingJob's workers can always be scaled (kubectl scale), but a running "
                  "TensorFlow program does not use added workers (docs/tensorflow.md).")


# --------------------------------------------------------------------------- security


def _security_note(specs: Mapping[str, Mapping[str, Any]], replicas: Mapping[str, Any],
                   notes: _Notes) -> None:
    """pstrain's pods run as non-root by default; the TensorFlow images run as root."""
    for rtype in specs:
        role = ROLE_OF[rtype]
        template = _map(_map(replicas.get(role or "")).get("template"))
        pod = _map(template.get("spec"))
        main = _map((pod.get("containers") or [{}])[0])
        pod_sc = _map(pod.get("securityContext")) if "securityContext" in pod else {
            "runAsNonRoot": True}
        main_sc = _map(main.get("securityContext")) if "securityContext" in main else {
            "runAsNonRoot": True}
        non_root = main_sc.get("runAsNonRoot", pod_sc.get("runAsNonRoot"))
        user = main_sc.get("runAsUser", pod_sc.get("runAsUser"))
        if role is not None and non_root and user is None:
            notes.add("template.spec.securityContext", "sets no runAsUser; a TrainingJob's pods "
                      "run with runAsNonRoot: true by default, and the kubelet refuses an image "
                      "that runs as root (the tensorflow/tensorflow images do): set a numeric "
                      "runAsUser (docs/tensorflow.md) or install the operator with "
                      "jobPodSecurity: none.", rtype)
