"""Weight-only quantized matmul and dequantization kernels (csrc/quant_matmul.c: q4_1, q8_0,
i8; csrc/quant_kquants.c: the K-quants, q5_0, q5_1, iq4_nl) over the layouts that
model_executor/layers/quantization/kernels.py defines."""
from __future__ import annotations

import ctypes
import functools

import torch

import pagedlm.kernels.amx as amx
import pagedlm.kernels.gemv as gemv
from pagedlm.kernels.loader import typed_library

# The formats dequantize_panels takes (csrc/quant_kquants.c's, the GGUF files' types).
BF16_PANEL_FORMATS = ("q4_k", "q5_k", "q6_k", "q3_k", "q2_k", "q5_0", "q5_1", "iq4_nl")
# The formats whose kernels can take x in two 8-bit limbs (qmm16_<fmt>, about 16 bits; every
# block format), which PAGEDLM_PRECISE_ACTIVATIONS asks for. A limb doubles the integer dot
# products but not the weight bytes read. 1B Q4_K_M matrices from memory, 2 threads, ms, 8-bit
# | two limbs: 8192x2048 q4_k at 1 row 0.645 | 0.656, 2048x8192 q4_k 0.594 | 0.677, q6_k
# 0.827 | 0.961; at 8 rows 1.65 | 3.28, 1.61 | 3.07, 2.44 | 4.18. Its one stream 24.2 -> 21.1
# tok/s with them at one row (medians of 3 servers, gguf_models.py).
TWO_LIMB_FORMATS = ("q4_1", "q8_0", *BF16_PANEL_FORMATS)

_p, _i = ctypes.c_void_p, ctypes.c_int
library = typed_library({
    "qmm_q4_1": ([_p, _p, _p, _i, _i, _i, _i], None),
    "qmm_q8_0": ([_p, _p, _p, _i, _i, _i, _i], None),
    "qmm16_q4_1": ([_p, _p, _p, _i, _i, _i, _i], None),
    "qmm16_q8_0": ([_p, _p, _p, _i, _i, _i, _i], None),
    "qmm_i8": ([_p, _p, _p, _p, _i, _i, _i, _i], None),
    "dequant_q4_1": ([_p, _p, _i, _i, _i], None),
    "dequant_q8_0": ([_p, _p, _i, _i, _i], None),
    "dequant_i8": ([_p, _p, _p, _i, _i, _i], None),
    "qmm_vector_bits": ([], _i),
    "qmm_quantize_activations": ([_p, _p, _p, _p, _i, _i], None),
    # csrc/quant_kquants.c
    "qmm_q4_k": ([_p, _p, _p, _i, _i, _i, _i], None),
    "qmm_q5_k": ([_p, _p, _p, _i, _i, _i, _i], None),
    "qmm_q6_k": ([_p, _p, _p, _i, _i, _i, _i], None),
    "qmm_q3_k": ([_p, _p, _p, _i, _i, _i, _i], None),
    "qmm_q2_k": ([_p, _p, _p, _i, _i, _i, _i], None),
    "qmm_q5_0": ([_p, _p, _p, _i, _i, _i, _i], None),
    "qmm_q5_1": ([_p, _p, _p, _i, _i, _i, _i], None),
    "qmm_iq4_nl": ([_p, _p, _p, _i, _i, _i, _i], None),
    "qgemm_available": ([], _i),
    "qgemm_q4_k": ([_p, _p, _p, _i, _i, _i, _i], None),
    "qgemm_q5_k": ([_p, _p, _p, _i, _i, _i, _i], None),
    "qgemm_q6_k": ([_p, _p, _p, _i, _i, _i, _i], None),
    "qmm16_q4_k": ([_p, _p, _p, _i, _i, _i, _i], None),
    "qmm16_q5_k": ([_p, _p, _p, _i, _i, _i, _i], None),
    "qmm16_q6_k": ([_p, _p, _p, _i, _i, _i, _i], None),
    "qmm16_q3_k": ([_p, _p, _p, _i, _i, _i, _i], None),
    "qmm16_q2_k": ([_p, _p, _p, _i, _i, _i, _i], None),
    "qmm16_q5_0": ([_p, _p, _p, _i, _i, _i, _i], None),
    "qmm16_q5_1": ([_p, _p, _p, _i, _i, _i, _i], None),
    "qmm16_iq4_nl": ([_p, _p, _p, _i, _i, _i, _i], None),
    "dequant_q4_k": ([_p, _p, _i, _i, _i], None),
    "dequant_q5_k": ([_p, _p, _i, _i, _i], None),
    "dequant_q6_k": ([_p, _p, _i, _i, _i], None),
    "dequant_q3_k": ([_p, _p, _i, _i, _i], None),
    "dequant_q2_k": ([_p, _p, _i, _i, _i], None),
    "dequant_q5_0": ([_p, _p, _i, _i, _i], None),
    "dequant_q5_1": ([_p, _p, _i, _i, _i], None),
    "dequant_iq4_nl": ([_p, _p, _i, _i, _i], None),
    "dequant_panels_q4_k": ([_p, _p, _i, _i, _i], None),
    "dequant_panels_q5_k": ([_p, _p, _i, _i, _i], None),
    "dequant_panels_q6_k": ([_p, _p, _i, _i, _i], None),
    "dequant_panels_q3_k": ([_p, _p, _i, _i, _i], None),
    "dequant_panels_q2_k": ([_p, _p, _i, _i, _i], None),
    "dequant_panels_q5_0": ([_p, _p, _i, _i, _i], None),
    "dequant_panels_q5_1": ([_p, _p, _i, _i, _i], None),
    "dequant_panels_iq4_nl": ([_p, _p, _i, _i, _i], None),
})

# From how many input rows on dequantizing the whole matrix once and running the float GEMM
# beats the kernels, by the kernels' vector width (qmm_vector_bits: 512, 256, 0 = scalar) and
# format. The kernels unpack each weight block once per tile of x rows, so their cost grows with
# the rows at a rate close to the GEMM's, while dequantizing costs a pass writing N*K floats.
# q4_1 / q8_0 on 8-bit x and integer sums (the same AVX2 code in both vector builds), on
# SmolLM2's gate_up (N=3072, K=576) and down (576, 1536) and a 4096-row Q8_0 slice, one thread,
# AVX2 EPYC, kernel vs dequantize+GEMM in ms: q4_1 at 64 rows 5.2 vs 6.7 and 2.5 vs 2.7, at 128
# 10.6 vs 12.0 and 5.0 vs 4.3 (a layer 15.6 vs 16.3), at 192 15.8 vs 15.7 and 7.8 vs 6.0; q8_0
# at 128 14.1 vs 16.0, at 192 21.4 vs 20.5. The 512 entries were measured on an AVX-512 EPYC
# with the float-activation kernels this replaced (q4_1 at 128 rows 3.0 vs 3.6 and 1.5 vs 3.6,
# at 256 6.0 vs 6.0 and 3.0 vs 4.8; q8_0 at 256 5.7 vs 7.5; i8 at 128 5.2 vs 5.3, at 192 7.4 vs
# 6.5) and want measuring again there. i8 on AVX2: 32 rows 1.1 vs 1.1.
# K-quants (csrc/quant_kquants.c), one thread, AVX2 EPYC shared with other jobs (CPU time, so
# both sides slowed alike), kernel vs dequantize+GEMM in ms at 32 / 64 / 128 / 192 rows:
# q4_k 2048x2048 4.6 vs 22.1, 8.8 vs 13.7, 17.4 vs 19.3, 26.2 vs 27.1; 8192x2048 18.1 vs 95.8,
# 34.9 vs 109.3, 68.1 vs 138.2, 102.9 vs 174.1 (the float matrix's first touch is in the GEMM
# side, as it is in quantized_matmul); q6_k 2048x2048 5.7 vs 10.2, 11.0 vs 13.0, 22.1 vs 20.1,
# 33.1 vs 28.1; 8192x2048 22.0 vs 108.6, 52.9 vs 128.6, 105.3 vs 171.4, 167.5 vs 222.6. q5_k
# takes q4_k's entry, q5_0 / q5_1 / iq4_nl q4_1's (the same unpacking work per weight). q3_k
# and q2_k unpack in AVX2 registers since 2d42f48 (before, through scalar code, 2048x2048 at 32
# rows took 16.4 vs 11.6 and their switch was at 32). Re-measured then on the AVX-512 Xeon (the
# same kernel code; oneDNN's float32 GEMM on AVX-512), the same way, under other jobs' load,
# at 64 / 96 / 128 / 160 rows: q3_k 2048x2048 8.0 vs 6.9, 12.0 vs 8.1, 16.8 vs 10.7, 19.8 vs
# 12.1; 8192x2048 31.7 vs 53.9, 48.4 vs 59.4, 63.1 vs 63.1, 77.8 vs 70.6; q2_k 2048x2048 10.1
# vs 7.1, 14.9 vs 9.1, 19.9 vs 10.8, 24.3 vs 12.3; 8192x2048 38.3 vs 48.5, 57.2 vs 54.5, 76.2
# vs 60.6, 95.9 vs 67.7 (at 32 rows the kernels won on every shape: q3_k 4.0 vs 9.6 and 15.8 vs
# 46.0). A 1B-8B layer's time is mostly its three 8192-wide matrices, so the switches sit where
# a layer's sum turns: 128 for q3_k, 96 for q2_k. The same code runs in AVX-512 builds, whose
# other K-quant entries are the EPYC's until measured there.
_KQUANT_MIN_ROWS = {"q4_k": 192, "q5_k": 192, "q6_k": 128, "q5_0": 128, "q5_1": 128,
                    "iq4_nl": 128, "q3_k": 128, "q2_k": 96}
_DEQUANT_GEMM_MIN_ROWS = {512: {"q4_1": 256, "q8_0": 256, "i8": 160, **_KQUANT_MIN_ROWS},
                          256: {"q4_1": 128, "q8_0": 128, "i8": 32, **_KQUANT_MIN_ROWS}}
_SCALAR_DEQUANT_GEMM_MIN_ROWS = 16


# Where AMX-BF16 runs (kernels/amx.py), the BF16_PANEL_FORMATS' many-row branch dequantizes
# into bfloat16 k-pair panels and runs the AMX GEMM instead (layers/quantization/kernels.py),
# which moves the switch down. The 2-vCPU Xeon, 2 threads, the 1B Q4_K_M file's matrices, ms
# for AMX panels | the kernel | dequantize + float32 GEMM: q4_k 8192x2048 at 16 rows 5.9 | 2.6
# | 10.3, 32 5.9 | 5.0 | 10.4, 64 6.6 | 10.0 | 13.7, 128 7.8 | 20.1 | 20.7, 512 15.6 | 82.0 |
# 60.5; q6_k 2048x8192 at 32 6.8 | 6.9 | 10.9, 64 7.2 | 13.6 | 13.4, 512 17.6 | 112.9 | 59.4;
# q4_k 2048x2048 at 32 1.5 | 1.4 | 2.7, 64 1.6 | 2.6 | 3.2. q5_k takes q4_k's switch; the
# others, whose kernels spend no less per weight than q6_k's, 32.
_AMX_DEQUANT_MIN_ROWS = {"q4_k": 40, "q5_k": 40}
_AMX_DEFAULT_MIN_ROWS = 32
# Where AVX512-BF16 runs without AMX (the Zen 4 EPYC), the same panels go to the panel kernel's
# vdpbf16ps GEMM (gemv.gemm_panels(dot=True)), which there retires one zmm a cycle, twice the
# rate of the widened float32 chain (on the Xeon it is half as fast, gemv.py). The Zen 4 EPYC, 2
# threads, medians of 7, ms for dpbf16 panels (dequantizing and the chunks' first touch
# included, so noisy) | the kernel | dequantize + float32 GEMM: q4_k 8192x2048 at 64 rows 30.0
# | 13.8 | 59.7, 96 18.5 | 19.3 | 35.5, 128 22.3 | 25.7 | 58.4, 192 37.0 | 38.5 | 70.0; q6_k
# 2048x8192 at 64 17.8 | 16.9 | 41.6, 96 18.9 | 25.4 | 44.9, 192 28.1 | 52.0 | 71.9; q6_k
# 8192x2048 at 96 21.3 | 27.8 | 56.8; q4_k 2048x2048 at 96 7.0 | 4.9 | 11.0, 128 5.0 | 6.4 |
# 11.5. So the panels win from 96 rows over q6_k's kernel and beat the float32 branch they
# replace by 1.9-2.6x. q4_k, q5_k and q6_k never reach this switch: every CPU with
# AVX512-BF16 has VNNI, where qgemm keeps their many-row steps (QGEMM_ONLY); the other
# formats' kernels spend no less per weight than q6_k's.
_DPBF16_DEQUANT_MIN_ROWS = 96


@functools.lru_cache(maxsize=None)
def _amx_available() -> bool:
    # Asked once: amx.available() takes about 5 us, and a quantized layer's every call consults
    # the switch (tests replace this function to switch AMX off).
    return amx.available()


def panel_gemm(fmt: str) -> str | None:
    """What the many-row branch of `fmt` runs over dequantize_panels's bfloat16 panels: "amx"
    (amx.gemm_panels), "dpbf16" (gemv.gemm_panels(dot=True)), or None (dequantize to float32 and
    the float32 GEMM). The native kernels must be available, which the caller checks first."""
    if fmt not in BF16_PANEL_FORMATS:
        return None
    if _amx_available():
        return "amx"
    return "dpbf16" if gemv.bf16_dot_available() else None


def dequant_gemm_min_rows(fmt: str, limbs: int = 1) -> int:
    """Inputs of this many rows or more run faster as dequantize + GEMM (float32, or bfloat16
    panels where panel_gemm says and x takes one limb) than through `matmul`. With two
    limbs the kernels' arithmetic doubles and the float32 GEMM's does not: half the rows,
    but never within the fused decode stack's rows (gemv.GEMV_MAX_ROWS), which runs the
    kernels there: a build without AVX2 switched at 8, and the stack's 8-row steps differed
    from the layers' (7.5e-3 in a logprob)."""
    if limbs == 2:
        return max(gemv.GEMV_MAX_ROWS + 1, _float_dequant_gemm_min_rows(fmt) // 2)
    route = panel_gemm(fmt)
    if route == "amx":
        return _AMX_DEQUANT_MIN_ROWS.get(fmt, _AMX_DEFAULT_MIN_ROWS)
    if qgemm_min_rows(fmt):
        return QGEMM_ONLY
    if route == "dpbf16":
        return _DPBF16_DEQUANT_MIN_ROWS
    return _float_dequant_gemm_min_rows(fmt)


@functools.lru_cache(maxsize=None)
def _float_dequant_gemm_min_rows(fmt: str) -> int:
    lib = library()
    bits = lib.qmm_vector_bits() if lib is not None else 0
    return _DEQUANT_GEMM_MIN_ROWS.get(bits, {}).get(fmt, _SCALAR_DEQUANT_GEMM_MIN_ROWS)


# The formats with a many-row GEMM of their own (qgemm_<fmt>, csrc/quant_kquants.c: each
# vpdpbusd lane one of 16 weight rows, so a 32-block's integer sums finish before its one float
# step; AVX512-VNNI builds), which outside the deterministic mode takes their steps from
# QGEMM_MIN_ROWS rows up to the dequantize + GEMM switch. Its bits are not the kernels', so it
# starts above gemv.GEMV_MAX_ROWS, the most rows the fused decode stack runs the kernels on.
QGEMM_FORMATS = ("q4_k", "q5_k", "q6_k")
QGEMM_MIN_ROWS = gemv.GEMV_MAX_ROWS + 1
# Where AMX does not run, the GEMM keeps every many-row step of its formats: no row count
# reaches this switch. The Zen 4 EPYC, 2 threads, medians of 21 (9 from 128 rows) alternating,
# ms for the kernel | qgemm | dpbf16 panels: q4_k 8192x2048 at 9 rows 1.69 | 1.03, 32 5.69 |
# 2.33, 128 22.8 | 7.84 | 20.8, 512 90.5 | 28.9 | 55.8; 2048x8192 at 32 6.23 | 3.09, 128
# 24.1 | 10.8 | 25.2, 512 101.2 | 44.3 | 74.1; q6_k 8192x2048 at 9 2.12 | 1.29, 32 7.04 |
# 3.48, 128 28.0 | 9.72 | 20.5, 512 111.6 | 35.5 | 54.0; 2048x8192 at 512 112.3 | 43.2 | 55.6;
# 2048x2048 at 512 28.8 | 8.84 | 13.4; q5_k 8192x2048 at 9 2.68 | 1.97, 32 8.29 | 4.16, 128
# 24.5 | 8.13 | 32.1. Past 512 rows both grow linearly (the panels'
# dequantizing is spread thin by then, and their GEMM computes no faster than the 480-590
# GFLOP/s qgemm reaches). On AMX (from 32-40 rows) not measured against it yet.
QGEMM_ONLY = 1 << 30


@functools.lru_cache(maxsize=None)
def _qgemm_built() -> bool:
    lib = library()
    return lib is not None and lib.qgemm_available() == 1


def qgemm_min_rows(fmt: str, limbs: int = 1) -> int:
    """The fewest rows `qgemm` takes in format `fmt` (0: never here: another format, two
    limbs, or a build without AVX512-VNNI)."""
    return QGEMM_MIN_ROWS if fmt in QGEMM_FORMATS and limbs == 1 and _qgemm_built() else 0


def qgemm(fmt: str, y: torch.Tensor, x: torch.Tensor, qweight: torch.Tensor) -> None:
    """y [M, N] = x [M, K] @ W^T as `matmul` with one limb, on the many-row GEMM (where
    qgemm_min_rows(fmt) is nonzero): x at 8 bits, each output its own chain of the 32-blocks'
    exact integer sums, so other bits than `matmul`'s."""
    m, n = y.shape
    getattr(library(), f"qgemm_{fmt}")(y.data_ptr(), x.data_ptr(), qweight.data_ptr(), m, n,
                                       x.shape[1], torch.get_num_threads())


def matmul(fmt: str, y: torch.Tensor, x: torch.Tensor, qweight: torch.Tensor,
           scale: torch.Tensor | None, *, limbs: int = 1) -> None:
    """y [M, N] = x [M, K] @ W^T for W = (qweight, scale) in format `fmt`, x quantized to 8
    bits (limbs=1) or in two 8-bit limbs (limbs=2, TWO_LIMB_FORMATS); every tensor
    contiguous and already checked against the format by the caller."""
    m, n = y.shape
    k = x.shape[1]
    lib, threads = library(), torch.get_num_threads()
    if limbs not in (1, 2) or (limbs == 2 and fmt not in TWO_LIMB_FORMATS):
        raise ValueError(f"{fmt} kernels take x in 1 limb{' or 2' * (fmt in TWO_LIMB_FORMATS)}"
                         f", not {limbs}")
    if fmt == "i8":
        lib.qmm_i8(y.data_ptr(), x.data_ptr(), qweight.data_ptr(), scale.data_ptr(), m, n, k,
                   threads)
    else:
        getattr(lib, f"qmm{'16' if limbs == 2 else ''}_{fmt}")(
            y.data_ptr(), x.data_ptr(), qweight.data_ptr(), m, n, k, threads)


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K] contiguous float32 (K a multiple of 32) as the q4_1 and q8_0 kernels quantize
    it: (q int8 [M, K], d float32 [M, K/32], s = d * sum(q) float32 [M, K/32])."""
    m, k = x.shape
    q = torch.empty(m, k, dtype=torch.int8)
    d, s = torch.empty(2, m, k // 32, dtype=torch.float32)
    library().qmm_quantize_activations(q.data_ptr(), d.data_ptr(), s.data_ptr(), x.data_ptr(),
                                       m, k)
    return q, d, s


def dequantize_panels(fmt: str, panels: torch.Tensor, qweight: torch.Tensor, n: int,
                      k: int) -> None:
    """panels [ceil(n / 32), k / 2, 32, 2] bfloat16 = W [n, k] of a BF16_PANEL_FORMATS qweight,
    rounded to bfloat16 in gemv.pack_panels's k-pair layout (amx.gemm_panels's input)."""
    getattr(library(), f"dequant_panels_{fmt}")(panels.data_ptr(), qweight.data_ptr(), n, k,
                                                torch.get_num_threads())


def dequantize(fmt: str, out: torch.Tensor, qweight: torch.Tensor,
               scale: torch.Tensor | None) -> None:
    """out [N, K] float32 = W for W = (qweight, scale) in format `fmt`."""
    n, k = out.shape
    lib, threads = library(), torch.get_num_threads()
    if fmt == "i8":
        lib.dequant_i8(out.data_ptr(), qweight.data_ptr(), scale.data_ptr(), n, k, threads)
    else:
        getattr(lib, f"dequant_{fmt}")(out.data_ptr(), qweight.data_ptr(), n, k, threads)
