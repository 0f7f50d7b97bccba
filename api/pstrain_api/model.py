"""The TrainingJob API (pstrain.io/v1alpha1) as pydantic models: the single source of truth.

The CRD (`pstrain crd`, `crds/`), offline validation (`pstrain validate`), the operator
and the runtime all read these models. Constraints live next to the fields they
constrain; cross-field rules are model validators whose messages name the field path,
the value and the rule.

Field names are camelCase on the wire (as in every Kubernetes API) and snake_case in
Python. Unknown fields are rejected, because a real API server would silently prune
them and the user would never learn their setting was ignored.
"""

from __future__ import annotations

import re
from datetime import datetime
from typing import Annotated, Any, Literal

from collections.abc import Callable

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator
from pydantic.alias_generators import to_camel
from pydantic_core import PydanticCustomError

from . import constants as c
from . import names, rules
from .membership import bounds_problem
from .names import check_job_name
from .template import schema_problems as template_schema_problems

ENTRYPOINT_RE = r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*$"

# Marker for the CRD generator: this subtree is Kubernetes' PodTemplateSpec
# (pstrain_api.podschema), embedded as it is.
POD_TEMPLATE_MARK = "x-pstrain-pod-template"
# Marker for the CRD generator: this subtree is free-form Kubernetes data
# (x-kubernetes-preserve-unknown-fields). Only small pod-template subtrees use it.
FREE_FORM = {"x-kubernetes-preserve-unknown-fields": True, "type": "object"}
INT_OR_STRING = {"x-kubernetes-int-or-string": True}


class ApiModel(BaseModel):
    """Base: camelCase aliases, unknown fields forbidden, assignment validated, and types
    strict as the CRD's are: the API server refuses `steps: '200'` and `replicas: true`,
    so pydantic must not turn them into 200 and 1."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        validate_assignment=True,
        strict=True,
    )

    def to_api(self) -> dict[str, Any]:
        """The object as the API server stores it: camelCase, no unset optionals."""
        return self.model_dump(by_alias=True, exclude_none=True, mode="json")


FreeForm = Annotated[dict[str, Any], Field(json_schema_extra=FREE_FORM)]
Quantity = Annotated[int | str, Field(json_schema_extra=INT_OR_STRING)]

# --------------------------------------------------------------------------- value rules
# Rules the CRD's schema cannot say but the API server or the runtime enforce. Each fails
# as a PydanticCustomError whose ctx['rule'] ends the message "PATH is VALUE; RULE".

def _rule(kind: str, rule: str) -> PydanticCustomError:
    return PydanticCustomError(kind, "{rule}", {"rule": rule})


def _kubernetes_name(problem_of: Callable[[str], str | None]) -> AfterValidator:
    def check(value: str) -> str:
        problem = problem_of(value)
        if problem:
            raise _rule("kubernetes_name", problem)
        return value

    return AfterValidator(check)


def _in_crd(pattern: re.Pattern[str], max_length: int) -> Any:
    """The same rule for the CRD, so that the API server refuses the name too."""
    return Field(json_schema_extra={"pattern": pattern.pattern, "maxLength": max_length})


# Numbers the runtime computes with: .inf and .nan are refused.
FiniteFloat = Annotated[float, Field(allow_inf_nan=False)]
# Status timestamps arrive as RFC 3339 strings from the API server.
Timestamp = Annotated[datetime, Field(strict=False)]
DnsLabel = Annotated[str, _kubernetes_name(names.dns_label_problem),
                     _in_crd(names.DNS_1123_LABEL, c.DNS_LABEL_MAX)]
DnsSubdomain = Annotated[str, _kubernetes_name(names.dns_subdomain_problem),
                         _in_crd(names.DNS_1123_SUBDOMAIN, names.DNS_SUBDOMAIN_MAX)]
# Keys carry no CRD rule: a structural schema has no patternProperties.
LabelKey = Annotated[str, _kubernetes_name(names.label_key_problem)]
LabelValue = Annotated[str, _kubernetes_name(names.label_value_problem),
                       _in_crd(names.LABEL_VALUE, c.DNS_LABEL_MAX)]
Labels = dict[LabelKey, LabelValue]
Annotations = dict[LabelKey, str]


# --------------------------------------------------------------------------- pod template


def _check_template(value: dict[str, Any]) -> dict[str, Any]:
    """Kubernetes' PodTemplateSpec schema (pstrain's own fields are ReplicaSpec rules)."""
    found = template_schema_problems(value)
    if found:
        raise ValueError(rules.joined(*found[0]))
    return value


PodTemplateSpec = Annotated[
    dict[str, Any],
    AfterValidator(_check_template),
    Field(json_schema_extra={POD_TEMPLATE_MARK: True, "type": "object"}),
]


class Resources(ApiModel):
    """core/v1 ResourceRequirements (requests and limits)."""

    requests: dict[str, Quantity] | None = Field(default=None, description="Requests.")
    limits: dict[str, Quantity] | None = Field(default=None, description="Limits.")

    @model_validator(mode="after")
    def _quantities(self) -> Resources:
        found = rules.quantity_problems(self.to_api())
        if found:
            raise ValueError(rules.joined(*found[0]))
        return self


class ReplicaSpec(ApiModel):
    """One role's replicas."""

    replicas: int = Field(default=1, ge=1, description="Number of replicas of this role.")
    resources: Resources | None = Field(
        default=None, description="Requests and limits of the main container."
    )
    gpus: int | None = Field(
        default=None,
        ge=0,
        description=f"GPUs per replica; shorthand for a {c.GPU_RESOURCE} limit.",
    )
    template: PodTemplateSpec | None = Field(
        default=None,
        description="The pods of this role: a Kubernetes PodTemplateSpec. The first "
        "container, named pstrain, runs the replica; unset fields get pstrain's defaults "
        "(the runtime image, `pstrain replica`, a restrictive security context). pstrain "
        "owns the main container's name and ports, the injected environment (PSTRAIN_*, "
        "TF_CONFIG), and the pod's hostname, subdomain and restartPolicy.",
    )
    readiness: c.ReadinessGate = Field(
        default="Auto",
        description="When a replica counts as ready (workers start once every parameter "
        "server is ready). Auto: the pstrain runtime's gRPC health service when the "
        "template sets no command, else a TCP connection to the replica port, as "
        "`tf.distribute.Server` serves; a readinessProbe in the template overrides it. "
        "GRPCHealth, TCP: that check (with spec.security.tls a pod's gRPC health check "
        "is a TCP check: a kubelet's gRPC probe speaks plaintext only). None: ready once "
        "started.",
    )

    @model_validator(mode="after")
    def _rules(self) -> ReplicaSpec:
        """The first broken rule; `pstrain validate` reports every one
        (validate.check_manifest)."""
        found = rules.replica_problems(self.to_api(), is_ps=isinstance(self, PSReplicaSpec))
        if found:
            raise ValueError(rules.joined(*found[0]))
        return self

    @property
    def gpu_count(self) -> int:
        """GPUs per replica, from `gpus` or the nvidia.com/gpu limit."""
        if self.gpus is not None:
            return self.gpus
        limits = (self.resources.limits or {}) if self.resources else {}
        return int(limits.get(c.GPU_RESOURCE, 0) or 0)


class PSReplicaSpec(ReplicaSpec):
    """Parameter servers: hold parameter shards and apply the optimizer, on the CPU, so
    they may not request GPUs (rules.PS_NO_GPU, checked by ReplicaSpec._rules)."""


class WorkerReplicaSpec(ReplicaSpec):
    replicas: int = Field(
        default=2, ge=1,
        description="Number of workers, the chief included when there is no separate "
        "chief. May change while the job runs (`kubectl scale`), within "
        "minReplicas..maxReplicas: worker pods are added or removed, nothing restarts.",
    )
    min_replicas: int | None = Field(
        default=None, ge=1, description="Fewest workers a scale may leave (unset: 1).")
    max_replicas: int | None = Field(
        default=None, ge=1, description="Most workers a scale may ask for (unset: no bound).")

    @model_validator(mode="after")
    def _within_bounds(self) -> WorkerReplicaSpec:
        problem = bounds_problem(self.replicas, self.min_replicas, self.max_replicas)
        if problem:  # the path is added by the caller: keep only "FIELD is VALUE; RULE"
            raise ValueError(problem.removeprefix("spec.replicas.worker."))
        return self


class ChiefReplicaSpec(ReplicaSpec):
    replicas: int = Field(
        default=1, ge=1, le=1, description="A separate chief has exactly one replica."
    )


class Replicas(ApiModel):
    """The roles of a job. Without `chief`, worker 0 is the chief (classic TensorFlow)."""

    ps: PSReplicaSpec = Field(
        default_factory=PSReplicaSpec, description="Parameter servers."
    )
    worker: WorkerReplicaSpec = Field(
        default_factory=WorkerReplicaSpec, description="Workers."
    )
    chief: ChiefReplicaSpec | None = Field(
        default=None,
        description="A separate chief. When absent, worker 0 acts as the chief.",
    )


# --------------------------------------------------------------------------- training


class Optimizer(ApiModel):
    """The optimizer the parameter servers apply; matches torch.optim numerically."""

    name: Literal["sgd", "momentum", "adagrad", "adam"] = Field(
        default="sgd", description="Optimizer."
    )
    learning_rate: FiniteFloat = Field(default=0.1, gt=0, description="Learning rate.")
    momentum: FiniteFloat = Field(
        default=0.9, ge=0, lt=1, description="Momentum factor (momentum optimizer)."
    )
    nesterov: bool = Field(default=False, description="Nesterov momentum.")
    weight_decay: FiniteFloat = Field(default=0.0, ge=0, description="L2 weight decay.")
    beta1: FiniteFloat = Field(default=0.9, ge=0, lt=1, description="Adam beta1.")
    beta2: FiniteFloat = Field(default=0.999, ge=0, lt=1, description="Adam beta2.")
    eps: FiniteFloat | None = Field(
        default=None, gt=0,
        description="Adam/Adagrad epsilon. Unset: torch.optim's default for the optimizer "
        "(Adagrad 1e-10, Adam 1e-8).",
    )
    initial_accumulator_value: FiniteFloat = Field(
        default=0.0, ge=0, description="Adagrad initial accumulator."
    )


class Checkpoint(ApiModel):
    directory: str | None = Field(
        default=None,
        min_length=1,
        description="Directory for checkpoints (a mounted volume on Kubernetes). "
        "No checkpoints are written when unset.",
    )
    interval_steps: int = Field(
        default=100, ge=1, description="Write a checkpoint every this many global steps."
    )
    keep: int = Field(default=3, ge=1, description="How many checkpoints to keep.")


class SparseCache(ApiModel):
    """Each worker's cache of the sparse tables' hot rows (async mode)."""

    staleness_steps: int = Field(
        default=0, ge=0, le=100_000,
        description="Use a row the worker pulled at most this many of its own steps ago "
        "instead of pulling it again (a bounded staleness, as in HET). 0: no cache, every "
        "step pulls every row. Ignored in sync mode, which stays exact.",
    )
    rows: int = Field(
        default=262_144, ge=1, le=2**31 - 1,
        description="Rows kept per table per worker at most (each id has one place, by a "
        "hash of the id, or the id itself for a fixed-size table of at most this many rows; "
        "ids sharing a place take turns); worker memory per table: rows x (embedding_dim x "
        "4 + 24) bytes (the rows and their bookkeeping).",
    )


SPARSE_MEMORY_RULE = ("it must be a positive Kubernetes quantity of bytes such as 512Mi "
                      "or 2Gi, or an integer number of MiB")


class SparseStorage(ApiModel):
    """A memory budget per parameter server for the sparse tables' rows, and a disk tier
    for the rows beyond it (docs/sparse.md). Unset: every row stays in memory."""

    server_memory: Quantity | None = Field(
        default=None,
        description="Memory each parameter server may spend on sparse table rows (and "
        "their optimizer state), split evenly over the tables: a Kubernetes quantity "
        "(2Gi, 512Mi) or an integer number of MiB. The rows updated least recently go "
        "to `directory` beyond it. Unset: all rows in memory.",
    )
    directory: str | None = Field(
        default=None,
        min_length=1,
        description="Where each parameter server keeps the rows beyond serverMemory: a "
        "volume (emptyDir or PVC) mounted in the ps pod template. `pstrain run` uses a "
        "temporary folder when unset.",
    )

    @model_validator(mode="after")
    def _budget(self) -> SparseStorage:
        value = self.server_memory
        if value is not None and (not rules.is_quantity(value)
                                  or self.memory_bytes() == 0):
            raise ValueError(f"serverMemory is {value!r}; {SPARSE_MEMORY_RULE}")
        if self.directory is not None and value is None:
            raise ValueError(f"directory is {self.directory!r} but serverMemory is unset; "
                             "set serverMemory too (without it every row stays in memory)")
        return self

    def memory_bytes(self) -> int | None:
        """The budget in bytes (an integer is MiB); None when unset."""
        value = self.server_memory
        if value is None:
            return None
        if isinstance(value, int):
            return value * 2**20
        return int(rules.quantity_value(value))


class Training(ApiModel):
    """What the runtime reads: model, schedule, optimizer, synchronisation, checkpoints."""

    entrypoint: str = Field(
        default="pstrain_runtime.examples.digits:make_task",
        pattern=ENTRYPOINT_RE,
        description="The model, data and loss: `module:function` returning a task.",
    )
    args: FreeForm | None = Field(
        default=None, description="Keyword arguments passed to the entrypoint function."
    )
    steps: int = Field(default=1000, ge=1, description="Global steps to train.")
    batch_size: int = Field(default=64, ge=1, description="Per-worker batch size.")
    optimizer: Optimizer = Field(default_factory=Optimizer, description="Optimizer.")
    mode: Literal["async", "sync"] = Field(
        default="async",
        description="async: each push is applied as it arrives. sync: one gradient per "
        "worker per step is aggregated before applying.",
    )
    staleness_bound: int | None = Field(
        default=None,
        ge=0,
        description="At most this many steps a worker may run ahead of the slowest one.",
    )
    wire_dtype: Literal["float32", "bfloat16", "float16"] = Field(
        default="float32",
        description="Precision of gradients on the wire; parameters stay float32.",
    )
    pipeline: bool = Field(
        default=False,
        description="async mode: send a step's gradients and fetch the parameters while "
        "the next step computes (on parameters one update older). Hides the round trip "
        "behind compute; ignored in sync mode.",
    )
    transport: Literal["tcp", "grpc"] = Field(
        default="tcp",
        description="How tensors travel between workers and parameter servers. tcp: a "
        "plain TCP data connection beside the gRPC port (the data port, 2223 in a "
        "cluster), about twice grpc's throughput. grpc: everything over the gRPC port, "
        "for networks that admit only that port.",
    )
    checkpoint: Checkpoint = Field(default_factory=Checkpoint, description="Checkpoints.")
    sparse_cache: SparseCache = Field(
        default_factory=SparseCache,
        description="Workers' cache of sparse table rows (models with SparseEmbedding "
        "layers).",
    )
    sparse_storage: SparseStorage = Field(
        default_factory=SparseStorage,
        description="A memory budget per parameter server for sparse table rows, and a "
        "directory for the rows beyond it (models with SparseEmbedding layers).",
    )
    eval_interval_steps: int | None = Field(
        default=None, ge=1, description="Evaluate every this many steps (and at the end)."
    )
    seed: int = Field(default=0, ge=0, description="Random seed.")


# --------------------------------------------------------------------------- run policy


class GangScheduling(ApiModel):
    """Start mode Gang: every pod of the job is created at once as one group that a
    batch scheduler admits all-or-nothing; the runtime keeps the start order itself
    (workers and the chief wait until every parameter server answers its health check).
    Without it, pods start in order (parameter servers first), which a gang scheduler
    cannot admit as one group."""

    provider: Literal["Volcano", "SchedulerPlugins", "Kueue"] = Field(
        description="Volcano: a scheduling.volcano.sh PodGroup and schedulerName volcano. "
        "SchedulerPlugins: a scheduling.x-k8s.io PodGroup (coscheduling plugin). Kueue: "
        "Kueue's pod-group labels and annotations on every pod (plain-pod integration).",
    )
    queue: str | None = Field(
        default=None, min_length=1,
        description="Volcano queue, or Kueue LocalQueue (kueue.x-k8s.io/queue-name).",
    )
    scheduler_name: str | None = Field(
        default=None, min_length=1,
        description="schedulerName of every pod. Default: volcano (Volcano), "
        "scheduler-plugins-scheduler (SchedulerPlugins), the cluster's default (Kueue). A "
        "pod template's own schedulerName wins.",
    )
    priority_class_name: str | None = Field(
        default=None, min_length=1,
        description="priorityClassName of every pod and of the PodGroup. A pod template's "
        "own priorityClassName wins.",
    )
    startup_timeout_seconds: int = Field(
        default=600, ge=1,
        description="How long workers and the chief wait for every parameter server to "
        "answer its health check before the job fails (reason StartupTimeout).",
    )


class RunPolicy(ApiModel):
    restart_policy: Literal["Never", "OnFailure", "ExitCode"] = Field(
        default="OnFailure",
        description="Never: a failed replica fails the job. OnFailure: restart it. "
        "ExitCode: restart only on retryable exit codes (130, 137, 143).",
    )
    backoff_limit: int = Field(
        default=3, ge=0, description="Replica restarts allowed before the job fails."
    )
    active_deadline_seconds: int | None = Field(
        default=None, ge=1, description="Fail the job when it runs longer than this."
    )
    ttl_seconds_after_finished: int | None = Field(
        default=None, ge=0, description="Delete the job this long after it finishes."
    )
    clean_pod_policy: Literal["All", "Running", "None"] = Field(
        default="Running",
        description="Which pods to delete when the job finishes: All, the still Running "
        "ones, or None.",
    )
    suspend: bool = Field(
        default=False,
        description="Suspended jobs have no pods. With a checkpoint directory the chief is "
        "asked for a checkpoint first and training continues from it on resume; without "
        "one, training restarts from step 0 on resume. A job created suspended (as Kueue "
        "admits jobs) creates nothing until it is resumed.",
    )
    stall_timeout_seconds: int | None = Field(
        default=None,
        ge=1,
        description="Stall watchdog: when the global step does not advance for this long "
        "while the job runs, the workers and the chief are restarted (one restart of the "
        "backoffLimit), or the job fails with reason Stalled when the restart policy allows "
        "no more. Unset: off.",
    )
    gang_scheduling: GangScheduling | None = Field(
        default=None,
        description="Create every pod at once as one group for a gang scheduler "
        "(Volcano, scheduler-plugins coscheduling, Kueue). Unset: ordered start.",
    )


# --------------------------------------------------------------------------- security


class Tls(ApiModel):
    secret_name: str = Field(
        min_length=1, max_length=253,
        description="A kubernetes.io/tls Secret in the job's namespace (e.g. one that "
        "cert-manager issues) with tls.crt, tls.key and ca.crt: the parameter servers "
        "serve with tls.crt/tls.key, and every replica trusts only ca.crt.",
    )


class Security(ApiModel):
    authentication: bool = Field(
        default=True,
        description="Every call to a parameter server proves the job's key (a Secret the "
        "operator creates per job); only the chief may initialise, restore or stop the "
        "servers. Turn off only on a network no one else can reach.",
    )
    tls: Tls | None = Field(
        default=None,
        description="Encrypt both parameter-server channels with TLS (off when unset).",
    )


# --------------------------------------------------------------------------- spec & status


class TrainingJobSpec(ApiModel):
    replicas: Replicas = Field(default_factory=Replicas, description="Roles and their pods.")
    training: Training = Field(default_factory=Training, description="The training run.")
    run_policy: RunPolicy = Field(
        default_factory=RunPolicy, description="Restarts, deadlines and clean-up."
    )
    security: Security = Field(
        default_factory=Security,
        description="Authentication (on by default) and TLS (opt-in) of the job's "
        "parameter-server channels.",
    )


class Condition(ApiModel):
    type: str = Field(description="Condition type, e.g. Running, Succeeded, Failed.")
    status: Literal["True", "False", "Unknown"] = Field(description="True, False, Unknown.")
    reason: str = Field(default="", description="Machine-readable CamelCase reason.")
    message: str = Field(default="", description="Human-readable message.")
    last_transition_time: Timestamp | None = Field(
        default=None, description="When the status last changed."
    )


class RoleStatus(ApiModel):
    active: int = Field(default=0, ge=0, description="Pods not yet finished.")
    ready: int = Field(default=0, ge=0, description="Pods Ready.")
    succeeded: int = Field(default=0, ge=0, description="Pods succeeded.")
    failed: int = Field(default=0, ge=0, description="Pods failed.")
    restarts: int = Field(default=0, ge=0, description="Replica restarts so far.")


class Progress(ApiModel):
    global_step: int = Field(default=0, ge=0, description="Global step.")
    loss: float | None = Field(default=None, description="Latest training loss.")
    samples_per_second: float | None = Field(default=None, description="Throughput.")
    eval_accuracy: float | None = Field(default=None, description="Latest eval accuracy.")
    auc: float | None = Field(default=None, description="Latest eval ROC AUC (tasks that "
                              "report one, e.g. click-through-rate models).")
    logloss: float | None = Field(default=None, description="Latest eval log loss (tasks "
                                  "that report one).")
    sparse_rows: int | None = Field(default=None, ge=0, description="Live rows of the "
                                    "model's sparse embedding tables, over all parameter "
                                    "servers (models with sparse tables only).")
    sparse_bytes: int | None = Field(default=None, ge=0, description="Parameter-server "
                                     "memory held by those rows and their optimizer state.")
    updated_at: Timestamp | None = Field(default=None, description="When last refreshed.")
    advanced_at: Timestamp | None = Field(
        default=None, description="When the global step was last seen to advance."
    )


class CheckpointStatus(ApiModel):
    step: int = Field(ge=0, description="Global step of the checkpoint.")
    path: str = Field(description="Where it was written.")
    time: Timestamp | None = Field(default=None, description="When it was written.")


class CreateRefusal(ApiModel):
    """The API server refused to create one of the job's objects; retried with back-off."""

    object: str = Field(description="Kind/name of the object that was refused.")
    code: int | None = Field(default=None, description="HTTP status of the refusal.")
    message: str = Field(default="", description="The API server's message.")
    attempts: int = Field(default=1, ge=1, description="Refused attempts so far.")
    first_time: Timestamp | None = Field(default=None, description="First refusal.")
    last_time: Timestamp | None = Field(default=None, description="Latest refusal.")


class CheckpointRequest(ApiModel):
    """A checkpoint asked of the chief before a disruption (suspend, a deadline, an
    eviction); the disruption waits for it, up to a bound."""

    step: int = Field(ge=0, description="A checkpoint at or after this step is awaited.")
    reason: str = Field(default="", description="Why: Suspend, Deadline, Disruption, ...")
    requested_at: Timestamp | None = Field(default=None, description="When it was asked.")


class FailureCause(ApiModel):
    role: str = Field(description="Role of the failing replica.")
    pod: str = Field(description="Pod (or local process) name.")
    exit_code: int | None = Field(default=None, description="Container exit code.")
    reason: str = Field(default="", description="OOMKilled, Error, Evicted, ...")
    message: str = Field(default="", description="Details.")


class WorkerMembership(ApiModel):
    """The elastic worker set, for `kubectl scale` and `kubectl get`."""

    desired: int = Field(default=0, ge=0, description="Workers the spec asks for.")
    live: int = Field(default=0, ge=0, description="Worker pods running now.")
    selector: str = Field(
        default="", description="Label selector of the job's worker pods (scale subresource)."
    )
    members: list[int] | None = Field(
        default=None,
        description="Trainer indices last set as the worker set on the parameter servers "
        "after a scale (unset: the set the chief initialised them with).",
    )


class TrainingJobStatus(ApiModel):
    phase: c.Phase = Field(default="Pending", description="Lifecycle phase.")
    conditions: list[Condition] = Field(default_factory=list, description="Conditions.")
    replica_statuses: dict[str, RoleStatus] = Field(
        default_factory=dict, description="Per-role pod counts, keyed by role."
    )
    ps_ready: str | None = Field(default=None, description="Ready/total parameter servers.")
    workers_ready: str | None = Field(
        default=None, description="Ready/total workers, the chief included."
    )
    start_time: Timestamp | None = Field(default=None, description="When pods were started.")
    completion_time: Timestamp | None = Field(default=None, description="When it finished.")
    restarts: int = Field(default=0, ge=0, description="Replica restarts, all roles.")
    workers: WorkerMembership | None = Field(
        default=None, description="Desired and live workers (elastic scaling)."
    )
    progress: Progress | None = Field(default=None, description="Training progress.")
    last_checkpoint: CheckpointStatus | None = Field(
        default=None, description="Most recent checkpoint."
    )
    failure: FailureCause | None = Field(default=None, description="Root cause of failure.")
    create_refusal: CreateRefusal | None = Field(
        default=None, description="The API server's latest refusal to create a pod or Service."
    )
    lost_steps: int = Field(
        default=0, ge=0,
        description="Global steps of training thrown away so far (suspends and disruptions "
        "without a checkpoint to continue from).",
    )
    disruptions: int = Field(
        default=0, ge=0,
        description="Replicas replaced after a deletion or eviction from outside the "
        "operator; included in restarts, not counted against backoffLimit.",
    )
    counted_disruptions: list[str] = Field(
        default_factory=list,
        description="UIDs of the pods whose deletion or eviction was already counted as a "
        "restart (the most recent ones); asked:<uid> marks a running pod whose announced "
        "disruption already got a checkpoint request.",
    )
    checkpoint_request: CheckpointRequest | None = Field(
        default=None, description="A checkpoint asked of the chief that is awaited."
    )
    resumed_from_step: int | None = Field(
        default=None, description="The checkpoint step training continued from on resume."
    )
    observed_generation: int | None = Field(
        default=None, description="The spec generation this status describes."
    )


class ObjectMeta(ApiModel):
    """The subset of metadata pstrain reads. Other metadata is accepted and ignored."""

    model_config = ConfigDict(
        alias_generator=to_camel, populate_by_name=True, extra="allow"
    )

    name: str = Field(description="Job name; children are named after it.")
    namespace: DnsLabel = Field(default="default", description="Namespace.")
    uid: str | None = None
    generation: int | None = None
    labels: Labels | None = None
    annotations: Annotations | None = None

    @model_validator(mode="after")
    def _name(self) -> ObjectMeta:
        problem = check_job_name(self.name)
        if problem:
            raise ValueError(problem)
        return self


class TrainingJob(ApiModel):
    """A parameter-server training job."""

    api_version: Literal["pstrain.io/v1alpha1"] = Field(
        default=c.API_VERSION, description="pstrain.io/v1alpha1"
    )
    kind: Literal["TrainingJob"] = Field(default=c.KIND, description="TrainingJob")
    metadata: ObjectMeta
    spec: TrainingJobSpec = Field(default_factory=TrainingJobSpec, description="Desired job.")
    status: TrainingJobStatus | None = Field(default=None, description="Observed state.")

    @property
    def name(self) -> str:
        return self.metadata.name

    @property
    def namespace(self) -> str:
        return self.metadata.namespace

    @property
    def has_separate_chief(self) -> bool:
        return self.spec.replicas.chief is not None

    def replica_spec(self, role: str) -> ReplicaSpec:
        """The spec of `role`'s replicas; KeyError when the job has no such role."""
        reps = self.spec.replicas
        spec = {c.ROLE_PS: reps.ps, c.ROLE_WORKER: reps.worker, c.ROLE_CHIEF: reps.chief}
        if spec.get(role) is None:
            raise KeyError(f"job {self.name} has no {role} replicas")
        return spec[role]  # type: ignore[return-value]
