"""The decoder layer's small ops on the GPU, one Triton launch each: RMSNorm (with the residual
add before it), rotary embedding in place on q and k, SiLU-and-mul.

Why: in PyTorch, RMSNorm is eight launches, rotary about twenty and SiLU-and-mul three. At
decode batch sizes each launch moves a few kilobytes, so the step is launch-bound: a 30-layer
model paid several hundred launches per token for these ops alone. Each is one launch here, and
computes what the PyTorch form in the layer computes (float32 inside, rounded to the
activations' dtype where the PyTorch form rounds), so outputs match it to rounding.

Triton is imported on first use (CPU-only installs need not have it); the tests run these
kernels on CPU tensors under TRITON_INTERPRET=1.
"""
from __future__ import annotations

import torch


def _kernels():
    # Imported here, not at the top: CPU-only installs need not have Triton.
    from pagedlm.kernels.triton import fused_ops_jit as jit
    return jit.rms_norm_kernel, jit.rotary_kernel, jit.silu_and_mul_kernel


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None
             ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """x [T, H] (rows contiguous). With residual: the norm of x + residual, returned with that
    sum, as RMSNorm.forward does (new tensors; the inputs are not modified)."""
    norm_kernel = _kernels()[0]
    t, n = x.shape
    out = torch.empty((t, n), dtype=x.dtype, device=x.device)
    res = residual if residual is not None else x
    res_out = torch.empty_like(out) if residual is not None else out
    if t:
        norm_kernel[(t,)](x, res, res_out, weight, out, x.stride(0), res.stride(0),
                          out.stride(0), n, eps, HAS_RESIDUAL=residual is not None,
                          BLOCK=_next_pow2(n))
    return out if residual is None else (out, res_out)


def rotary_(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
            sin: torch.Tensor) -> None:
    """Rotates q [T, Hq, D] and k [T, Hkv, D] in place (the last dim contiguous); cos/sin
    [max_position, rotary_dim / 2] float32 on the same device."""
    rotary_kernel = _kernels()[1]
    t, hq, _ = q.shape
    hk = k.shape[1]
    half = cos.shape[1]
    if t:
        rotary_kernel[(t, hq + hk)](positions, q, k, cos, sin, q.stride(0), q.stride(1),
                                    k.stride(0), k.stride(1), hq, hk, HALF=half,
                                    BLOCK_HALF=_next_pow2(half))


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[T, 2I] (rows contiguous) -> silu(x[:, :I]) * x[:, I:]."""
    kernel = _kernels()[2]
    t, n2 = x.shape
    n = n2 // 2
    out = torch.empty((t, n), dtype=x.dtype, device=x.device)
    block = min(1024, _next_pow2(n))
    if t:
        kernel[(t, (n + block - 1) // block)](x, out, x.stride(0), out.stride(0), n,
                                              BLOCK=block)
    return out
