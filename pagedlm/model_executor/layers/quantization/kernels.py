"""The quantized weight formats: packing, plain-PyTorch reference dequantization, and the matmul
that runs them on the native kernels (pagedlm/kernels/quant.py) or dequantizes them for a float
GEMM.

Formats (W is [N, K]; blocks run along K):
  "q4_1": [N, K/32, 20] uint8, ggml's Q4_1 block {fp16 d, fp16 m, 16 nibble bytes}: w = d*q + m.
  "q8_0": [N, K/32, 34] uint8, ggml's Q8_0 block {fp16 d, 32 int8}: w = d*q.
  "i8":   [N, K] int8 plus one float32 scale per output row: w = s*q.
  K-quants and the 32-weight types llama-quantize falls back to, ggml's blocks as stored:
  "q4_k", "q5_k", "q6_k", "q3_k", "q2_k" ([N, K/256, BLOCK_BYTES]) and "q5_0", "q5_1",
  "iq4_nl" ([N, K/32, BLOCK_BYTES]); csrc/quant_kquants.c describes them.

The block layouts are byte-for-byte ggml's, so a GGUF file's blocks are used as stored.
Their native kernels, like llama.cpp's, first quantize each input row to 8 bits per 32-block
(quantize_activations_reference) and then sum integer products exactly, or, under
PAGEDLM_PRECISE_ACTIVATIONS, in two 8-bit limbs, x and its residual, about 16 bits
(activation_limbs_reference); the dequantize + GEMM
branch (large M outside the deterministic mode) multiplies the float input instead: in float32,
or, for the GGUF files' types where AMX-BF16 or AVX512-BF16 runs, on AMX or vdpbf16ps with x
and W rounded to bfloat16 (_panels_matmul).
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from pagedlm.kernels import quant as native
from pagedlm.kernels.loader import available

QK = 32  # weights per q4_1 / q8_0 block, and per block of the 8-bit activations
# Input features per block, and bytes per block, of each block format (ggml's sizes).
BLOCK_WEIGHTS = {"q4_1": 32, "q8_0": 32, "q5_0": 32, "q5_1": 32, "iq4_nl": 32,
                 "q4_k": 256, "q5_k": 256, "q6_k": 256, "q3_k": 256, "q2_k": 256}
BLOCK_BYTES = {"q4_1": 20, "q8_0": 34, "q5_0": 22, "q5_1": 24, "iq4_nl": 18,
               "q4_k": 144, "q5_k": 176, "q6_k": 210, "q3_k": 110, "q2_k": 84}
# The formats only gguf-py's dequantizer describes here (no packer: they come from files).
GGUF_ONLY_FORMATS = ("q4_k", "q5_k", "q6_k", "q3_k", "q2_k", "q5_0", "q5_1", "iq4_nl")
FORMATS = ("q4_1", "q8_0", "i8", *GGUF_ONLY_FORMATS)


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
    if fmt in GGUF_ONLY_FORMATS:
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize as gguf_dequantize
        raw = qweight.contiguous().numpy().reshape(n, -1)
        w = gguf_dequantize(raw, GGMLQuantizationType[fmt.upper()])
        return torch.from_numpy(w.astype("float32", copy=False)).reshape(n, -1)
    raise ValueError(f"unknown quantized format {fmt!r} (supported: {', '.join(FORMATS)})")


def quantize_activations_reference(x: torch.Tensor
                                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K] float32 as the block formats' kernels quantize it, per 32-block: d = amax / 127,
    q = round-half-even(x * (127 / amax)) as int8 (all 0 where amax is below 2^-120), and
    q4_1's offset term s = d * sum(q); returns (q [M, K], d [M, K/32], s [M, K/32]). A block
    holding a NaN or an infinity has q 0 and d, s NaN (its row's outputs NaN). Every step is
    one float32 operation, so the bits are the kernels'."""
    m, k = x.shape
    xb = x.float().reshape(m, k // QK, QK)
    finite = xb.isfinite().all(-1)
    xb = torch.where(finite[..., None], xb, 0.0)
    amax = xb.abs().amax(-1)
    d = amax / 127
    inv = torch.where(amax >= 2.0 ** -120, torch.full_like(amax, 127) / amax,
                      torch.zeros_like(amax))
    q = (xb * inv[..., None]).round()  # torch.round: ties to even
    s = d * q.sum(-1)  # the integer sum is exact in float32 (|sum| <= 32 * 127)
    nan = torch.full_like(d, float("nan"))
    return (q.to(torch.int8).reshape(m, k), torch.where(finite, d, nan),
            torch.where(finite, s, nan))


def activation_limbs_reference(x: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor,
                                                                  torch.Tensor]]:
    """x [M, K] float32 in the two 8-bit limbs the qmm16_ kernels take: the first is
    quantize_activations_reference(x), the second that of the residual x - d q, rounded once
    to float32 (as the kernels' fmaf; in float64 the difference is exact, the two terms' bits
    spanning fewer than 53)."""
    hi = quantize_activations_reference(x)
    res = (x.double() - _dequantize_limb(hi)).float()
    return [hi, quantize_activations_reference(res)]


def _dequantize_limb(limb: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> torch.Tensor:
    q, d, _ = limb
    m, k = q.shape
    return (q.double().reshape(m, k // QK, QK) * d.double()[..., None]).reshape(m, k)


def matmul_reference_x16(fmt: str, x: torch.Tensor, qweight: torch.Tensor) -> torch.Tensor:
    """matmul_reference_q8 for x in two limbs (activation_limbs_reference), in float64."""
    w = dequantize_reference(fmt, qweight).double()
    return sum(_dequantize_limb(limb) @ w.T for limb in activation_limbs_reference(x))


def matmul_reference_q8(fmt: str, x: torch.Tensor, qweight: torch.Tensor) -> torch.Tensor:
    """What the block formats' kernels compute, in float64: x quantized as they quantize it,
    times the dequantized weights. The kernels' integer sums are exact, so they differ from
    this only by their float32 scaling and summing over the blocks."""
    return _dequantize_limb(quantize_activations_reference(x)) @ dequantize_reference(
        fmt, qweight).double().T


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
        raise ValueError(f"{fmt} weight must be [N, K/{BLOCK_WEIGHTS[fmt]}, {BLOCK_BYTES[fmt]}] "
                         f"uint8, got {tuple(qweight.shape)}")
    return qweight.shape[0], qweight.shape[1] * BLOCK_WEIGHTS[fmt]


def dequantize(fmt: str, qweight: torch.Tensor, scale: torch.Tensor | None = None,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """Float32 [N, K] weights (native kernel; the reference where it is unavailable)."""
    n, k = _shape(fmt, qweight)
    if not available():
        w = dequantize_reference(fmt, qweight, scale)
        return w if out is None else out.copy_(w)
    out = torch.empty(n, k, dtype=torch.float32) if out is None else out
    native.dequantize(fmt, out, qweight, scale)
    return out


# The bfloat16 panels of one panel GEMM call. 16 MiB stays under the 32 MiB mmap threshold that
# worker/malloc_tuning.py sets, so each chunk reuses heap memory: a fresh 67 MB float32 matrix
# (the 1B model's gate, 8192 x 2048) took 20 ms of page faults where filling a reused one took
# 2.6. Each call rounds x to bfloat16 again, a small cost beside a chunk's GEMM.
_PANEL_CHUNK_BYTES = 16 << 20


def _panels_matmul(fmt: str, x: torch.Tensor, qweight: torch.Tensor, n: int, k: int,
                   route: str) -> torch.Tensor:
    """x [M, k] float32 @ W^T, W's rows dequantized chunk by chunk into bfloat16 k-pair panels
    and multiplied on AMX or with vdpbf16ps (`route`, quant.panel_gemm; x rounded to
    bfloat16, float32 sums): where the kernels' cost grows with every row, this one's is mostly
    the dequantizing, paid once a call."""
    from pagedlm.kernels import amx, gemv
    gemm = amx.gemm_panels if route == "amx" else functools.partial(gemv.gemm_panels, dot=True)
    rows = max(32, _PANEL_CHUNK_BYTES // (2 * k) // 32 * 32)
    y = torch.empty(x.shape[0], n) if rows < n or n == 0 else None
    for r0 in range(0, n, rows):
        r1 = min(n, r0 + rows)
        panels = torch.empty(-(-(r1 - r0) // 32), k // 2, 32, 2, dtype=torch.bfloat16)
        native.dequantize_panels(fmt, panels, qweight[r0:r1], r1 - r0, k)
        out = gemm(x, panels, r1 - r0)
        if y is None:
            return out
        y[:, r0:r1] = out
    return y


def activation_limbs(fmt: str, precise_activations: bool) -> int:
    """How many 8-bit limbs quantized_matmul's kernel takes x in for `fmt` (a layer's native
    form says the same, for the fused decode stack)."""
    return 2 if precise_activations and fmt in native.TWO_LIMB_FORMATS else 1


def quantized_matmul(fmt: str, x: torch.Tensor, qweight: torch.Tensor,
                     scale: torch.Tensor | None = None, bias: torch.Tensor | None = None, *,
                     batch_invariant: bool = False,
                     precise_activations: bool = False) -> torch.Tensor:
    """y [M, N] = x [M, K] @ W^T (+ bias) with W in format `fmt` (see the module docstring).
    The block formats' kernels take x at 8 bits (matmul_reference_q8); the dequantize + GEMM
    branch, from dequant_gemm_min_rows rows on outside batch_invariant, takes it in float32, or
    in bfloat16 over panels where quant.panel_gemm(fmt) says. Below that switch, from
    quant.qgemm_min_rows rows, the formats with a many-row GEMM (quant.QGEMM_FORMATS, where
    the build has AVX512-VNNI) run it instead of the kernels: x at 8 bits as theirs, its own
    sum order.

    precise_activations (envs.PAGEDLM_PRECISE_ACTIVATIONS, for quant.TWO_LIMB_FORMATS): the
    kernels take x in two limbs (matmul_reference_x16) and the many-row branch is float32.

    batch_invariant: the kernels at every row count, never dequantize + float GEMM (whose sum
    order changes with M): each output is then one weight row against one x row in a fixed K
    order, whatever M, the row's place in the kernel's tile of rows, or the thread count
    (csrc/quant_matmul.c)."""
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
    limbs = activation_limbs(fmt, precise_activations)
    if batch_invariant:
        if not available():
            raise ValueError("quantized_matmul(batch_invariant=True) needs the native kernels "
                             "(unset PAGEDLM_DISABLE_KERNELS; a C compiler must be available)")
    elif not available() or m >= native.dequant_gemm_min_rows(fmt, limbs):
        route = native.panel_gemm(fmt) if available() and limbs == 1 else None
        if route is not None:
            y = _panels_matmul(fmt, x2, qweight, n, k, route)
            if bias is not None:
                y.add_(bias)
        else:
            y = F.linear(x2, dequantize(fmt, qweight, scale), bias)
        return y.reshape(*lead, n).to(x.dtype)
    y = torch.empty(m, n, dtype=torch.float32)
    qgemm_from = 0 if batch_invariant else native.qgemm_min_rows(fmt, limbs)
    if qgemm_from and m >= qgemm_from:
        native.qgemm(fmt, y, x2, qweight)
    elif m:
        native.matmul(fmt, y, x2, qweight, scale, limbs=limbs)
    if bias is not None:
        y.add_(bias)
    return y.reshape(*lead, n).to(x.dtype)
