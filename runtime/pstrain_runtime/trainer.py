"""The worker loop, and the chief's extra duties.

Every worker: pull all shards (concurrently) into the model, run forward/backward on
its own batch (CUDA when present, CPU otherwise), push every shard's gradients
(concurrently; with `overlap`, a shard's push starts during backward as soon as its
gradients are complete). It stops when every server's step reaches `training.steps`
(they differ after a server restarted without a checkpoint), or when a server says
the job is done.

The chief (worker 0) also: initialises the servers (fresh, or from the latest
checkpoint), reads the global step (kept by parameter server 0, one increment per
applied update), writes checkpoints every `checkpoint.intervalSteps` and at the end,
evaluates every `evalIntervalSteps` and at the end, reports status to server 0 for the
operator, prints events, and finally marks the job done and shuts the servers down.

Failures:
- A server that is unreachable is retried with backoff for `connect_timeout` seconds.
- A server that comes back empty (restarted): workers wait for it to be initialised;
  the chief re-initialises it. With a checkpoint directory, the chief restores *every*
  server from the latest checkpoint (a consistent state) and reports how many global
  steps were lost. Without one, it installs its own latest pulled copy of the
  parameters on the restarted servers only, with fresh optimizer state for that shard;
  the global step continues from server 0 (or from the chief's last known step when
  server 0 itself restarted), and `lost_steps` is 0 because no step count is undone,
  although the optimizer state of that shard is lost.
- A restarted worker pulls the current state and continues; in sync mode it joins the
  step the servers are collecting (a duplicate contribution is ignored).
- Every Init gives a server a new generation, which pulls carry and pushes send back.
  A gradient computed on parameters from before a restore (or a re-initialisation) is
  refused (ABORTED), never applied: the worker pulls again and recomputes.

Data position: every worker counts the batches it draws (`position`). In async mode a
push's step is its batch's index, and server 0 keeps the last applied one per worker;
in sync mode every worker draws one batch per global step, so the step is the
position. Checkpoints save these positions and a restore installs them, so a worker
that starts (first start, restart, resume) opens its `batches` where it left off
(`task.open_batches`). Workers that keep running through a parameter server's
recovery keep their iterators: the batches of lost steps are not read again.

Checkpoint storage: the chief refuses an unusable checkpoint directory before it
trains (`checkpoint_dir.check_directory`, a configuration error). A checkpoint write
that fails mid-run is reported and training carries on (the next interval tries
again). When the final checkpoint cannot be written, the trained parameters go to a
fallback directory (fresh and private: `checkpoint_dir.private_directory`), which is
reported, and then the chief fails with a configuration
error, so the job fails at once with that line instead of restarting the chief.
"""

from __future__ import annotations

import concurrent.futures as cf
import math
import shutil
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from pstrain_api import events
from pstrain_api.model import Training
from pstrain_api.quote import one_line

from .checkpoint import Checkpoint, CheckpointError, CheckpointStore, model_fingerprint
from .checkpoint_dir import check_directory, fallback_bases, private_directory
from .client import ShardedClient, Transport, retry_unavailable
from .elastic import AppliedSamples, admitted, not_a_member
from .failure import ConfigurationError
from .optim import SLOT_NAMES, OptimizerConfig, OptimizerState
from .placement import build_placement, param_specs
from .proto import ps_pb2 as pb
from .sparse.session import SparseSession
from .store import PSError
from .task import Task, load_task, open_batches

EmitFn = Callable[..., None]
BUSY_BACKOFF_S = 0.2  # before retrying a call a busy server refused


class TrainingDiverged(RuntimeError):
    """A parameter server rejected a gradient with NaN/inf values."""


@dataclass(frozen=True)
class WorkerRole:
    namespace: str
    worker: int  # 0 is the chief
    num_workers: int

    @property
    def is_chief(self) -> bool:
        return self.worker == 0


@dataclass
class TrainResult:
    global_step: int = 0
    local_steps: int = 0
    loss: float | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    samples_per_sec: float = 0.0
    wall_seconds: float = 0.0
    lost_steps: int = 0
    samples: int = 0  # examples in this worker's batches (their real lengths)

    def samples_per_step(self, workers_per_step: int) -> float:
        """Examples behind one global step: this worker's mean real batch length (a
        batch may be shorter than batchSize, e.g. a small data set's only batch) times
        the workers whose gradients one step applies."""
        return self.samples / max(self.local_steps, 1) * workers_per_step


def _why(exc: BaseException) -> str:
    return one_line(f"{type(exc).__name__}: {exc}", 300)


def pick_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def wire_torch_dtype(name: str) -> torch.dtype:
    return {"float32": torch.float32, "bfloat16": torch.bfloat16,
            "float16": torch.float16}[name]


class Trainer:
    def __init__(self, training: Training, role: WorkerRole, transports: Sequence[Transport],
                 *, emit: EmitFn = events.emit, device: torch.device | None = None,
                 connect_timeout: float = 120.0, init_timeout: float = 600.0,
                 overlap: bool = False, pipeline: bool | None = None,
                 progress_interval: float = 1.0, shutdown_grace: float = 30.0,
                 task: Task | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.training = training
        self.role = role
        self.emit = emit
        self.device = device or pick_device()
        self.connect_timeout = connect_timeout
        self.init_timeout = init_timeout
        self.overlap = overlap
        self.progress_interval = progress_interval
        self.shutdown_grace = shutdown_grace
        self.clock = clock
        self.task = task or load_task(training.entrypoint, training.args)
        self.model = self.task.model.to(self.device)
        self.params = dict(self.model.named_parameters())
        # CPU tensors the transport reads and writes: the parameters themselves on CPU,
        # pinned mirrors on CUDA.
        on_cpu = self.device.type == "cpu"
        self.mirror: dict[str, torch.Tensor] = {}
        for name, p in self.params.items():
            if on_cpu and p.data.is_contiguous():
                self.mirror[name] = p.data
            else:
                self.mirror[name] = torch.empty(p.shape, dtype=p.dtype, pin_memory=not on_cpu)
                self.mirror[name].copy_(p.detach())  # the chief installs these values
        self.grad_mirror: dict[str, torch.Tensor] = {}
        self.optimizer = OptimizerConfig.from_model(training.optimizer)
        # Sparse tables (rows on the servers): pushed beside the dense gradients.
        self.sparse = SparseSession.attach(self.model, transports, role.namespace,
                                           self.optimizer, training.seed)
        self.fingerprint = model_fingerprint(self.mirror)
        if self.sparse is not None:
            self.fingerprint = self.sparse.fingerprint(self.fingerprint)
            self.overlap = False  # sparse rows must reach a sync step before its bucket
        num_ps = len(transports)
        self.placement = build_placement(
            param_specs({n: tuple(t.shape) for n, t in self.mirror.items()}), num_ps)
        self.client = ShardedClient(transports, self.placement, role.namespace,
                                    wire_dtype=wire_torch_dtype(training.wire_dtype))
        ckpt = training.checkpoint
        self.ckpt_store = (CheckpointStore(ckpt.directory, ckpt.keep)
                           if ckpt.directory else None)
        self.last_step = 0  # newest global step seen
        self.last_ckpt_step: int | None = None
        self.last_checkpoint: tuple[int, str, float] | None = None  # step, path, time written
        self.failed_ckpt: tuple[Checkpoint, BaseException] | None = None  # the last write
        self.position = 0  # batches drawn from this worker's data since the job began
        self.lost_steps = 0
        self._fresh = False  # the mirror holds parameters pulled by the last push
        # Pipelining (async only): step k's push_pull runs in the background while step
        # k+1 computes; it writes the parameters into `_recv`, swapped in by `_land`.
        want = training.pipeline if pipeline is None else pipeline
        self.pipeline = bool(want) and training.mode == "async" and not (
            overlap and num_ps > 1) and self.sparse is None
        self._inflight: cf.Future[list[pb.PushReply]] | None = None
        self._recv: dict[str, torch.Tensor] = {}
        self._send: list[dict[str, torch.Tensor]] = []
        self._send_slot = 0
        self._pipe: cf.ThreadPoolExecutor | None = None

    # ------------------------------------------------------------------ plumbing
    def _retry(self, fn: Callable[[], Any]) -> Any:
        return retry_unavailable(fn, self.connect_timeout)

    def _infos(self) -> list[pb.StepInfo]:
        def all_reachable() -> list[pb.StepInfo]:
            infos = self.client.info_all(self.role.worker)
            for item in infos:
                if isinstance(item, PSError):
                    raise item
            return infos  # type: ignore[return-value]

        return self._retry(all_reachable)  # type: ignore[no-any-return]

    def _copy_in(self) -> None:
        if self.device.type != "cpu":
            for name, p in self.params.items():
                p.data.copy_(self.mirror[name], non_blocking=True)
        else:
            for name, p in self.params.items():
                if p.data.data_ptr() != self.mirror[name].data_ptr():
                    p.data.copy_(self.mirror[name])

    def _zero_grads(self) -> None:
        """`model.zero_grad(set_to_none=False)` for leaf gradients in one multi-tensor
        op, without walking the module tree every step."""
        grads = [p.grad for p in self.params.values() if p.grad is not None]
        if grads:
            torch._foreach_zero_(grads)

    def _grad_cpu(self, name: str) -> torch.Tensor:
        p = self.params[name]
        grad = p.grad if p.grad is not None else torch.zeros_like(p)
        if self.device.type == "cpu" and grad.is_contiguous():
            return grad
        buf = self.grad_mirror.get(name)
        if buf is None:
            buf = self.grad_mirror[name] = torch.empty(
                p.shape, dtype=p.dtype, pin_memory=self.device.type != "cpu")
        buf.copy_(grad)
        return buf

    def _wait_initialised(self) -> None:
        """A worker waits for the chief to initialise every server and to be in the
        live worker set of each (elastic workers: SetWorkers admits a newcomer; a worker
        a scale-down removed waits here until it is stopped)."""
        deadline = self.clock() + self.init_timeout
        delay = 0.05
        waited = False  # for admission to the worker set
        while True:
            infos = self._infos()
            if all(i.initialized for i in infos) and (admitted(infos)
                                                      or any(i.done for i in infos)):
                self.last_step = max(self.last_step, infos[0].global_step)
                if waited:
                    print(f"pstrain: worker {self.role.worker} is in the worker set; "
                          f"training from step {self.last_step}", flush=True)
                return
            if all(i.initialized for i in infos) and not waited:
                waited = True
                print(f"pstrain: worker {self.role.worker} is not in the job's worker set; "
                      "waiting to be admitted (a scale-up) or stopped (a scale-down)",
                      flush=True)
            if self.clock() > deadline:
                uninitialised = [i for i, x in enumerate(infos) if not x.initialized]
                if not uninitialised:
                    raise TimeoutError(
                        f"worker {self.role.worker} was not in the job's worker set within "
                        f"{self.init_timeout:.0f} s; a worker started by a scale-up is "
                        "admitted by the operator or `pstrain run`, one removed by a "
                        "scale-down is stopped by them")
                raise TimeoutError(
                    f"parameter servers {uninitialised}"
                    f" were not initialised within {self.init_timeout:.0f} s; the chief "
                    "initialises them")
            time.sleep(delay)  # backoff between polls of a remote flag
            delay = min(delay * 2, 1.0)

    def _wait_done(self) -> None:
        """A non-chief worker past the last step: wait for the chief's Finish."""
        deadline = self.clock() + max(self.connect_timeout, 600.0)
        while self.clock() < deadline:
            info = self._retry(lambda: self.client.info(0, self.role.worker))
            if info.done:
                return
            time.sleep(0.1)  # poll of a remote flag
        raise TimeoutError("the chief did not finish the job in time after the last step")

    # ------------------------------------------------------------------ chief: state
    def _save_checkpoint(self, at_step: int = 0) -> Path | None:
        """Write a checkpoint of the servers' state: the copies they kept at `at_step`
        (a multiple of the interval) where they have them, else their state now. A write
        that fails is reported and training carries on (the next interval tries again):
        None."""
        if self.ckpt_store is None:
            return None
        ckpt = self._pull_checkpoint(at_step)
        try:
            if self.sparse is not None:  # each table's rows, streamed beside the file
                ckpt.sparse = self.sparse.save(self.ckpt_store.directory, ckpt.global_step)
            path = self.ckpt_store.save(ckpt)
        except (OSError, RuntimeError) as exc:  # torch.save wraps some write errors
            self.failed_ckpt = (ckpt, exc)
            print(f"pstrain: warning: the checkpoint of step {ckpt.global_step} could not be "
                  f"written to {self.ckpt_store.directory} ({_why(exc)}); training goes on "
                  "and the next checkpoint tries again", flush=True)
            return None
        self.failed_ckpt = None
        self.last_ckpt_step = ckpt.global_step
        self.last_checkpoint = (ckpt.global_step, str(path), ckpt.wall_time)
        self.emit("checkpoint", step=ckpt.global_step, path=str(path))
        self._report(checkpoint=(ckpt.global_step, str(path), ckpt.wall_time))
        return path

    def _save_fallback(self) -> None:
        """The final checkpoint could not be written: save the trained parameters to a
        fallback directory, then fail (a configuration error: retrying cannot help)."""
        assert self.failed_ckpt is not None  # set by the failed _save_checkpoint
        ckpt, error = self.failed_ckpt
        where = self.ckpt_store.directory if self.ckpt_store else None
        lost = (f"the final checkpoint (step {ckpt.global_step}) could not be written to "
                f"{where} ({_why(error)})")
        problems = []
        for base in fallback_bases():
            directory = None
            try:  # a fresh private directory: never one another user could have made
                directory = private_directory(base, self.role.namespace)
                check_directory(directory, "the fallback directory")
                path = CheckpointStore(directory).save(ckpt)
            except (ConfigurationError, OSError, RuntimeError) as exc:
                problems.append(_why(exc))
                if directory is not None:
                    shutil.rmtree(directory, ignore_errors=True)
                continue
            print(f"pstrain: the trained parameters of step {ckpt.global_step} were saved to "
                  f"{path}", flush=True)
            raise ConfigurationError(
                f"{lost}; the trained parameters were saved to {path} instead (point "
                "checkpoint.directory at its directory to continue from them)")
        raise ConfigurationError(f"{lost}, nor to any fallback directory: "
                                 + "; ".join(problems))

    def _pull_checkpoint(self, at_step: int = 0) -> Checkpoint:
        state = self._retry(lambda: self.client.pull_state(at_step))
        params = self.client.assemble(state.params, self.mirror)
        slots: dict[str, dict[str, torch.Tensor]] = {}
        slot_steps: dict[str, int] = {}
        for name in self.mirror:
            pieces = self.placement.pieces_of(name)
            slot_steps[name] = state.slot_steps.get(pieces[0].key, 0)
            for slot in state.slots.get(pieces[0].key, {}):
                full = torch.empty_like(self.mirror[name], device="cpu")
                for piece in pieces:
                    view = full[piece.row_start:piece.row_end] if piece.partitioned else full
                    view.copy_(state.slots[piece.key][slot])
                slots.setdefault(name, {})[slot] = full
        return Checkpoint(global_step=state.global_step, fingerprint=self.fingerprint,
                          optimizer=self.optimizer.name, params=params, slots=slots,
                          slot_steps=slot_steps, wall_time=time.time(),
                          positions=state.positions)

    def _install(self, params: Mapping[str, torch.Tensor],
                 states: Mapping[str, OptimizerState] | None, global_step: int,
                 only: Sequence[int] | None = None, positions: Sequence[int] = (),
                 sparse_rows: dict[str, Any] | None = None,
                 num_workers: int | None = None) -> None:
        if self.sparse is not None:  # tables (and their rows) first: init lets workers in
            sparse = self.sparse
            directory = self.ckpt_store.directory if self.ckpt_store is not None else None
            self._retry(lambda: sparse.install(sparse_rows, directory, only))
        self._retry(lambda: self.client.init(
            params, self.optimizer, mode=self.training.mode,
            num_workers=num_workers or self._live_workers,
            staleness_bound=self.training.staleness_bound,
            fingerprint=self.fingerprint, global_step=global_step,
            target_steps=self.training.steps, states=states, only=only,
            positions=positions,
            checkpoint_every=(self.training.checkpoint.interval_steps
                              if self.ckpt_store is not None else 0)))

    def _restore_all(self, ckpt: Checkpoint, path: Path) -> None:
        ckpt.check_matches(self.fingerprint, self.optimizer.name, str(path))
        ckpt.check_tensors(self.mirror, str(path), SLOT_NAMES[self.optimizer.name])
        states: dict[str, OptimizerState] = {}
        for piece in self.placement.pieces:
            slots = {}
            for slot, full in ckpt.slots.get(piece.param, {}).items():
                slots[slot] = full[piece.row_start:piece.row_end] if piece.partitioned else full
            states[piece.key] = OptimizerState(step=ckpt.slot_steps.get(piece.param, 0),
                                               slots=slots)
        # The checkpoint's positions are one per trainer of the worker set it was saved
        # with (elastic workers: not necessarily the set this chief started with).
        # A chief that has pulled knows the live set; a chief that has just started
        # takes the set the checkpoint was saved with.
        live = (self.client.last_pull_workers or len(ckpt.positions)
                or self.role.num_workers)
        positions = ckpt.positions
        if positions and len(positions) != live:
            print(f"pstrain: {path} holds the data positions of {len(positions)} workers and "
                  f"this job has {live}; every worker reads its data from the beginning",
                  flush=True)
            positions = []
        self._install(ckpt.params, states, ckpt.global_step, positions=positions,
                      sparse_rows=ckpt.sparse, num_workers=live)
        self.last_ckpt_step = ckpt.global_step

    def _latest_checkpoint(self) -> tuple[Checkpoint, Path, dict[str, str]] | None:
        """The newest intact checkpoint, and the `warning` field for the restored event
        when newer ones were skipped as damaged (each named in the log as well). Every
        checkpoint damaged: NoUsableCheckpoint, a configuration error (no restart)."""
        if self.ckpt_store is None:
            return None
        found = self.ckpt_store.latest()
        if found is None:
            return None
        ckpt, path, problems = found
        for problem in problems:
            print(f"pstrain: skipping checkpoint: {problem}", flush=True)
        if not problems:
            return ckpt, path, {}
        skipped = (f"{len(problems)} newer checkpoint{'s' if len(problems) > 1 else ''} "
                   f"skipped as damaged; restored the previous intact one, {path} (step "
                   f"{ckpt.global_step})")
        print(f"pstrain: {skipped}", flush=True)
        return ckpt, path, {"warning": skipped}

    def _start_chief(self) -> None:
        if self.ckpt_store is not None:  # refuse an unusable directory before training
            check_directory(self.ckpt_store.directory)
        infos = self._infos()
        if all(i.initialized for i in infos):
            # The chief restarted while the servers kept training: join them.
            self.last_step = infos[0].global_step
            return
        if any(i.initialized for i in infos):
            self._recover()
            return
        latest = self._latest_checkpoint()
        if latest is not None:
            ckpt, path, skipped = latest
            self._restore_all(ckpt, path)
            self.last_step = ckpt.global_step
            past = ckpt.global_step > self.training.steps
            warning = (f"checkpoint {path} is at global step {ckpt.global_step}, past this "
                       f"job's target of {self.training.steps} steps (spec.training.steps): "
                       "nothing is left to train, so the job ends with that checkpoint's "
                       "parameters")
            if past:
                print(f"pstrain: warning: {warning}", flush=True)
            warnings = [w for w in (skipped.get("warning"), past and warning) if w]
            self.emit("restored", step=ckpt.global_step, path=str(path), lost_steps=0,
                      **({"warning": "; ".join(warnings)} if warnings else {}))
            return
        self._install(self.mirror, None, 0)
        self.last_step = 0

    def _recover(self) -> None:
        """Some servers lost their state (restarted): re-initialise, see module doc."""
        infos = self._infos()
        lost = [i for i, info in enumerate(infos) if not info.initialized]
        if not lost:
            return
        before = max(self.last_step, max(i.global_step for i in infos))
        latest = self._latest_checkpoint()
        if latest is not None:
            ckpt, path, skipped = latest
            self._restore_all(ckpt, path)
            lost_steps = max(0, before - ckpt.global_step)
            self.lost_steps += lost_steps
            self.last_step = ckpt.global_step
            self.emit("restored", step=ckpt.global_step, path=str(path),
                      lost_steps=lost_steps, servers=lost, **skipped)
            return
        step = infos[0].global_step if 0 not in lost else self.last_step
        self._install(self.mirror, None, step, only=lost)
        self.last_step = step
        self.emit("restored", step=step, path=None, lost_steps=0, servers=lost,
                  note="no checkpoint directory: restarted servers got the chief's latest "
                  "pulled parameters and fresh optimizer state")

    def _report(self, *, loss: float | None = None, samples_per_sec: float = 0.0,
                metrics: Mapping[str, float] | None = None,
                checkpoint: tuple[int, str, float] | None = None,
                tables: Mapping[str, Any] | None = None) -> None:
        """Status for parameter server 0; `metrics` are an evaluation's (all of them,
        e.g. accuracy or auc and logloss)."""
        accuracy = metrics.get("accuracy") if metrics else None
        report = pb.StatusReport(
            loss=loss if loss is not None else math.nan, samples_per_sec=samples_per_sec,
            eval_accuracy=accuracy if accuracy is not None else math.nan,
            has_eval=bool(metrics), has_checkpoint=checkpoint is not None,
            target_steps=self.training.steps, eval_metrics=metrics or {})
        if checkpoint is not None:
            report.checkpoint_step, report.checkpoint_path, report.checkpoint_time = checkpoint
        if tables:
            report.sparse_rows, report.sparse_bytes = tables["sparse_rows"], tables["sparse_bytes"]
        try:
            self.client.report(report)
        except PSError as exc:  # status is best effort; training goes on
            print(f"pstrain: could not report status to parameter server 0: {exc}", flush=True)

    def _table_fields(self) -> dict[str, Any]:
        """Sparse tables' live rows and memory for an event (best effort, like status)."""
        if self.sparse is None:
            return {}
        try:
            return self.sparse.progress_fields()
        except PSError as exc:
            print(f"pstrain: could not read the sparse tables' size: {exc}", flush=True)
            return {}

    def _evaluate(self) -> dict[str, float]:
        self.model.eval()
        try:
            metrics = {k: float(v) for k, v in self.task.evaluate(self.model).items()}
        finally:
            self.model.train()
        return metrics

    # ------------------------------------------------------------------ the loop
    def _handle(self, exc: PSError) -> None:
        """React to a refused or failed call; return to retry the step, or raise."""
        if exc.code == "INVALID_ARGUMENT" and "NaN or inf" in exc.message:
            raise TrainingDiverged(f"training diverged: {exc.message}") from exc
        if exc.code == "RESOURCE_EXHAUSTED":  # the server is busy: back off, retry
            time.sleep(BUSY_BACKOFF_S)
            return
        if exc.code == "ABORTED":  # a push computed on a server's previous state: the
            return                 # loop pulls the current parameters and goes on
        if (exc.code == "INVALID_ARGUMENT" and not self.role.is_chief
                and not admitted(self._infos())):
            self._wait_initialised()  # elastic: not in the worker set (see `elastic`)
            return
        if exc.code in ("UNAVAILABLE", "FAILED_PRECONDITION", "DEADLINE_EXCEEDED",
                        "CANCELLED"):
            if self.role.is_chief:
                self._recover()
            else:
                self._wait_initialised()
            return
        raise exc

    def _backward_and_push(self, batch: tuple[torch.Tensor, torch.Tensor],
                           steps: list[int]) -> tuple[float, list[pb.PushReply] | None]:
        x, y = (t.to(self.device, non_blocking=True) for t in batch)
        if self.pipeline:
            grads = self._pipeline_grads()  # before zeroing: the last ones may be in flight
        self._zero_grads()
        if self.sparse is not None:
            self.sparse.begin_step()
        loss = self.task.loss(self.model(x), y)
        if self.pipeline:
            return self._pipelined_backward_and_push(loss, grads, steps)
        if not self.overlap or self.placement.num_ps == 1:
            loss.backward()
            grads = {n: self._grad_cpu(n) for n in self.params}
            if self.training.mode == "sync":
                if self.sparse is not None:  # before the dense push completes the step
                    self.sparse.push(self.role.worker, steps)
                return float(loss.detach()), self.client.push(grads, self.role.worker, steps)
            # async: one round trip per server: push, and read the parameters back into
            # the mirror for the next step (backward is over, nothing reads them now).
            replies = self.client.push_pull(grads, self.mirror, self.role.worker, steps)
            self._fresh = True
            if self.sparse is not None and all(r.applied for r in replies):
                # after the dense push: it waited for the staleness bound
                self.sparse.push(self.role.worker, steps)
            return float(loss.detach()), replies
        # Overlap: push a shard as soon as backward has produced all its gradients.
        waiting = {ps: {p.param for p in self.client.shards[ps]}
                   for ps in range(self.placement.num_ps)}
        grads: dict[str, torch.Tensor] = {}
        futures: dict[int, cf.Future[pb.PushReply]] = {}

        def ready(name: str) -> None:
            grads[name] = self._grad_cpu(name)
            for ps, names in waiting.items():
                names.discard(name)
                if not names and ps not in futures:
                    futures[ps] = self.client.pool.submit(
                        self.client.push_one, ps, grads, self.role.worker, steps[ps])

        handles = [p.register_post_accumulate_grad_hook(lambda _p, n=n: ready(n))
                   for n, p in self.params.items()]
        try:
            loss.backward()
        finally:
            for h in handles:
                h.remove()
        for name in self.params:
            if name not in grads:
                ready(name)
        replies = [futures[ps].result() for ps in range(self.placement.num_ps)]
        return float(loss.detach()), replies

    # ------------------------------------------------------------------ pipelining
    def _pipeline_buffers(self) -> None:
        """The receive and send buffers and the background thread, made on first use."""
        if self._pipe is not None:
            return
        pinned = self.device.type != "cpu"
        def like() -> dict[str, torch.Tensor]:
            return {n: torch.zeros(t.shape, dtype=t.dtype, pin_memory=pinned)
                    for n, t in self.mirror.items()}
        self._recv = like()
        self._send = [like(), like()]
        self._pipe = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="pipeline")

    def _pipeline_grads(self) -> dict[str, torch.Tensor]:
        """This step's gradient buffers (two alternate: the other one may be in flight);
        on CPU they become the parameters' .grad, so backward writes them directly."""
        self._pipeline_buffers()
        grads = self._send[self._send_slot]
        self._send_slot ^= 1
        if self.device.type == "cpu":
            for name, p in self.params.items():
                p.grad = grads[name]
        return grads

    def _pipelined_backward_and_push(self, loss: torch.Tensor, grads: dict[str, torch.Tensor],
                                     steps: list[int]
                                     ) -> tuple[float, list[pb.PushReply] | None]:
        """Backward into this step's gradient buffers, then land the previous step's
        push_pull (its parameters become the model's) and start this step's in the
        background. Returns the previous push's replies (None on a pipeline's first
        step). Gradients are computed on parameters one push older than without
        pipelining: async training tolerates that staleness."""
        loss.backward()
        if self.device.type != "cpu":
            for name, p in self.params.items():
                grads[name].copy_(p.grad if p.grad is not None else torch.zeros_like(p))
            torch.cuda.synchronize(self.device)
        value = float(loss.detach())
        replies = self._land()
        self._inflight = self._pipe.submit(  # type: ignore[union-attr] - made with the grads
            self.client.push_pull, grads, self._recv, self.role.worker, steps)
        return value, replies

    def _land(self) -> list[pb.PushReply] | None:
        """Wait for the push_pull in flight; make the parameters it brought the model's
        (swap buffers, no copy on CPU). Its PSError is raised here."""
        future, self._inflight = self._inflight, None
        if future is None:
            return None
        replies = future.result()
        self._recv, self.mirror = self.mirror, self._recv
        if self.device.type == "cpu":
            for name, p in self.params.items():
                p.data = self.mirror[name]
        self._fresh = True
        return replies

    def _drain(self) -> None:
        """Let the push_pull in flight end and forget it (before a pull, a recovery or
        the end of the loop); its failure does not matter any more."""
        future, self._inflight = self._inflight, None
        if future is not None:
            try:
                future.result()
            except PSError:
                pass

    @property
    def _live_workers(self) -> int:
        """Trainers in the servers' worker set as the last pull saw it (elastic workers
        change it while the job runs), else as this trainer was started with."""
        return self.client.last_pull_workers or self.role.num_workers

    @property
    def _workers_per_step(self) -> int:
        """Workers whose gradients one global step applies: all of them in sync mode, one
        push in async mode."""
        return self._live_workers if self.training.mode == "sync" else 1

    def run(self) -> TrainResult:
        training, role = self.training, self.role
        started = self.clock()
        if role.is_chief:
            self._start_chief()
        else:
            self._wait_initialised()
            print(f"pstrain: worker {role.worker} joins at step {self.last_step}", flush=True)
        applied = AppliedSamples(step=self.last_step)  # the rate's examples, from here
        # Where this worker's data resumes: kept by server 0 (restored from a checkpoint,
        # or from this worker's pushes before it restarted).
        info = self._retry(lambda: self.client.info(0, role.worker))
        self.position = int(info.position)
        opened_for = role.num_workers
        batches = open_batches(self.task, role.worker, opened_for,
                               training.batch_size, training.seed, start=self.position)
        result = TrainResult()
        ckpt_every = training.checkpoint.interval_steps
        next_ckpt = (self.last_step // ckpt_every + 1) * ckpt_every
        eval_every = training.eval_interval_steps
        next_eval = (self.last_step // eval_every + 1) * eval_every if eval_every else None
        last_progress = -math.inf  # the first step is reported at once: training has begun
        window_loss: list[float] = []
        local_steps: list[int] | None = None
        finished_by_peer = False
        self.model.train()

        while True:  # the chief comes back here when finishing needed a recovery
            self._fresh = False
            while True:
                if self._fresh:  # the last push brought the parameters back
                    gstep = self.client.last_pull_steps[0]
                    self._fresh = False
                else:
                    self._drain()
                    try:
                        gstep = self.client.pull(self.mirror, worker=role.worker)
                    except PSError as exc:
                        self._handle(exc)
                        continue
                self.last_step = max(self.last_step, gstep) if role.is_chief else gstep
                if min(self.client.last_pull_steps) >= training.steps:
                    break
                if training.mode == "sync":
                    # Each server counts its own steps; they agree except after a server
                    # restarted without a checkpoint, so a worker follows each one.
                    bound = training.staleness_bound or 0
                    pulled = self.client.last_pull_steps
                    if local_steps is None or len(local_steps) != len(pulled):
                        local_steps = list(pulled)
                    local_steps = [mine if g <= mine <= g + bound else g
                                   for mine, g in zip(local_steps, pulled, strict=True)]
                else:
                    # async: a push's step is the index of its batch in this worker's
                    # data; server 0 keeps it, and so every checkpoint has it.
                    local_steps = [self.position] * self.placement.num_ps
                self._copy_in()
                if 0 < self.client.last_pull_workers != opened_for:
                    # Elastic workers: the set changed size; read this worker's shard of
                    # the new partition from its beginning (docs/runtime.md).
                    opened_for = self.client.last_pull_workers
                    self.position = 0
                    batches = open_batches(self.task, role.worker, opened_for,
                                           training.batch_size, training.seed)
                try:
                    batch = next(batches)
                except StopIteration:
                    raise ValueError(
                        f"{training.entrypoint}: batches() ran out after {self.position} "
                        "batches; it must be endless or long enough for the job") from None
                self.position += 1
                try:
                    loss, replies = self._backward_and_push(batch, local_steps)
                except PSError as exc:
                    self._fresh = False
                    self._drain()
                    self._handle(exc)
                    continue
                result.local_steps += 1
                result.samples += len(batch[1])
                local_steps = [x + 1 for x in local_steps]
                window_loss.append(loss)
                result.loss = loss
                if replies is None:  # pipelining's first step: its push is in flight
                    self._fresh = True
                    continue
                gstep = replies[0].info.global_step
                self.last_step = gstep
                if any(r.info.done for r in replies):
                    finished_by_peer = True
                    break
                if not role.is_chief and not_a_member(replies):
                    # Elastic workers: removed by a scale-down (the push was dropped
                    # whole), or a server re-initialised with an older set: wait.
                    self._fresh = False
                    self._drain()
                    self._wait_initialised()
                    continue
                # Every server must reach the target: one that lags (restarted without
                # a checkpoint) still needs this worker's gradients for its last steps.
                reached = min(r.info.global_step for r in replies) >= training.steps
                if not role.is_chief:
                    if reached:
                        break
                    continue
                # chief duties
                now = self.clock()
                elapsed = max(now - started, 1e-9)
                applied.advance(gstep, result.samples_per_step(self._workers_per_step))
                rate = applied.total / elapsed
                if now - last_progress >= self.progress_interval:
                    avg = sum(window_loss) / len(window_loss)
                    tables = self._table_fields()
                    self.emit("progress", step=gstep, loss=round(avg, 6),
                              samples_per_sec=round(rate, 1), **tables)
                    self._report(loss=avg, samples_per_sec=rate, tables=tables)
                    window_loss.clear()
                    last_progress = now
                # A checkpoint is due by the interval, or asked for before a disruption
                # (RequestCheckpoint on PS 0: suspend, a deadline, an eviction).
                asked = (replies[0].info.checkpoint_requested
                         and gstep > (self.last_ckpt_step if self.last_ckpt_step is not None
                                      else -1))
                if (self.ckpt_store is not None and (gstep >= next_ckpt or asked)
                        and gstep < training.steps):
                    try:
                        self._save_checkpoint(at_step=gstep // ckpt_every * ckpt_every)
                    except PSError as exc:  # a server failed under the checkpoint: recover
                        self._fresh = False  # a recovery may reinstall the parameters
                        self._drain()
                        self._handle(exc)
                        continue
                    next_ckpt = (gstep // ckpt_every + 1) * ckpt_every
                if eval_every and next_eval is not None and next_eval <= gstep < training.steps:
                    metrics = self._evaluate()
                    self.emit("eval", step=gstep, **metrics)
                    self._report(metrics=metrics)
                    next_eval = (gstep // eval_every + 1) * eval_every
                if reached:
                    break

            self._drain()
            result.global_step = self.last_step
            result.wall_seconds = self.clock() - started
            result.lost_steps = self.lost_steps
            if not role.is_chief:
                if not finished_by_peer:
                    self._wait_done()
                self.client.info_all(role.worker)  # goodbye: every server may stop now
                return result
            try:
                return self._finish(result, applied)
            except PSError as exc:  # a server failed while finishing: recover, then go on
                self._handle(exc)
                continue

    def _finish(self, result: TrainResult, applied: AppliedSamples) -> TrainResult:
        """The chief's end: final pull, eval, checkpoint, report, done, Finish, Shutdown."""
        gstep = self._retry(lambda: self.client.pull(self.mirror, worker=0))
        self._copy_in()
        result.global_step = gstep
        result.metrics = self._evaluate()
        applied.advance(gstep, result.samples_per_step(self._workers_per_step))
        result.samples_per_sec = applied.total / max(result.wall_seconds, 1e-9)
        self.emit("eval", step=gstep, **result.metrics)
        if self.ckpt_store is not None and self.last_ckpt_step != gstep:
            if self._save_checkpoint() is None:
                self._save_fallback()
        tables = self._table_fields()
        self._report(loss=result.loss, samples_per_sec=result.samples_per_sec,
                     metrics=result.metrics, tables=tables)
        self.emit("done", step=gstep, loss=result.loss,
                  accuracy=result.metrics.get("accuracy"),
                  samples_per_sec=round(result.samples_per_sec, 1),
                  wall_seconds=round(result.wall_seconds, 3), lost_steps=self.lost_steps,
                  **tables)
        self._retry(self.client.finish)
        return result

    def shutdown_servers(self) -> None:
        """Ask every server to stop (they wait up to the grace for workers to learn the
        job is done); the chief calls it after `run`."""
        try:
            self.client.shutdown(self.shutdown_grace)
        except PSError as exc:
            print(f"pstrain: shutdown request failed: {exc}", flush=True)

    def close(self) -> None:
        self._drain()
        if self.sparse is not None:
            self.sparse.close()
        if self._pipe is not None:
            self._pipe.shutdown(wait=False, cancel_futures=True)
        self.client.close()


__all__ = ["CheckpointError", "TrainResult", "Trainer", "TrainingDiverged", "WorkerRole"]
