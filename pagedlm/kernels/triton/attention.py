"""Paged attention on the GPU, in Triton: the KV-cache write, decode rows, and prefill chunks with
cached context (the kernels: attention_jit.py). The Triton attention backend
(pagedlm/attention/backends/triton_attn.py) calls these once per layer.

No wrapper reads a tensor's values on the host (no .item(), .tolist(), nonzero): every length
and block id is read inside the kernels, and grids come from shapes (and, for prefills, the
longest chunk, a host int the caller has). The decode path can therefore be captured in a CUDA
graph (small decode batches split the keys over more programs, a plan from shapes too: see
decode_splits). Nothing is validated here for the same reason: the model runner builds the
block tables and lengths, and the PyTorch backends' tests pin down the convention the kernels
follow.

Triton is imported on first use (CPU-only installs need not have it); the tests run these
kernels on CPU tensors under TRITON_INTERPRET=1.
"""
from __future__ import annotations

import torch

# The tensor cores' smallest tile side: tl.dot needs every dimension >= 16 on the GPU.
_MIN_DOT = 16
# Keys per step of the decode loop. Decode is bound by reading the cache; 64 keys of a
# 128-wide float32 head are 32 KiB per tile, well inside shared memory with two stages.
_DECODE_BLOCK_N = 64
_NUM_STAGES = 2
# Split-KV decode (see decode_splits). The SMs of the GPUs this targets: 132 on an H100 SXM and
# an H200. A fixed figure, not the device's: the plan is then a function of shapes alone,
# identical on every device and checkable on the CPU.
_NUM_SMS = 132
# Below two decode programs per SM the (rows x KV heads) grid leaves SMs idle (a one-stream
# decode of SmolLM2, 3 KV heads: 3 programs for 132 SMs) or runs one latency-bound program per
# SM, too few loads in flight to use the memory bandwidth; splitting the keys brings the grid
# to about this many programs. Two is also what an SM holds at once: the decode kernels take
# about 240 registers a thread at 4 warps (sm_90, head_dim 64), 2 x 30K of the SM's 64K, so
# this many programs are one full wave.
_SPLIT_BELOW_PROGRAMS = 2 * _NUM_SMS
# Split only when the tables span at least this many key tiles: the split path adds a second
# launch (the combine) and a scratch round trip, which a loop of a few tiles does not repay.
_SPLIT_MIN_TILES = 4
# Splits the combine kernel merges per step of its loop.
_COMBINE_BLOCK_S = 16


def _jit():
    # Imported here, not at the top: CPU-only installs need not have Triton.
    from pagedlm.kernels.triton import attention_jit
    return attention_jit


def _pow2(n: int, floor: int = 1) -> int:
    return max(floor, 1 << max(n - 1, 0).bit_length())


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _dot_fp32(query: torch.Tensor, cache: torch.Tensor) -> bool:
    """Whether the products run in float32: unless the query and the cache share a 16-bit
    dtype, which the tensor cores multiply exactly into float32. Always on CPU tensors, which
    only Triton's interpreter runs: its tl.dot multiplies bfloat16 tiles as their raw bits."""
    return query.is_cpu or not (query.dtype == cache.dtype
                                and query.dtype in (torch.float16, torch.bfloat16))


def _cache_strides(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, int, int]:
    if (k_cache.shape != v_cache.shape or k_cache.stride() != v_cache.stride()
            or k_cache.stride(3) != 1):
        raise ValueError(f"the K and V caches must share one layout with contiguous heads, "
                         f"got {tuple(k_cache.shape)} {k_cache.stride()} and "
                         f"{tuple(v_cache.shape)} {v_cache.stride()}")
    return k_cache.stride(0), k_cache.stride(1), k_cache.stride(2)


def _check_rows(name: str, x: torch.Tensor) -> None:
    if x.dim() != 3 or x.stride(2) != 1:
        raise ValueError(f"{name} must be [tokens, heads, head_dim] with contiguous features, "
                         f"got shape {tuple(x.shape)} strides {x.stride()}")


def write_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
             v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """key/value [T, Hkv, D] into the caches [num_blocks, block_size, Hkv, D] at
    slot_mapping [T] (int32/int64; < 0: skipped), cast to the caches' dtype."""
    _check_rows("key", key)
    _check_rows("value", value)
    t, hk, d = key.shape
    if not t:
        return
    cs = _cache_strides(k_cache, v_cache)
    _jit().write_kv_kernel[(t,)](
        key, value, k_cache, v_cache, slot_mapping, key.stride(0), key.stride(1),
        value.stride(0), value.stride(1), *cs, NUM_KV_HEADS=hk, HEAD_DIM=d,
        BLOCK_SIZE=k_cache.shape[1], BLOCK_H=_pow2(hk), BLOCK_D=_pow2(d))


def _split_plan(max_context: int, num_splits: int) -> tuple[int, int]:
    """(splits, split_len) cutting max_context keys into at most num_splits runs of whole
    tiles; fewer when the tiles do not divide evenly."""
    tiles = max(1, _cdiv(max_context, _DECODE_BLOCK_N))
    split_len = _cdiv(tiles, max(1, num_splits)) * _DECODE_BLOCK_N
    return _cdiv(max_context, split_len) if max_context > 0 else 1, split_len


def decode_splits(rows: int, kv_heads: int, max_context: int) -> tuple[int, int]:
    """The split-KV plan of a decode batch: (num_splits, split_len), 1 split meaning the
    single-pass kernel. max_context is the block tables' width x block_size, the most keys a
    row can have. Shapes only, never the lengths' values: the grid it sizes is the same for
    every step of a shape, so the launch can be captured in a CUDA graph (there the tables are
    as wide as max_model_len needs, whatever the lengths).

    Splits when rows x kv_heads programs are under _SPLIT_BELOW_PROGRAMS and the tables span
    _SPLIT_MIN_TILES tiles or more: into enough splits to bring the grid to about
    _SPLIT_BELOW_PROGRAMS programs, each at least one tile (64 keys). Rows shorter than the
    table leave their later splits empty; those programs return at once."""
    programs = rows * kv_heads
    tiles = _cdiv(max_context, _DECODE_BLOCK_N)
    if programs >= _SPLIT_BELOW_PROGRAMS or tiles < _SPLIT_MIN_TILES:
        return 1, max_context
    return _split_plan(max_context, min(tiles, _cdiv(_SPLIT_BELOW_PROGRAMS, programs)))


def _split_scratch(rows: int, heads: int, splits: int, head_dim: int,
                   device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The splits' partial states, float32: acc [rows, heads, splits, head_dim] and (m, l)
    [rows, heads, splits, 2]. Uninitialised: the combine reads only splits that were written.
    (Allocated per call; under CUDA-graph capture that comes from the graph's pool.)"""
    return (torch.empty(rows, heads, splits, head_dim, dtype=torch.float32, device=device),
            torch.empty(rows, heads, splits, 2, dtype=torch.float32, device=device))


def decode_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                     out: torch.Tensor, sliding_window: int | None = None,
                     logits_soft_cap: float | None = None,
                     num_splits: int | None = None) -> None:
    """One query token per row: query [B, Hq, D] attends to the first seq_lens[b] keys of its
    sequence (blocks block_tables[b], [B, W] int32/int64, W may exceed what the lengths need),
    the last `sliding_window` of them when set; writes out [B, Hq, D]. A row with seq_lens 0
    (a CUDA-graph padding row) gets zeros.

    Small batches split the keys over more programs (decode_splits); num_splits forces a
    split count instead (1: the single-pass kernel), for tests and measurements."""
    _check_rows("query", query)
    _check_rows("out", out)
    b, hq, d = query.shape
    hk = k_cache.shape[2]
    if not b:
        return
    group = hq // hk
    cs = _cache_strides(k_cache, v_cache)
    block_size = k_cache.shape[1]
    max_context = block_tables.shape[1] * block_size
    if num_splits is None:
        splits, split_len = decode_splits(b, hk, max_context)
    else:
        splits, split_len = _split_plan(max_context, num_splits)
    window, soft_cap = sliding_window or 0, logits_soft_cap or 0.0
    has_window, has_soft_cap = sliding_window is not None, logits_soft_cap is not None
    block_h, block_d = _pow2(group, _MIN_DOT), _pow2(d, _MIN_DOT)
    dot_fp32 = _dot_fp32(query, k_cache)
    if splits == 1:
        _jit().paged_decode_kernel[(b, hk)](
            query, k_cache, v_cache, block_tables, seq_lens, out, scale, soft_cap, window,
            query.stride(0), query.stride(1), out.stride(0), out.stride(1), *cs,
            block_tables.stride(0), GROUP=group, HEAD_DIM=d, BLOCK_SIZE=block_size,
            BLOCK_H=block_h, BLOCK_D=block_d, BLOCK_N=_DECODE_BLOCK_N, HAS_WINDOW=has_window,
            HAS_SOFT_CAP=has_soft_cap, DOT_FP32=dot_fp32, num_warps=4, num_stages=_NUM_STAGES)
        return
    part_acc, part_ml = _split_scratch(b, hq, splits, d, query.device)
    pa, pm = part_acc.stride()[:3], part_ml.stride()[:3]
    _jit().paged_decode_split_kernel[(b, hk, splits)](
        query, k_cache, v_cache, block_tables, seq_lens, part_acc, part_ml, scale, soft_cap,
        window, split_len, query.stride(0), query.stride(1), *cs, block_tables.stride(0),
        *pa, *pm, GROUP=group, HEAD_DIM=d, BLOCK_SIZE=block_size, BLOCK_H=block_h,
        BLOCK_D=block_d, BLOCK_N=_DECODE_BLOCK_N, HAS_WINDOW=has_window,
        HAS_SOFT_CAP=has_soft_cap, DOT_FP32=dot_fp32, num_warps=4, num_stages=_NUM_STAGES)
    _jit().paged_decode_combine_kernel[(b, hq)](
        part_acc, part_ml, seq_lens, out, window, split_len, splits, out.stride(0),
        out.stride(1), *pa, *pm, HEAD_DIM=d, BLOCK_D=block_d, BLOCK_S=_COMBINE_BLOCK_S,
        HAS_WINDOW=has_window, num_warps=2)


def prefill_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      k_cache: torch.Tensor, v_cache: torch.Tensor,
                      query_start_loc: torch.Tensor, context_lens: torch.Tensor,
                      block_tables: torch.Tensor, max_query_len: int, scale: float,
                      out: torch.Tensor, sliding_window: int | None = None,
                      logits_soft_cap: float | None = None) -> None:
    """Prefill chunks, varlen: chunk c is rows [query_start_loc[c], query_start_loc[c + 1]) of
    the flat batch ([P + 1] int32), at positions context_lens[c] .. of its sequence. Each row
    attends to the chunk's cached context (context_lens[c] keys through block_tables[c], [P, W])
    and causally to the chunk's own key/value rows (the caches need not hold them). Writes
    those rows of out [T, Hq, D]; max_query_len: the longest chunk (it sizes the grid)."""
    for name, x in (("query", query), ("key", key), ("value", value), ("out", out)):
        _check_rows(name, x)
    p = context_lens.shape[0]
    if not p or max_query_len <= 0:
        return
    hq, d = query.shape[1:]
    group = hq // k_cache.shape[2]
    cs = _cache_strides(k_cache, v_cache)
    dot_fp32 = _dot_fp32(query, k_cache)
    # 64 x 64 tiles for 16-bit heads up to 128 wide; float32 (or wider) tiles are twice the
    # bytes, so half the side keeps each stage's Q, K and V tiles within shared memory.
    block_d = _pow2(d, _MIN_DOT)
    side = 32 if dot_fp32 or block_d > 128 else 64
    grid = (p, hq, _cdiv(max_query_len, side))
    _jit().prefill_attention_kernel[grid](
        query, key, value, k_cache, v_cache, out, query_start_loc, context_lens, block_tables,
        scale, logits_soft_cap or 0.0, sliding_window or 0,
        query.stride(0), query.stride(1), key.stride(0), key.stride(1),
        value.stride(0), value.stride(1), out.stride(0), out.stride(1), *cs,
        block_tables.stride(0), GROUP=group, HEAD_DIM=d, BLOCK_SIZE=k_cache.shape[1],
        BLOCK_M=side, BLOCK_D=block_d, BLOCK_N=side, HAS_WINDOW=sliding_window is not None,
        HAS_SOFT_CAP=logits_soft_cap is not None, DOT_FP32=dot_fp32, num_warps=4,
        num_stages=_NUM_STAGES)
