"""The cluster spec: who is a parameter server, who is a worker, who is the chief, at
which address, and the environment each replica starts with.

This is a pure function of a TrainingJob plus an addressing scheme. The operator uses
Kubernetes addressing (pod hostname under the job's headless Service, port 2222); the
local runner uses 127.0.0.1 with distinct free ports it found. Everything else is shared.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field

from . import constants as c
from .model import TrainingJob
from .names import replica_host, replica_name


@dataclass(frozen=True, order=True)
class Task:
    """One replica: a role and its index within the role."""

    role: str
    index: int

    def as_json(self) -> dict[str, object]:
        return {"type": self.role, "index": self.index}


@dataclass(frozen=True)
class Address:
    host: str
    port: int

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"


AddressFn = Callable[[Task], Address]


@dataclass(frozen=True)
class ClusterSpec:
    """Addresses of every replica of one job, and which task is the chief."""

    job_name: str
    namespace: str
    addresses: Mapping[Task, Address]
    chief: Task
    training_json: str = field(repr=False)

    @property
    def cluster(self) -> dict[str, list[str]]:
        """Role -> addresses ordered by index, TensorFlow's `cluster` dictionary."""
        out: dict[str, list[str]] = {}
        for task in sorted(self.addresses, key=_role_order):
            out.setdefault(task.role, []).append(str(self.addresses[task]))
        return out

    def tasks(self) -> list[Task]:
        """Every task in start order: parameter servers, non-chief workers, the chief."""
        ps = [t for t in self.addresses if t.role == c.ROLE_PS]
        rest = [t for t in self.addresses if t.role != c.ROLE_PS and t != self.chief]
        return sorted(ps) + sorted(rest, key=_role_order) + [self.chief]

    def ps_tasks(self) -> list[Task]:
        return sorted(t for t in self.addresses if t.role == c.ROLE_PS)

    def worker_tasks(self) -> list[Task]:
        """Every task that trains (workers and a separate chief), chief first."""
        others = sorted(
            (t for t in self.addresses if t.role != c.ROLE_PS and t != self.chief),
            key=_role_order,
        )
        return [self.chief, *others]

    def is_chief(self, task: Task) -> bool:
        return task == self.chief

    def trainer_index(self, task: Task) -> int:
        """`task`'s index among the trainers (`worker_tasks`, the chief's 0): the worker
        index it trains and proves itself as. ValueError for a parameter server."""
        return self.worker_tasks().index(task)

    def replica_name(self, task: Task) -> str:
        """Pod name on Kubernetes, process name locally."""
        return replica_name(self.job_name, task.role, task.index)

    def env(self, task: Task) -> dict[str, str]:
        """The environment that tells replica `task` who it is and where everyone is."""
        if task not in self.addresses:
            raise KeyError(f"{task} is not a task of job {self.job_name}")
        cluster = self.cluster
        pstrain = {
            "cluster": cluster,
            "task": task.as_json(),
            "chief": self.chief.as_json(),
            "job": {"name": self.job_name, "namespace": self.namespace},
        }
        tf_config = {"cluster": cluster, "task": task.as_json()}
        return {
            c.ENV_CLUSTER: json.dumps(pstrain, separators=(",", ":")),
            c.ENV_TF_CONFIG: json.dumps(tf_config, separators=(",", ":")),
            c.ENV_TRAINING: self.training_json,
        }


_ROLE_RANK = {c.ROLE_PS: 0, c.ROLE_WORKER: 1, c.ROLE_CHIEF: 2}


def _role_order(task: Task) -> tuple[int, int]:
    return (_ROLE_RANK.get(task.role, 9), task.index)


def job_tasks(job: TrainingJob) -> Iterator[Task]:
    """Every (role, index) of the job, parameter servers first."""
    reps = job.spec.replicas
    for i in range(reps.ps.replicas):
        yield Task(c.ROLE_PS, i)
    for i in range(reps.worker.replicas):
        yield Task(c.ROLE_WORKER, i)
    if reps.chief is not None:
        yield Task(c.ROLE_CHIEF, 0)


def chief_task(job: TrainingJob) -> Task:
    """The separate chief if there is one, else worker 0 (classic TensorFlow)."""
    return Task(c.ROLE_CHIEF, 0) if job.has_separate_chief else Task(c.ROLE_WORKER, 0)


def build_cluster_spec(job: TrainingJob, address_of: AddressFn) -> ClusterSpec:
    """The cluster spec of `job`, with addresses from `address_of`."""
    addresses = {task: address_of(task) for task in job_tasks(job)}
    seen: dict[Address, Task] = {}
    for task, addr in addresses.items():
        if addr in seen:
            raise ValueError(f"{task} and {seen[addr]} were given the same address {addr}")
        seen[addr] = task
    return ClusterSpec(
        job_name=job.name,
        namespace=job.namespace,
        addresses=addresses,
        chief=chief_task(job),
        training_json=json.dumps(job.spec.training.to_api(), separators=(",", ":")),
    )


def kubernetes_addressing(job: TrainingJob) -> AddressFn:
    """Pod hostname under the job's headless Service, on the fixed replica port."""

    def address_of(task: Task) -> Address:
        host = replica_host(job.name, job.namespace, task.role, task.index)
        return Address(host, c.REPLICA_PORT)

    return address_of


def local_addressing(job: TrainingJob, ports: Iterable[int]) -> AddressFn:
    """127.0.0.1 and one distinct port per task, taken in start order from `ports`.

    Finding free ports is I/O; the caller does it and passes them in.
    """
    tasks = list(job_tasks(job))
    port_list = list(ports)
    if len(set(port_list)) < len(tasks):
        raise ValueError(f"job {job.name} needs {len(tasks)} distinct ports, got {port_list}")
    assigned = dict(zip(tasks, port_list, strict=False))

    def address_of(task: Task) -> Address:
        return Address(c.LOCAL_HOST, assigned[task])

    return address_of


def kubernetes_cluster_spec(job: TrainingJob) -> ClusterSpec:
    return build_cluster_spec(job, kubernetes_addressing(job))


def local_cluster_spec(job: TrainingJob, ports: Iterable[int]) -> ClusterSpec:
    return build_cluster_spec(job, local_addressing(job, ports))


def task_count(job: TrainingJob) -> int:
    reps = job.spec.replicas
    return reps.ps.replicas + reps.worker.replicas + (reps.chief.replicas if reps.chief else 0)


# Linux's limit on one environment entry ("NAME=value" and its NUL), MAX_ARG_STRLEN: a
# longer one makes execve fail with E2BIG, "Argument list too long".
MAX_ENV_ENTRY_BYTES = 32 * 4096
# No Kubernetes address is shorter: "<job>-ps-0.<job>.<namespace>.svc:2222", quoted.
_MIN_ADDRESS_BYTES = len('"a-ps-0.a.a.svc:2222",')


def environment_problem(job: TrainingJob) -> tuple[str, str] | None:
    """(field path, message) when the cluster-spec environment of `job` would not fit
    in one environment variable, else None. Every replica of a job receives the same
    variables, so the check needs no addresses beyond the job's own."""
    tasks = task_count(job)
    if tasks * _MIN_ADDRESS_BYTES > MAX_ENV_ENTRY_BYTES:
        size = f"at least {tasks * _MIN_ADDRESS_BYTES} bytes"  # not worth building
    else:
        env = kubernetes_cluster_spec(job).env(chief_task(job))
        training = len(c.ENV_TRAINING) + 2 + len(env[c.ENV_TRAINING].encode())
        if training > MAX_ENV_ENTRY_BYTES:
            return "spec.training", (
                f"spec.training is {training} bytes as JSON; every replica receives it in "
                f"the {c.ENV_TRAINING} environment variable, and Linux allows one variable "
                f"at most {MAX_ENV_ENTRY_BYTES} bytes ('Argument list too long'); pass large "
                "data through a file or a volume, e.g. a path in spec.training.args")
        cluster = len(c.ENV_CLUSTER) + 2 + len(env[c.ENV_CLUSTER].encode())
        if cluster <= MAX_ENV_ENTRY_BYTES:
            return None
        size = f"{cluster} bytes"
    return "spec.replicas", (
        f"spec.replicas asks for {tasks} replicas; every replica receives all their "
        f"addresses in the {c.ENV_CLUSTER} environment variable, which would be {size}, and "
        f"Linux allows one variable at most {MAX_ENV_ENTRY_BYTES} bytes ('Argument list "
        "too long')")


@dataclass(frozen=True)
class ReplicaIdentity:
    """What a replica reads back from its own PSTRAIN_CLUSTER environment."""

    cluster: dict[str, list[str]]
    task: Task
    chief: Task
    job_name: str
    namespace: str

    @property
    def is_chief(self) -> bool:
        return self.task == self.chief

    def addresses(self, role: str) -> list[str]:
        return list(self.cluster.get(role, []))


def parse_cluster_env(environ: Mapping[str, str]) -> ReplicaIdentity:
    """Read PSTRAIN_CLUSTER; raise ValueError with a clear message when it is unusable."""
    raw = environ.get(c.ENV_CLUSTER)
    if not raw:
        raise ValueError(
            f"{c.ENV_CLUSTER} is not set; a replica is started by `pstrain run` or by the "
            "operator, which set it"
        )
    try:
        data = json.loads(raw)
        task = Task(str(data["task"]["type"]), int(data["task"]["index"]))
        chief = Task(str(data["chief"]["type"]), int(data["chief"]["index"]))
        cluster = {str(k): [str(a) for a in v] for k, v in data["cluster"].items()}
        job = data.get("job", {})
        return ReplicaIdentity(
            cluster=cluster,
            task=task,
            chief=chief,
            job_name=str(job.get("name", "")),
            namespace=str(job.get("namespace", "")),
        )
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"{c.ENV_CLUSTER} is not valid cluster JSON: {exc}") from exc
