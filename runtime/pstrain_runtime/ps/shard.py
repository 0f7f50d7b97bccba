"""The dense shard: this server's parameters and their optimizer state.

- Init (and a restore, which is an Init carrying slots, slot steps and positions)
  allocates only what its header announces as the body, within `max_init_bytes`, reads
  and checks everything before it replaces the namespace's state (`install`), and
  starts a new generation.
- `apply` runs the optimizer on the shard (the step rules decide when).
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
from pstrain_api.membership import WorkerSet

from ..optim import (SLOT_NAMES, OptimizerConfig, OptimizerState, apply_gradients,
                     hyperparameter_problem, init_state)
from ..proto import ps_pb2 as pb
from ..transport import wire
from .errors import PSError, invalid
from .grads import GRAD_DTYPES, is_all_finite, take
from .membership import new_generation
from .streams import read_body, read_header

if TYPE_CHECKING:
    from .namespace import Namespace

SLOT_SEPARATOR = "@"


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
        raise invalid(f"init: {exc}") from exc
    problem = hyperparameter_problem(config)
    if problem is not None:
        raise invalid(f"init: {problem}")
    return config


def optimizer_to_pb(config: OptimizerConfig) -> pb.OptimizerSpec:
    return pb.OptimizerSpec(
        name=config.name, learning_rate=config.learning_rate, momentum=config.momentum,
        nesterov=config.nesterov, weight_decay=config.weight_decay, beta1=config.beta1,
        beta2=config.beta2, eps=config.eps,
        initial_accumulator_value=config.initial_accumulator_value,
    )


def physical_memory() -> int:
    """This machine's memory in bytes: no Init may claim more."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):  # pragma: no cover - a platform without sysconf names
        return 1 << 40


# ---------------------------------------------------------------------- init / restore
@dataclass
class Restored:
    """An Init, read and checked: what `install` makes the namespace's state."""

    header: pb.StreamHeader
    config: OptimizerConfig
    params: dict[str, torch.Tensor]
    states: dict[str, OptimizerState]


def check_init_header(header: pb.StreamHeader) -> OptimizerConfig:
    if not header.namespace:
        raise invalid("init: namespace is empty; every request must name a namespace")
    config = optimizer_from_pb(header.optimizer)
    if header.mode not in ("async", "sync"):
        raise invalid(f"init: mode is {header.mode!r}; it must be async or sync")
    if header.num_workers < 1:
        raise invalid(f"init: num_workers is {header.num_workers}; it must be at least 1")
    if header.global_step < 0:
        raise invalid(f"init: global_step is {header.global_step}; it must be >= 0")
    return config


def check_init_sizes(header: pb.StreamHeader, max_init_bytes: int,
                     ps_index: int) -> list[torch.dtype]:
    """The dtypes of an Init's tensors, once their sizes are known to be sane: checked
    against the body the header announces and `max_init_bytes` before anything is
    allocated (a few header bytes must not make the server allocate 100 GB)."""
    dtypes: list[torch.dtype] = []
    claimed = 0
    for meta in header.tensors:
        try:
            dtype = wire.parse_dtype(meta.dtype)
        except wire.WireError as exc:
            raise invalid(f"init: tensor {meta.name!r}: {exc}") from exc
        if any(d < 0 for d in meta.shape):
            raise invalid(f"init: tensor {meta.name!r} has a negative dimension")
        dtypes.append(dtype)
        claimed += math.prod(meta.shape) * dtype.itemsize
    if claimed != header.total_bytes:
        raise invalid(f"init: the tensors' shapes add up to {claimed} bytes but the "
                      f"header announces a body of {header.total_bytes} bytes; "
                      "they must agree")
    if claimed > max_init_bytes:
        raise PSError("RESOURCE_EXHAUSTED",
                      f"init: the tensors hold {claimed} bytes, more than the "
                      f"{max_init_bytes} bytes parameter server {ps_index} "
                      "accepts in one namespace (its memory)")
    return dtypes


def allocate(header: pb.StreamHeader, dtypes: list[torch.dtype], config: OptimizerConfig,
             ps_index: int) -> tuple[dict[str, torch.Tensor],
                                     dict[str, dict[str, torch.Tensor]], list[np.ndarray]]:
    """Empty parameters and slots for an Init's tensors, and their byte targets in
    header order."""
    params: dict[str, torch.Tensor] = {}
    slots: dict[str, dict[str, torch.Tensor]] = {}
    targets: list[np.ndarray] = []
    for meta, dtype in zip(header.tensors, dtypes, strict=True):
        try:
            tensor = torch.empty(tuple(meta.shape), dtype=dtype)
        except RuntimeError as exc:  # the allocator's refusal
            raise PSError("RESOURCE_EXHAUSTED",
                          f"init: tensor {meta.name!r} of shape {list(meta.shape)} "
                          f"cannot be allocated on parameter server {ps_index}: "
                          f"{exc}") from exc
        key, sep, slot = meta.name.partition(SLOT_SEPARATOR)
        if sep:
            if slot not in SLOT_NAMES[config.name]:
                raise invalid(
                    f"init: slot {slot!r} of {key!r} does not belong to optimizer "
                    f"{config.name} (slots: {list(SLOT_NAMES[config.name])})"
                )
            slots.setdefault(key, {})[slot] = tensor
        else:
            if key in params:
                raise invalid(f"init: tensor {key!r} appears twice")
            if dtype not in GRAD_DTYPES:
                raise invalid(f"init: parameter {key!r} has dtype {meta.dtype}; "
                              "parameters must be floating point")
            params[key] = tensor
        targets.append(wire.byte_view(tensor))
    return params, slots, targets


def check_slots(header: pb.StreamHeader, params: dict[str, torch.Tensor],
                slots: dict[str, dict[str, torch.Tensor]]) -> None:
    for key, named in slots.items():
        if key not in params:
            raise invalid(f"init: slots for {key!r} but no such parameter")
        for slot, tensor in named.items():
            if tensor.shape != params[key].shape:
                raise invalid(f"init: slot {key}@{slot} has shape {list(tensor.shape)}, "
                              f"the parameter has {list(params[key].shape)}")
    if slots and len(header.slot_steps) != len(params):
        raise invalid(f"init: {len(header.slot_steps)} slot steps for {len(params)} "
                      "parameters; send one per parameter, in header order")


def build_states(header: pb.StreamHeader, config: OptimizerConfig,
                 params: dict[str, torch.Tensor],
                 slots: dict[str, dict[str, torch.Tensor]]) -> dict[str, OptimizerState]:
    """Fresh optimizer state per parameter, or (a restore) the slots the Init carried."""
    states: dict[str, OptimizerState] = {}
    with_slots = bool(slots)
    steps = dict(zip(params, header.slot_steps, strict=False)) if with_slots else {}
    for key, tensor in params.items():
        state = init_state(config, tensor)
        if with_slots:
            missing = set(SLOT_NAMES[config.name]) - set(slots.get(key, {}))
            if missing:
                raise invalid(f"init: parameter {key!r} lacks slots {sorted(missing)}")
            state.slots = slots[key]
            state.step = int(steps[key])
        states[key] = state
    return states


def read_init(messages: Iterator[bytes], max_init_bytes: int, ps_index: int) -> Restored:
    """An Init stream, read and checked; nothing of the namespace is touched yet."""
    header = read_header(messages, pb.STREAM_KIND_INIT)
    config = check_init_header(header)
    dtypes = check_init_sizes(header, max_init_bytes, ps_index)
    params, slots, targets = allocate(header, dtypes, config, ps_index)
    check_slots(header, params, slots)
    read_body(header, messages, targets)
    for key, tensor in params.items():
        if not is_all_finite(tensor):
            raise invalid(f"init: parameter {key!r} contains NaN or inf")
    return Restored(header, config, params, build_states(header, config, params, slots))



def install(ns: Namespace, restored: Restored) -> pb.StepInfo:
    """Make a read Init the namespace's state: a new generation, every wait ended, per
    worker and per step tables cleared (ns.cond held)."""
    header = restored.header
    if ns.initialized and ns.fingerprint != header.fingerprint:
        raise PSError(
            "FAILED_PRECONDITION",
            f"namespace {header.namespace!r} already holds a different model "
            "(fingerprint mismatch); use another namespace for another model",
        )
    params = restored.params
    ns.params, ns.states, ns.config = params, restored.states, restored.config
    ns.shapes = {key: tuple(tensor.shape) for key, tensor in params.items()}
    ns.metas = {key: wire.meta_of(key, tensor) for key, tensor in params.items()}
    ns.optimizer_pb = optimizer_to_pb(restored.config)
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
    ns.scratch.clear()
    ns.done = False
    ns.told_done.clear()
    ns.initialized = True
    ns.epoch += 1
    ns.generation = new_generation(ns.generation)
    ns.cond.notify_all()
    return ns.info()


# ---------------------------------------------------------------------- apply
def apply(ns: Namespace, grads: dict[str, torch.Tensor]) -> None:
    """One optimizer step on the parameters of `grads` (ns.cond held). Reduced-precision
    gradients are widened into pooled float32 buffers first."""
    widened = {key: take(ns, key, torch.float32).copy_(grad)
               for key, grad in grads.items() if grad.dtype != torch.float32}
    try:
        apply_gradients(ns.config, [ns.params[key] for key in grads],
                        [widened.get(key, grad) for key, grad in grads.items()],
                        [ns.states[key] for key in grads])
    finally:
        for key, buf in widened.items():
            ns.scratch.give(key, buf)
