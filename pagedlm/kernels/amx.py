"""bfloat16 linear layers on AMX's tile unit (csrc/amx_bf16.c): many rows of float32 x against
the bfloat16 panels that gemv.pack_panels packs (32 wide, the AVX-512 build's). A build with
AMX has AVX512-BF16, so they are k-pairs (gemv.bf16_pairs()), AMX's B-tile layout as they
stand: no second copy of the weight is kept.

x is rounded to bfloat16 once per call and the products of each k-pair are summed in float32
by tdpbf16ps: not gemv.gemm_panels's bits, but each row's result still depends on that row
alone (the same alone or in any batch, on one CPU). The layers use it only at many rows
outside the deterministic mode (linear_method.UnquantizedLinearMethod.apply).
"""
from __future__ import annotations

import ctypes
import functools

import torch

import pagedlm.kernels.gemv as gemv
from pagedlm.kernels.loader import typed_library

_p, _i = ctypes.c_void_p, ctypes.c_int
library = typed_library({
    "amx_bf16_available": ([], _i),
    "gemm_panels_bf16_amx": ([_p, _p, _p, _i, _i, _i, _i], None),
})

# The kernel takes K in steps of 32 (16 k-pairs, one A tile's row); gemm_panels_bf16_amx hands
# any other K to gemm_panels_bf16 (the panel kernel), so callers check `runs(k)` to know which
# one they get.
K_STEP = 32


@functools.lru_cache(maxsize=None)
def _granted() -> bool:
    # Asks Linux for the tile data permission (arch_prctl) the first time: once per process.
    return bool(library().amx_bf16_available())


def available() -> bool:
    """True where the build has AMX-BF16 (the library is built with -march=native on a CPU with
    it), Linux granted this process the tile data permission, and bfloat16 panels are 32 wide
    for the kernel to read."""
    return torch.bfloat16 in gemv.panel_dtypes() and gemv.panel_width() == 32 and _granted()


def runs(k: int) -> bool:
    """Whether the AMX kernel itself takes a K (a multiple of K_STEP) where available()."""
    return k % K_STEP == 0


def gemm_panels(x: torch.Tensor, panels: torch.Tensor, n: int,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] float32 @ W^T (+ bias) -> float32 [M, n] on the tile unit, for the bfloat16
    k-pair `panels` [ceil(n / 32), K / 2, 32, 2] that gemv.pack_panels made of W [n, K]. K not
    a multiple of K_STEP runs on gemv.gemm_panels's kernel instead."""
    if not available():
        raise RuntimeError("amx.gemm_panels: AMX-BF16 is not available here")
    if (panels.dtype != torch.bfloat16 or panels.dim() != 4 or panels.shape[2:] != (32, 2)
            or not panels.is_contiguous()):
        raise ValueError(f"amx.gemm_panels: panels must be contiguous bfloat16 "
                         f"[P, K / 2, 32, 2], got {panels.dtype} {tuple(panels.shape)}")
    num_panels, k = panels.shape[0], panels.shape[1] * 2
    if not (num_panels - 1) * 32 < n <= num_panels * 32:
        raise ValueError(f"amx.gemm_panels: {n} output columns do not fit {num_panels} panels")
    if x.dim() != 2 or x.shape[1] != k or x.dtype != torch.float32:
        raise ValueError(f"amx.gemm_panels: x must be float32 [M, {k}], got {x.dtype} "
                         f"{tuple(x.shape)}")
    x = x.contiguous()
    m = x.shape[0]
    y = torch.empty(m, n, dtype=torch.float32)
    if m:
        library().gemm_panels_bf16_amx(y.data_ptr(), x.data_ptr(), panels.data_ptr(), m, n, k,
                                       torch.get_num_threads())
    return y.add_(bias) if bias is not None else y
