"""Linear layers with float32 activations and sums through the native kernels of
csrc/gemv_f32.c: float32 weights, and bfloat16 and float16 weights on the panel kernel.

A decode step multiplies one row per running sequence by every weight matrix, so with few
sequences the step's time is how fast the weights stream from memory. Where the build has the
panel kernel (AVX2 or AVX-512) the layers run on it at every row count, over a copy of the
weight packed with the output columns along the vector lanes: no horizontal sums, one
sequential weight stream per thread, and each output one FMA chain over K, so a row's result
does not depend on the batch it is in (deterministic inference needs that). Every matrix of
SmolLM2-135M once (benchmarks/gemv.py), panel kernel / row-major GEMV kernel / oneDNN's packed
GEMM:
  - AVX-512, a Sapphire Rapids-class Xeon, 2 threads: 19.5 / 20.7 / 22.8 ms at 1 row, 23.3 /
    31.6 / 28.6 at 8, 36.4 / 73.0 / 45.9 at 32, 94.7 / 246.9 / 111.7 at 128.
  - AVX2, an AMD EPYC (Zen 3), 1 thread (medians of interleaved repeats, on a machine other
    jobs loaded to 5 runnable threads a core, so the absolute times are several times an idle
    machine's; 2 threads there were too disturbed to compare): 172 / 184 / 254 ms at 1 row,
    164 / 185 / 263 at 2, 159 / 199 / 277 at 4, 198 / 272 / 346 at 8; panels / oneDNN 290 /
    488 at 16, 380 / 486 at 32, 632 / 860 at 64, 1429 / 1756 at 128, 2974 / 3004 at 256,
    22084 / 25682 at 2048.
bfloat16 panels (the same layout, 2-byte elements) are widened exactly to float32 as they are
read, so a layer gives the float32 kernel's bits on weight.float() and reads half the bytes.
Same matrices, AVX2 EPYC, 1 thread, float32 / bfloat16 panels (medians of interleaved repeats,
machine loaded to about 2 runnable threads a core): 122 / 63 ms at 1 row, 142 / 84 at 8, 995 /
961 at 128 (the widening costs nothing measurable once the tiles are compute-bound).
Where the build has AVX512-BF16 (`bf16_pairs()`), bfloat16 panels are k-pairs instead, the
layout of vdpbf16ps and of AMX's B tiles, widened the same way (same bits): on the Sapphire
Rapids-class Xeon, 1 thread, 32 SmolLM2-shaped matrices, plain panels / k-pairs, medians 2.95 /
2.56 ms at 1 row, 4.50 / 2.92 at 8, 12.47 / 12.02 at 32, 51.3 / 47.8 at 128. vdpbf16ps on them
(rounding x to bfloat16) is opt-in, `bf16_dpbf16()`: 2.53, 4.08, 16.6 and 71.3 ms there.
float16 panels (a GGUF file's F16 matrices, dtype="float16") are widened exactly too
(vcvtph2ps), with the same result: the float32 kernel's bits on weight.float().
Without the panel kernel the layers run on the GEMV kernel up to GEMV_MAX_ROWS rows (it streams
the row-major weight as fast as oneDNN or faster there, see the C file) and on oneDNN's packed
GEMM past them.

`PAGEDLM_DISABLE_KERNELS=1` or a failed build (pagedlm/kernels/loader.py) leaves every layer
on its GEMM path.
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
from typing import Callable

import torch

from pagedlm import envs
from pagedlm.kernels.loader import available, typed_library

_p, _i = ctypes.c_void_p, ctypes.c_int
_library = typed_library({
    "gemv_f32": ([_p, _p, _p, _i, _i, _i, _i], None),
    "gemm_panels_f32": ([_p, _p, _p, _i, _i, _i, _i], None),
    "gemm_panels_bf16": ([_p, _p, _p, _i, _i, _i, _i], None),
    "gemm_panels_bf16_dot": ([_p, _p, _p, _i, _i, _i, _i], None),
    "gemm_panels_f16": ([_p, _p, _p, _i, _i, _i, _i], None),
    "gemm_panel_width": ([], _i),
    "pack_panel_rows32": ([_p, _p, _i, _i, _i, _i, _i], None),
    "gemm_panels_bf16_layout": ([], _i),
    "gemm_panels_bf16_dpbf16": ([], _i),
    "gemm_panels_bf16_set_dpbf16": ([_i], _i),
})

# Opt-in (envs.PAGEDLM_BF16_DPBF16): bfloat16 k-pair panels multiplied with vdpbf16ps. Off by
# default: on the Sapphire Rapids-class Xeon, the only CPU here with AVX512-BF16, vdpbf16ps
# (zmm) sustains one instruction per 2 cycles against two FMAs a cycle (latency 8 cycles
# against 4), so its 32 products an instruction give half the FMAs' 32 a cycle: widening the
# pairs is as fast at 1 row and faster from 8 (figures in gemv_f32.c), and keeps the float32
# kernel's bits.
_configured: list = []  # the library the setting was made on
# [bf16_pairs(), bf16_dpbf16()], kept between setting changes: gemm_panels asks at every call,
# and asking the library each time cost about 1 ms a pass over SmolLM2-135M's 121 matrices.
_state: list = []


def library() -> ctypes.CDLL | None:
    """The kernel library (None where it is unavailable), its bfloat16 math set from
    envs.PAGEDLM_BF16_DPBF16 the first time."""
    lib = _library()
    if lib is not None and (not _configured or _configured[0] is not lib):
        _configured[:] = [lib]
        _state.clear()
        if envs.PAGEDLM_BF16_DPBF16:
            lib.gemm_panels_bf16_set_dpbf16(1)
    return lib

# Where the panel kernel does not run (no AVX2), the most rows the float32 layers run on the
# GEMV kernel. Measured (benchmarks/gemv.py: every matrix of SmolLM2-135M once, float32, 2
# threads): on an AVX2-only EPYC, before it had the panel kernel, the kernel against oneDNN's
# pre-packed GEMM took 30 vs 43 ms at 1 row, 42 vs 49 at 4, 63 vs 69 at 8 and 100 vs 105 at 16;
# on an AVX-512 EPYC the two tie at 1 to 4 rows and oneDNN wins at 8 (24 vs 34 ms). 8 is kept
# because the fused decode stack (model_executor/layers/fused_decode.py), which saves more than
# that per step, runs on this kernel where the panel kernel does not run; it is also the most
# rows the stack takes off the panel kernel.
GEMV_MAX_ROWS = 8


def runs(weight: torch.Tensor) -> bool:
    """Whether `weight` [N, K] can go through the kernel (checked once, when the layer loads)."""
    return (weight.dtype == torch.float32 and weight.dim() == 2 and weight.is_contiguous()
            and weight.device.type == "cpu" and available())


def gemv(x: torch.Tensor, weight: torch.Tensor,
         bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ weight[N, K]^T (+ bias) -> [M, N]; `weight` must pass `runs`, and x be
    float32 [M, K] (copied to a contiguous tensor if it is not)."""
    n, k = weight.shape
    return _call("gemv", library().gemv_f32, x, weight, n, k, bias)


@functools.lru_cache(maxsize=None)
def _dot_supported(lib) -> bool:
    # Once per library: bf16_dpbf16_supported() flips the process-wide setting to ask, which a
    # call per chunk of a many-row step should not do.
    return bf16_dpbf16_supported()


def bf16_dot_available() -> bool:
    """Whether `gemm_panels(..., dot=True)` runs here (a build with AVX512-BF16)."""
    lib = library()
    return lib is not None and _dot_supported(lib)


def _call(name: str, fn, x: torch.Tensor, weight: torch.Tensor, n: int, k: int,
          bias: torch.Tensor | None) -> torch.Tensor:
    """y [M, n] = fn(y, x, weight, M, n, k, threads) (+ bias), after checking x [M, k]."""
    if x.dim() != 2 or x.shape[1] != k or x.dtype != torch.float32:
        raise ValueError(f"{name}: x must be float32 [M, {k}], got {x.dtype} {tuple(x.shape)}")
    x = x.contiguous()
    m = x.shape[0]
    y = torch.empty(m, n, dtype=torch.float32)
    if m:
        fn(y.data_ptr(), x.data_ptr(), weight.data_ptr(), m, n, k, torch.get_num_threads())
    return y.add_(bias) if bias is not None else y


def panel_width() -> int:
    """Output columns per panel of the panel kernel (16 on AVX2 builds, 32 on AVX-512 ones);
    0 where it is unavailable (no AVX2, or the kernels are disabled or failed to build)."""
    return library().gemm_panel_width() if available() else 0


# The panel kernel's weight element types, each with its C entry point. bfloat16 and float16
# panels are widened exactly to float32 as they are read and meet the same FMA chain, so their
# outputs are bit for bit the float32 kernel's on weight.float(), at half the bytes read (but
# for the opt-in vdpbf16ps math on bfloat16 k-pairs, bf16_dpbf16).
_PANEL_KERNELS = {torch.float32: "gemm_panels_f32", torch.bfloat16: "gemm_panels_bf16",
                  torch.float16: "gemm_panels_f16"}


def panel_dtypes() -> tuple[torch.dtype, ...]:
    """The weight dtypes `pack_panels` packs for the panel kernel here; empty where it is
    unavailable."""
    return tuple(_PANEL_KERNELS) if panel_width() else ()


def _bf16_state() -> list:
    if not _state:
        lib = library() if panel_width() else None
        _state[:] = [lib is not None and lib.gemm_panels_bf16_layout() == 2,
                     lib is not None and lib.gemm_panels_bf16_dpbf16() == 1]
    return _state


def bf16_pairs() -> bool:
    """Whether bfloat16 panels here are k-pairs, [ceil(N / W), ceil(K / 2), W, 2] (builds with
    AVX512-BF16, as the library says: the build, not /proc/cpuinfo, decides), the layout of
    vdpbf16ps and of AMX's B tiles; else plain [ceil(N / W), K, W] as the float32 ones. Both
    are widened exactly to the float32 kernel's FMA chain (its bits on weight.float()) unless
    `bf16_dpbf16()`."""
    return _bf16_state()[0]


def bf16_dpbf16() -> bool:
    """Whether k-pair panels are multiplied with vdpbf16ps (PAGEDLM_BF16_DPBF16=1, or inside
    `bf16_dot(True)`): x rounded to bfloat16 once per call, and per output from +0, for each
    pair, the odd product then the even one added in float32, subnormals flushed (Intel SDM).
    Its bits are not the float32 kernel's on weight.float() (nor a CPU's without it), but do
    not depend on the row count: a row's bits are the same alone or in any batch on one CPU."""
    return _bf16_state()[1]


def bf16_dpbf16_supported() -> bool:
    """Whether this build can multiply bfloat16 panels with vdpbf16ps (AVX512-BF16)."""
    if not bf16_pairs():
        return False
    with bf16_dot(True) as on:
        return on


@contextlib.contextmanager
def bf16_dot(on: bool):
    """Runs the block with k-pair panels multiplied with vdpbf16ps (on) or widened (off), as
    far as the build can, yielding the setting in force; then restores the previous one. For
    tests and benchmarks: the setting is process-wide."""
    lib = library()
    before = lib.gemm_panels_bf16_dpbf16()
    try:
        _state.clear()
        yield bool(lib.gemm_panels_bf16_set_dpbf16(int(on)))
    finally:
        lib.gemm_panels_bf16_set_dpbf16(before)
        _state.clear()


def _torch_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    # The zeroing pass also faults fresh pages in, before the transposing copy (empty_panels).
    return torch.empty(shape, dtype=dtype).zero_()


def pack_panels(weight: torch.Tensor,
                zeros: Callable[[tuple[int, ...], torch.dtype], torch.Tensor] = _torch_zeros,
                ) -> torch.Tensor | None:
    """weight [N, K] (float32, bfloat16 or float16, contiguous, on the CPU) as
    [ceil(N / W), K, W] panels of the same dtype (W = panel_width(), zero columns past N) for
    `gemm_panels`, or None where the panel kernel does not run it. bfloat16 where
    `bf16_pairs()`: [ceil(N / W), ceil(K / 2), W, 2], element [p, j, c, e] the weight's
    [p * W + c, 2 * j + e] (zero past N and at an odd K's last k). `zeros(shape, dtype)`
    allocates the panels, zeroed (default: torch's memory; huge_pages.Arena.zeros puts them on
    huge pages)."""
    if (weight.dtype not in panel_dtypes() or weight.dim() != 2
            or not weight.is_contiguous() or weight.device.type != "cpu"):
        return None
    panels = empty_panels(*weight.shape, weight.dtype, zeros)
    put_panel_rows(panels, 0, weight)
    return panels


def empty_panels(n: int, k: int, dtype: torch.dtype,
                 zeros: Callable[[tuple[int, ...], torch.dtype], torch.Tensor] = _torch_zeros,
                 ) -> torch.Tensor | None:
    """Zeroed panels of `pack_panels`' layout for an [n, k] weight of `dtype`, for
    `put_panel_rows` to fill; None where the panel kernel does not take the dtype.

    Written straight from the weight's rows, not from a zero-padded copy of the whole matrix
    (which doubled what packing held beside the weight: a tied 1B embedding is 200 MB a copy).
    Zeroed first, one sequential pass that also faults fresh pages in (and pads): the
    transposing copy faulting them itself ran 3-4x slower. An 8192 x 2048 bfloat16 matrix onto
    fresh huge pages, 2 threads, Zen 4 EPYC: 45-51 ms, against 13-16 zeroed first (25 on one
    thread); the 1B bfloat16 directory packs 65 of them."""
    if dtype not in panel_dtypes():
        return None
    width = panel_width()
    count = -(-n // width)
    if dtype == torch.bfloat16 and bf16_pairs():
        return zeros((count, (k + 1) // 2, width, 2), dtype)
    return zeros((count, k, width), dtype)


def put_panel_rows(panels: torch.Tensor, first: int, rows: torch.Tensor) -> None:
    """Rows first .. first + r - 1 of the weight `panels` pack = rows [r, K] (contiguous, the
    panels' dtype), wherever they start and end within a panel: a loader packs a fused
    layer's shards as they arrive."""
    if rows.dtype != panels.dtype:
        raise ValueError(f"put_panel_rows: {rows.dtype} rows into {panels.dtype} panels")
    width, k = panels.shape[2], rows.shape[1]
    pairs = panels.dim() == 4
    lib = library()
    if (lib is not None and panels.element_size() * (2 if pairs else 1) == 4
            and k % (2 if pairs else 1) == 0 and panels.is_contiguous() and rows.is_contiguous()
            and rows.shape[0]):
        lib.pack_panel_rows32(panels.data_ptr(), rows.data_ptr(), first, rows.shape[0],
                              k // 2 if pairs else k, width, torch.get_num_threads())
        return
    while rows.shape[0]:  # a panel's tail, whole panels, a panel's head
        p, c = divmod(first, width)
        if c == 0 and rows.shape[0] >= width:
            num = rows.shape[0] // width
            dst, cols = panels[p:p + num], width
        else:
            num, cols = 1, min(width - c, rows.shape[0])
            dst = panels[p:p + 1, :, c:c + cols]
        src = rows[:num * cols]
        if pairs:
            _put_pairs(dst, src, cols)
        else:
            dst.copy_(src.view(num, cols, k).transpose(1, 2))
        first, rows = first + num * cols, rows[num * cols:]


def _put_pairs(dst: torch.Tensor, rows: torch.Tensor, cols: int) -> None:
    """dst [P, ceil(K / 2), cols, 2] (a view into zeroed panels) = rows [P * cols, K] in
    k-pairs."""
    num, k = dst.shape[0], rows.shape[1]
    src = rows.view(num, cols, k)
    if k % 2 == 0 and dst.stride(-2) == 2:
        # Each pair moved as one int32: half the elements of the strided copy (8192 x 2048,
        # 2 threads, into faulted panels: 11.7 -> 8.3 ms).
        dst.view(torch.int32).view(num, k // 2, cols).copy_(
            src.view(torch.int32).view(num, cols, k // 2).transpose(1, 2))
        return
    even = k - k % 2
    dst[:, :even // 2].copy_(src[:, :, :even].view(num, cols, even // 2, 2).transpose(1, 2))
    if k % 2:
        dst[:, -1, :, 0].copy_(src[:, :, -1])


def panel_rows(panels: torch.Tensor, ids: torch.Tensor, k: int) -> torch.Tensor:
    """Float32 rows `ids` (any shape) of the [N, k] matrix that `pack_panels` packed (row r is
    column r % W of panel r // W; padding rows are zero) -> [*ids.shape, k]."""
    width = panels.shape[2]
    flat = ids.reshape(-1)
    rows = panels[flat // width, :, flat % width]  # [n, K] or, in k-pairs, [n, K / 2, 2]
    return rows.reshape(len(flat), -1)[:, :k].float().reshape(*ids.shape, k)


def gemm_panels(x: torch.Tensor, panels: torch.Tensor, n: int,
                bias: torch.Tensor | None = None, *, dot: bool = False) -> torch.Tensor:
    """x [M, K] @ W^T (+ bias) -> float32 [M, n] for the W that `pack_panels` turned into
    `panels` (float32, bfloat16 or float16: the products and sums are float32 in each, x
    rounded to bfloat16 under `bf16_dpbf16()`); x must be float32 [M, K] (copied to a contiguous
    tensor if it is not), bias float32 [n]. dot: bfloat16 k-pairs on vdpbf16ps whatever
    `bf16_dpbf16()` says (only where `bf16_dot_available()`)."""
    if dot and not bf16_dot_available():
        raise RuntimeError("gemm_panels(dot=True): this build has no vdpbf16ps (AVX512-BF16)")
    num_panels, width = panels.shape[0], panels.shape[2]
    if not (num_panels - 1) * width < n <= num_panels * width:
        raise ValueError(f"gemm_panels: {n} output columns do not fit {num_panels} panels of "
                         f"{width}")
    name = _PANEL_KERNELS.get(panels.dtype)
    if dot and panels.dtype != torch.bfloat16:
        raise ValueError(f"gemm_panels(dot=True): panels must be bfloat16, got {panels.dtype}")
    if name is None or not panels.is_contiguous():
        raise ValueError(f"gemm_panels: panels must be contiguous float32, bfloat16 or "
                         f"float16, got {panels.dtype}"
                         f"{'' if panels.is_contiguous() else ' (strided)'}")
    pairs = panels.dtype == torch.bfloat16 and bf16_pairs()
    if panels.dim() != 3 + pairs or (pairs and panels.shape[3] != 2):
        raise ValueError(f"gemm_panels: {panels.dtype} panels here are "
                         f"{'[P, K / 2, W, 2] k-pairs' if pairs else '[P, K, W]'}, got "
                         f"{tuple(panels.shape)}")
    k = panels.shape[1]
    if pairs:  # K is x's, if it is even or odd as the panels' last pair says
        k = x.shape[-1] if x.dim() == 2 and (x.shape[-1] + 1) // 2 == k else 2 * k
    return _call("gemm_panels", getattr(library(), name + "_dot" * dot), x, panels, n, k, bias)
