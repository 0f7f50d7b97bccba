"""The reconcile decision: observed job + observed pods -> actions + new status + events.

Pure and level-based. Nothing here remembers past calls: everything comes from the job
(spec and the status written last time) and the pods that exist now, so the operator
may restart at any moment and a repeated event yields the same plan. One executor
(`handlers.py`) applies a plan and writes the status once.

Start order: the headless Service and the parameter servers first; the non-chief
workers only once every PS pod is Ready; the chief last. A failed replica is restarted
or fails the job through `pstrain_api.policy.decide_restart`, the rule the local
runner follows too.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from typing import Any, Literal

from pstrain_api import constants as c
from pstrain_api.cluster import ClusterSpec, Task, kubernetes_cluster_spec
from pstrain_api.model import (
    CheckpointStatus,
    Condition,
    CreateRefusal,
    FailureCause,
    Progress,
    Replicas,
    RoleStatus,
    Security,
    Training,
    TrainingJob,
    TrainingJobStatus,
)
from pstrain_api.policy import decide_ps_exit, decide_restart, shorten
from pstrain_api.readiness import runs_pstrain_runtime

from . import checkpointing, disruption, refusals, scaling, stall, suspend
from .build import applied_spec, build_pod, build_service, owner_reference, spec_hash
from .conditions import Event, condition_is, set_condition
from .gang import build_pod_group, gang_of
from .observe import ObservedPod
from .security import secure_pod
from .settings import PodSettings

# How soon to look again when nothing else (a pod or job event) wakes the operator.
REQUEUE_STARTING_S = 5.0
REQUEUE_RUNNING_S = 10.0  # progress is refreshed at least this often while Running
REQUEUE_CLEANUP_S = 5.0
# A PS exits 0 when the chief, done, tells it to stop: just before the chief's own
# success. One that exited 0 this long ago while the chief has not succeeded failed.
PS_EXIT_GRACE_S = 30.0

# Reasons (machine-readable, CamelCase) used in conditions and events.
R_INVALID_SPEC = "InvalidSpec"
R_SPEC_VALID = "SpecValid"
R_PODS_CREATED = "PodsCreated"
R_CREATED_SERVICE = "CreatedService"
R_CREATED_PS = "CreatedPS"
R_WAITING_FOR_PS = "WaitingForPS"
R_STARTED_WORKERS = "StartedWorkers"
R_STARTED_CHIEF = "StartedChief"
R_ALL_STARTED = "AllReplicasStarted"
R_RESTARTING = "RestartingReplica"
R_RESTARTING_STALLED = "RestartingStalled"
R_WAITING_FOR_RESTART = "WaitingForRestartedReplicas"
R_CHIEF_SUCCEEDED = "ChiefSucceeded"
R_DEADLINE = "DeadlineExceeded"
R_SUSPENDED = "JobSuspended"
R_RESUMED = "JobResumed"
R_SPEC_REJECTED = "SpecChangeNotApplicable"
R_SPEC_APPLIED = "SpecApplied"
R_CLEANUP = "CleanedUpPods"
R_TTL = "TTLExpired"
R_UNEXPECTED_POD = "UnexpectedPod"

@dataclass(frozen=True)
class Observed:
    """Everything one reconcile looks at."""

    job: TrainingJob
    pods: tuple[ObservedPod, ...]
    service_exists: bool
    now: datetime
    progress: Progress | None = None
    checkpoint: CheckpointStatus | None = None
    server_workers: tuple[int, ...] | None = None  # PS 0's live worker set, when read


# --------------------------------------------------------------------------- plan


@dataclass(frozen=True)
class CreateService:
    manifest: dict[str, Any] = field(compare=False)
    name: str = ""


@dataclass(frozen=True)
class CreateObject:
    """Another child object, such as a gang's PodGroup."""

    kind: str
    manifest: dict[str, Any] = field(compare=False, repr=False)

    @property
    def name(self) -> str:
        return str(self.manifest["metadata"]["name"])


@dataclass(frozen=True)
class CreatePod:
    name: str
    role: str
    manifest: dict[str, Any] = field(compare=False, repr=False)


@dataclass(frozen=True)
class DeletePod:
    name: str
    uid: str
    why: str = field(compare=False, default="")


@dataclass(frozen=True)
class DeleteJob:
    why: str = field(compare=False, default="")


@dataclass(frozen=True)
class RequestCheckpoint:
    """Ask the chief, through PS 0 at `address`, for a checkpoint before a disruption."""

    address: str
    why: str = field(compare=False, default="")


def ps0_address(job: TrainingJob) -> str:
    """Where the operator reaches parameter server 0 (status, checkpoint requests)."""
    return str(kubernetes_cluster_spec(job).addresses[Task(c.ROLE_PS, 0)])


SetWorkers = scaling.SetWorkers
Action = (CreateService | CreateObject | CreatePod | DeletePod | DeleteJob
          | RequestCheckpoint | SetWorkers)


@dataclass(frozen=True)
class Plan:
    actions: tuple[Action, ...]
    status: TrainingJobStatus
    events: tuple[Event, ...] = ()
    requeue_after: float | None = None

    @property
    def status_patch(self) -> dict[str, Any]:
        """The status as a JSON merge patch body: every field, None where it is unset
        (a merge patch deletes keys set to null)."""
        return status_to_api(self.status)


def status_to_api(status: TrainingJobStatus) -> dict[str, Any]:
    """Unset fields of objects become null (a merge patch removes them); list items,
    which a merge patch replaces whole, carry no nulls."""
    return _drop_nulls_in_lists(status.model_dump(by_alias=True, mode="json"))


def _drop_nulls_in_lists(value: Any, in_list: bool = False) -> Any:
    if isinstance(value, dict):
        return {k: _drop_nulls_in_lists(v, in_list) for k, v in value.items()
                if not (in_list and v is None)}
    if isinstance(value, list):
        return [_drop_nulls_in_lists(v, True) for v in value]
    return value


# --------------------------------------------------------------------------- helpers


def _count(job: TrainingJob, pods: Sequence[ObservedPod],
           old: Mapping[str, RoleStatus]) -> dict[str, RoleStatus]:
    roles = [c.ROLE_PS, c.ROLE_WORKER] + ([c.ROLE_CHIEF] if job.has_separate_chief else [])
    out: dict[str, RoleStatus] = {}
    for role in roles:
        mine = [p for p in pods if p.role == role and not p.deleting]
        out[role] = RoleStatus(
            active=sum(1 for p in mine if p.active),
            ready=sum(1 for p in mine if p.ready),
            succeeded=sum(1 for p in mine if p.phase == "Succeeded"),
            failed=sum(1 for p in mine if p.phase == "Failed"),
            restarts=old[role].restarts if role in old else 0,
        )
    return out


def _after(pods: Sequence[ObservedPod], actions: Sequence[Action]) -> list[ObservedPod]:
    """The pods as they will be once `actions` are applied: the status describes that, so
    the next reconcile of an unchanged world writes no new status."""
    gone = {a.name for a in actions if isinstance(a, DeletePod)}
    out = [p for p in pods if p.name not in gone]
    out += [ObservedPod(name=a.name, role=a.role, index=-1) for a in actions
            if isinstance(a, CreatePod)]
    return out


def _with_counts(job: TrainingJob, st: TrainingJobStatus, pods: Sequence[ObservedPod],
                 actions: Sequence[Action] = ()) -> TrainingJobStatus:
    counts = _count(job, _after(pods, actions), st.replica_statuses)
    reps = job.spec.replicas
    workers_total = reps.worker.replicas + (1 if reps.chief else 0)
    workers_ready = counts[c.ROLE_WORKER].ready + (
        counts[c.ROLE_CHIEF].ready if c.ROLE_CHIEF in counts else 0
    )
    return st.model_copy(update={
        "workers": scaling.membership(job, _after(pods, actions), st.workers),
        "replica_statuses": counts,
        "ps_ready": f"{counts[c.ROLE_PS].ready}/{reps.ps.replicas}",
        "workers_ready": f"{workers_ready}/{workers_total}",
    })


def _names(pods: Sequence[ObservedPod | CreatePod | DeletePod]) -> str:
    return ", ".join(p.name for p in pods)


def cleanup_actions(job: TrainingJob, pods: Sequence[ObservedPod]) -> list[DeletePod]:
    """Pods to delete once the job has finished. Parameter servers never linger, whatever
    cleanPodPolicy says: without a chief they would wait forever."""
    policy = job.spec.run_policy.clean_pod_policy
    out = []
    for p in pods:
        if p.deleting:
            continue
        if policy == "All" or (p.active and (policy == "Running" or p.role == c.ROLE_PS)):
            out.append(DeletePod(p.name, p.uid, f"the job finished (cleanPodPolicy {policy})"))
    return out


def _effective_job(
    job: TrainingJob, pods: Sequence[ObservedPod]
) -> tuple[TrainingJob | None, str]:
    """The job as its existing pods were built (None when that cannot be read back), and
    why it differs from the spec ("" when it does not). Replicas, training and security
    cannot change under running pods (pods with and without the job's keys cannot talk);
    the run policy and the worker count within its bounds (a scale) can."""
    want, current = spec_hash(job), applied_spec(job)
    stale = [p for p in pods if not p.deleting and p.spec_hash and p.spec_hash != want
             and not scaling.is_scale_only(p.applied_spec, current)]
    if not stale:
        return job, ""
    old: TrainingJob | None
    try:
        applied = json.loads(stale[0].applied_spec)
        old = job.model_copy(update={"spec": job.spec.model_copy(update={
            "replicas": Replicas.model_validate(applied["replicas"]),
            "training": Training.model_validate(applied["training"]),
            "security": Security.model_validate(applied.get("security", {})),
        })})
    except (ValueError, KeyError, TypeError):
        old = None
    changed = [part for part in ("replicas", "training", "security")
               if old is not None and getattr(old.spec, part) != getattr(job.spec, part)]
    what = " and ".join(f"spec.{p}" for p in changed) or "spec"
    return old, (
        f"{what} changed while pods built from the previous spec are running "
        f"({_names(stale)}); such a change cannot be applied live, so it was not applied. "
        "Revert it, or suspend the job (spec.runPolicy.suspend: true), change it and resume."
    )


# --------------------------------------------------------------------------- decisions


def decide_invalid(
    status: TrainingJobStatus, problems: Sequence[str], generation: int | None, now: datetime
) -> Plan:
    """A job whose spec the API model rejects: a condition and an event, no pods."""
    message = "The spec is invalid: " + " ".join(problems)
    was = condition_is(status, c.COND_CREATED, "False") and any(
        cond.reason == R_INVALID_SPEC and cond.message == message for cond in status.conditions
    )
    st = status.model_copy(update={
        "conditions": set_condition(status.conditions, c.COND_CREATED, "False",
                                    R_INVALID_SPEC, message, now),
        "observed_generation": generation,
    })
    events = () if was else (Event("Warning", R_INVALID_SPEC, message),)
    return Plan((), st, events, None)


def decide(obs: Observed, settings: PodSettings,
           progress_interval: float = REQUEUE_RUNNING_S) -> Plan:
    """The one reconcile decision. Reads as the script the operator follows.

    `progress_interval`: how soon to look again while Running (progress refresh)."""
    job, now = obs.job, obs.now
    # Pods of an earlier job of the same name (deleted, not yet garbage-collected) hold
    # their names but are not ours: treat them as already going away.
    uid = job.metadata.uid
    obs = replace(obs, pods=tuple(
        replace(p, deleting=True) if uid and p.owner_uid and p.owner_uid != uid else p
        for p in obs.pods))
    old = job.status or TrainingJobStatus()
    st = old.model_copy(deep=True, update={"observed_generation": job.metadata.generation})
    live = [p for p in obs.pods if not p.deleting]
    events: list[Event] = []
    actions: list[Action] = []
    policy = job.spec.run_policy
    st.conditions = _spec_valid_again(st, live, now)

    # 1. A finished job only cleans up and, after its TTL, deletes itself.
    if old.phase in c.TERMINAL_PHASES:
        return _decide_finished(job, st, obs, live)

    # 2. Suspended: no pods, the job stays; a running job checkpoints first.
    if policy.suspend:
        return _decide_suspended(job, old, st, obs, live)
    if old.phase == "Suspended":
        message, st.resumed_from_step = suspend.resumed(job, st)
        events.append(Event("Normal", R_RESUMED, message))
        st.progress = None  # read afresh once running again
        st.conditions = set_condition(st.conditions, c.COND_SUSPENDED, "False", R_RESUMED,
                                      "The job was resumed.", now)
        st.start_time = None  # activeDeadlineSeconds counts from the resume

    # 3. A spec change that cannot be applied live is refused; the pods keep the old one.
    effective, rejected = _effective_job(job, live)
    hold = effective is None  # the applied spec is unreadable: change nothing at all
    job = effective or job
    if rejected:
        if not condition_is(old, c.COND_SPEC_REJECTED):
            events.append(Event("Warning", R_SPEC_REJECTED, rejected))
        st.conditions = set_condition(st.conditions, c.COND_SPEC_REJECTED, "True",
                                      R_SPEC_REJECTED, rejected, now)
    elif condition_is(old, c.COND_SPEC_REJECTED):
        st.conditions = set_condition(st.conditions, c.COND_SPEC_REJECTED, "False",
                                      R_SPEC_APPLIED, "The spec matches the running pods.",
                                      now)

    # 4. activeDeadlineSeconds.
    deadline = policy.active_deadline_seconds
    if deadline is not None and st.start_time is not None:
        if (now - st.start_time).total_seconds() >= deadline:
            if old.phase == "Running":
                gate = checkpointing.gate(job, st, obs.checkpoint, now, "deadline")
                st = gate.status
                events.extend(gate.events)
                if not gate.ready:
                    return _hold(job, st, obs, gate, events)
            message = f"the job ran longer than activeDeadlineSeconds ({deadline} s)"
            return _finish(job, st, obs, "Failed", R_DEADLINE, message, None, events)

    # 5. Creates the API server keeps refusing: back off, and fail in bounded time.
    backoff = refusals.wait_left(old, job.metadata.generation, now)
    hold = hold or backoff > 0

    cluster = kubernetes_cluster_spec(job)
    by_name = {p.name: p for p in obs.pods}
    wanted = {cluster.replica_name(t) for t in cluster.tasks()}
    given_up = refusals.gave_up(old)
    if given_up and old.create_refusal is not None:
        return _finish(job, st, obs, "Failed", refusals.R_CREATE_REJECTED, given_up,
                       _refusal_cause(cluster, old.create_refusal), events)

    # 6. A scale removes worker pods (highest index first); other pods that are not part
    # of the job (left from another spec) go too.
    scale = scaling.decide_scale(job, old, live) if not hold else scaling.Scale()
    actions.extend(DeletePod(name, uid, why) for name, uid, why in scale.remove)
    events.extend(scale.events)
    scaled_away = {name for name, _, _ in scale.remove}
    for p in live:
        if p.name not in wanted and p.name not in scaled_away:
            actions.append(DeletePod(p.name, p.uid, "not a replica of the current spec"))
            events.append(Event("Normal", R_UNEXPECTED_POD,
                                f"deleting pod {p.name}: it is not a replica of the spec"))

    # 7. Pods deleted or evicted from outside: name the cause, count the replacement,
    # and ask for a checkpoint when a DisruptionTarget announces one.
    st = _note_disruptions(job, old, st, obs, wanted, actions, events)

    # 8. Failed replicas: restart within the run policy, or fail the job. Disruptions
    # from outside are restarts, but not the job's own failures (backoffLimit). A PS
    # that exited 0 while the chief has not succeeded (past the grace) failed too.
    chief = by_name.get(cluster.replica_name(cluster.chief))
    chief_done = chief is not None and not chief.deleting and chief.phase == "Succeeded"
    restarted: set[str] = set()
    for task in cluster.tasks():
        p = by_name.get(cluster.replica_name(task))
        if p is None or p.deleting:
            continue
        used = st.restarts - st.disruptions
        if p.phase == "Failed":
            # The pod's termination message (its last error line, or its log's tail) goes
            # into the status and the events now, before the pod is deleted or restarted.
            decision = decide_restart(policy, p.name, p.exit_code, used, p.reason,
                                      detail=p.message)
        elif task.role == c.ROLE_PS and not chief_done and _exited_early(p, now):
            decision = decide_ps_exit(policy, p.name, used)
        else:
            continue
        how = _how(p)
        if decision.action == "fail":
            cause = FailureCause(role=p.role, pod=p.name, exit_code=p.exit_code,
                                 reason=p.reason, message=p.message or decision.message)
            return _finish(job, st, obs, "Failed", decision.reason,
                           f"pod {p.name} ({p.role}) failed ({how}): {decision.message}",
                           cause, events, actions)
        actions.append(DeletePod(p.name, p.uid, decision.message))
        restarted.add(p.name)
        st.counted_disruptions = disruption.remembered(st.counted_disruptions, [p.uid])
        st.restarts += 1
        role_status = st.replica_statuses.get(p.role, RoleStatus())
        st.replica_statuses = {**st.replica_statuses,
                               p.role: role_status.model_copy(
                                   update={"restarts": role_status.restarts + 1})}
        last = f"; its last output: {shorten(p.message)}" if p.message else ""
        events.append(Event("Warning", R_RESTARTING,
                            f"restarting pod {p.name}: it failed ({how}); restart "
                            f"{used + 1} of {policy.backoff_limit}{last}"))

    # 9. Success: the chief completed.
    progress = (stall.merged_progress(old.progress, obs.progress, now)
                if obs.progress is not None else st.progress)
    if chief is not None and chief_done:
        step = st.progress.global_step if st.progress else None
        if obs.progress is not None:
            st.progress = progress
            step = obs.progress.global_step
        # The parameter servers are stopped only once the final checkpoint is confirmed
        # (ones that already exited did so after the chief's Finish, which follows it).
        if any(p.role == c.ROLE_PS and p.active for p in live):
            gate = checkpointing.gate(job, st, obs.checkpoint, now, "success", ask=False,
                                      step=job.spec.training.steps)
            st = gate.status
            events.extend(gate.events)
            if not gate.ready:
                return _hold(job, st, obs, gate, events, actions)
        elif obs.checkpoint is not None:
            st.last_checkpoint = obs.checkpoint
        at = f" at global step {step}" if step else ""
        return _finish(job, st, obs, "Succeeded", R_CHIEF_SUCCEEDED,
                       f"the chief {chief.name} completed{at}", None, events, actions)

    # 10. The stall watchdog (runPolicy.stallTimeoutSeconds).
    stalled = (stall.check_stall(policy, progress, st.restarts - st.disruptions, now)
               if old.phase == "Running" and not restarted else None)
    if stalled is not None and stalled.action == "fail":
        return _finish(job, st, obs, "Failed", stalled.reason, stalled.message, None, events,
                       actions)
    if stalled is not None:
        restarted |= _restart_stalled(st, live, actions, events, stalled.message)
        progress = progress.model_copy(update={"advanced_at": now}) if progress else None

    # 11. Create what is missing, in order: Service, PS, workers once PS are Ready, chief.
    if not obs.service_exists and not hold:
        service = build_service(job)
        actions.append(CreateService(service, service["metadata"]["name"]))
        events.append(Event("Normal", R_CREATED_SERVICE,
                            f"created headless Service {service['metadata']['name']}",
                            about=(service["metadata"]["name"],)))

    def absent(task: Task) -> bool:
        return not hold and cluster.replica_name(task) not in by_name

    new_ps = [_create(job, cluster, t, settings) for t in cluster.ps_tasks() if absent(t)]
    gang = gang_of(job) is not None  # every pod at once; the runtime keeps the order
    if new_ps:
        group = build_pod_group(job, owner_reference(job))
        if group is not None:
            actions.append(CreateObject(group["kind"], group))
        actions.extend(new_ps)
        events.append(Event("Normal", R_CREATED_PS, f"created parameter servers {_names(new_ps)}",
                            about=tuple(p.name for p in new_ps)))
    ps_pods = [by_name.get(cluster.replica_name(t)) for t in cluster.ps_tasks()]
    ps_ready = sum(1 for p in ps_pods if p is not None and p.ready and not p.deleting)
    all_ps_ready = ps_ready == len(ps_pods)
    # A PS exits 0 only once the chief is done: the chief's own completion is about to
    # be seen, so this is no reason to go back to Starting.
    ps_finished = any(p is not None and p.phase == "Succeeded" and p.name not in restarted
                      for p in ps_pods)

    workers = [t for t in cluster.tasks() if t.role != c.ROLE_PS and not cluster.is_chief(t)]
    chief_created = False
    if all_ps_ready or gang:
        new_workers = [_create(job, cluster, t, settings) for t in workers if absent(t)]
        if new_workers:
            actions.extend(new_workers)
            why = ("gang start: created with the parameter servers" if gang else
                   f"all {len(ps_pods)} parameter servers are Ready")
            events.append(Event("Normal", R_STARTED_WORKERS,
                                f"{why}; started workers {_names(new_workers)}",
                                about=tuple(p.name for p in new_workers)))
        if absent(cluster.chief):
            new_chief = _create(job, cluster, cluster.chief, settings)
            actions.append(new_chief)
            chief_created = True
            events.append(Event("Normal", R_STARTED_CHIEF, f"started the chief {new_chief.name}",
                                about=(new_chief.name,)))

    if st.start_time is None and any(isinstance(a, CreatePod) for a in actions):
        st.start_time = now
    if new_ps:
        st.conditions = set_condition(st.conditions, c.COND_CREATED, "True", R_PODS_CREATED,
                                      "The job's pods are being created.", now)

    # 12. Phase and progress.
    chief_up = chief_created or (
        chief is not None and not chief.deleting and chief.name not in restarted
    )
    if (all_ps_ready or ps_finished) and chief_up:
        if st.create_refusal is None and (old.phase != "Running"
                                          or not condition_is(old, c.COND_RUNNING)):
            st.conditions = set_condition(
                st.conditions, c.COND_RUNNING, "True", R_ALL_STARTED,
                "All parameter servers are Ready and every worker was started.", now)
        st.phase = "Running"
        # The stall watchdog's clock starts when the job (re)starts running.
        st.progress = (progress if old.phase == "Running" or progress is None
                       else progress.model_copy(update={"advanced_at": now}))
        if obs.checkpoint is not None:
            st.last_checkpoint = obs.checkpoint
        # Elastic workers: the parameter servers learn the worker set after a scale
        # (those that run the pstrain runtime: a program of its own reads TF_CONFIG).
        ps_addresses = [str(cluster.addresses[t]) for t in cluster.ps_tasks()]
        set_workers = (scaling.decide_worker_set(job, old, live, ps_addresses,
                                                 obs.server_workers)
                       if runs_pstrain_runtime(job.spec.replicas.ps) else None)
        if set_workers is not None:
            actions.append(set_workers)
            st.workers = scaling.membership(job, live, st.workers).model_copy(
                update={"members": list(set_workers.workers)})
        st, settled = checkpointing.settle(st, now)
        events.extend(settled)
        requeue = REQUEUE_STARTING_S if ps_finished else progress_interval
    else:
        message = f"waiting for parameter servers to be Ready ({ps_ready}/{len(ps_pods)})"
        if not all_ps_ready and old.phase != "Starting" and not backoff:
            events.append(Event("Normal", R_WAITING_FOR_PS, message))
        if not backoff:  # while backing off, the Running condition quotes the refusal
            st.conditions = set_condition(st.conditions, c.COND_RUNNING, "False",
                                          R_WAITING_FOR_PS if not all_ps_ready
                                          else R_WAITING_FOR_RESTART,
                                          message if not all_ps_ready
                                          else "waiting for restarted replicas", now)
        st.phase = "Starting"
        requeue = min(REQUEUE_STARTING_S, backoff) if backoff else REQUEUE_STARTING_S
    if deadline is not None and st.start_time is not None:
        left = deadline - (now - st.start_time).total_seconds()
        requeue = max(0.5, min(requeue, left))
    return Plan(tuple(actions), _with_counts(job, st, obs.pods, actions), tuple(events), requeue)


def _spec_valid_again(st: TrainingJobStatus, live: Sequence[ObservedPod],
                      now: datetime) -> list[Condition]:
    """The conditions of a job whose spec is valid (again): a `Created=False` of an
    earlier invalid spec (`decide_invalid`) does not outlive it. It becomes True when the
    job has pods or had started; else it goes (the first parameter servers set it)."""
    stale = any(cond.type == c.COND_CREATED and cond.reason == R_INVALID_SPEC
                for cond in st.conditions)
    if not stale:
        return st.conditions
    if live or st.start_time is not None or st.phase in c.TERMINAL_PHASES:
        return set_condition(st.conditions, c.COND_CREATED, "True", R_SPEC_VALID,
                             "The spec is valid again.", now)
    return [cond for cond in st.conditions if cond.type != c.COND_CREATED]


def _exited_early(p: ObservedPod, now: datetime) -> bool:
    """`p` exited 0 more than PS_EXIT_GRACE_S ago (an unknown finish time: not yet)."""
    return (p.phase == "Succeeded" and p.finished_at is not None
            and (now - p.finished_at).total_seconds() >= PS_EXIT_GRACE_S)


def _decide_finished(job: TrainingJob, st: TrainingJobStatus, obs: Observed,
                     live: Sequence[ObservedPod]) -> Plan:
    """A finished job only cleans up and, after its TTL, deletes itself."""
    policy, now = job.spec.run_policy, obs.now
    cleanup = cleanup_actions(job, live)
    actions: list[Action] = list(cleanup)
    events: list[Event] = []
    if cleanup:
        events.append(Event("Normal", R_CLEANUP, f"deleted pods {_names(cleanup)} "
                            f"(cleanPodPolicy {policy.clean_pod_policy})"))
    requeue = REQUEUE_CLEANUP_S if cleanup else None
    ttl = policy.ttl_seconds_after_finished
    if ttl is not None and st.completion_time is not None:
        expires = st.completion_time + timedelta(seconds=ttl)
        left = (expires - now).total_seconds()
        if left <= 0:
            actions.append(DeleteJob(f"ttlSecondsAfterFinished ({ttl}) passed"))
            events.append(Event("Normal", R_TTL, f"deleting the job: it finished at "
                                f"{st.completion_time.isoformat()} and "
                                f"ttlSecondsAfterFinished is {ttl}"))
            requeue = None
        else:
            requeue = min(requeue or left, left)
    return Plan(tuple(actions), _with_counts(job, st, obs.pods, actions), tuple(events),
                requeue)


def _decide_suspended(job: TrainingJob, old: TrainingJobStatus, st: TrainingJobStatus,
                      obs: Observed, live: Sequence[ObservedPod]) -> Plan:
    """Suspended: no pods, the job stays. A running job checkpoints first (bounded)."""
    now = obs.now
    events: list[Event] = []
    if obs.progress is not None:  # the freshest step: what a suspension loses counts
        st.progress = stall.merged_progress(old.progress, obs.progress, now)
    if old.phase == "Running" and live:
        gate = checkpointing.gate(job, st, obs.checkpoint, now, "suspend")
        st = gate.status
        events.extend(gate.events)
        if not gate.ready:
            return _hold(job, st, obs, gate, events)
    actions: list[Action] = [DeletePod(p.name, p.uid, "the job is suspended") for p in live]
    if old.phase != "Suspended":
        message, lost = suspend.suspended(job, st)
        events.append(Event("Normal", R_SUSPENDED, message))
        st.lost_steps += lost
    st.phase = "Suspended"
    st.create_refusal = None  # the user stepped in: retry afresh on resume
    st.conditions = set_condition(st.conditions, c.COND_SUSPENDED, "True", R_SUSPENDED,
                                  "The job is suspended (spec.runPolicy.suspend).", now)
    st.conditions = set_condition(st.conditions, c.COND_RUNNING, "False", R_SUSPENDED,
                                  "The job is suspended.", now)
    return Plan(tuple(actions), _with_counts(job, st, obs.pods, actions), tuple(events),
                REQUEUE_CLEANUP_S if live else None)


def _refusal_cause(cluster: ClusterSpec, refusal: CreateRefusal) -> FailureCause:
    """The root cause of a job failed by refused creates: the refused pod and its role."""
    refused = refusal.object.split("/")[-1]
    role = next((t.role for t in cluster.tasks() if cluster.replica_name(t) == refused), "")
    return FailureCause(role=role, pod=refused, reason=refusals.R_CREATE_REJECTED,
                        message=refusal.message)


def _note_disruptions(job: TrainingJob, old: TrainingJobStatus, st: TrainingJobStatus,
                      obs: Observed, wanted: set[str], actions: list[Action],
                      events: list[Event]) -> TrainingJobStatus:
    """Pods deleted or evicted from outside get an event naming the cause and count as a
    restart. A disruption announced by a DisruptionTarget condition (an eviction, a
    preemption) asks the chief for a checkpoint, once per pod: an eviction cannot be
    held up, so nothing waits for it."""
    uid = job.metadata.uid
    coming = disruption.announced(obs.pods, wanted, uid, st.counted_disruptions)
    events.extend(disruption.count(st, disruption.from_outside(
        obs.pods, wanted, uid, st.counted_disruptions)))
    if not coming or old.phase != "Running":
        return st
    st.counted_disruptions = disruption.remembered(
        st.counted_disruptions, [disruption.ASKED + p.uid for p in coming if not p.deleting])
    if st.checkpoint_request is not None:
        return st
    why = f"disruption of {coming[0].name}"
    gate = checkpointing.gate(job, st, obs.checkpoint, obs.now, why)
    events.extend(gate.events)
    if gate.ask:
        actions.append(RequestCheckpoint(ps0_address(job), why))
    return gate.status


def _hold(job: TrainingJob, st: TrainingJobStatus, obs: Observed,
          gate: checkpointing.Gate, events: list[Event],
          actions: Sequence[Action] = ()) -> Plan:
    """Wait for a checkpoint before a disruption; ask the chief for it when the gate says."""
    asks = (RequestCheckpoint(ps0_address(job), st.checkpoint_request.reason),) if (
        gate.ask and st.checkpoint_request is not None) else ()
    return Plan((*actions, *asks), _with_counts(job, st, obs.pods, actions), tuple(events),
                gate.requeue)


def _restart_stalled(st: TrainingJobStatus, live: Sequence[ObservedPod],
                     actions: list[Action], events: list[Event], why: str) -> set[str]:
    """Delete the workers and the chief of a stalled job (they are recreated in order);
    one restart of the backoffLimit. The parameter servers keep the parameters."""
    gone = {a.name for a in actions if isinstance(a, DeletePod)}
    victims = [p for p in live if p.role != c.ROLE_PS and p.active and p.name not in gone]
    actions.extend(DeletePod(p.name, p.uid, why) for p in victims)
    st.counted_disruptions = disruption.remembered(st.counted_disruptions,
                                                   [p.uid for p in victims])
    st.restarts += 1
    events.append(Event("Warning", R_RESTARTING_STALLED, why))
    return {p.name for p in victims}


def unapplied(plan: Plan, names: set[str]) -> Plan:
    """The plan as carried out when the creates of `names` did not happen (the API
    server refused one): they are not counted, no event reports them, and a job whose
    chief was not created is not Running."""
    if not names:
        return plan
    st = plan.status
    counts = dict(st.replica_statuses)
    chief_missing = False
    for a in plan.actions:
        if isinstance(a, CreatePod) and a.name in names:
            if a.role in counts:
                role = counts[a.role]
                counts[a.role] = role.model_copy(update={"active": max(0, role.active - 1)})
            labels = (a.manifest.get("metadata") or {}).get("labels") or {}
            chief_missing |= labels.get(c.LABEL_IS_CHIEF) == "true"
    update: dict[str, Any] = {"replica_statuses": counts}
    refused_workers = sum(1 for a in plan.actions if isinstance(a, CreatePod)
                          and a.name in names and a.role == c.ROLE_WORKER)
    if st.workers is not None and refused_workers:
        update["workers"] = st.workers.model_copy(
            update={"live": max(0, st.workers.live - refused_workers)})
    if chief_missing and st.phase == "Running":
        update["phase"] = "Starting"
    return replace(
        plan,
        actions=tuple(a for a in plan.actions
                      if not (isinstance(a, CreatePod | CreateService) and a.name in names)),
        status=st.model_copy(update=update),
        events=tuple(e for e in plan.events if not set(e.about) & names),
    )


def _how(p: ObservedPod) -> str:
    parts = [p.reason] if p.reason else []
    if p.exit_code is not None:
        parts.append(f"exit code {p.exit_code}")
    return ", ".join(parts) or "unknown cause"


def _create(job: TrainingJob, cluster: ClusterSpec, task: Task,
            settings: PodSettings) -> CreatePod:
    manifest = secure_pod(build_pod(job, cluster, task, settings), job, task.role,
                          cluster.is_chief(task))
    return CreatePod(manifest["metadata"]["name"], task.role, manifest)


def _finish(
    job: TrainingJob,
    st: TrainingJobStatus,
    obs: Observed,
    phase: Literal["Succeeded", "Failed"],
    reason: str,
    message: str,
    cause: FailureCause | None,
    events: list[Event],
    actions: Sequence[Action] = (),
) -> Plan:
    """The job ends now: terminal phase, conditions, completion time, clean-up."""
    now = obs.now
    st.phase = phase
    st.completion_time = now
    st.failure = cause
    st.checkpoint_request = None
    kind = c.COND_SUCCEEDED if phase == "Succeeded" else c.COND_FAILED
    st.conditions = set_condition(st.conditions, kind, "True", reason, message, now)
    st.conditions = set_condition(st.conditions, c.COND_RUNNING, "False", reason,
                                  f"The job {phase.lower()}.", now)
    verb = "succeeded" if phase == "Succeeded" else "failed"
    events.append(Event("Normal" if phase == "Succeeded" else "Warning",
                        reason, f"job {verb}: {message}"))
    done = {a.name for a in actions if isinstance(a, DeletePod)}
    live = [p for p in obs.pods if not p.deleting and p.name not in done]
    cleanup = cleanup_actions(job, live)
    if cleanup:
        events.append(Event("Normal", R_CLEANUP, f"deleted pods {_names(cleanup)} "
                            f"(cleanPodPolicy {job.spec.run_policy.clean_pod_policy})"))
    all_actions = [a for a in actions if not isinstance(a, CreatePod)] + cleanup
    ttl = job.spec.run_policy.ttl_seconds_after_finished
    requeue: float | None = REQUEUE_CLEANUP_S if cleanup else None
    if ttl is not None:
        requeue = min(requeue or float(ttl), float(ttl)) if ttl > 0 else 0.5
    return Plan(tuple(all_actions), _with_counts(job, st, obs.pods, all_actions), tuple(events), requeue)
