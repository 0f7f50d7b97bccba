"""`run_job`: one local run, start to summary, and the executor of its actions.

`_run` reads like a reconcile, one named step each:

    wire      the process table, environments, reporter, executor, control channel
    announce  what startup.py has to say (nothing runs before the entry point passed)
    supervise observe (queue: lines, health, exits, signals, ticks)
              -> decide (supervisor.decide, pure) -> apply (spawn, signal, print)
              until Finish
    close     stop listening and sending, kill what is left
    conclude  the summary, printed once (render.format_result), and the exit code

A temporary checkpoint directory (no --checkpoint-dir, none in the job) is removed at the
end, all but the chief's TensorBoard event files in its `tensorboard/` (the summary says
how to open them). So is the temporary folder for the rows of sparse tables beyond the
servers' memory budget (spec.training.sparseStorage without a directory).

The loop runs on the calling thread, which also spawns every replica: on Linux the
replicas' PR_SET_PDEATHSIG is tied to the thread that forked them.
"""

from __future__ import annotations

import os
import queue
import shlex
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from pstrain_api import constants as c
from pstrain_api import security
from pstrain_api.cluster import (Address, ClusterSpec, build_cluster_spec,
                                 environment_problem, local_cluster_spec, task_count)
from pstrain_api.constants import ENV_TERMINATION_LOG
from pstrain_api.events import parse_event
from pstrain_api.membership import plan_scale, scale_problem
from pstrain_api.model import TrainingJob
from pstrain_api.names import replica_name
from pstrain_api.readiness import runs_pstrain_runtime, user_command

from ..checkpoint_dir import check_directory
from ..failure import ConfigurationError
from ..status_client import request_checkpoint, set_workers
from ..transport.auth import Credentials
from ..worker.chief.tensorboard import has_event_files, remove_checkpoints, tensorboard_dir
from .capacity import available_memory, capacity_warning, cores_warning, usable_cores
from .control import Answer, ControlServer, Inbox
from .devices import ENV_VISIBLE, DeviceRequest, assign_gpus, visible_gpus
from .keys import LocalKeys
from .keys import remove_stale as remove_stale_keys
from .metrics import Metrics, build_summary, fold
from .processes import (DEFAULT_REPLICA_COMMAND, Line, ProcessTable, find_free_ports,
                        replica_environment)
from .render import PlainReporter, Reporter, RichReporter, format_result
from .startup import entrypoint_problem, startup_notices
from .supervisor import (Action, AskCheckpoint, Begin, CheckpointUnanswered, Checkpointed,
                         Finish, Interrupt, Kill, Notify, Progressed, Replica, Reply, Respec,
                         RunState, ScaleRequest, SetWorkers, Settings, SpawnFailed, Start,
                         Terminate, Tick, decide, effective_deadline, initial_state,
                         signal_name)

TICK_SECONDS = 0.1
ASK_TIMEOUT_S = 2.0  # RequestCheckpoint on PS 0 at the deadline
# Replica events that carry the global step (the stall watchdog's input).
STEP_EVENTS = frozenset({"progress", "eval", "checkpoint", "restored", "done"})
FAILURE_CONTEXT_LINES = 12
RESEND_WORKERS_S = 5.0  # the worker set is sent again this often once a job was scaled


@dataclass(frozen=True)
class RunOptions:
    """How to run, besides the job itself. Defaults are what `pstrain run` uses."""

    json: bool = False
    quiet: bool = False
    timeout: float | None = None
    checkpoint_dir: str | None = None
    replica_command: Sequence[str] = DEFAULT_REPLICA_COMMAND
    health_timeout: float = 60.0
    success_grace: float = 20.0
    kill_grace: float = 5.0
    backoff_base: float = 0.5
    handle_signals: bool = True
    keep_temp_checkpoints: bool = False
    manifest: str | None = None  # the file the job came from: the resume command names it


@dataclass
class RunResult:
    summary: dict[str, Any]
    exit_code: int
    pids: dict[str, list[int]] = field(default_factory=dict)


def with_checkpoint_dir(job: TrainingJob, directory: str) -> TrainingJob:
    """`job` with spec.training.checkpoint.directory set to `directory` (validated)."""
    data = job.to_api()
    data["spec"].setdefault("training", {}).setdefault("checkpoint", {})["directory"] = (
        directory)
    return TrainingJob.model_validate(data)


def with_rows_directory(job: TrainingJob) -> tuple[TrainingJob, str | None]:
    """A job with a sparse memory budget (spec.training.sparseStorage) and no directory
    for the rows beyond it gets a temporary one (returned: the run removes it at the
    end; each server keeps its rows in a folder of its own there); a directory it names
    must exist and be writable (ConfigurationError, one line naming the field)."""
    storage = job.spec.training.sparse_storage
    if storage.server_memory is None:
        return job, None
    if storage.directory:
        where = f"spec.training.sparseStorage.directory {storage.directory!r}"
        if not Path(storage.directory).is_dir():
            raise ConfigurationError(f"{where} does not exist or is not a directory; "
                                     "create it, or leave it unset for a temporary one")
        if not os.access(storage.directory, os.W_OK | os.X_OK):
            raise ConfigurationError(f"{where} is not writable")
        return job, None
    temp = tempfile.mkdtemp(prefix=f"pstrain-{job.name}-rows-")
    data = job.to_api()
    data["spec"]["training"]["sparseStorage"]["directory"] = temp
    return TrainingJob.model_validate(data), temp


def with_workers(job: TrainingJob, workers: int) -> TrainingJob:
    """`job` with spec.replicas.worker.replicas set to `workers` (a scale)."""
    data = job.to_api()
    data["spec"]["replicas"]["worker"]["replicas"] = workers
    return TrainingJob.model_validate(data)


def gpus_requested(job: TrainingJob, role: str) -> int:
    return job.replica_spec(role).gpu_count


def own_commands(job: TrainingJob, spec: ClusterSpec) -> dict[str, list[str]]:
    """Replica name -> command for the replicas whose role's template sets a command of
    its own (with its args), as the pod would run it; the others run the runner's
    replica command (`pstrain replica`)."""
    out: dict[str, list[str]] = {}
    for task in spec.tasks():
        command = user_command(job.replica_spec(task.role))
        if command:
            out[spec.replica_name(task)] = command
    return out


def exit_code_of(finish: Finish, signum: int | None) -> int:
    """0 Succeeded; 128+N when interrupted by signal N (130 for Ctrl-C); 1 otherwise."""
    if finish.interrupted:
        return 128 + (signum or signal.SIGINT)
    return 0 if finish.phase == "Succeeded" else 1


@contextmanager
def _signals_to(post: Callable[[object], None], clock: Callable[[], float],
                enabled: bool) -> Iterator[list[int]]:
    """SIGINT and SIGTERM become Interrupt observations while the run lasts."""
    received: list[int] = []
    if not enabled or threading.current_thread() is not threading.main_thread():
        yield received
        return

    def handler(signum: int, _frame: object) -> None:
        received.append(signum)
        post(Interrupt(clock(), signum))

    previous = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield received
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def _make_reporter(options: RunOptions, stream: TextIO, names: Sequence[str],
                   job: TrainingJob) -> Reporter:
    if not options.quiet and stream.isatty():
        total = job.spec.training.steps if counts_steps(job, Metrics(0)) else None
        return RichReporter(stream, names, total, job.name)
    return PlainReporter(stream, names, quiet=options.quiet)


def run_job(job: TrainingJob, options: RunOptions = RunOptions(),
            stdout: TextIO | None = None, stderr: TextIO | None = None) -> RunResult:
    """Run `job` as local processes until it succeeds, fails or is interrupted.

    Raises ConfigurationError, before anything starts, when the entry point or the
    checkpoint directory cannot be used."""
    problem = entrypoint_problem(job, options.replica_command)
    if problem is not None:
        raise ConfigurationError(problem + ".")
    temp_dir: str | None = None
    if options.checkpoint_dir:
        check_directory(options.checkpoint_dir, "--checkpoint-dir")
        job = with_checkpoint_dir(job, str(Path(options.checkpoint_dir).resolve()))
    elif job.spec.training.checkpoint.directory:
        check_directory(job.spec.training.checkpoint.directory,
                        "spec.training.checkpoint.directory")
    else:
        # A restarted parameter server can only come back from a checkpoint.
        temp_dir = tempfile.mkdtemp(prefix=f"pstrain-{job.name}-ckpt-")
        job = with_checkpoint_dir(job, temp_dir)
    # A fresh job token per run; each replica gets a private directory with only its
    # own keys (`keys`), given the path, never the key. Runs killed with SIGKILL left
    # theirs behind: remove those first.
    remove_stale_keys()
    job, rows_dir = with_rows_directory(job)
    keys = LocalKeys(job.name) if job.spec.security.authentication else None
    result: RunResult | None = None
    try:
        result = _run(job, options,
                      (stderr or sys.stderr) if options.json else (stdout or sys.stdout),
                      temp_dir, keys)
        return result
    finally:
        # Kept: asked to, or a job that stopped early can resume from it.
        kept = options.keep_temp_checkpoints or (
            result is not None and result.summary["checkpoint_dir"] is not None)
        if temp_dir and not kept:  # the chief's TensorBoard files stay
            remove_checkpoints(temp_dir)
        if keys is not None:
            keys.remove()
        if rows_dir is not None:  # the servers' disk rows die with the run
            shutil.rmtree(rows_dir, ignore_errors=True)


@dataclass(frozen=True)
class _Environments:
    """How every replica's environment is built: the runner's own, the cluster spec's,
    a thread budget, its GPUs, where it leaves its last words, and its keys."""

    threads: int
    last_words: Path
    keys: LocalKeys | None

    def build(self, spec: ClusterSpec, gpus: Mapping[str, str]) -> dict[str, dict[str, str]]:
        out = {}
        for task in spec.tasks():
            name = spec.replica_name(task)
            env = replica_environment(os.environ, spec.env(task), self.threads)
            if name in gpus:
                env[ENV_VISIBLE] = gpus[name]
            env[ENV_TERMINATION_LOG] = str(self.last_words / name)
            env.pop(security.ENV_AUTH_DIR, None)  # never the runner's own
            if self.keys is not None:
                holder = security.key_holder(task.role, spec.is_chief(task))
                trainer = (spec.worker_tasks().index(task) if task.role != c.ROLE_PS
                           else 0)
                env[security.ENV_AUTH_DIR] = str(self.keys.directory(name, holder, trainer))
            out[name] = env
        return out


def _gpus(job: TrainingJob, spec: ClusterSpec) -> dict[str, str]:
    return assign_gpus([DeviceRequest(spec.replica_name(t), t.role, gpus_requested(job, t.role))
                        for t in spec.tasks()], visible_gpus())


class _WorkerSetSender:
    """Sends the worker set to every parameter server (SetWorkers, with the chief's key)
    from a thread: at once when it changes, then every RESEND_WORKERS_S, so a server
    the chief re-initialised with an older set gets it back. Failures are retried
    quietly: a server that is down gets the set when it is back."""

    def __init__(self, addresses: Sequence[str], namespace: str,
                 credentials: Credentials | None) -> None:
        self.addresses = list(addresses)
        self.namespace = namespace
        self.credentials = credentials
        self._workers: tuple[int, ...] | None = None
        self._changed = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="set-workers", daemon=True)

    def send(self, workers: tuple[int, ...]) -> None:
        self._workers = workers
        self._changed.set()
        if not self._thread.is_alive():
            self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._changed.set()
        if self._thread.is_alive():
            self._thread.join(ASK_TIMEOUT_S * max(len(self.addresses), 1) + 1)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._changed.clear()
            workers = self._workers
            if workers is not None:
                for address in self.addresses:
                    if self._stop.is_set():
                        return
                    set_workers(address, ASK_TIMEOUT_S, self.namespace, list(workers),
                                credentials=self.credentials)
            self._changed.wait(RESEND_WORKERS_S)


class _Executor:
    """Carries out supervisor actions: spawns, signals, prints, scales."""

    def __init__(self, table: ProcessTable, reporter: Reporter, clock: Callable[[], float],
                 credentials: Credentials | None = None, *, job: TrainingJob | None = None,
                 environments: _Environments | None = None,
                 sender: _WorkerSetSender | None = None, control: Inbox | None = None):
        self.table = table
        self.credentials = credentials  # the worker key, for control calls to PS 0
        self.reporter = reporter
        self.clock = clock
        self.pids: dict[str, list[int]] = {}
        self.inbox: list[object] = []  # observations the executor itself makes
        self.job = job  # for a scale: the environments of the new cluster spec
        self.environments = environments
        self.sender = sender
        self.control = control

    def apply(self, action: Action, state: RunState) -> Finish | None:
        if isinstance(action, Start):
            self._start(action, state.replica(action.name))
        elif isinstance(action, Terminate):
            self.table.signal(action.names, signal.SIGTERM)
        elif isinstance(action, Kill):
            self.table.signal(action.names, signal.SIGKILL)
        elif isinstance(action, Notify):
            self.reporter.notice(action.level, action.text, self._context(action))
        elif isinstance(action, AskCheckpoint):
            ps0 = next(r.address for r in state.replicas if r.is_ps and r.index == 0)
            if request_checkpoint(ps0, ASK_TIMEOUT_S, credentials=self.credentials) is None:
                self.inbox.append(CheckpointUnanswered(self.clock()))
        elif isinstance(action, Respec):
            self._respec(action.workers, state)
        elif isinstance(action, SetWorkers):
            if self.sender is not None:
                self.sender.send(action.workers)
        elif isinstance(action, Reply):
            if self.control is not None:
                self.control.answer(action.ticket, Answer(action.ok, action.message,
                                                          action.warning))
        elif isinstance(action, Finish):
            return action
        return None

    def _context(self, action: Notify) -> list[str]:
        """An error's explanation: the replica's last output lines, less those the
        notice already quotes (a configuration error's one line)."""
        if action.level != "error" or not action.replica:
            return []
        context = [line for line in self.table.tail(action.replica, FAILURE_CONTEXT_LINES)
                   if not (line.strip() and action.text.endswith(line.strip()))]
        return [f"last output of {action.replica}:", *context] if context else []

    def _respec(self, workers: int, state: RunState) -> None:
        """The environments (and own commands) of every replica for `workers` workers:
        newcomers start with them, and a replica restarted later too."""
        if self.job is None or self.environments is None:
            raise RuntimeError("a scale needs the job and its environments")
        job = with_workers(self.job, workers)
        known = {r.name: r.address for r in state.replicas}

        def address_of(task: Any) -> Address:
            host, _, port = known[replica_name(job.name, task.role, task.index)].rpartition(":")
            return Address(host, int(port))

        spec = build_cluster_spec(job, address_of)
        old = {n: e[ENV_VISIBLE] for n, e in self.table.environments.items()
               if ENV_VISIBLE in e}
        self.table.environments.update(self.environments.build(spec, {**_gpus(job, spec),
                                                                      **old}))
        self.table.commands.update(own_commands(job, spec))

    def scale_request(self, replicas: int, ticket: int, state: RunState,
                      settings: Settings) -> ScaleRequest | Reply:
        """A ScaleRequest with a free address for each worker index never had, or the
        refusal when this machine cannot hold the processes it would start."""
        if scale_problem(replicas, settings.min_workers, settings.max_workers) is not None:
            return ScaleRequest(replicas, self.clock(), ticket)  # the supervisor refuses
        if self.job is not None:
            too_big = environment_problem(with_workers(self.job, replicas))
            if too_big is not None:
                return Reply(ticket, False, too_big[1])
        names = {r.name for r in state.replicas}
        new = [i for i in range(replicas)
               if replica_name(state.job_name, c.ROLE_WORKER, i) not in names]
        running = (r.index for r in state.replicas if r.role == c.ROLE_WORKER and r.is_live)
        starts = plan_scale(running, replicas).add  # the processes this scale would start
        too_many = capacity_warning(len(starts), available_memory())
        if too_many:
            return Reply(ticket, False, f"refused: {too_many}")
        ports = find_free_ports(len(new)) if new else []
        return ScaleRequest(replicas, self.clock(), ticket,
                            {i: f"{c.LOCAL_HOST}:{port}" for i, port in zip(new, ports)},
                            cores_warning(replicas, usable_cores()) or "")

    def _start(self, action: Start, replica: Replica) -> None:
        try:
            proc = self.table.start(action.name, action.attempt)
        except OSError as exc:
            program = self.table.command_of(action.name)[0]
            self.inbox.append(SpawnFailed(action.name, action.attempt,
                                          f"{program}: {exc.strerror or exc}",
                                          self.clock()))
            return
        self.pids.setdefault(action.name, []).append(proc.pid)
        # A start after a scale-down stopped it (a rejoin) is not a restart: no attempt.
        again = (f", attempt {action.attempt - replica.rejoined}"
                 if action.attempt - replica.rejoined > 1 else "")
        self.reporter.notice("info", f"started {action.name} (pid {proc.pid}{again})")
        if replica.is_ps and replica.check != c.GATE_NONE:
            proc.probe_health(replica.address, check=replica.check)

    def line(self, item: Line, metrics: Metrics) -> Metrics:
        event = parse_event(item.text)
        if event is None:
            self.reporter.replica_line(item.name, item.text)
            return metrics
        metrics = fold(metrics, item.name, event)
        self.reporter.event(item.name, event, metrics)
        step = event.get("step")
        if event.get("event") in STEP_EVENTS and isinstance(step, int):
            self.inbox.append(Progressed(step, self.clock()))  # the stall watchdog's input
        if event.get("event") == "checkpoint" and isinstance(step, int):
            self.inbox.append(Checkpointed(step, self.clock()))
        return metrics


@dataclass
class _Parts:
    """What one run is wired from, built before its first process starts."""

    spec: ClusterSpec
    settings: Settings
    gpus: dict[str, str]
    table: ProcessTable
    reporter: Reporter
    executor: _Executor
    server: ControlServer
    sender: _WorkerSetSender | None


@dataclass(frozen=True)
class _Ending:
    """How the loop ended: the last state, the metrics, the Finish, the signal."""

    state: RunState
    metrics: Metrics
    finish: Finish
    signum: int | None
    wall_seconds: float


def _run(job: TrainingJob, options: RunOptions, log_stream: TextIO,
         temp_dir: str | None, keys: LocalKeys | None) -> RunResult:
    """Wire, announce, supervise until a Finish, close, conclude."""
    clock = time.monotonic
    spec = local_cluster_spec(job, find_free_ports(task_count(job)))
    # Each replica leaves its last error line here; the supervisor quotes it.
    with tempfile.TemporaryDirectory(prefix=f"pstrain-{job.name}-exit-") as last_words:
        parts = _wire(job, spec, options, log_stream, Path(last_words), keys, clock)
        _announce(job, parts, temp_dir)
        started = clock()
        with _signals_to(parts.table.post, clock, options.handle_signals) as received:
            try:
                state, metrics, finish = _supervise(parts, job, started, clock)
            finally:
                _close(parts)
    ending = _Ending(state, metrics, finish, received[-1] if received else None,
                     clock() - started)
    return _conclude(job, options, parts, ending, temp_dir, log_stream)


def _wire(job: TrainingJob, spec: ClusterSpec, options: RunOptions, log_stream: TextIO,
          last_words: Path, keys: LocalKeys | None, clock: Callable[[], float]) -> _Parts:
    """The process table with every replica's environment and command, the reporter,
    the executor and the control channel; nothing runs yet."""
    tasks = spec.tasks()
    builder = _Environments(threads=max(1, (os.cpu_count() or 1) // max(len(tasks), 1)),
                            last_words=last_words, keys=keys)
    gpus = _gpus(job, spec)
    table = ProcessTable(options.replica_command, builder.build(spec, gpus), clock,
                         commands=own_commands(job, spec))
    reporter = _make_reporter(options, log_stream, [spec.replica_name(t) for t in tasks],
                              job)
    worker_key, chief_key = (keys.worker, keys.chief) if keys is not None else (None, None)
    control = Inbox(table.post)
    # The worker set goes to parameter servers that run the pstrain runtime (a program
    # of its own, such as TensorFlow's, learns its workers from TF_CONFIG alone).
    sender = (_WorkerSetSender([str(spec.addresses[t]) for t in tasks
                                if t.role == c.ROLE_PS],
                               f"{job.namespace or 'default'}/{job.name}", chief_key)
              if runs_pstrain_runtime(job.spec.replicas.ps) else None)
    executor = _Executor(table, reporter, clock, worker_key, job=job, environments=builder,
                         sender=sender, control=control)
    server = ControlServer(job.name, lambda n: control.ask(
        lambda ticket: ScaleRequest(n, clock(), ticket)))
    return _Parts(spec, _settings(job, options), gpus, table, reporter, executor, server,
                  sender)


def _settings(job: TrainingJob, options: RunOptions) -> Settings:
    run_policy = job.spec.run_policy
    return Settings(
        policy=run_policy,
        deadline_seconds=effective_deadline(run_policy.active_deadline_seconds,
                                            options.timeout),
        health_timeout=options.health_timeout,
        success_grace=options.success_grace,
        kill_grace=options.kill_grace,
        backoff_base=options.backoff_base,
        min_workers=job.spec.replicas.worker.min_replicas,
        max_workers=job.spec.replicas.worker.max_replicas,
    )


def _announce(job: TrainingJob, parts: _Parts, temp_dir: str | None) -> None:
    """Open the control channel, then say what the run is about to do."""
    notices = startup_notices(
        job, parts.spec, parts.gpus, temp_dir,
        memory_warning=capacity_warning(len(parts.spec.tasks()), available_memory()),
        cores_warning=cores_warning(job.spec.replicas.worker.replicas, usable_cores()),
        control_problem=parts.server.start())
    for level, text in notices:
        parts.reporter.notice(level, text)


def _supervise(parts: _Parts, job: TrainingJob, started: float,
               clock: Callable[[], float]) -> tuple[RunState, Metrics, Finish]:
    """observe -> decide -> apply, until the supervisor says Finish."""
    state = initial_state(parts.spec, parts.settings, job)
    metrics = Metrics(total_steps=job.spec.training.steps)
    executor = parts.executor
    executor.inbox.append(Begin(started))
    last_tick = started
    finish: Finish | None = None
    while finish is None:
        item, last_tick = _observe(executor, parts.table, clock, last_tick)
        if isinstance(item, Line):
            metrics = executor.line(item, metrics)
            continue
        if isinstance(item, ScaleRequest):  # from the control thread: the runner
            # finds the addresses (I/O) before the supervisor decides
            item = executor.scale_request(item.replicas, item.ticket, state,
                                          parts.settings)
            if isinstance(item, Reply):
                executor.apply(item, state)
                continue
        state, actions = decide(state, item)  # type: ignore[arg-type]
        for action in actions:
            finish = executor.apply(action, state) or finish
    return state, metrics, finish


def _observe(executor: _Executor, table: ProcessTable, clock: Callable[[], float],
             last_tick: float) -> tuple[object, float]:
    """The next observation and the time of the latest tick: the executor's own
    observations first, then the queue; a tick at least every TICK_SECONDS even while
    output streams in."""
    if not executor.inbox and clock() - last_tick >= TICK_SECONDS:
        executor.inbox.append(Tick(clock()))
    if executor.inbox:
        item = executor.inbox.pop(0)
    else:
        try:
            item = table.observations.get(timeout=TICK_SECONDS)
        except queue.Empty:
            item = Tick(clock())
    return item, item.now if isinstance(item, Tick) else last_tick


def _close(parts: _Parts) -> None:
    """Stop listening, stop sending, kill whatever is left, stop drawing."""
    parts.server.close()
    if parts.sender is not None:
        parts.sender.close()
    parts.table.kill_all()
    parts.reporter.close()


def _conclude(job: TrainingJob, options: RunOptions, parts: _Parts, ending: _Ending,
              temp_dir: str | None, log_stream: TextIO) -> RunResult:
    """The summary (what happened, where the checkpoints are, how to resume), printed
    for humans, and the exit code."""
    state, metrics, finish = ending.state, ending.metrics, ending.finish
    directory = job.spec.training.checkpoint.directory
    resumable = finish.phase != "Succeeded" and metrics.checkpoint_step is not None
    removed = bool(temp_dir) and not options.keep_temp_checkpoints and not resumable
    events_dir = tensorboard_dir(directory) if directory else None
    summary = build_summary(
        state, metrics, ending.wall_seconds, job.name, directory,
        checkpoint_removed=removed,
        tensorboard_dir=(str(events_dir) if events_dir is not None
                         and has_event_files(events_dir) else None),
        resume=_resume(job, options, temp_dir) if resumable else None,
        stopped_by=(signal_name(ending.signum or signal.SIGINT)
                    if finish.interrupted and finish.phase != "Succeeded" else None),
        counts_steps=counts_steps(job, metrics))
    for line in format_result(summary):
        log_stream.write(line + "\n")
    log_stream.flush()
    return RunResult(summary=summary, exit_code=exit_code_of(finish, ending.signum),
                     pids=parts.executor.pids)


def _resume(job: TrainingJob, options: RunOptions, temp_dir: str | None) -> str:
    """The command that resumes this job: its manifest, and the checkpoint directory
    unless the manifest names it."""
    named_here = options.checkpoint_dir or temp_dir
    return resume_command(options.manifest,
                          job.spec.training.checkpoint.directory if named_here else None)


def resume_command(manifest: str | None, checkpoint_dir: str | None) -> str:
    words = ["pstrain", "run", manifest or "JOB.yaml"]
    if checkpoint_dir:
        words += ["--checkpoint-dir", checkpoint_dir]
    return shlex.join(words)


def counts_steps(job: TrainingJob, metrics: Metrics) -> bool:
    """pstrain knows the job's steps: its chief runs the pstrain runtime, or reported
    a step anyway (a program of its own that prints PSTRAIN_EVENT lines)."""
    chief = job.spec.replicas.chief or job.spec.replicas.worker
    return runs_pstrain_runtime(chief) or metrics.step > 0
