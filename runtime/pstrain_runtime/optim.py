"""Optimizers as pure functions over tensors, matching `torch.optim` numerically.

The parameter server keeps, per parameter, an `OptimizerState`: a step count and
named slot tensors (momentum buffer, Adagrad sum, Adam moments). `apply_gradient`
updates the parameter and the slots in place, following the single-tensor
(`foreach=False`) code paths of torch.optim.SGD, Adagrad and Adam, so that a
parameter server and a plain PyTorch loop produce the same numbers.

`apply_gradients` does the same for many parameters at once with torch's multi-tensor
(`torch._foreach_*`) ops: one call per operation for all tensors instead of one per
tensor, which is what a step over many small tensors costs. It performs the very same
operations, in the same order, as `apply_gradient` does per tensor (not those of
torch.optim's own foreach paths, which order some differently), so on the CPU both give
bit-identical results.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch

OptimizerName = Literal["sgd", "momentum", "adagrad", "adam"]
SLOT_NAMES: dict[str, tuple[str, ...]] = {
    "sgd": (),
    "momentum": ("momentum_buffer",),
    "adagrad": ("sum",),
    "adam": ("exp_avg", "exp_avg_sq"),
}

# The hyperparameters each optimizer reads; the others are ignored (and may be left 0).
HYPERPARAMETERS: dict[str, tuple[str, ...]] = {
    "sgd": ("learning_rate", "weight_decay"),
    "momentum": ("learning_rate", "weight_decay", "momentum", "nesterov"),
    "adagrad": ("learning_rate", "weight_decay", "eps", "initial_accumulator_value"),
    "adam": ("learning_rate", "weight_decay", "beta1", "beta2", "eps"),
}


# torch.optim's defaults, so that a job matches torch without setting eps.
DEFAULT_EPS: dict[str, float] = {"adagrad": 1e-10, "adam": 1e-8}


@dataclass(frozen=True)
class OptimizerConfig:
    name: OptimizerName = "sgd"
    learning_rate: float = 0.1
    momentum: float = 0.9
    nesterov: bool = False
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float | None = None  # None: torch.optim's default for `name` (DEFAULT_EPS)
    initial_accumulator_value: float = 0.0

    def __post_init__(self) -> None:
        if self.name not in SLOT_NAMES:
            raise ValueError(
                f"optimizer name is {self.name!r}; it must be one of {sorted(SLOT_NAMES)}"
            )
        if self.eps is None:
            object.__setattr__(self, "eps", DEFAULT_EPS.get(self.name, 1e-8))
        if not self.learning_rate > 0:
            raise ValueError(f"learning rate is {self.learning_rate}; it must be positive")

    @classmethod
    def from_model(cls, optimizer: object) -> OptimizerConfig:
        """From a `pstrain_api.model.Optimizer` (or anything with the same fields)."""
        return cls(**{f: getattr(optimizer, f) for f in cls.__dataclass_fields__})


@dataclass
class OptimizerState:
    step: int = 0
    slots: dict[str, torch.Tensor] = field(default_factory=dict)


def hyperparameter_problem(config: OptimizerConfig) -> str | None:
    """What is wrong with `config`'s hyperparameters, as one line naming the field and
    its value, or None. The rules are the API's (`pstrain_api.model.Optimizer`: finite,
    learning rate > 0, momentum and betas in [0, 1), eps > 0, ...), checked on the fields
    the named optimizer reads; every other number must be finite."""
    from pstrain_api.model import Optimizer  # pydantic: only where configs come in
    from pydantic import ValidationError

    for name in sorted(OptimizerConfig.__dataclass_fields__):
        value = getattr(config, name)
        if isinstance(value, float) and not math.isfinite(value):
            return f"optimizer.{name} is {value}; it must be a finite number"
    used = {name: getattr(config, name) for name in HYPERPARAMETERS.get(config.name, ())}
    try:
        Optimizer.model_validate({"name": config.name, **used})
    except ValidationError as exc:
        error = exc.errors()[0]
        field = ".".join(str(part) for part in error["loc"]) or "name"
        rule = error["msg"].replace("Input should be", "it must be", 1)
        return f"optimizer.{field} is {error.get('input')!r}; {rule}"
    return None


def init_state(config: OptimizerConfig, param: torch.Tensor) -> OptimizerState:
    slots = {}
    for slot in SLOT_NAMES[config.name]:
        fill = config.initial_accumulator_value if slot == "sum" else 0.0
        slots[slot] = torch.full_like(param, fill, memory_format=torch.contiguous_format)
    return OptimizerState(step=0, slots=slots)


def torch_optimizer(config: OptimizerConfig, params: list[torch.Tensor]) -> torch.optim.Optimizer:
    """The torch.optim optimizer these functions match (for tests and the reference loop)."""
    if config.name == "sgd":
        return torch.optim.SGD(params, lr=config.learning_rate,
                               weight_decay=config.weight_decay, foreach=False)
    if config.name == "momentum":
        return torch.optim.SGD(params, lr=config.learning_rate, momentum=config.momentum,
                               nesterov=config.nesterov, weight_decay=config.weight_decay,
                               foreach=False)
    if config.name == "adagrad":
        return torch.optim.Adagrad(
            params, lr=config.learning_rate, weight_decay=config.weight_decay,
            initial_accumulator_value=config.initial_accumulator_value, eps=config.eps,
            foreach=False)
    return torch.optim.Adam(params, lr=config.learning_rate, betas=(config.beta1, config.beta2),
                            eps=config.eps, weight_decay=config.weight_decay, foreach=False)


def apply_gradient(config: OptimizerConfig, param: torch.Tensor, grad: torch.Tensor,
                   state: OptimizerState) -> None:
    """One optimizer step for one parameter, in place. `grad` may be modified."""
    if config.weight_decay:
        grad = grad.add(param, alpha=config.weight_decay)
    name = config.name
    lr = config.learning_rate
    if name == "sgd":
        param.add_(grad, alpha=-lr)
    elif name == "momentum":
        buf = state.slots["momentum_buffer"]
        if state.step == 0:
            buf.copy_(grad)
        else:
            buf.mul_(config.momentum).add_(grad)
        step_dir = grad.add(buf, alpha=config.momentum) if config.nesterov else buf
        param.add_(step_dir, alpha=-lr)
    elif name == "adagrad":
        acc = state.slots["sum"]
        acc.addcmul_(grad, grad, value=1)
        std = acc.sqrt().add_(config.eps)
        param.addcdiv_(grad, std, value=-lr)
    else:
        exp_avg, exp_avg_sq = state.slots["exp_avg"], state.slots["exp_avg_sq"]
        t = state.step + 1
        exp_avg.lerp_(grad, 1 - config.beta1)
        exp_avg_sq.mul_(config.beta2).addcmul_(grad, grad.conj(), value=1 - config.beta2)
        bias_correction1 = 1 - config.beta1 ** t
        bias_correction2 = 1 - config.beta2 ** t
        step_size = lr / bias_correction1
        denom = (exp_avg_sq.sqrt() / math.sqrt(bias_correction2)).add_(config.eps)
        param.addcdiv_(exp_avg, denom, value=-step_size)
    state.step += 1


def apply_gradients(config: OptimizerConfig, params: Sequence[torch.Tensor],
                    grads: Sequence[torch.Tensor], states: Sequence[OptimizerState]) -> None:
    """`apply_gradient` for each (param, grad, state), in place, with multi-tensor ops.

    Parameters whose states are at different steps are updated in groups of equal step
    (the first momentum step copies the gradient; Adam's bias correction depends on the
    step). `grads` may be modified."""
    if not len(params) == len(grads) == len(states):
        raise ValueError(f"apply_gradients got {len(params)} parameters, {len(grads)} "
                         f"gradients and {len(states)} states; they must match one to one")
    if len(params) == 1:  # one tensor: the single-tensor ops cost less
        apply_gradient(config, params[0], grads[0], states[0])
        return
    groups: dict[int, list[int]] = {}
    for index, state in enumerate(states):
        groups.setdefault(state.step, []).append(index)
    for step, indices in groups.items():
        if len(indices) == len(params):
            _apply_foreach(config, step, list(params), list(grads), list(states))
        else:
            _apply_foreach(config, step, [params[i] for i in indices],
                           [grads[i] for i in indices], [states[i] for i in indices])


def _apply_foreach(config: OptimizerConfig, step: int, params: list[torch.Tensor],
                   grads: list[torch.Tensor], states: list[OptimizerState]) -> None:
    """One step for tensors whose states are all at `step` (the ops of `apply_gradient`)."""
    if config.weight_decay:
        grads = list(torch._foreach_add(grads, params, alpha=config.weight_decay))
    name = config.name
    lr = config.learning_rate
    if name == "sgd":
        torch._foreach_add_(params, grads, alpha=-lr)
    elif name == "momentum":
        bufs = [s.slots["momentum_buffer"] for s in states]
        if step == 0:
            torch._foreach_copy_(bufs, grads)
        else:
            torch._foreach_mul_(bufs, config.momentum)
            torch._foreach_add_(bufs, grads)
        step_dirs = (torch._foreach_add(grads, bufs, alpha=config.momentum)
                     if config.nesterov else bufs)
        torch._foreach_add_(params, step_dirs, alpha=-lr)
    elif name == "adagrad":
        accs = [s.slots["sum"] for s in states]
        torch._foreach_addcmul_(accs, grads, grads, value=1)
        stds = torch._foreach_sqrt(accs)
        torch._foreach_add_(stds, config.eps)
        torch._foreach_addcdiv_(params, grads, stds, value=-lr)
    else:
        exp_avgs = [s.slots["exp_avg"] for s in states]
        exp_avg_sqs = [s.slots["exp_avg_sq"] for s in states]
        t = step + 1
        torch._foreach_lerp_(exp_avgs, grads, 1 - config.beta1)
        torch._foreach_mul_(exp_avg_sqs, config.beta2)
        torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1 - config.beta2)
        bias_correction1 = 1 - config.beta1 ** t
        bias_correction2 = 1 - config.beta2 ** t
        step_size = lr / bias_correction1
        denoms = torch._foreach_sqrt(exp_avg_sqs)
        torch._foreach_div_(denoms, math.sqrt(bias_correction2))
        torch._foreach_add_(denoms, config.eps)
        torch._foreach_addcdiv_(params, exp_avgs, denoms, value=-step_size)
    for state in states:
        state.step += 1
