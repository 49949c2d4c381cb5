"""The quantized weight formats: packing, plain-PyTorch reference dequantization, and the native
matmul kernels (csrc/quant_matmul.c, built by the attention kernels' compile-once mechanism).

Formats (W is [N, K]; blocks run along K):
  "q4_1": [N, K/32, 20] uint8, ggml's Q4_1 block {fp16 d, fp16 m, 16 nibble bytes}: w = d*q + m.
  "q8_0": [N, K/32, 34] uint8, ggml's Q8_0 block {fp16 d, 32 int8}: w = d*q.
  "i8":   [N, K] int8 plus one float32 scale per output row: w = s*q.

The q4_1/q8_0 layouts are byte-for-byte ggml's, so a GGUF file's blocks are used as stored.
"""
from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

import torch
import torch.nn.functional as F

# The compile-once, cache-by-source-hash builder of the attention kernels, reused as is.
from pagedlm.attention.kernels import _build, kernels_disabled

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).parent / "csrc" / "quant_matmul.c"
QK = 32  # weights per q4_1 / q8_0 block
BLOCK_BYTES = {"q4_1": 20, "q8_0": 34}
FORMATS = ("q4_1", "q8_0", "i8")
# From how many input rows on dequantizing the whole matrix once and running the float GEMM
# beats the kernels, by the kernels' vector width (qmm_vector_bits: 512, 256, 0 = scalar) and
# format. The kernels decode each weight block once per tile of x rows (4 rows with AVX-512, 2
# with AVX2), so their cost grows with the rows at a rate close to the GEMM's, while
# dequantizing costs a pass writing N*K floats. Measured on SmolLM2's gate_up (N=3072, K=576)
# and down (576, 1536) shapes, 2 threads, AVX-512 EPYC, kernel vs dequantize+GEMM in ms:
# q4_1 at 128 rows 3.0 vs 3.6 and 1.5 vs 3.6, at 256 rows 6.0 vs 6.0 and 3.0 vs 4.8; q8_0 at 256
# 5.7 vs 7.5; i8 at 128 5.2 vs 5.3, at 192 7.4 vs 6.5. The same source built for AVX2 only:
# q4_1 at 32 rows 1.3 vs 1.7, at 64 2.6 vs 2.4; q8_0 and i8 even at 32 (1.1 vs 1.1).
_DEQUANT_GEMM_MIN_ROWS = {512: {"q4_1": 256, "q8_0": 256, "i8": 160},
                          256: {"q4_1": 48, "q8_0": 32, "i8": 32}}
_SCALAR_DEQUANT_GEMM_MIN_ROWS = 16


@functools.lru_cache(maxsize=None)
def load_library() -> ctypes.CDLL | None:
    try:
        lib = ctypes.CDLL(str(_build((_SOURCE,), name="pagedlm_quant")))
    except Exception as exc:  # noqa: BLE001 - any failure means "use the PyTorch path"
        logger.warning("pagedlm quantized matmul kernels unavailable, using the PyTorch "
                       "fallback: %s", exc)
        return None
    p, i = ctypes.c_void_p, ctypes.c_int
    for name in ("qmm_q4_1", "qmm_q8_0"):
        getattr(lib, name).argtypes = [p, p, p, i, i, i, i]
    lib.qmm_i8.argtypes = [p, p, p, p, i, i, i, i]
    for name in ("dequant_q4_1", "dequant_q8_0"):
        getattr(lib, name).argtypes = [p, p, i, i, i]
    lib.dequant_i8.argtypes = [p, p, p, i, i, i]
    lib.qmm_vector_bits.argtypes, lib.qmm_vector_bits.restype = [], i
    for name in ("qmm_q4_1", "qmm_q8_0", "qmm_i8", "dequant_q4_1", "dequant_q8_0", "dequant_i8"):
        getattr(lib, name).restype = None
    return lib


def native_available() -> bool:
    return not kernels_disabled() and load_library() is not None


@functools.lru_cache(maxsize=None)
def dequant_gemm_min_rows(fmt: str) -> int:
    """quantized_matmul runs x of this many rows or more as dequantize + float GEMM."""
    lib = load_library()
    bits = lib.qmm_vector_bits() if lib is not None else 0
    return _DEQUANT_GEMM_MIN_ROWS.get(bits, {}).get(fmt, _SCALAR_DEQUANT_GEMM_MIN_ROWS)


# ------------------------------------------------------------------ reference (plain PyTorch)

def _fp16_field(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    """The fp16 at byte `offset` of every block, as float32 [..., 1]."""
    return blocks[..., offset:offset + 2].contiguous().view(torch.float16).float()


def dequantize_reference(fmt: str, qweight: torch.Tensor,
                         scale: torch.Tensor | None = None) -> torch.Tensor:
    """Float32 [N, K] weights of a packed tensor, written directly from the format's definition."""
    if fmt == "i8":
        return qweight.float() * scale.float()[:, None]
    n = qweight.shape[0]
    if fmt == "q4_1":
        d, m = _fp16_field(qweight, 0), _fp16_field(qweight, 2)
        qs = qweight[..., 4:].to(torch.int32)
        q = torch.cat([qs & 0x0F, qs >> 4], dim=-1).float()  # element j, then j + 16
        return (d * q + m).reshape(n, -1)
    if fmt == "q8_0":
        d = _fp16_field(qweight, 0)
        q = qweight[..., 2:].contiguous().view(torch.int8).float()
        return (d * q).reshape(n, -1)
    raise ValueError(f"unknown quantized format {fmt!r} (supported: {', '.join(FORMATS)})")


# ------------------------------------------------------------------ packing float weights

def quantize_q4_1(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] float -> q4_1 blocks, by ggml's rule: m = block min, d = (max - min) / 15, both
    stored as fp16; q = round((w - m) / d) computed against the stored (rounded) d and m."""
    n, k = weight.shape
    if k % QK:
        raise ValueError(f"q4_1 needs the input size to be a multiple of {QK}, got {k}")
    w = weight.detach().float().reshape(n, k // QK, QK)
    lo, hi = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
    m = lo.half()
    d = ((hi - lo) / 15).half()
    inv = torch.where(d.float() > 0, 1 / d.float(), torch.zeros_like(lo))
    q = ((w - m.float()) * inv).round().clamp_(0, 15).to(torch.uint8)
    qs = (q[..., :16] | (q[..., 16:] << 4)).to(torch.uint8)
    return torch.cat([d.view(torch.uint8), m.view(torch.uint8), qs], dim=-1).contiguous()


def quantize_q8_0(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] float -> q8_0 blocks (ggml's rule: d = absmax / 127, fp16; q = round(w / d))."""
    n, k = weight.shape
    if k % QK:
        raise ValueError(f"q8_0 needs the input size to be a multiple of {QK}, got {k}")
    w = weight.detach().float().reshape(n, k // QK, QK)
    d = (w.abs().amax(-1, keepdim=True) / 127).half()
    inv = torch.where(d.float() > 0, 1 / d.float(), torch.zeros_like(d, dtype=torch.float32))
    q = (w * inv).round().clamp_(-127, 127).to(torch.int8)
    return torch.cat([d.view(torch.uint8), q.view(torch.uint8)], dim=-1).contiguous()


def quantize_i8(weight: torch.Tensor, row_absmax: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float -> (int8 [N, K], float32 scale [N]): symmetric, per output channel.
    row_absmax: each row's largest |w| when `weight` is only part of the row (a TP slice)."""
    w = weight.detach().float()
    if row_absmax is None:
        row_absmax = w.abs().amax(-1)
    scale = row_absmax.float() / 127
    inv = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
    q = (w * inv[:, None]).round().clamp_(-127, 127).to(torch.int8)
    return q.contiguous(), scale.contiguous()


def q4_0_to_q4_1(blocks: torch.Tensor) -> torch.Tensor:
    """ggml Q4_0 blocks {fp16 d, 16 nibble bytes}: w = d*(q - 8) -> q4_1 with m = -8d, exactly
    (scaling an fp16 by 8 only moves its exponent; d*q - 8d then rounds as d*(q - 8) does)."""
    d = blocks[..., 0:2].contiguous().view(torch.float16)
    m = d * -8
    if not torch.isfinite(m).all():
        raise ValueError("a Q4_0 block's scale is too large to convert exactly")
    return torch.cat([blocks[..., 0:2], m.view(torch.uint8), blocks[..., 2:]], dim=-1).contiguous()


# ------------------------------------------------------------------ matmul

def _check(name: str, t: torch.Tensor, dtype: torch.dtype) -> None:
    if t.dtype != dtype or not t.is_contiguous() or t.device.type != "cpu":
        raise ValueError(f"{name}: expected a contiguous CPU {dtype} tensor, got {t.dtype} "
                         f"{tuple(t.shape)} on {t.device} (contiguous={t.is_contiguous()})")


def _shape(fmt: str, qweight: torch.Tensor) -> tuple[int, int]:
    if fmt == "i8":
        return qweight.shape[0], qweight.shape[1]
    if fmt not in BLOCK_BYTES:
        raise ValueError(f"unknown quantized format {fmt!r} (supported: {', '.join(FORMATS)})")
    if qweight.dim() != 3 or qweight.shape[2] != BLOCK_BYTES[fmt]:
        raise ValueError(f"{fmt} weight must be [N, K/{QK}, {BLOCK_BYTES[fmt]}] uint8, got "
                         f"{tuple(qweight.shape)}")
    return qweight.shape[0], qweight.shape[1] * QK


def dequantize(fmt: str, qweight: torch.Tensor, scale: torch.Tensor | None = None,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """Float32 [N, K] weights (native kernel; the reference where it is unavailable)."""
    n, k = _shape(fmt, qweight)
    if not native_available():
        w = dequantize_reference(fmt, qweight, scale)
        return w if out is None else out.copy_(w)
    lib = load_library()
    out = torch.empty(n, k, dtype=torch.float32) if out is None else out
    threads = torch.get_num_threads()
    if fmt == "i8":
        lib.dequant_i8(out.data_ptr(), qweight.data_ptr(), scale.data_ptr(), n, k, threads)
    else:
        getattr(lib, f"dequant_{fmt}")(out.data_ptr(), qweight.data_ptr(), n, k, threads)
    return out


def quantized_matmul(fmt: str, x: torch.Tensor, qweight: torch.Tensor,
                     scale: torch.Tensor | None = None,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """y [M, N] = x [M, K] @ W^T (+ bias) with W in format `fmt` (see the module docstring)."""
    n, k = _shape(fmt, qweight)
    _check("qweight", qweight, torch.int8 if fmt == "i8" else torch.uint8)
    if fmt == "i8":
        if scale is None or scale.shape != (n,):
            raise ValueError(f"i8 needs a float32 scale of shape ({n},)")
        _check("scale", scale, torch.float32)
    lead = x.shape[:-1]
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} input features, the weight {k}")
    x2 = x.reshape(-1, k)
    if x2.dtype != torch.float32 or not x2.is_contiguous():
        x2 = x2.float().contiguous()
    if bias is not None and bias.dtype != torch.float32:
        bias = bias.float()
    m = x2.shape[0]
    if not native_available() or m >= dequant_gemm_min_rows(fmt):
        y = F.linear(x2, dequantize(fmt, qweight, scale), bias)
        return y.reshape(*lead, n).to(x.dtype)
    y = torch.empty(m, n, dtype=torch.float32)
    if m:
        lib, threads = load_library(), torch.get_num_threads()
        if fmt == "i8":
            lib.qmm_i8(y.data_ptr(), x2.data_ptr(), qweight.data_ptr(), scale.data_ptr(), m, n,
                       k, threads)
        else:
            getattr(lib, f"qmm_{fmt}")(y.data_ptr(), x2.data_ptr(), qweight.data_ptr(), m, n, k,
                                       threads)
    if bias is not None:
        y.add_(bias)
    return y.reshape(*lead, n).to(x.dtype)
