"""The parameter server's state and rules, without sockets.

A `ParameterStore` holds namespaces (one per job or model, like TensorFlow's
containers). A namespace holds this server's shard of parameters, their optimizer
state, the applied-step counter and, in sync mode, the per-step gradient buckets.

Streams come in as iterators of raw frame messages (see `wire`), so the gRPC service
(`server.py`) is a thin adapter and tests can drive the store directly.

Invariants:
- Bad input (unknown namespace or tensor, wrong shape or dtype, NaN/inf, pushes before
  initialisation, chunks out of order or truncated) raises `PSError` with a status
  code and a message, and leaves parameters, optimizer state and step unchanged:
  gradients are read into pooled scratch buffers and validated before anything is
  applied.
- async mode applies each push as it arrives (one lock per namespace serialises the
  optimizer, no lock spans servers). sync mode adds one gradient per worker into the
  bucket of its step and applies the mean when every worker has contributed, in step
  order. `staleness_bound` N lets a worker run at most N steps ahead.
- The workers are a `WorkerSet` (Init: 0..num_workers-1) that `set_workers` changes
  while the job runs (elastic workers; rules in `pstrain_api.membership`). A push of a
  worker outside the set is refused; one whose worker is removed while it is in flight
  is applied whole or dropped whole (under the namespace lock). Sync steps wait for a
  newcomer from its first push on; the staleness bound counts live workers only.
- Every wait ends: at the caller's deadline, when the caller is gone (cancelled or
  disconnected), when the job is done, the server stops or the namespace is
  initialised again, and in any case after `max_wait` seconds.
- Init allocates only what its header announces as the body, within `max_init_bytes`.
- Every Init starts a new generation of the namespace; a push computed on parameters
  of another generation is refused (ABORTED), so no gradient computed before a
  restore is applied after it.
"""

from __future__ import annotations

import math
import os
import secrets
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch
from pstrain_api.membership import WorkerSet

from . import wire
from .optim import (SLOT_NAMES, OptimizerConfig, OptimizerState, apply_gradients,
                    hyperparameter_problem)
from .proto import ps_pb2 as pb
from .snapshots import StepSnapshot, snapshot_if_due

SLOT_SEPARATOR = "@"
GRAD_DTYPES = frozenset({torch.float32, torch.bfloat16, torch.float16})
WAIT_SLICE = 0.5  # seconds between checks of done/stop/cancel while blocking
MAX_WAIT = 60.0  # seconds: no wait in the store lasts longer, whatever the caller asks
Gone = Callable[[], bool]  # True once the caller cancelled or disconnected


def is_all_finite(tensor: torch.Tensor) -> bool:
    """No NaN or inf in `tensor`. A finite sum proves it (NaN and inf propagate through
    a sum) at a fraction of the cost of `isfinite`, which only runs when the sum is not
    finite (NaN/inf present, or an overflow of large finite values)."""
    if math.isfinite(float(tensor.sum())):
        return True
    return bool(torch.isfinite(tensor).all())


def first_nonfinite(tensors: dict[str, torch.Tensor]) -> str | None:
    """The first of `tensors` (in order) holding NaN or inf, or None."""
    return next((key for key, tensor in tensors.items() if not is_all_finite(tensor)), None)


class RunningSum:
    """The sum of a tensor's elements, taken stretch by stretch as its bytes arrive
    (`wire.StreamReader.on_data`) while they are still in cache, so that the NaN/inf
    check of a large push costs no extra pass over memory."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.flat = tensor.reshape(-1)
        self.itemsize = tensor.element_size()
        self.summed = 0  # elements summed so far
        self.total = 0.0

    def __call__(self, start: int, end: int) -> None:
        upto = end // self.itemsize
        if upto > self.summed:
            self.total += float(self.flat[self.summed:upto].sum())
            self.summed = upto

    def all_finite(self) -> bool:
        """True proves every element finite; False (NaN/inf, or an overflow of large
        finite values) calls for the precise check."""
        return self.summed == self.flat.numel() and math.isfinite(self.total)


class PSError(Exception):
    """A request the parameter server refuses. `code` names a grpc.StatusCode."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def _invalid(message: str) -> PSError:
    return PSError("INVALID_ARGUMENT", message)


@dataclass
class Bucket:
    sums: dict[str, torch.Tensor] = field(default_factory=dict)
    contributors: set[int] = field(default_factory=set)


@dataclass
class JobReport:
    loss: float | None = None
    samples_per_sec: float | None = None
    eval_accuracy: float | None = None
    eval_metrics: dict[str, float] = field(default_factory=dict)
    checkpoint_step: int | None = None
    checkpoint_path: str = ""
    checkpoint_time: float = 0.0
    target_steps: int = 0
    updated_time: float = 0.0
    sparse_rows: int = -1  # -1: no sparse tables
    sparse_bytes: int = 0


@dataclass(frozen=True)
class FlatGrads:
    """Gradients of several parameters as views of one 1-D buffer, in push order: the
    push is read into one target and checked for NaN/inf with one sum. Pooled whole
    (buffer and views) and used for async pushes only: a sync bucket adopts gradient
    tensors, which must not be views of a buffer that is reused."""

    keys: tuple[str, ...]
    flat: torch.Tensor
    views: dict[str, torch.Tensor]

    @classmethod
    def build(cls, keys: tuple[str, ...], shapes: list[tuple[int, ...]],
              dtype: torch.dtype) -> FlatGrads:
        sizes = [math.prod(shape) for shape in shapes]
        flat = torch.empty(sum(sizes), dtype=dtype)
        views = {key: part.view(shape) for key, part, shape
                 in zip(keys, flat.split(sizes), shapes, strict=True)}
        return cls(keys, flat, views)


class Namespace:
    def __init__(self, name: str) -> None:
        self.name = name
        self.cond = threading.Condition()
        self.initialized = False
        self.params: dict[str, torch.Tensor] = {}
        self.states: dict[str, OptimizerState] = {}
        self.config = OptimizerConfig()
        self.mode = "async"
        self.members = WorkerSet.initial(1)
        self.staleness: int | None = None
        self.fingerprint = b""
        self.global_step = 0
        self.target_steps = 0  # 0: unbounded
        self.checkpoint_every = 0  # keep a snapshot at each multiple (0: none)
        self.snapshot: StepSnapshot | None = None
        self.done = False
        self.epoch = 0  # bumped by every init: blocked waits end when it changes
        self.generation = 0  # random and new at every init; pulls carry it
        self.told_done: set[int] = set()
        self.worker_pushes: dict[int, int] = {}
        # async: per worker, the batches it had drawn when its last applied push was made
        # (the push's step + 1); from a checkpoint's INIT until then
        self.positions: dict[int, int] = {}
        self.buckets: dict[int, Bucket] = {}
        self.skipped_nonfinite = 0
        self.checkpoint_wanted = -1  # RequestCheckpoint: a checkpoint at/after this step
        self.report = JobReport()
        self.sparse: Any = None  # sparse.service.NamespaceTables, made by the chief's configure
        self.shapes: dict[str, tuple[int, ...]] = {}  # of params, for push checks
        self.metas: dict[str, pb.TensorMeta] = {}  # of params, for pull headers
        self.optimizer_pb = pb.OptimizerSpec()  # of config, for pull headers
        self._pool: dict[tuple[str, torch.dtype], list[torch.Tensor]] = {}
        self._flat_pool: dict[tuple[tuple[str, ...], torch.dtype], list[FlatGrads]] = {}
        self._pool_lock = threading.Lock()

    def keep_snapshot(self) -> None:
        """After a step: copy the shard if the step is a checkpoint step (lock held)."""
        snap = snapshot_if_due(self.global_step, self.checkpoint_every, self.params,
                               self.states)
        if snap is not None:  # with where each worker's data stood at that step
            self.snapshot = replace(snap, positions=tuple(
                self.position_of(w) for w in range(self.num_workers)))

    @property
    def num_workers(self) -> int:
        """The size of per-worker tables: one more than the highest live worker."""
        return self.members.span

    # Scratch buffers: reused across pushes so that a steady state allocates nothing.
    def take(self, key: str, dtype: torch.dtype) -> torch.Tensor:
        with self._pool_lock:
            free = self._pool.get((key, dtype))
            if free:
                return free.pop()
        return torch.empty(self.params[key].shape, dtype=dtype)

    def give(self, key: str, tensor: torch.Tensor) -> None:
        with self._pool_lock:
            self._pool.setdefault((key, tensor.dtype), []).append(tensor)

    def take_flat(self, keys: tuple[str, ...], dtype: torch.dtype) -> FlatGrads:
        """Scratch gradients for `keys`, all of `dtype`, end to end in one buffer."""
        with self._pool_lock:
            free = self._flat_pool.get((keys, dtype))
            if free:
                return free.pop()
        return FlatGrads.build(keys, [self.shapes[key] for key in keys], dtype)

    def give_flat(self, grads: FlatGrads) -> None:
        with self._pool_lock:
            self._flat_pool.setdefault((grads.keys, grads.flat.dtype), []).append(grads)

    def clear_pools(self) -> None:
        with self._pool_lock:
            self._pool.clear()
            self._flat_pool.clear()

    def position_of(self, worker: int) -> int:
        """Where `worker`'s data resumes: in sync mode every worker draws one batch per
        global step, so the step itself; in async mode what its pushes said."""
        return self.global_step if self.mode == "sync" else self.positions.get(worker, 0)

    def info(self, worker: int | None = None) -> pb.StepInfo:
        if self.done and worker is not None:
            self.told_done.add(worker)
        return pb.StepInfo(global_step=self.global_step, done=self.done,
                           initialized=self.initialized,
                           skipped_nonfinite=self.skipped_nonfinite,
                           checkpoint_requested=self.checkpoint_wanted >= 0,
                           position=self.position_of(worker) if worker is not None else 0,
                           member=worker is not None and worker in self.members)


def optimizer_from_pb(spec: pb.OptimizerSpec) -> OptimizerConfig:
    """The optimizer an Init asks for; INVALID_ARGUMENT naming the field and its value
    when it is out of the API's bounds (`optim.hyperparameter_problem`)."""
    try:
        config = OptimizerConfig(
            name=spec.name or "sgd",  # type: ignore[arg-type]
            learning_rate=spec.learning_rate, momentum=spec.momentum,
            nesterov=spec.nesterov, weight_decay=spec.weight_decay, beta1=spec.beta1,
            beta2=spec.beta2, eps=spec.eps,
            initial_accumulator_value=spec.initial_accumulator_value,
        )
    except ValueError as exc:
        raise _invalid(f"init: {exc}") from exc
    problem = hyperparameter_problem(config)
    if problem is not None:
        raise _invalid(f"init: {problem}")
    return config


def optimizer_to_pb(config: OptimizerConfig) -> pb.OptimizerSpec:
    return pb.OptimizerSpec(
        name=config.name, learning_rate=config.learning_rate, momentum=config.momentum,
        nesterov=config.nesterov, weight_decay=config.weight_decay, beta1=config.beta1,
        beta2=config.beta2, eps=config.eps,
        initial_accumulator_value=config.initial_accumulator_value,
    )


def _read_header(messages: Iterator[bytes], kind: int) -> pb.StreamHeader:
    first = next(messages, None)
    if first is None:
        raise _invalid("the stream was empty; it must start with a header frame")
    try:
        header = wire.decode_frame(first)
    except wire.WireError as exc:
        raise _invalid(str(exc)) from exc
    if not isinstance(header, pb.StreamHeader):
        raise _invalid("the stream did not start with a header frame")
    if header.kind != kind:
        raise _invalid(
            f"stream kind is {pb.StreamKind.Name(header.kind)}; this call expects "
            f"{pb.StreamKind.Name(kind)}"
        )
    return header


def _read_body(header: pb.StreamHeader, messages: Iterator[bytes],
               targets: list[np.ndarray],
               on_data: Callable[[int, int], None] | None = None) -> None:
    try:
        reader = wire.StreamReader(header, targets)
        reader.on_data = on_data
        wire.read_body(reader, messages)
    except wire.WireError as exc:
        raise _invalid(str(exc)) from exc


def new_generation(previous: int) -> int:
    """A random nonzero 64-bit generation other than `previous` (0 means "unknown" on
    the wire). Random rather than counted, so that a restarted server, which counts
    from nothing, never repeats the generation of its previous incarnation."""
    while True:
        generation = secrets.randbits(64)
        if generation not in (0, previous):
            return generation


def physical_memory() -> int:
    """This machine's memory in bytes: no Init may claim more."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):  # pragma: no cover - a platform without sysconf names
        return 1 << 40


def _listed(workers: frozenset[int]) -> str:
    return ", ".join(map(str, sorted(workers)))


def _removed(ns: Namespace, worker: int) -> pb.PushReply:
    return pb.PushReply(info=ns.info(worker), applied=False,
                        note=f"worker {worker} was removed from the job while its push was "
                        "in flight; the push was dropped whole")


def _at_target(ns: Namespace, worker: int) -> pb.PushReply:
    return pb.PushReply(info=ns.info(worker), applied=False,
                        note=f"the target of {ns.target_steps} steps is reached")


class ParameterStore:
    """All namespaces of one parameter server."""

    def __init__(self, ps_index: int = 0, clock: Callable[[], float] = time.monotonic,
                 max_wait: float = MAX_WAIT, max_init_bytes: int | None = None) -> None:
        self.ps_index = ps_index
        self.clock = clock
        self.max_wait = max_wait
        self.max_init_bytes = physical_memory() if max_init_bytes is None else max_init_bytes
        self._lock = threading.Lock()
        self._namespaces: dict[str, Namespace] = {}
        self.stopping = threading.Event()

    # ------------------------------------------------------------------ lookup
    def namespace(self, name: str, create: bool = False) -> Namespace:
        with self._lock:
            ns = self._namespaces.get(name)
            if ns is None and create:
                ns = self._namespaces[name] = Namespace(name)
        if ns is None:
            raise PSError(
                "FAILED_PRECONDITION",
                f"namespace {name!r} is not initialised on parameter server "
                f"{self.ps_index}; the chief initialises it (or restores it from a "
                "checkpoint) before workers push or pull",
            )
        return ns

    def namespaces(self) -> list[Namespace]:
        with self._lock:
            return list(self._namespaces.values())

    def _ready(self, name: str) -> Namespace:
        ns = self.namespace(name)
        if not ns.initialized:
            raise PSError("FAILED_PRECONDITION",
                          f"namespace {name!r} is not initialised on parameter server "
                          f"{self.ps_index} yet")
        return ns

    def _wait(self, ns: Namespace, ready: Callable[[], bool], timeout: float | None,
              gone: Gone | None = None) -> bool:
        """Wait on ns.cond (held) until ready(), done, stop, re-init, the caller is
        `gone` (cancelled or disconnected: checked every WAIT_SLICE), or the deadline:
        `timeout` (the caller's), never more than `max_wait`. Every wait ends."""
        limit = self.max_wait if timeout is None else min(timeout, self.max_wait)
        deadline = self.clock() + limit
        epoch = ns.epoch
        while not ready():
            if ns.done or self.stopping.is_set() or ns.epoch != epoch:
                return False
            if gone is not None and gone():
                return False
            left = min(WAIT_SLICE, deadline - self.clock())
            if left <= 0:
                return False
            ns.cond.wait(left)
        return True

    # ------------------------------------------------------------------ init
    def _check_init_sizes(self, header: pb.StreamHeader) -> list[torch.dtype]:
        """The dtypes of an Init's tensors, once their sizes are known to be sane:
        checked against the body the header announces and `max_init_bytes` before
        anything is allocated (a few header bytes must not make the server allocate
        100 GB)."""
        dtypes: list[torch.dtype] = []
        claimed = 0
        for meta in header.tensors:
            try:
                dtype = wire.parse_dtype(meta.dtype)
            except wire.WireError as exc:
                raise _invalid(f"init: tensor {meta.name!r}: {exc}") from exc
            if any(d < 0 for d in meta.shape):
                raise _invalid(f"init: tensor {meta.name!r} has a negative dimension")
            dtypes.append(dtype)
            claimed += math.prod(meta.shape) * dtype.itemsize
        if claimed != header.total_bytes:
            raise _invalid(f"init: the tensors' shapes add up to {claimed} bytes but the "
                           f"header announces a body of {header.total_bytes} bytes; "
                           "they must agree")
        if claimed > self.max_init_bytes:
            raise PSError("RESOURCE_EXHAUSTED",
                          f"init: the tensors hold {claimed} bytes, more than the "
                          f"{self.max_init_bytes} bytes parameter server {self.ps_index} "
                          "accepts in one namespace (its memory)")
        return dtypes

    def init(self, messages: Iterator[bytes]) -> pb.StepInfo:
        header = _read_header(messages, pb.STREAM_KIND_INIT)
        if not header.namespace:
            raise _invalid("init: namespace is empty; every request must name a namespace")
        config = optimizer_from_pb(header.optimizer)
        if header.mode not in ("async", "sync"):
            raise _invalid(f"init: mode is {header.mode!r}; it must be async or sync")
        if header.num_workers < 1:
            raise _invalid(f"init: num_workers is {header.num_workers}; it must be at least 1")
        if header.global_step < 0:
            raise _invalid(f"init: global_step is {header.global_step}; it must be >= 0")
        dtypes = self._check_init_sizes(header)
        params: dict[str, torch.Tensor] = {}
        slots: dict[str, dict[str, torch.Tensor]] = {}
        targets: list[np.ndarray] = []
        for meta, dtype in zip(header.tensors, dtypes, strict=True):
            try:
                tensor = torch.empty(tuple(meta.shape), dtype=dtype)
            except RuntimeError as exc:  # the allocator's refusal
                raise PSError("RESOURCE_EXHAUSTED",
                              f"init: tensor {meta.name!r} of shape {list(meta.shape)} "
                              f"cannot be allocated on parameter server {self.ps_index}: "
                              f"{exc}") from exc
            key, sep, slot = meta.name.partition(SLOT_SEPARATOR)
            if sep:
                if slot not in SLOT_NAMES[config.name]:
                    raise _invalid(
                        f"init: slot {slot!r} of {key!r} does not belong to optimizer "
                        f"{config.name} (slots: {list(SLOT_NAMES[config.name])})"
                    )
                slots.setdefault(key, {})[slot] = tensor
            else:
                if key in params:
                    raise _invalid(f"init: tensor {key!r} appears twice")
                if dtype not in GRAD_DTYPES:
                    raise _invalid(f"init: parameter {key!r} has dtype {meta.dtype}; "
                                   "parameters must be floating point")
                params[key] = tensor
            targets.append(wire.byte_view(tensor))
        for key, named in slots.items():
            if key not in params:
                raise _invalid(f"init: slots for {key!r} but no such parameter")
            for slot, tensor in named.items():
                if tensor.shape != params[key].shape:
                    raise _invalid(f"init: slot {key}@{slot} has shape {list(tensor.shape)}, "
                                   f"the parameter has {list(params[key].shape)}")
        with_slots = bool(slots)
        if with_slots and len(header.slot_steps) != len(params):
            raise _invalid(f"init: {len(header.slot_steps)} slot steps for {len(params)} "
                           "parameters; send one per parameter, in header order")
        _read_body(header, messages, targets)
        for key, tensor in params.items():
            if not is_all_finite(tensor):
                raise _invalid(f"init: parameter {key!r} contains NaN or inf")

        states: dict[str, OptimizerState] = {}
        from .optim import init_state

        steps = dict(zip(params, header.slot_steps, strict=False)) if with_slots else {}
        for key, tensor in params.items():
            state = init_state(config, tensor)
            if with_slots:
                missing = set(SLOT_NAMES[config.name]) - set(slots.get(key, {}))
                if missing:
                    raise _invalid(f"init: parameter {key!r} lacks slots {sorted(missing)}")
                state.slots = slots[key]
                state.step = int(steps[key])
            states[key] = state

        ns = self.namespace(header.namespace, create=True)
        with ns.cond:
            if ns.initialized and ns.fingerprint != header.fingerprint:
                raise PSError(
                    "FAILED_PRECONDITION",
                    f"namespace {header.namespace!r} already holds a different model "
                    "(fingerprint mismatch); use another namespace for another model",
                )
            ns.params, ns.states, ns.config = params, states, config
            ns.shapes = {key: tuple(tensor.shape) for key, tensor in params.items()}
            ns.metas = {key: wire.meta_of(key, tensor) for key, tensor in params.items()}
            ns.optimizer_pb = optimizer_to_pb(config)
            ns.mode = header.mode
            ns.members = WorkerSet.initial(header.num_workers)
            ns.staleness = header.staleness_bound if header.staleness_bound >= 0 else None
            ns.fingerprint = header.fingerprint
            ns.global_step = header.global_step
            ns.target_steps = header.target_steps
            ns.checkpoint_every = header.checkpoint_every
            ns.snapshot = None
            ns.buckets.clear()
            ns.worker_pushes.clear()
            ns.positions = dict(enumerate(header.positions))
            ns.clear_pools()
            ns.done = False
            ns.told_done.clear()
            ns.initialized = True
            ns.epoch += 1
            ns.generation = new_generation(ns.generation)
            ns.cond.notify_all()
            return ns.info()

    # ------------------------------------------------------------------ push
    def push(self, messages: Iterator[bytes], timeout: float | None = None,
             gone: Gone | None = None) -> pb.PushReply:
        header = _read_header(messages, pb.STREAM_KIND_PUSH)
        return self._push(header, messages, timeout, gone)

    def push_pull(self, messages: Iterator[bytes], timeout: float | None = None,
                  chunk_bytes: int = wire.CHUNK_BYTES,
                  gone: Gone | None = None) -> Iterator[bytes]:
        """A push, then a pull of the pushed tensors (one round trip for a worker).

        Validates and applies now (raises PSError like `push`), then returns the PULL
        frame iterator; its header carries the push's reply in `push_reply`. The pull
        reads the parameters after the push returned, exactly as a separate Pull issued
        after the Push would (in sync mode: after the push's step was applied, within
        the staleness bound)."""
        header = _read_header(messages, pb.STREAM_KIND_PUSH)
        reply = self._push(header, messages, timeout, gone)
        names = [meta.name for meta in header.tensors]
        if not names:
            raise _invalid("push_pull: the push lists no tensors; name the tensors to pull "
                           "back")
        request = pb.PullRequest(namespace=header.namespace, names=names,
                                 worker=header.worker)
        return self.pull(request, timeout, chunk_bytes, push_reply=reply, gone=gone)

    def push_pull_small(self, message: bytes, timeout: float | None = None,
                        gone: Gone | None = None) -> bytes:
        """`push_pull` with the whole stream batched in one message each way."""
        try:
            frames = wire.decode_batch(message)
        except wire.WireError as exc:
            raise _invalid(f"push_pull: {exc}") from exc
        return wire.encode_batch(self.push_pull(iter(frames), timeout, gone=gone))

    def _push(self, header: pb.StreamHeader, messages: Iterator[bytes],
              timeout: float | None, gone: Gone | None) -> pb.PushReply:
        ns = self._ready(header.namespace)
        if header.worker not in ns.members:
            raise _invalid(f"push: worker is {header.worker}; this job's workers are "
                           f"{_listed(ns.members.live)}")
        if ns.done:
            for _ in messages:  # drain, so the client sees the reply rather than a reset
                pass
            return pb.PushReply(info=ns.info(header.worker), applied=False,
                                note="the job is done; the push was not applied")
        if header.generation and header.generation != ns.generation:
            raise PSError("ABORTED",
                          f"push: the gradients of worker {header.worker} were computed on "
                          f"parameters of generation {header.generation:#x}; parameter "
                          f"server {self.ps_index} was initialised again since (generation "
                          f"{ns.generation:#x}): pull the parameters again")
        mode = ns.mode
        checked: dict[str, torch.dtype] = {}
        for meta in header.tensors:
            key = meta.name
            if key not in ns.params:
                raise PSError("NOT_FOUND",
                              f"push: tensor {key!r} is not on parameter server "
                              f"{self.ps_index} in namespace {ns.name!r}")
            if key in checked:
                raise _invalid(f"push: tensor {key!r} appears twice")
            try:
                dtype = wire.parse_dtype(meta.dtype)
            except wire.WireError as exc:
                raise _invalid(f"push: gradient {key!r}: {exc}") from exc
            if dtype not in GRAD_DTYPES:
                raise _invalid(f"push: gradient {key!r} has dtype {meta.dtype}; "
                               "gradients must be float32, bfloat16 or float16")
            if tuple(meta.shape) != ns.shapes[key]:
                raise _invalid(f"push: gradient {key!r} has shape {list(meta.shape)}, "
                               f"the parameter has {list(ns.shapes[key])}")
            checked[key] = dtype
        flat: FlatGrads | None = None
        grads: dict[str, torch.Tensor] = {}
        try:
            dtypes = set(checked.values())
            if mode == "async" and len(checked) > 1 and len(dtypes) == 1:
                flat = ns.take_flat(tuple(checked), dtypes.pop())
                grads = dict(flat.views)
                targets = [wire.byte_view(flat.flat)]
            else:
                grads = {key: ns.take(key, dtype) for key, dtype in checked.items()}
                targets = [wire.byte_view(grad) for grad in grads.values()]
            # One tensor receives the whole push (the flat buffer, or a lone gradient):
            # sum it as it arrives.
            whole = flat.flat if flat is not None else (
                next(iter(grads.values())) if len(grads) == 1 else None)
            running = RunningSum(whole) if whole is not None else None
            _read_body(header, messages, targets, running)
            if running is not None:
                bad = None if running.all_finite() else first_nonfinite(grads)
            else:
                bad = first_nonfinite(grads)
            if bad is not None:
                with ns.cond:
                    ns.skipped_nonfinite += 1
                    count = ns.skipped_nonfinite
                raise _invalid(
                    f"push: gradient {bad!r} contains NaN or inf; the push from worker "
                    f"{header.worker} was rejected and not applied ({count} rejected so far)"
                )
            if mode == "sync":
                return self._push_sync(ns, header, grads, timeout, gone)
            return self._push_async(ns, header, grads, timeout, gone)
        finally:
            if flat is not None:
                ns.give_flat(flat)
            else:
                for key, tensor in grads.items():
                    ns.give(key, tensor)

    def _push_async(self, ns: Namespace, header: pb.StreamHeader,
                    grads: dict[str, torch.Tensor], timeout: float | None,
                    gone: Gone | None) -> pb.PushReply:
        worker = header.worker
        with ns.cond:
            # The target is checked before the staleness wait too: a worker that stopped
            # at the target never pushes again, so waiting for it would not end.
            if ns.target_steps and ns.global_step >= ns.target_steps:
                return _at_target(ns, worker)
            if ns.staleness is not None:
                def allowed() -> bool:  # over the live workers; a removed one goes on
                    if worker not in ns.members:
                        return True
                    mine = ns.worker_pushes.get(worker, 0)
                    slowest = min(ns.worker_pushes.get(w, 0) for w in ns.members.live)
                    return mine - slowest <= ns.staleness  # type: ignore[operator]

                if not self._wait(ns, allowed, timeout, gone):
                    return pb.PushReply(info=ns.info(worker), applied=False,
                                        note="not applied: the job is done or the wait "
                                        "for slower workers timed out")
            if ns.target_steps and ns.global_step >= ns.target_steps:
                return _at_target(ns, worker)
            if worker not in ns.members:
                return _removed(ns, worker)
            started = time.perf_counter()
            # Reduced-precision gradients are widened into pooled float32 buffers.
            widened = {key: ns.take(key, torch.float32).copy_(grad)
                       for key, grad in grads.items() if grad.dtype != torch.float32}
            try:
                apply_gradients(ns.config, [ns.params[key] for key in grads],
                                [widened.get(key, grad) for key, grad in grads.items()],
                                [ns.states[key] for key in grads])
            finally:
                for key, buf in widened.items():
                    ns.give(key, buf)
            spent = time.perf_counter() - started
            ns.global_step += 1
            ns.worker_pushes[worker] = ns.worker_pushes.get(worker, 0) + 1
            ns.positions[worker] = header.step + 1  # async: the step is the batch's index
            ns.keep_snapshot()
            ns.cond.notify_all()
            return pb.PushReply(info=ns.info(worker), applied=True, apply_seconds=spent)

    def _push_sync(self, ns: Namespace, header: pb.StreamHeader,
                   grads: dict[str, torch.Tensor], timeout: float | None,
                   gone: Gone | None) -> pb.PushReply:
        worker, step = header.worker, header.step
        bound = ns.staleness or 0
        with ns.cond:
            if step < ns.global_step:
                return pb.PushReply(info=ns.info(worker), applied=False,
                                    note=f"step {step} was already applied; the global "
                                    f"step is {ns.global_step}")
            if ns.target_steps and step >= ns.target_steps:
                return _at_target(ns, worker)
            if not self._wait(ns, lambda: step <= ns.global_step + bound, timeout, gone):
                return pb.PushReply(info=ns.info(worker), applied=False,
                                    note=f"step {step} is more than {bound} ahead")
            if worker not in ns.members:
                return _removed(ns, worker)
            bucket = ns.buckets.setdefault(step, Bucket())
            duplicate = worker in bucket.contributors
            if not duplicate:
                missing = set(ns.params) - set(grads)
                if missing:
                    raise _invalid(f"push: sync step {step} lacks gradients for "
                                   f"{sorted(missing)[:3]}; send every tensor of the shard")
                adopted = []
                for key, grad in grads.items():
                    acc = bucket.sums.get(key)
                    if acc is not None:
                        acc.add_(grad)
                    elif grad.dtype == torch.float32:
                        bucket.sums[key] = grad  # the first gradient becomes the sum: no copy
                        adopted.append(key)
                    else:
                        bucket.sums[key] = ns.take(key, torch.float32)
                        bucket.sums[key].copy_(grad)
                for key in adopted:
                    del grads[key]  # owned by the bucket now; returned to the pool after apply
                bucket.contributors.add(worker)
                ns.members = ns.members.joined(worker, step)  # a newcomer: waited for now
            spent = self._apply_ready_buckets(ns)
            complete = self._wait(ns, lambda: ns.global_step >= step + 1 - bound, timeout,
                                  gone)
            note = "duplicate contribution ignored" if duplicate else ""
            if not complete and not ns.done:
                # The contribution stays in its bucket; the worker pulls again and, if
                # the step is still open, pushes it again (a duplicate, ignored).
                note = (f"step {step} was not complete within the wait; the contribution "
                        "is kept")
            return pb.PushReply(info=ns.info(worker), applied=not duplicate, note=note,
                                apply_seconds=spent)

    def _apply_ready_buckets(self, ns: Namespace) -> float:
        """Apply every complete bucket in step order; the seconds spent applying."""
        started = time.perf_counter()
        while True:
            bucket = ns.buckets.get(ns.global_step)
            if bucket is None or not ns.members.is_complete(ns.global_step,
                                                            bucket.contributors):
                return time.perf_counter() - started
            del ns.buckets[ns.global_step]
            totals = list(bucket.sums.values())
            if totals:
                torch._foreach_div_(totals, len(bucket.contributors))
            apply_gradients(ns.config, [ns.params[key] for key in bucket.sums], totals,
                            [ns.states[key] for key in bucket.sums])
            if ns.sparse is not None:  # the step's sparse rows, pushed before its bucket
                ns.sparse.apply_step(ns, ns.global_step, len(bucket.contributors))
            for key, total in bucket.sums.items():
                ns.give(key, total)
            ns.global_step += 1
            ns.keep_snapshot()
            ns.cond.notify_all()

    # ------------------------------------------------------------------ pull
    def pull(self, request: pb.PullRequest, timeout: float | None = None,
             chunk_bytes: int = wire.CHUNK_BYTES,
             push_reply: pb.PushReply | None = None,
             gone: Gone | None = None) -> Iterator[bytes]:
        """Validate now (raises PSError), then return the frame iterator."""
        ns = self._ready(request.namespace)
        names = list(request.names) or sorted(ns.params)
        for name in names:
            if name not in ns.params:
                raise PSError("NOT_FOUND",
                              f"pull: tensor {name!r} is not on parameter server "
                              f"{self.ps_index} in namespace {ns.name!r}")
        with ns.cond:
            if request.min_step > ns.global_step:
                self._wait(ns, lambda: ns.global_step >= request.min_step, timeout, gone)
            snap = ns.snapshot
            if not (request.include_slots and request.at_step and snap is not None
                    and snap.step == request.at_step):
                snap = None  # the live shard
            params, states = (snap.params, snap.states) if snap else (ns.params, ns.states)
            header = pb.StreamHeader(kind=pb.STREAM_KIND_PULL, namespace=ns.name,
                                     global_step=snap.step if snap else ns.global_step,
                                     ps_index=self.ps_index, fingerprint=ns.fingerprint,
                                     optimizer=ns.optimizer_pb, mode=ns.mode,
                                     num_workers=ns.num_workers, generation=ns.generation)
            tensors: list[torch.Tensor] = []
            for name in names:
                tensors.append(params[name])
                header.tensors.append(ns.metas[name])
                if request.include_slots:
                    header.slot_steps.append(states[name].step)
                    for slot, value in sorted(states[name].slots.items()):
                        tensors.append(value)
                        header.tensors.append(
                            wire.meta_of(f"{name}{SLOT_SEPARATOR}{slot}", value))
            if request.include_slots:
                header.positions.extend(snap.positions if snap else (
                    ns.position_of(w) for w in range(ns.num_workers)))
            if (request.consistent or request.include_slots) and snap is None:
                tensors = [t.clone() for t in tensors]  # a snapshot is never written again
            info = ns.info(request.worker)
        header.step = info.global_step
        if push_reply is not None:
            header.push_reply.CopyFrom(push_reply)
        return wire.StreamWriter(chunk_bytes).frames(header, tensors)

    # ------------------------------------------------------------------ control
    def info(self, namespace: str, worker: int | None = None) -> pb.StepInfo:
        with self._lock:
            ns = self._namespaces.get(namespace)
        if ns is None:
            return pb.StepInfo(initialized=False)
        with ns.cond:
            return ns.info(worker)

    def set_workers(self, namespace: str, workers: Iterable[int]) -> pb.StepInfo:
        """Elastic workers: make `workers` the namespace's live set (the chief's or the
        operator's control call). A newcomer starts level with the slowest live worker
        (the staleness bound never makes the others wait for it to catch up) and is
        waited for by sync steps from its first push on; a removed worker is waited for
        by no step from now on, so the open steps it held back are applied here."""
        ns = self._ready(namespace)
        with ns.cond:
            try:
                members = ns.members.changed(workers)
            except ValueError as exc:
                raise _invalid(f"set_workers: {exc}") from exc
            slowest = min((ns.worker_pushes.get(w, 0) for w in ns.members.live
                           if w in members), default=0)
            for worker in members.live - ns.members.live:
                ns.worker_pushes[worker] = slowest
                ns.positions.pop(worker, None)  # a newcomer reads a new partition from 0
            ns.members = members
            self._apply_ready_buckets(ns)
            ns.cond.notify_all()
            return ns.info()

    def finish(self, namespace: str) -> pb.StepInfo:
        ns = self._ready(namespace)
        with ns.cond:
            ns.done = True
            ns.told_done.add(0)
            ns.cond.notify_all()
            return ns.info()

    def report(self, report: pb.StatusReport) -> None:
        ns = self.namespace(report.namespace)
        with ns.cond:
            r = ns.report
            r.loss = report.loss if math.isfinite(report.loss) else r.loss
            r.samples_per_sec = report.samples_per_sec
            if report.has_eval:
                r.eval_accuracy = (report.eval_accuracy if math.isfinite(report.eval_accuracy)
                                   else None)
                r.eval_metrics = dict(report.eval_metrics)
            if report.has_checkpoint:
                if 0 <= ns.checkpoint_wanted <= report.checkpoint_step:
                    ns.checkpoint_wanted = -1  # the requested checkpoint is written
                r.checkpoint_step = report.checkpoint_step
                r.checkpoint_path = report.checkpoint_path
                r.checkpoint_time = report.checkpoint_time
            r.target_steps = report.target_steps or r.target_steps
            if report.sparse_rows >= 0 and (report.sparse_rows or report.sparse_bytes):
                r.sparse_rows, r.sparse_bytes = report.sparse_rows, report.sparse_bytes
            r.updated_time = time.time()

    def _reported(self, namespace: str) -> Namespace:
        """`namespace`, or the most recently reported one when empty."""
        if namespace:
            return self.namespace(namespace)
        candidates = self.namespaces()
        if not candidates:
            raise PSError("NOT_FOUND", "this parameter server holds no namespace yet")
        return max(candidates, key=lambda n: n.report.updated_time)

    def request_checkpoint(self, namespace: str) -> pb.StepInfo:
        """Ask the chief for a checkpoint (it sees `checkpoint_requested` in its next push
        reply or Info); the request stands until it reports one at or after today's step.
        Returns the StepInfo, whose global_step is the step asked for."""
        ns = self._reported(namespace)
        with ns.cond:
            if ns.checkpoint_wanted < 0:
                ns.checkpoint_wanted = ns.global_step
            return ns.info()

    def job_status(self, namespace: str) -> pb.JobStatus:
        """Status of `namespace`, or of the most recently reported one when empty."""
        ns = self._reported(namespace)
        with ns.cond:
            r = ns.report
            return pb.JobStatus(
                namespace=ns.name, global_step=ns.global_step,
                loss=r.loss if r.loss is not None else float("nan"),
                samples_per_sec=r.samples_per_sec or 0.0,
                eval_accuracy=r.eval_accuracy if r.eval_accuracy is not None else float("nan"),
                has_eval=r.eval_accuracy is not None or bool(r.eval_metrics),
                checkpoint_step=r.checkpoint_step if r.checkpoint_step is not None else -1,
                checkpoint_path=r.checkpoint_path, checkpoint_time=r.checkpoint_time,
                has_checkpoint=r.checkpoint_step is not None, done=ns.done,
                target_steps=r.target_steps, initialized=ns.initialized,
                updated_time=r.updated_time, eval_metrics=r.eval_metrics,
                sparse_rows=r.sparse_rows, sparse_bytes=r.sparse_bytes,
                workers=sorted(ns.members.live),
            )

    def workers_informed(self) -> bool:
        """Every worker of every finished namespace has been told the job is done."""
        for ns in self.namespaces():
            with ns.cond:
                if ns.done and not ns.members.live <= ns.told_done:
                    return False
        return True

    def stop(self) -> None:
        self.stopping.set()
        for ns in self.namespaces():
            with ns.cond:
                ns.cond.notify_all()
