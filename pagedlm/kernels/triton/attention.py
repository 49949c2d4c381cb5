"""Paged attention on the GPU, in Triton: the KV-cache write, decode rows, and prefill chunks with
cached context (the kernels: attention_jit.py). The Triton attention backend
(pagedlm/attention/backends/triton_attn.py) calls these once per layer.

No wrapper reads a tensor's values on the host (no .item(), .tolist(), nonzero): every length
and block id is read inside the kernels, and grids come from shapes (and, for prefills, the
longest chunk, a host int the caller has). The decode path can therefore be captured in a CUDA
graph. Nothing is validated here for the same reason: the model runner builds the block tables
and lengths, and the PyTorch backends' tests pin down the convention the kernels follow.

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


def decode_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                     out: torch.Tensor, sliding_window: int | None = None,
                     logits_soft_cap: float | None = None) -> None:
    """One query token per row: query [B, Hq, D] attends to the first seq_lens[b] keys of its
    sequence (blocks block_tables[b], [B, W] int32/int64, W may exceed what the lengths need),
    the last `sliding_window` of them when set; writes out [B, Hq, D]. A row with seq_lens 0
    (a CUDA-graph padding row) gets zeros."""
    _check_rows("query", query)
    _check_rows("out", out)
    b, hq, d = query.shape
    hk = k_cache.shape[2]
    if not b:
        return
    group = hq // hk
    cs = _cache_strides(k_cache, v_cache)
    _jit().paged_decode_kernel[(b, hk)](
        query, k_cache, v_cache, block_tables, seq_lens, out, scale,
        logits_soft_cap or 0.0, sliding_window or 0,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1), *cs,
        block_tables.stride(0), GROUP=group, HEAD_DIM=d, BLOCK_SIZE=k_cache.shape[1],
        BLOCK_H=_pow2(group, _MIN_DOT), BLOCK_D=_pow2(d, _MIN_DOT), BLOCK_N=_DECODE_BLOCK_N,
        HAS_WINDOW=sliding_window is not None, HAS_SOFT_CAP=logits_soft_cap is not None,
        DOT_FP32=_dot_fp32(query, k_cache), num_warps=4, num_stages=_NUM_STAGES)


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
