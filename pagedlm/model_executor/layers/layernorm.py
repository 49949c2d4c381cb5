"""RMSNorm, optionally fused with the residual add that precedes it; Gemma's (1 + w) variant.

float32 rows go through the native library's one-call kernel (pagedlm/kernels/fused_ops.py)
where it is available: the PyTorch form is eight dispatches (add, float, pow, mean, add, rsqrt,
mul, mul), which at batch 1 cost far more than the arithmetic (figures in that module). On a GPU,
rows go through one Triton launch (pagedlm/kernels/triton/fused_ops.py) for the same reason.
"""
from __future__ import annotations

import torch
from torch import nn

from pagedlm import kernels
from pagedlm.kernels.triton import fused_ops as triton_ops


class RMSNorm(nn.Module):

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        # Decided once: the library builds (or not) for the whole process.
        self.native = kernels.available()

    def _native_ok(self, x: torch.Tensor) -> bool:
        return (self.native and x.dtype is torch.float32 and self.weight.dtype is torch.float32
                and x.dim() == 2 and x.stride(1) == 1 and x.device.type == "cpu")

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 as HF does, then cast back, so bf16 runs match it too.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)

    def _triton_ok(self, x: torch.Tensor) -> bool:
        return (x.is_cuda and x.dim() == 2 and x.stride(1) == 1
                and self.weight.dtype is x.dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if self._native_ok(x) and (residual is None or self._native_ok(residual)):
            return kernels.fused_ops.rms_norm(x, self.weight, self.eps, residual)
        if self._triton_ok(x) and (residual is None or self._triton_ok(residual)):
            return triton_ops.rms_norm(x, self.weight, self.eps, residual)
        if residual is None:
            return self._norm(x)
        residual = x + residual
        return self._norm(residual), residual


class GemmaRMSNorm(nn.Module):
    """RMSNorm whose weight is stored as an offset from one: x_hat * (1 + w).

    Unlike RMSNorm, the weight is applied in float32 before the cast back, as transformers'
    Gemma norms do, so low-precision runs round the same way."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * (1.0 + self.weight.float())).to(x.dtype)
