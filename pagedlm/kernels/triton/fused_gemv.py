"""GEMVs with the decoder layer's previous op folded in, for decode steps on the GPU (the kernels:
fused_gemv_jit.py):
- rms_norm_gemv: W @ rmsnorm(x + residual), and the new residual: the input norm + QKV and the
  post-attention norm + gate_up of a Llama layer in one launch each;
- silu_mul_gemv: W @ (silu(gate) * up): SiLU-and-mul + the down projection in one launch.

Why: one decode stream of SmolLM2-135M on an H200 (bfloat16, CUDA graphs, 8 scheduler steps,
the Triton GEMV at <= 2 rows) ran at 1004 and 969 tok/s against issue 35's 1000: ~0.75 ms of
kernel time a token, plus ~335 kernels a token with ~0.85 us of idle GPU between them. The
norm and the activation are two or three of a layer's ~11 launches, each a few microseconds of
a few kilobytes; fused, 30 layers launch 90 kernels fewer a token. Whether that pays for the
prologue each GEMV program recomputes (the norm's sum of squares over K = hidden = 576, the
SiLU of its BLOCK_N copies of the row) is for a GPU to measure: the layers use these only under
PAGEDLM_TRITON_FUSED_NORM_ACT=1 (layers/fused_decode.py's TritonFusedLayers).

Numerics: those of the two launches they replace (fused_ops.rms_norm or silu_and_mul, then
gemv.gemv at the same configuration): the same roundings to the activations' dtype, the same
float32 sums in the same K order; bit for bit under Triton's interpreter. On a GPU the norm's
sum of squares is one reduction over the row as in rms_norm_kernel, but a reduction's order
follows the kernel's layout (its warps), so 1/rms may differ in the last float32 bit and, on
rare elements, move a normalised value by one unit of bfloat16.

No host sync and a grid from shapes only: the calls can be captured in a CUDA graph. On CPU
tensors (the interpreter: the tests) the GEMV writes float32 and torch rounds it, as gemv.gemv
does there.
"""
from __future__ import annotations

import torch

from pagedlm.kernels.triton import gemv as _gemv


# Where the plain GEMV's configuration (gemv.default_config) spills with the SiLU prologue:
# ptxas for sm_90 (Triton 3.6, compiled here without a GPU) gave TUNED's 8/64 at 8 rows over
# K = 1536 255 registers and 4.5 KB of spill stores (24 unrolled steps, each holding gate, up
# and their product); 4/128 keeps 78 registers and spills none. The layers send at most
# linear_method.TRITON_GEMV_MAX_ROWS (2) rows, where TUNED's picks do not spill
# (tests/kernels/test_triton_fused_gemv.py compiles them). Another BLOCK_K is another sum
# order: at these shapes the result is the two launches' at this configuration, not gemv's
# default one.
SILU_CONFIGS: dict[tuple[int, int, int], _gemv.GemvConfig] = {
    (8, 576, 1536): _gemv.GemvConfig(4, 128, 1, 4),
}


def _jit():
    # Imported here, not at the top: CPU-only installs need not have Triton.
    from pagedlm.kernels.triton import fused_gemv_jit
    return fused_gemv_jit


def _check(x: torch.Tensor, weight: torch.Tensor, k: int, bias: torch.Tensor | None,
           name: str) -> None:
    if x.dim() != 2 or weight.dim() != 2 or weight.shape[1] != k:
        raise ValueError(f"{name}: x {tuple(x.shape)} does not give weight "
                         f"{tuple(weight.shape)} its {weight.shape[-1]} inputs")
    if x.shape[0] > _gemv.MAX_ROWS:
        raise ValueError(f"{name} takes at most {_gemv.MAX_ROWS} rows, got {x.shape[0]}")
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError(f"{name} needs the rows of x and of the weight contiguous")
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ValueError(f"{name}: bias must be [{weight.shape[0]}], got {tuple(bias.shape)}")


def _config(m: int, n: int, k: int, device: torch.device,
            config: _gemv.GemvConfig | None) -> _gemv.GemvConfig:
    cfg = config or _gemv.default_config(m, n, k, device)
    if cfg.split_k != 1:  # no split-K form: its second launch is what these save
        raise ValueError(f"the fused GEMVs do not split K, got {cfg}")
    return cfg


def rms_norm_gemv(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor,
                  eps: float, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  config: _gemv.GemvConfig | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual [M, K] (M <= 8; rows contiguous), norm_weight [K], weight [N, K] ->
    (y [M, N], new residual [M, K]): y = weight @ RMSNorm(x + residual) + bias and the sum
    x + residual, as fused_ops.rms_norm then gemv.gemv compute them. Without residual: the
    norm of x, and x itself as the residual (the first decoder layer's form). The inputs are
    not modified."""
    _check(x, weight, x.shape[-1], bias, "rms_norm_gemv")
    m, k = x.shape
    n = weight.shape[0]
    if norm_weight.shape != (k,) or norm_weight.stride(0) != 1:
        raise ValueError(f"rms_norm_gemv: norm weight must be [{k}] contiguous")
    if residual is not None and (residual.shape != x.shape or residual.stride(1) != 1
                                 or residual.dtype != x.dtype):
        raise ValueError("rms_norm_gemv: residual must be x's shape and dtype, rows contiguous")
    y = torch.empty((m, n), dtype=torch.float32 if x.is_cpu else x.dtype, device=x.device)
    res_out = torch.empty_like(x, memory_format=torch.contiguous_format) if (
        residual is not None) else x
    if m == 0 or n == 0:
        return y.to(x.dtype), res_out
    cfg = _config(m, n, k, x.device, config)
    res = residual if residual is not None else x
    b = bias if bias is not None else y  # not read without HAS_BIAS
    _jit().rms_norm_gemv_kernel[(_gemv._cdiv(n, cfg.block_n),)](
        x, res, res_out, norm_weight, weight, b, y, m, n, k, eps, x.stride(0), res.stride(0),
        res_out.stride(0), weight.stride(0), y.stride(0), BLOCK_M=_gemv.row_bucket(m),
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, BLOCK_H=_gemv._pow2(k),
        K_STEPS=_gemv._cdiv(k, cfg.block_k), HAS_RESIDUAL=residual is not None,
        HAS_BIAS=bias is not None, num_warps=cfg.num_warps)
    return y.to(x.dtype), res_out


def silu_mul_gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  config: _gemv.GemvConfig | None = None) -> torch.Tensor:
    """x [M, 2I] = [gate, up] (M <= 8; rows contiguous), weight [N, I] -> [M, N]:
    weight @ (silu(gate) * up) + bias, as fused_ops.silu_and_mul then gemv.gemv compute it."""
    if x.dim() != 2 or x.shape[1] % 2:
        raise ValueError(f"silu_mul_gemv: x must be [M, 2I], got {tuple(x.shape)}")
    m, k = x.shape[0], x.shape[1] // 2
    _check(x, weight, k, bias, "silu_mul_gemv")
    n = weight.shape[0]
    y = torch.empty((m, n), dtype=torch.float32 if x.is_cpu else x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y.to(x.dtype)
    cfg = _config(m, n, k, x.device, config or SILU_CONFIGS.get((_gemv.row_bucket(m), n, k)))
    b = bias if bias is not None else y
    _jit().silu_mul_gemv_kernel[(_gemv._cdiv(n, cfg.block_n),)](
        x, weight, b, y, m, n, k, x.stride(0), weight.stride(0), y.stride(0),
        BLOCK_M=_gemv.row_bucket(m), BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        K_STEPS=_gemv._cdiv(k, cfg.block_k), HAS_BIAS=bias is not None,
        num_warps=cfg.num_warps)
    return y.to(x.dtype)
