"""The local run's lifecycle as a pure state machine: observations in, actions out.

`decide(state, observation)` returns the next state and the actions the executor must
carry out (start a replica, terminate or kill replicas, tell the user something, finish).
Nothing here touches processes, sockets, clocks or signals: time arrives inside each
observation, so every rule can be tested with a table of whole states.

Invariants:
- Start order is the cluster spec's (`ClusterSpec.tasks()`): every parameter server,
  then, once every parameter server is ready, the non-chief workers, then the chief, in
  one batch of `Start` actions executed in that order. "Ready" is the role's readiness
  check (`pstrain_api.readiness.local_check`): the runtime's gRPC health service, the
  replica port accepting TCP connections, or nothing (ready once started).
- Restarts count job-wide, like a Kubernetes Job's backoffLimit, and are decided by
  `pstrain_api.policy.decide_restart`, the function the operator uses; a replica that
  exits with the configuration-error code fails the job at once, with the line it left
  in its termination-message file as the reason.
- Job success is the chief exiting 0. Replicas that never end by themselves (a user's
  own server program, such as TensorFlow's PS) are then terminated at once; the
  runtime's replicas get `success_grace` seconds to exit by themselves first.
- A parameter server serves until the chief finishes. One that exits 0 while the job
  runs, and whose exit the chief's success does not follow within `ps_exit_grace`
  seconds (a PS told to stop by the chief exits just before it), failed: it is
  restarted or fails the job under the restart policy (`decide_ps_exit`).
- Once the job is decided (succeeded, failed, interrupted) nothing is started or
  restarted again; the run finishes when no replica process is left.
- Stall watchdog (`runPolicy.stallTimeoutSeconds`): the global step the chief reports
  (`Progressed`) must advance within the timeout once the workers run, else
  `pstrain_api.policy.decide_stall` (the operator's rule too) restarts the workers and
  the chief (one restart; their exits are then expected, not failures) or fails the
  job with reason Stalled.
- At the deadline, a running job asks the chief for a checkpoint first (`AskCheckpoint`,
  RequestCheckpoint on PS 0) and fails once it is written (`Checkpointed`), cannot be
  asked for (`CheckpointUnanswered`), or `checkpoint_wait` has passed.
- Elastic workers (`ScaleRequest`, from `pstrain scale`): refused outside the bounds
  with the CRD's sentence; otherwise `pstrain_api.membership.plan_scale` says which
  worker indices start and stop. The environments follow the new count (`Respec`),
  newcomers start, the parameter servers get the new set (`SetWorkers`), and removed
  workers are terminated (SIGKILL after `kill_grace`); their exit is expected, never
  a restart nor a failure. Parameter servers and the chief are never touched.
"""

from __future__ import annotations

import signal
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Literal

from pstrain_api import constants as c
from pstrain_api.cluster import ClusterSpec
from pstrain_api.membership import plan_scale, scale_problem, trainer_set
from pstrain_api.model import RunPolicy, TrainingJob
from pstrain_api.names import replica_name
from pstrain_api.policy import (
    RestartDecision,
    decide_ps_exit,
    decide_restart,
    decide_stall,
    stalled_for,
)
from pstrain_api.readiness import describe_check, local_check, stopped_on_success

ReplicaStatus = Literal["pending", "running", "waiting_restart", "exited", "stopped"]
Stage = Literal["starting_ps", "running", "draining", "stopping", "done"]
Level = Literal["info", "warning", "error"]

REASON_SUCCEEDED = "ChiefSucceeded"
REASON_INTERRUPTED = "Interrupted"
REASON_DEADLINE = "DeadlineExceeded"
REASON_HEALTH_TIMEOUT = "ParameterServerNotServing"
REASON_SPAWN_FAILED = "CannotStartReplica"
REASON_EARLY_EXIT = "ParameterServerExitedBeforeServing"


# --------------------------------------------------------------------------- settings


@dataclass(frozen=True)
class Settings:
    """Timing rules of one local run, validated up front."""

    policy: RunPolicy = field(default_factory=RunPolicy)
    deadline_seconds: float | None = None
    health_timeout: float = 60.0
    success_grace: float = 20.0
    kill_grace: float = 5.0
    backoff_base: float = 0.5
    backoff_max: float = 10.0
    checkpoint_wait: float = 30.0
    ps_exit_grace: float = 15.0
    min_workers: int | None = None  # spec.replicas.worker.minReplicas
    max_workers: int | None = None  # spec.replicas.worker.maxReplicas

    def __post_init__(self) -> None:
        for name in ("health_timeout", "success_grace", "kill_grace", "backoff_base",
                     "backoff_max", "checkpoint_wait", "ps_exit_grace"):
            value = getattr(self, name)
            if value < 0:
                raise ValueError(f"{name} is {value}; it must be at least 0.")
        if self.deadline_seconds is not None and self.deadline_seconds <= 0:
            raise ValueError(
                f"deadline_seconds is {self.deadline_seconds}; it must be greater than 0."
            )


def effective_deadline(active_deadline_seconds: int | None,
                       timeout: float | None) -> float | None:
    """The tighter of spec.runPolicy.activeDeadlineSeconds and `--timeout`."""
    limits = [x for x in (active_deadline_seconds, timeout) if x is not None]
    return float(min(limits)) if limits else None


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def restart_delay(settings: Settings, previous_restarts: int) -> float:
    """Exponential back-off before restart number `previous_restarts + 1` of a replica."""
    return min(settings.backoff_base * (2 ** previous_restarts), settings.backoff_max)


def normalize_exit_code(returncode: int) -> int:
    """Popen's -N (killed by signal N) as a shell and Kubernetes report it: 128 + N."""
    return 128 - returncode if returncode < 0 else returncode


# --------------------------------------------------------------------------- state


@dataclass(frozen=True)
class Replica:
    """One replica as the supervisor sees it. `attempt` counts its starts (1 = first)."""

    name: str
    role: str
    index: int
    address: str
    is_chief: bool = False
    status: ReplicaStatus = "pending"
    attempt: int = 0
    healthy: bool = False
    started_at: float | None = None
    restart_at: float | None = None
    exit_code: int | None = None
    check: str = c.GATE_GRPC  # how readiness is checked (pstrain_api.readiness)
    stop_on_success: bool = False  # terminated at once when the chief exits 0
    exited_at: float | None = None
    stall_restart: bool = False  # stopped by the stall watchdog: its exit is expected
    kill_at: float | None = None  # SIGKILL then, if the watchdog's SIGTERM was ignored
    retiring: bool = False  # stopped by a scale-down: its exit is expected
    rejoined: int = 0  # starts by a scale-up after a scale-down stopped it (not restarts)

    @property
    def is_ps(self) -> bool:
        return self.role == c.ROLE_PS

    @property
    def is_live(self) -> bool:
        """A process exists (or is being started) for this replica."""
        return self.status == "running"


@dataclass(frozen=True)
class RunState:
    replicas: tuple[Replica, ...]
    settings: Settings
    stage: Stage = "starting_ps"
    phase: c.Phase = "Pending"
    reason: str = ""
    message: str = ""
    culprit: str | None = None
    started_at: float = 0.0
    restarts: int = 0
    drain_until: float | None = None
    kill_at: float | None = None
    killed: bool = False
    interrupted: bool = False
    step: int = 0  # the global step last reported
    advanced_at: float | None = None  # when it last advanced (the stall watchdog's clock)
    checkpoint_asked_at: float | None = None  # the deadline's checkpoint request
    checkpoint_wanted: int = 0  # a checkpoint at or after this step answers it
    job_name: str = ""
    members: tuple[int, ...] | None = None  # the worker set sent to the servers, if scaled

    def replica(self, name: str) -> Replica:
        for rep in self.replicas:
            if rep.name == name:
                return rep
        raise KeyError(f"{name} is not a replica of this run")

    def live(self) -> list[str]:
        return [r.name for r in self.replicas if r.is_live]

    def with_replica(self, rep: Replica) -> RunState:
        return replace(
            self, replicas=tuple(rep if r.name == rep.name else r for r in self.replicas)
        )

    @property
    def ps(self) -> list[Replica]:
        return [r for r in self.replicas if r.is_ps]


def initial_state(spec: ClusterSpec, settings: Settings,
                  job: TrainingJob | None = None) -> RunState:
    """Every replica pending, in the cluster spec's start order; with `job`, each one's
    readiness check and success behaviour follow its role's program."""
    replicas = []
    for task in spec.tasks():
        role = job.replica_spec(task.role) if job is not None else None
        replicas.append(Replica(
            name=spec.replica_name(task),
            role=task.role,
            index=task.index,
            address=str(spec.addresses[task]),
            is_chief=spec.is_chief(task),
            check=local_check(role) if role is not None else c.GATE_GRPC,
            stop_on_success=role is not None and stopped_on_success(role),
        ))
    return RunState(replicas=tuple(replicas), settings=settings, job_name=spec.job_name)


# --------------------------------------------------------------------------- observations


@dataclass(frozen=True)
class Begin:
    now: float


@dataclass(frozen=True)
class Healthy:
    """Parameter server `name`, start `attempt`, passed its readiness check."""

    name: str
    attempt: int
    now: float


@dataclass(frozen=True)
class Exited:
    """The process of start `attempt` of `name` ended with `exit_code` (128+N on signal N);
    `message`: what it left in its termination-message file ("" when nothing)."""

    name: str
    attempt: int
    exit_code: int
    now: float
    message: str = ""


@dataclass(frozen=True)
class SpawnFailed:
    name: str
    attempt: int
    message: str
    now: float


@dataclass(frozen=True)
class Tick:
    now: float


@dataclass(frozen=True)
class Progressed:
    """The chief reported global step `step`."""

    step: int
    now: float


@dataclass(frozen=True)
class Interrupt:
    now: float
    signum: int = signal.SIGINT


@dataclass(frozen=True)
class Checkpointed:
    """The chief wrote a checkpoint at global step `step`."""

    step: int
    now: float


@dataclass(frozen=True)
class CheckpointUnanswered:
    """A checkpoint could not be asked for (PS 0 unreachable, or no job on it)."""

    now: float


@dataclass(frozen=True)
class ScaleRequest:
    """`pstrain scale`: run `replicas` workers. `addresses`: a free address for each
    worker index the job has never had (the runner finds them; taking ports is I/O).
    `warning`: what the runner found worth a word should the scale be made (more
    workers than this machine's cores). The answer goes back under `ticket` (`Reply`)."""

    replicas: int
    now: float
    ticket: int = 0
    addresses: Mapping[int, str] = field(default_factory=dict)
    warning: str = ""


Observation = (Begin | Healthy | Exited | SpawnFailed | Tick | Interrupt | Progressed
               | Checkpointed | CheckpointUnanswered | ScaleRequest)


# --------------------------------------------------------------------------- actions


@dataclass(frozen=True)
class Start:
    name: str
    attempt: int


@dataclass(frozen=True)
class Terminate:
    """SIGTERM to each named replica's process group."""

    names: tuple[str, ...]


@dataclass(frozen=True)
class Kill:
    """SIGKILL to each named replica's process group."""

    names: tuple[str, ...]


@dataclass(frozen=True)
class Notify:
    level: Level
    text: str
    replica: str | None = None  # the replica whose recent log lines explain the notice


@dataclass(frozen=True)
class Finish:
    phase: c.Phase
    reason: str
    message: str
    culprit: str | None = None
    interrupted: bool = False


@dataclass(frozen=True)
class AskCheckpoint:
    """Ask the chief, through PS 0, for a checkpoint (RequestCheckpoint)."""


@dataclass(frozen=True)
class Respec:
    """Rebuild every replica's environment for `workers` workers (the cluster spec after
    a scale); the replicas of the state carry the addresses."""

    workers: int


@dataclass(frozen=True)
class SetWorkers:
    """Make `workers` (trainer indices) the worker set on every parameter server, and
    keep it so (a server the chief re-initialises is sent it again)."""

    workers: tuple[int, ...]


@dataclass(frozen=True)
class Reply:
    """The answer to the ScaleRequest with `ticket`, and a warning the caller prints."""

    ticket: int
    ok: bool
    message: str
    warning: str = ""


Action = (Start | Terminate | Kill | Notify | Finish | AskCheckpoint | Respec | SetWorkers
          | Reply)


# --------------------------------------------------------------------------- decisions


def decide(state: RunState, obs: Observation) -> tuple[RunState, list[Action]]:
    """The next state and the actions that get there."""
    if state.stage == "done":
        return state, []
    if isinstance(obs, Begin):
        return _begin(state, obs.now)
    if isinstance(obs, Healthy):
        return _healthy(state, obs)
    if isinstance(obs, Exited):
        return _exited(state, obs)
    if isinstance(obs, SpawnFailed):
        return _spawn_failed(state, obs)
    if isinstance(obs, Tick):
        return _tick(state, obs.now)
    if isinstance(obs, Interrupt):
        return _interrupt(state, obs)
    if isinstance(obs, Progressed):
        if obs.step != state.step:
            state = replace(state, step=obs.step, advanced_at=obs.now)
        return state, []
    if isinstance(obs, Checkpointed | CheckpointUnanswered):
        return _checkpoint_answer(state, obs)
    if isinstance(obs, ScaleRequest):
        return _scale(state, obs)
    raise TypeError(f"unknown observation {obs!r}")


def _start(state: RunState, names: Iterable[str], now: float) -> tuple[RunState, list[Action]]:
    actions: list[Action] = []
    for name in names:
        rep = state.replica(name)
        rep = replace(rep, status="running", attempt=rep.attempt + 1,
                      healthy=rep.check == c.GATE_NONE, started_at=now, restart_at=None,
                      exit_code=None)
        state = state.with_replica(rep)
        actions.append(Start(rep.name, rep.attempt))
    return state, actions


def _begin(state: RunState, now: float) -> tuple[RunState, list[Action]]:
    state = replace(state, started_at=now, phase="Starting", stage="starting_ps")
    ps_names = [r.name for r in state.ps]
    state, actions = _start(state, ps_names, now)
    notice = Notify("info", f"starting {len(ps_names)} parameter server(s): "
                            f"{', '.join(ps_names)}")
    if all(r.healthy for r in state.ps):  # no PS, or none with a readiness check
        state, more = _start_workers(state, now)
        return state, [notice, *actions, *more]
    return state, [notice, *actions]


def _start_workers(state: RunState, now: float) -> tuple[RunState, list[Action]]:
    """Every parameter server serves: start the non-chief workers, then the chief."""
    others = [r.name for r in state.replicas
              if not r.is_ps and not r.is_chief and r.status == "pending"]
    chief = [r.name for r in state.replicas if r.is_chief]
    state = replace(state, stage="running", phase="Running", advanced_at=now)
    state, actions = _start(state, [*others, *chief], now)
    ps_count = len(state.ps)
    text = (f"{ps_count} parameter server(s) ready; starting "
            f"{len(others)} worker(s), then the chief {', '.join(chief)}")
    return state, [Notify("info", text), *actions]


def _healthy(state: RunState, obs: Healthy) -> tuple[RunState, list[Action]]:
    rep = state.replica(obs.name)
    if rep.attempt != obs.attempt or not rep.is_live or rep.healthy:
        return state, []
    state = state.with_replica(replace(rep, healthy=True))
    if state.stage == "starting_ps" and all(r.healthy for r in state.ps):
        return _start_workers(state, obs.now)
    return state, []


def _exited(state: RunState, obs: Exited) -> tuple[RunState, list[Action]]:
    rep = state.replica(obs.name)
    if rep.attempt != obs.attempt or not rep.is_live:
        return state, []
    rep = replace(rep, status="exited", exit_code=obs.exit_code, healthy=False,
                  exited_at=obs.now)
    state = state.with_replica(rep)

    if state.stage in ("draining", "stopping"):
        return _finish_if_idle(state)

    if rep.retiring:  # a scale-down stopped it
        rep = replace(rep, status="stopped", retiring=False, kill_at=None)
        return state.with_replica(rep), [Notify("info", f"{rep.name} stopped (scale-down, "
                                                        f"exit code {obs.exit_code})")]

    if rep.stall_restart:  # stopped by the watchdog, already counted: start it again
        delay = restart_delay(state.settings, 0)
        rep = replace(rep, status="waiting_restart", restart_at=obs.now + delay,
                      stall_restart=False, kill_at=None)
        return state.with_replica(rep), []

    if obs.exit_code == 0:
        if rep.is_chief:
            return _chief_succeeded(state, obs.now)
        if not (rep.is_ps and state.stage == "starting_ps"):
            # A worker that finished its share, or a PS told to stop by the chief, whose
            # success follows (else `_tick` finds the PS exit after `ps_exit_grace`).
            return state, []
        # A PS that exits 0 before it ever served can never let the job start.
        return _fail(state, obs.now, REASON_EARLY_EXIT,
                     f"{rep.name} exited with code 0 before it served on {rep.address}; "
                     "a parameter server must serve until the job ends.", rep.name)

    decision = decide_restart(state.settings.policy, rep.name, obs.exit_code, state.restarts,
                              detail=obs.message)
    return _restart_or_fail(state, rep, decision, obs.now)


def _restart_or_fail(state: RunState, rep: Replica, decision: RestartDecision,
                     now: float) -> tuple[RunState, list[Action]]:
    if decision.action == "fail":
        return _fail(state, now, decision.reason, decision.message, rep.name)
    delay = restart_delay(state.settings, rep.attempt - 1)
    rep = replace(rep, status="waiting_restart", restart_at=now + delay)
    state = replace(state.with_replica(rep), restarts=state.restarts + 1)
    text = f"{decision.message.rstrip('.')}; in {delay:g}s."
    return state, [Notify("warning", text, replica=rep.name)]


def _spawn_failed(state: RunState, obs: SpawnFailed) -> tuple[RunState, list[Action]]:
    rep = state.replica(obs.name)
    if rep.attempt != obs.attempt:
        return state, []
    state = state.with_replica(replace(rep, status="stopped"))
    return _fail(state, obs.now, REASON_SPAWN_FAILED,
                 f"cannot start {rep.name}: {obs.message}", rep.name)


def _chief_succeeded(state: RunState, now: float) -> tuple[RunState, list[Action]]:
    state = replace(state, phase="Succeeded", reason=REASON_SUCCEEDED,
                    message="the chief finished training and exited 0.")
    state = _drop_pending(state)
    if not state.live():
        return _finish_if_idle(replace(state, stage="stopping"))
    servers = tuple(r.name for r in state.replicas if r.is_live and r.stop_on_success)
    waited = [r.name for r in state.replicas if r.is_live and not r.stop_on_success]
    stop: list[Action] = []
    if servers:
        stop = [Notify("info", f"chief finished; stopping {', '.join(servers)}, which "
                               "serve until stopped"), Terminate(servers)]
    if not waited:
        kill_at = now + state.settings.kill_grace
        return replace(state, stage="stopping", drain_until=None, kill_at=kill_at), stop
    grace = state.settings.success_grace
    state = replace(state, stage="draining", drain_until=now + grace)
    return state, [*stop, Notify("info", f"chief finished; waiting up to {grace:g}s for "
                                         f"{', '.join(waited)} to exit")]


def _drop_pending(state: RunState) -> RunState:
    """Replicas not started or waiting to be restarted will never be started now."""
    for rep in state.replicas:
        if rep.status in ("pending", "waiting_restart"):
            state = state.with_replica(replace(rep, status="stopped", restart_at=None))
    return state


def _fail(state: RunState, now: float, reason: str, message: str,
          culprit: str | None) -> tuple[RunState, list[Action]]:
    state = replace(state, phase="Failed", reason=reason, message=message, culprit=culprit)
    notice = Notify("error", message, replica=culprit)
    state, actions = _stop_all(state, now)
    return state, [notice, *actions]


def _stop_all(state: RunState, now: float) -> tuple[RunState, list[Action]]:
    state = replace(_drop_pending(state), stage="stopping", drain_until=None)
    live = tuple(state.live())
    if not live:
        return _finish_if_idle(state)
    state = replace(state, kill_at=now + state.settings.kill_grace)
    return state, [Terminate(live)]


def _finish_if_idle(state: RunState) -> tuple[RunState, list[Action]]:
    if state.live():
        return state, []
    state = replace(state, stage="done", kill_at=None, drain_until=None)
    return state, [Finish(state.phase, state.reason, state.message, state.culprit,
                          state.interrupted)]


def _tick(state: RunState, now: float) -> tuple[RunState, list[Action]]:
    """Time passed: the timers of the current stage fire (deadline, health timeout, PS
    exits, stall watchdog and due restarts; the drain; SIGKILL after the kill grace)."""
    if state.stage in ("starting_ps", "running"):
        return _tick_active(state, now)
    if state.stage == "draining":
        return _tick_draining(state, now)
    if state.stage == "stopping":
        return _tick_stopping(state, now)
    return state, []


def _tick_active(state: RunState, now: float) -> tuple[RunState, list[Action]]:
    """Before the job is decided: each check may end it; due restarts start last."""
    deadline = state.settings.deadline_seconds
    if deadline is not None and now - state.started_at >= deadline:
        return _deadline_reached(state, now, deadline)
    actions: list[Action] = []
    if state.stage == "starting_ps":
        late = _not_serving_in_time(state, now)
        if late is not None:
            return late
    else:
        state, actions = _ps_exits(state, now)
        if state.stage != "running":
            return state, actions
        state, watched = _watch_stall(state, now)
        actions = [*actions, *watched]
        if state.stage != "running":
            return state, actions
    due = [r.name for r in state.replicas
           if r.status == "waiting_restart" and r.restart_at is not None
           and r.restart_at <= now]
    state, started = _start(state, due, now)
    return state, [*actions, *started]


def _deadline_reached(state: RunState, now: float,
                      deadline: float) -> tuple[RunState, list[Action]]:
    """Ask the chief for a checkpoint first (once, while training runs); fail once it
    is answered (`_checkpoint_answer`) or `checkpoint_wait` has passed."""
    s = state.settings
    if (state.stage == "running" and state.checkpoint_asked_at is None
            and s.checkpoint_wait > 0):
        state = replace(state, checkpoint_asked_at=now, checkpoint_wanted=state.step)
        return state, [Notify("info", f"the deadline of {deadline:g}s is reached; "
                                      "asking the chief for a checkpoint first (up "
                                      f"to {s.checkpoint_wait:g}s)"), AskCheckpoint()]
    asked = state.checkpoint_asked_at
    if asked is not None and now - asked < s.checkpoint_wait:
        return state, []
    return _fail(state, now, REASON_DEADLINE,
                 f"the job ran longer than its deadline of {deadline:g}s.", None)


def _not_serving_in_time(state: RunState, now: float,
                         ) -> tuple[RunState, list[Action]] | None:
    """The job fails when a parameter server is not ready within `health_timeout`."""
    timeout = state.settings.health_timeout
    for rep in state.ps:
        if (rep.is_live and not rep.healthy and rep.started_at is not None
                and now - rep.started_at >= timeout):
            return _fail(state, now, REASON_HEALTH_TIMEOUT,
                         f"{rep.name} did not {describe_check(rep.check)} on "
                         f"{rep.address} within {timeout:g}s.", rep.name)
    return None


def _ps_exits(state: RunState, now: float) -> tuple[RunState, list[Action]]:
    """Parameter servers that exited 0 `ps_exit_grace` ago, with no chief success
    after: failures, restarted or failing the job under the restart policy."""
    s = state.settings
    actions: list[Action] = []
    for rep in state.ps:
        if (rep.status == "exited" and rep.exit_code == 0 and rep.exited_at is not None
                and now - rep.exited_at >= s.ps_exit_grace):
            decision = decide_ps_exit(s.policy, rep.name, state.restarts)
            state, more = _restart_or_fail(state, rep, decision, now)
            actions += more
            if state.stage != "running":
                break
    return state, actions


def _tick_draining(state: RunState, now: float) -> tuple[RunState, list[Action]]:
    """The chief succeeded; replicas still running after `success_grace` are stopped."""
    if state.drain_until is None or now < state.drain_until:
        return state, []
    s = state.settings
    live = state.live()
    state = replace(state, stage="stopping", drain_until=None, kill_at=now + s.kill_grace)
    return state, [
        Notify("warning", f"{', '.join(live)} did not exit within "
                          f"{s.success_grace:g}s after the chief finished; stopping "
                          f"{'it' if len(live) == 1 else 'them'}."),
        Terminate(tuple(live)),
    ]


def _tick_stopping(state: RunState, now: float) -> tuple[RunState, list[Action]]:
    """SIGKILL, once, what ignored SIGTERM for `kill_grace`."""
    if state.killed or state.kill_at is None or now < state.kill_at:
        return state, []
    live = state.live()
    state = replace(state, killed=True)
    if not live:
        return state, []
    return state, [
        Notify("warning", f"{', '.join(live)} ignored SIGTERM for "
                          f"{state.settings.kill_grace:g}s; sending SIGKILL."),
        Kill(tuple(live)),
    ]


def _checkpoint_answer(state: RunState, obs: Checkpointed | CheckpointUnanswered,
                       ) -> tuple[RunState, list[Action]]:
    """The deadline's checkpoint is written (or cannot be had): the job fails now."""
    if state.checkpoint_asked_at is None or state.stage not in ("starting_ps", "running"):
        return state, []
    if isinstance(obs, Checkpointed) and obs.step < state.checkpoint_wanted:
        return state, []
    deadline = state.settings.deadline_seconds or 0.0
    kept = (f" A checkpoint at step {obs.step} was written first."
            if isinstance(obs, Checkpointed) else "")
    return _fail(state, obs.now, REASON_DEADLINE,
                 f"the job ran longer than its deadline of {deadline:g}s.{kept}", None)


def _watch_stall(state: RunState, now: float) -> tuple[RunState, list[Action]]:
    """The stall watchdog: restart the workers and the chief, or fail with Stalled; and
    SIGKILL a replica that ignored the watchdog's SIGTERM for `kill_grace`."""
    s = state.settings
    stubborn = tuple(r.name for r in state.replicas
                     if (r.stall_restart or r.retiring) and r.is_live
                     and r.kill_at is not None and now >= r.kill_at)
    if stubborn:
        for name in stubborn:
            state = state.with_replica(replace(state.replica(name), kill_at=None))
        return state, [Kill(stubborn)]
    if any(r.stall_restart for r in state.replicas):
        return state, []  # a watchdog restart is under way
    idle = stalled_for(s.policy, state.advanced_at, now)
    if idle is None:
        return state, []
    decision = decide_stall(s.policy, state.step, idle, state.restarts)
    if decision.action == "fail":
        return _fail(state, now, decision.reason, decision.message, None)
    victims = tuple(r.name for r in state.replicas if not r.is_ps and r.is_live)
    for name in victims:
        state = state.with_replica(replace(state.replica(name), stall_restart=True,
                                           kill_at=now + s.kill_grace))
    state = replace(state, restarts=state.restarts + 1, advanced_at=now)
    return state, [Notify("warning", decision.message), *([Terminate(victims)] if victims else [])]


def _interrupt(state: RunState, obs: Interrupt) -> tuple[RunState, list[Action]]:
    if state.interrupted or state.stage == "stopping":
        # A second Ctrl-C (or one while already stopping): do not wait any longer.
        live = state.live()
        state = replace(state, interrupted=True, killed=True)
        return state, ([Kill(tuple(live))] if live else [])
    name = signal_name(obs.signum)
    if state.phase == "Succeeded":
        # The chief already finished: the job stays Succeeded, only the wait is cut short.
        state = replace(state, interrupted=True)
    else:
        state = replace(state, interrupted=True, phase="Failed", reason=REASON_INTERRUPTED,
                        message=f"interrupted by {name}; stopped every replica.",
                        culprit=None)
    notice = Notify("warning", f"{name} received; stopping every replica.")
    state, actions = _stop_all(state, obs.now)
    return state, [notice, *actions]


# --------------------------------------------------------------------------- scaling


def _scale(state: RunState, obs: ScaleRequest) -> tuple[RunState, list[Action]]:
    """`pstrain scale`: the same rules as `kubectl scale` on a cluster."""
    s = state.settings
    if state.stage not in ("starting_ps", "running"):
        return state, [Reply(obs.ticket, False, f"job {state.job_name} is finishing "
                                                f"({state.phase}); it cannot be scaled now")]
    problem = scale_problem(obs.replicas, s.min_workers, s.max_workers)
    if problem is not None:
        return state, [Reply(obs.ticket, False, problem)]
    workers = {r.index: r for r in state.replicas if r.role == c.ROLE_WORKER
               and r.status in ("pending", "running", "waiting_restart") and not r.retiring}
    before = len(workers)
    plan = plan_scale(workers, obs.replicas)
    if plan.is_noop:
        return state, [Reply(obs.ticket, True, f"job {state.job_name} already has "
                                               f"{before} workers")]
    for index in plan.add:
        state = _admit(state, index, obs.addresses.get(index), template=workers[0])
    stopping: list[str] = []
    for index in plan.remove:
        rep = workers[index]
        if rep.is_live:
            rep = replace(rep, retiring=True, kill_at=obs.now + s.kill_grace)
            stopping.append(rep.name)
        else:
            rep = replace(rep, status="stopped", restart_at=None)
        state = state.with_replica(rep)
    members = trainer_set(obs.replicas, any(r.role == c.ROLE_CHIEF for r in state.replicas))
    state = replace(state, members=members)
    actions: list[Action] = [Respec(obs.replicas)]
    if state.stage == "running":  # else the workers start with the others, once PS serve
        state, started = _start(state, [replica_name(state.job_name, c.ROLE_WORKER, i)
                                        for i in plan.add], obs.now)
        actions += [*started, SetWorkers(members)]
    if stopping:
        actions.append(Terminate(tuple(stopping)))
    text = f"{plan.reason}: {plan.message(before, obs.replicas)}"
    warned: list[Action] = [Notify("warning", obs.warning)] if obs.warning else []
    return state, [Notify("info", text), *warned, *actions,
                   Reply(obs.ticket, True, text, obs.warning)]


def _admit(state: RunState, index: int, address: str | None,
           template: Replica) -> RunState:
    """Worker `index` pending, to be started: the one an earlier scale-down stopped
    (same address), or a new replica like `template` at `address` (which the runner
    found; it has one for every index the run never had), placed before the chief,
    which always starts last."""
    old = _named(state, index)
    if old is not None:
        return state.with_replica(replace(old, status="pending", retiring=False,
                                          restart_at=None, kill_at=None,
                                          rejoined=old.rejoined + 1))
    if address is None:
        raise ValueError(f"worker {index} has no address; the runner finds one")
    new = Replica(name=replica_name(state.job_name, c.ROLE_WORKER, index),
                  role=c.ROLE_WORKER, index=index, address=address, check=template.check,
                  stop_on_success=template.stop_on_success)
    at = next(i for i, r in enumerate(state.replicas) if r.is_chief)
    return replace(state, replicas=(*state.replicas[:at], new, *state.replicas[at:]))


def _named(state: RunState, index: int) -> Replica | None:
    """Worker `index` as the run has known it (a worker an earlier scale-down stopped)."""
    name = replica_name(state.job_name, c.ROLE_WORKER, index)
    return next((r for r in state.replicas if r.name == name), None)
