"""The model's parameters on this worker, and the CPU tensors the transport reads and
writes: the parameters themselves on CPU, pinned mirrors of them (and of their
gradients) on CUDA.

A pull writes the servers' parameters into `mirror`, and `copy_in` makes them the
model's; a push reads the gradients through `grad_cpu`. `fresh` says the mirror already
holds the parameters the last push brought back (an async push_pull, or a pipelined
push that landed), so the next step needs no pull.
"""

from __future__ import annotations

import torch
from torch import nn


class LocalParameters:
    def __init__(self, model: nn.Module, device: torch.device) -> None:
        self.device = device
        self.params = dict(model.named_parameters())
        on_cpu = device.type == "cpu"
        self.mirror: dict[str, torch.Tensor] = {}
        for name, p in self.params.items():
            if on_cpu and p.data.is_contiguous():
                self.mirror[name] = p.data
            else:
                self.mirror[name] = torch.empty(p.shape, dtype=p.dtype, pin_memory=not on_cpu)
                self.mirror[name].copy_(p.detach())  # the chief installs these values
        self.grad_mirror: dict[str, torch.Tensor] = {}
        self.fresh = False  # the mirror holds parameters pulled by the last push

    def copy_in(self) -> None:
        if self.device.type != "cpu":
            for name, p in self.params.items():
                p.data.copy_(self.mirror[name], non_blocking=True)
        else:
            for name, p in self.params.items():
                if p.data.data_ptr() != self.mirror[name].data_ptr():
                    p.data.copy_(self.mirror[name])

    def zero_grads(self) -> None:
        """`model.zero_grad(set_to_none=False)` for leaf gradients in one multi-tensor
        op, without walking the module tree every step."""
        grads = [p.grad for p in self.params.values() if p.grad is not None]
        if grads:
            torch._foreach_zero_(grads)

    def grad_cpu(self, name: str) -> torch.Tensor:
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
