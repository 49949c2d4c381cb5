"""The gated activations of Llama-style (SiLU) and Gemma-style (GELU) MLPs."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    """x = [gate, up] along the last dim -> silu(gate) * up."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


class GeluAndMul(nn.Module):
    """x = [gate, up] along the last dim -> gelu(gate) * up (GeGLU).

    approximate: "tanh" (transformers' gelu_pytorch_tanh, Gemma's) or "none" (exact erf)."""

    def __init__(self, approximate: str = "tanh") -> None:
        super().__init__()
        if approximate not in ("tanh", "none"):
            raise ValueError(f"GELU approximate must be 'tanh' or 'none', got {approximate!r}.")
        self.approximate = approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate=self.approximate) * up

    def extra_repr(self) -> str:
        return f"approximate={self.approximate!r}"
