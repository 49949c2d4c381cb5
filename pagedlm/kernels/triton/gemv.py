"""y = x @ W^T (+ b) for decode-sized batches (M <= 8 rows) on the GPU, in Triton (the kernels:
gemv_jit.py). The linear layers call it instead of F.linear on CUDA for up to
linear_method.TRITON_GEMV_MAX_ROWS (2) rows unless PAGEDLM_TRITON_GEMV=0
(UnquantizedLinearMethod.apply).
On an H200 it made one decode stream 22% and 18% faster end to end in two runs
(benchmarks/results/gpu-20261127b and c; per call at 1 row: 3.0-4.1 us against cuBLAS's
3.7-5.3); at 4 rows the two tie, at 8 cuBLAS wins.

Why: one decode stream of SmolLM2-135M on an H200 spent 3.7-3.8 us in each of its 120 cuBLAS
GEMV calls per token (benchmarks/results/gpu-20261127/run2_gpu_bench.json, legs.pagedlm.profile):
cuBLAS picks 8x64 tiles, which for N = 960 is about 15 CTAs on 132 SMs, while reading the
0.7-3.5 MB of each weight at 4.8 TB/s takes under 1 us. Here many programs split N (BLOCK_N
features each, chosen so that there are about as many programs as SMs or more), each reading
its rows of W once for all the batch's rows. K may be split too (split_k > 1: a second launch
adds the float32 partial sums in a fixed order, no atomics), which costs a launch and can pay
only where the first pass has too few programs; default_config never splits, and
benchmarks/gpu_gemv.py measures both.

Numerics: products and sums in float32 (each lane of the tile sums its K positions in K order,
then the lanes are summed), the bias added in float32, rounded once to x's dtype, as cuBLAS's
bfloat16 GEMM does; the sum orders differ, so the two agree within a unit in the last place,
not bit for bit.

Specialisation: the row count m changes from step to step (CUDA graphs run at 1, 2, 4, 8 rows,
eager steps at any count up to 8). Its bucket BLOCK_M (1, 2, 4 or 8; rows past m masked) is a
constexpr, so each weight shape compiles at most 4 variants (8 with and without a bias), and
CUDA-graph capture at start-up (sizes 1, 2, 4, 8 when max_num_seqs >= 8) compiles all 4 in its
warm-up runs; m itself is not specialised on (gemv_jit.py). A compile in the middle of serving
stalls a stream for about a second; with `do_not_specialize` on m alone, the tiles would have
to be the largest bucket's at every count: 8x the loads and multiplies for a single row, and
registers sized for 8. (Without graphs, enforce_eager, each bucket still compiles once per
weight shape at its first use.)

Host cost: a Triton launch from Python takes more host time than cuBLAS's; inside a CUDA graph
(decode steps) that is gone, but an eager step of few rows pays it in every layer.

No host sync and a grid from shapes only: the call can be captured in a CUDA graph.
Triton is imported on first use (CPU-only installs need not have it); the tests run these
kernels on CPU tensors under TRITON_INTERPRET=1.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

# The most rows a call takes (the linear layers' hook sends at most this many).
MAX_ROWS = 8
# Float32 accumulators of one program's tile ([BLOCK_M * BLOCK_N, BLOCK_K]): 32 a thread at 4
# warps, so the tile stays in registers beside its loads (no spills in ptxas's report for sm_90
# at these sizes, all K steps unrolled).
_TILE_ELEMS = 4096
_MIN_BLOCK_K = 64
_MAX_BLOCK_K = 1024
# bfloat16/float16 elements in a 16-byte load: each thread should hold at least one per step.
_VECTOR = 8


@dataclass(frozen=True)
class GemvConfig:
    """One launch configuration: BLOCK_N features a program, BLOCK_K per loop step, K split
    over split_k programs (> 1: a second, reducing launch), num_warps a program."""
    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4


# Configurations measured best on a GPU, by (row bucket, N, K), from benchmarks/gpu_gemv.py's
# "best" (in the source: default_config caches its picks). Shapes not here get default_config's
# rule. These: SmolLM2-135M's four shapes on an H200 (132 SMs), per call in a CUDA graph with
# L2 flushed (benchmarks/results/gpu-20261127{b,c}/gpu_gemv.json): at 1 row the rule's pick
# except gate_up (3.65 us against 4.06); at 2 rows gate_up 4.13 against 7.17; at 8 rows
# 4.4-9.1 us against the rule's 6.2-10.7.
TUNED: dict[tuple[int, int, int], GemvConfig] = {
    (1, 960, 576): GemvConfig(4, 64, 1, 1), (1, 576, 576): GemvConfig(4, 64, 1, 1),
    (1, 3072, 576): GemvConfig(4, 64, 1, 1), (1, 576, 1536): GemvConfig(4, 512, 1, 4),
    (2, 960, 576): GemvConfig(8, 64, 1, 4), (2, 576, 576): GemvConfig(8, 64, 1, 4),
    (2, 3072, 576): GemvConfig(8, 64, 1, 4), (2, 576, 1536): GemvConfig(4, 512, 1, 4),
    (4, 960, 576): GemvConfig(4, 64, 1, 4), (4, 576, 576): GemvConfig(4, 64, 1, 4),
    (4, 3072, 576): GemvConfig(4, 64, 1, 4), (4, 576, 1536): GemvConfig(4, 256, 1, 4),
    (8, 960, 576): GemvConfig(8, 64, 1, 4), (8, 576, 576): GemvConfig(8, 64, 1, 4),
    (8, 3072, 576): GemvConfig(8, 64, 1, 4), (8, 576, 1536): GemvConfig(8, 64, 1, 4),
}


def _jit():
    # Imported here, not at the top: CPU-only installs need not have Triton.
    from pagedlm.kernels.triton import gemv_jit
    return gemv_jit


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def row_bucket(m: int) -> int:
    """The tile rows BLOCK_M for m rows: 1, 2, 4 or 8."""
    return _pow2(max(m, 1))


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 132  # CPU tensors (the interpreter): an H100/H200's count, for the same picks
    return torch.cuda.get_device_properties(device).multi_processor_count


def default_config(m: int, n: int, k: int, device: torch.device) -> GemvConfig:
    """TUNED's entry, else a rule (a first guess, until a GPU run fills TUNED): the widest
    BLOCK_N of 16, 8, 4 that still gives a program per SM (latency, not arithmetic, bounds a
    GEMV this small: the more programs loading at once, the sooner the weight is in); the
    BLOCK_K that wastes the fewest masked lanes past K (K = 576 = 9 x 64, 1536 = 3 x 512),
    the longest of those whose tile fits _TILE_ELEMS; and as many warps as give each thread a
    16-byte load per step, up to 4."""
    return _config(row_bucket(m), n, k, device)


# Cached: in eager steps every linear layer asks, and the host time of a call adds up there.
@functools.lru_cache(maxsize=None)
def _config(bm: int, n: int, k: int, device: torch.device) -> GemvConfig:
    tuned = TUNED.get((bm, n, k))
    return tuned if tuned is not None else rule_config(bm, n, k, _sm_count(device))


def rule_config(bm: int, n: int, k: int, sms: int, block_n: int | None = None) -> GemvConfig:
    """default_config's rule for row bucket bm on a GPU with `sms` SMs (block_n: given, not
    chosen; benchmarks/gpu_gemv.py sweeps it)."""
    if block_n is None:
        block_n = next((b for b in (16, 8) if _cdiv(n, b) >= sms), 4)
    rows = bm * block_n
    widest = max(_MIN_BLOCK_K, min(_TILE_ELEMS // rows, _MAX_BLOCK_K, _pow2(k)))
    steps = [1 << e for e in range(_MIN_BLOCK_K.bit_length() - 1, widest.bit_length())]
    block_k = min(steps, key=lambda bk: (_cdiv(k, bk) * bk, -bk))
    num_warps = max(1, min(4, rows * block_k // (_VECTOR * 32)))
    return GemvConfig(block_n, block_k, num_warps=num_warps)


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         config: GemvConfig | None = None) -> torch.Tensor:
    """x [M, K] (M <= MAX_ROWS, any strides), weight [N, K] (rows contiguous), bias [N] or
    None -> [M, N] in x's dtype: x @ weight^T + bias, products and sums in float32."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"gemv needs x [M, K] and weight [N, K], got {tuple(x.shape)} and "
                         f"{tuple(weight.shape)}")
    m, k = x.shape
    n = weight.shape[0]
    if m > MAX_ROWS:
        raise ValueError(f"gemv takes at most {MAX_ROWS} rows, got {m}")
    if weight.stride(1) != 1:
        raise ValueError(f"gemv needs the weight's rows contiguous, got strides "
                         f"{weight.stride()}")
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"bias must be [{n}], got {tuple(bias.shape)}")
    # On CPU tensors (Triton's interpreter: the tests) the kernel writes float32 and torch
    # rounds it: the interpreter rounds float32 to bfloat16 by truncation (and its
    # round-to-nearest mode drops the carry into the exponent), where the GPU rounds to nearest.
    y = torch.empty((m, n), dtype=torch.float32 if x.is_cpu else x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y.to(x.dtype)
    cfg = config or default_config(m, n, k, x.device)
    bm = row_bucket(m)
    jit = _jit()
    grid_n = _cdiv(n, cfg.block_n)
    # Each split covers whole K steps: the last one's tail is masked.
    k_steps = _cdiv(_cdiv(k, cfg.split_k), cfg.block_k)
    b = bias if bias is not None else y  # not read without HAS_BIAS
    if cfg.split_k == 1:
        jit.gemv_kernel[(grid_n, 1)](
            x, weight, b, y, m, n, k, x.stride(0), x.stride(1), weight.stride(0),
            y.stride(0), 0, BLOCK_M=bm, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
            K_STEPS=k_steps, HAS_BIAS=bias is not None, PARTIAL=False,
            num_warps=cfg.num_warps)
        return y.to(x.dtype)
    part = torch.empty((cfg.split_k, m, n), dtype=torch.float32, device=x.device)
    jit.gemv_kernel[(grid_n, cfg.split_k)](
        x, weight, b, part, m, n, k, x.stride(0), x.stride(1), weight.stride(0),
        part.stride(1), part.stride(0), BLOCK_M=bm, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        K_STEPS=k_steps, HAS_BIAS=False, PARTIAL=True, num_warps=cfg.num_warps)
    reduce_n = min(256, _pow2(n))
    jit.splitk_reduce_kernel[(_cdiv(n, reduce_n),)](
        part, b, y, m, n, part.stride(0), part.stride(1), y.stride(0), BLOCK_M=bm,
        BLOCK_N=reduce_n, SPLIT_K=cfg.split_k, HAS_BIAS=bias is not None, num_warps=4)
    return y.to(x.dtype)
