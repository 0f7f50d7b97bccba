"""Each optimizer matches torch.optim step for step, and the multi-tensor apply matches
the per-tensor one bit for bit."""

from __future__ import annotations

import pytest
import torch

from pstrain_runtime.optim import (
    OptimizerConfig,
    apply_gradient,
    apply_gradients,
    init_state,
    torch_optimizer,
)

CONFIGS = {
    "sgd": OptimizerConfig(name="sgd", learning_rate=0.1),
    "sgd-weight-decay": OptimizerConfig(name="sgd", learning_rate=0.1, weight_decay=0.01),
    "momentum": OptimizerConfig(name="momentum", learning_rate=0.05, momentum=0.9),
    "nesterov": OptimizerConfig(name="momentum", learning_rate=0.05, momentum=0.8,
                                nesterov=True, weight_decay=0.001),
    "adagrad": OptimizerConfig(name="adagrad", learning_rate=0.1),
    "adagrad-initial-accumulator": OptimizerConfig(name="adagrad", learning_rate=0.1,
                                                   initial_accumulator_value=0.5, eps=1e-6),
    "adam": OptimizerConfig(name="adam", learning_rate=0.01),
    "adam-weight-decay": OptimizerConfig(name="adam", learning_rate=0.01, beta1=0.8,
                                         beta2=0.99, weight_decay=0.1, eps=1e-6),
}


@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
def test_matches_torch_optim(config: OptimizerConfig) -> None:
    gen = torch.Generator().manual_seed(0)
    start = torch.randn(17, 5, generator=gen)
    grads = [torch.randn(17, 5, generator=gen) for _ in range(6)]

    reference = start.clone().requires_grad_(True)
    opt = torch_optimizer(config, [reference])
    ours = start.clone()
    state = init_state(config, ours)
    for grad in grads:
        reference.grad = grad.clone()
        opt.step()
        apply_gradient(config, ours, grad.clone(), state)
    torch.testing.assert_close(ours, reference.detach(), rtol=0, atol=1e-6)
    assert state.step == len(grads)


def test_unknown_optimizer_is_rejected_with_its_name() -> None:
    with pytest.raises(ValueError, match="optimizer name is 'rmsprop'"):
        OptimizerConfig(name="rmsprop")  # type: ignore[arg-type]


SHAPES = [(17, 5), (3,), (4, 2, 2), (1,)]


def _random(shapes: list[tuple[int, ...]], gen: torch.Generator) -> list[torch.Tensor]:
    return [torch.randn(shape, generator=gen) for shape in shapes]


@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
def test_multi_tensor_apply_matches_torch_optim(config: OptimizerConfig) -> None:
    gen = torch.Generator().manual_seed(1)
    start = _random(SHAPES, gen)
    references = [t.clone().requires_grad_(True) for t in start]
    opt = torch_optimizer(config, references)
    ours = [t.clone() for t in start]
    states = [init_state(config, t) for t in ours]
    for _ in range(6):
        grads = _random(SHAPES, gen)
        for reference, grad in zip(references, grads, strict=True):
            reference.grad = grad.clone()
        opt.step()
        apply_gradients(config, ours, [g.clone() for g in grads], states)
    for mine, reference in zip(ours, references, strict=True):
        torch.testing.assert_close(mine, reference.detach(), rtol=0, atol=1e-6)
    assert [s.step for s in states] == [6] * len(SHAPES)


@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
def test_multi_tensor_apply_equals_per_tensor_apply_bit_for_bit(config: OptimizerConfig) -> None:
    # States at different steps (as restored from a checkpoint, or a tensor pushed less
    # often): the first momentum step and Adam's bias correction depend on the step.
    gen = torch.Generator().manual_seed(2)
    start = _random(SHAPES, gen)
    single, multi = [t.clone() for t in start], [t.clone() for t in start]
    single_states = [init_state(config, t) for t in single]
    multi_states = [init_state(config, t) for t in multi]
    for states in (single_states, multi_states):
        states[1].step = 3
        states[3].step = 3
    for _ in range(4):
        grads = _random(SHAPES, gen)
        for param, grad, state in zip(single, grads, single_states, strict=True):
            apply_gradient(config, param, grad.clone(), state)
        apply_gradients(config, multi, [g.clone() for g in grads], multi_states)
    for a, b, sa, sb in zip(single, multi, single_states, multi_states, strict=True):
        assert torch.equal(a, b)
        assert sa.step == sb.step
        assert sa.slots.keys() == sb.slots.keys()
        assert all(torch.equal(sa.slots[k], sb.slots[k]) for k in sa.slots)


def test_multi_tensor_apply_updates_lower_precision_parameters_like_per_tensor() -> None:
    config = CONFIGS["momentum"]
    params = [torch.ones(8, dtype=torch.bfloat16), torch.ones(3, dtype=torch.float16)]
    single = [p.clone() for p in params]
    grads = [torch.full((8,), 0.3), torch.full((3,), 0.7)]
    states = [init_state(config, p) for p in params]
    single_states = [init_state(config, p) for p in single]
    apply_gradients(config, params, [g.clone() for g in grads], states)
    for param, grad, state in zip(single, grads, single_states, strict=True):
        apply_gradient(config, param, grad.clone(), state)
    assert all(torch.equal(a, b) for a, b in zip(params, single, strict=True))
    assert [p.dtype for p in params] == [torch.bfloat16, torch.float16]


def test_multi_tensor_apply_of_nothing_does_nothing_and_mismatches_are_named() -> None:
    apply_gradients(CONFIGS["adam"], [], [], [])
    with pytest.raises(ValueError, match="got 1 parameters, 2 gradients and 1 states"):
        apply_gradients(CONFIGS["sgd"], [torch.zeros(1)], [torch.zeros(1)] * 2,
                        [init_state(CONFIGS["sgd"], torch.zeros(1))])
