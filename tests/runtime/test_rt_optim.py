"""Each optimizer matches torch.optim step for step."""

from __future__ import annotations

import pytest
import torch

from pstrain_runtime.optim import OptimizerConfig, apply_gradient, init_state, torch_optimizer

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
