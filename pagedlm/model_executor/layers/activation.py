"""Activations: the gated ones of Llama-style (SiLU) and Gemma-style (GELU) MLPs, and the
plain ones of OPT / GPT-2 / Phi-3 by their HF config names."""
from __future__ import annotations

from functools import partial
from types import MappingProxyType
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from pagedlm import kernels
from pagedlm.kernels.triton import fused_ops as triton_ops


def per_element(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """fn(x) for an elementwise `fn`, with every element through the same code (deterministic
    mode). On a contiguous tensor torch computes whole vector blocks with one routine (Sleef's
    exp, tanh, ...) and the leftover elements, and each thread's ragged chunk edges, with the
    scalar one; the two differ in the last bit, so an element's result would depend on where it
    sits in the batch. A strided view sends every element through the scalar loop."""
    strided = torch.empty(x.numel(), 2, dtype=x.dtype, device=x.device)[:, 0]
    strided.copy_(x.reshape(-1))
    return fn(strided).reshape(x.shape)


class PerElement(nn.Module):
    """An elementwise activation module run through `per_element` (deterministic mode)."""

    def __init__(self, act: nn.Module) -> None:
        super().__init__()
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return per_element(self.act, x)


class SiluAndMul(nn.Module):
    """x = [gate, up] along the last dim -> silu(gate) * up; float32 [T, 2I] in one native call
    (the PyTorch form is chunk, silu, mul: three dispatches)."""

    def __init__(self) -> None:
        super().__init__()
        self.native = kernels.available()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (self.native and x.dtype is torch.float32 and x.dim() == 2 and x.stride(1) == 1
                and x.device.type == "cpu"):
            return kernels.fused_ops.silu_and_mul(x)
        if x.is_cuda and x.dim() == 2 and x.stride(1) == 1:  # one Triton launch instead of 3
            return triton_ops.silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


class GeluAndMul(nn.Module):
    """x = [gate, up] along the last dim -> gelu(gate) * up (GeGLU).

    approximate: "tanh" (transformers' gelu_pytorch_tanh, Gemma's) or "none" (exact erf).
    deterministic: every element through torch's scalar loop (`per_element`)."""

    def __init__(self, approximate: str = "tanh", deterministic: bool = False) -> None:
        super().__init__()
        if approximate not in ("tanh", "none"):
            raise ValueError(f"GELU approximate must be 'tanh' or 'none', got {approximate!r}.")
        self.approximate, self.deterministic = approximate, deterministic

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        gelu = partial(F.gelu, approximate=self.approximate)
        return (per_element(gelu, gate) if self.deterministic else gelu(gate)) * up

    def extra_repr(self) -> str:
        return f"approximate={self.approximate!r}"


# HF activation names -> a factory. "gelu_new" and "gelu_pytorch_tanh" are both the tanh
# approximation of GELU (GPT-2's name and torch's); plain "gelu" is the exact erf form.
_ACTIVATIONS = MappingProxyType({
    "relu": nn.ReLU,
    "gelu": nn.GELU,
    "gelu_new": lambda: nn.GELU(approximate="tanh"),
    "gelu_pytorch_tanh": lambda: nn.GELU(approximate="tanh"),
    "silu": nn.SiLU,
})


def get_act_fn(name: str, field: str = "hidden_act", deterministic: bool = False) -> nn.Module:
    """The activation module for an HF config's activation name. `field` is the config key the
    name came from (hidden_act, activation_function), so an unsupported one is reported there.
    deterministic: wrapped in PerElement (ReLU is exact either way)."""
    factory = _ACTIVATIONS.get(name) if isinstance(name, str) else None
    if factory is None:
        raise ValueError(f"{field} {name!r} is not supported; pagedlm supports "
                         f"{', '.join(sorted(_ACTIVATIONS))}.")
    act = factory()
    return PerElement(act) if deterministic and not isinstance(act, nn.ReLU) else act
