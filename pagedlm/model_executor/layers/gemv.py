"""Float32 linear layers at decode batch sizes, through the native kernel of csrc/gemv_f32.c.

A decode step multiplies one row per running sequence by every weight matrix, so with few
sequences the step's time is how fast the weights stream from memory. The kernel reads them
as fast as oneDNN's packed GEMM or faster, and about twice as fast as torch's, at those shapes
(see the C file); past GEMV_MAX_ROWS rows the GEMM's blocking wins and the layer uses it.

Built and cached like the attention kernels (`pagedlm.attention.kernels._build`);
`PAGEDLM_DISABLE_KERNELS=1` or a failed build leaves every layer on its GEMM path.
"""
from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

import torch

from pagedlm.attention.kernels import _build, kernels_disabled

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).parent / "csrc" / "gemv_f32.c"
# Measured (benchmarks/gemv.py: every matrix of SmolLM2-135M once, float32, 2 threads): on an
# AVX2-only EPYC the kernel against oneDNN's pre-packed GEMM took 30 vs 43 ms at 1 row, 42 vs 49
# at 4, 63 vs 69 at 8 and 100 vs 105 at 16; on an AVX-512 EPYC the two tie at 1 to 4 rows and
# oneDNN wins at 8 (24 vs 34 ms). 8 is kept because the fused decode stack (models/llama.py),
# which saves more than that per step, runs only on this kernel.
GEMV_MAX_ROWS = 8


@functools.lru_cache(maxsize=None)
def load_library() -> ctypes.CDLL | None:
    try:
        lib = ctypes.CDLL(str(_build((_SOURCE,), name="pagedlm_gemv")))
    except Exception as exc:  # noqa: BLE001 - any failure means "use the GEMM path"
        logger.warning("pagedlm float32 GEMV kernel unavailable, using the GEMM path: %s", exc)
        return None
    p, i = ctypes.c_void_p, ctypes.c_int
    lib.gemv_f32.argtypes = [p, p, p, i, i, i, i]
    lib.gemv_f32.restype = None
    return lib


def available() -> bool:
    return not kernels_disabled() and load_library() is not None


def runs(weight: torch.Tensor) -> bool:
    """Whether `weight` [N, K] can go through the kernel (checked once, when the layer loads)."""
    return (weight.dtype == torch.float32 and weight.dim() == 2 and weight.is_contiguous()
            and weight.device.type == "cpu" and available())


def gemv(x: torch.Tensor, weight: torch.Tensor,
         bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ weight[N, K]^T (+ bias) -> [M, N]; `weight` must pass `runs`, and x be
    float32 [M, K] (copied to a contiguous tensor if it is not)."""
    n, k = weight.shape
    if x.dim() != 2 or x.shape[1] != k or x.dtype != torch.float32:
        raise ValueError(f"gemv: x must be float32 [M, {k}], got {x.dtype} {tuple(x.shape)}")
    x = x.contiguous()
    m = x.shape[0]
    y = torch.empty(m, n, dtype=torch.float32)
    if m:
        load_library().gemv_f32(y.data_ptr(), x.data_ptr(), weight.data_ptr(), m, n, k,
                                torch.get_num_threads())
    return y.add_(bias) if bias is not None else y
