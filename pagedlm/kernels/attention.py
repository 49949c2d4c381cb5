"""Paged attention kernels (csrc/paged_attention.c, csrc/prefill_attention.c): float32 queries
over a float32, bfloat16 or float16 paged KV cache, for decode tokens and for prefill chunks."""
from __future__ import annotations

import ctypes

import torch

from pagedlm.kernels.kv_types import KERNEL_KV_DTYPES, KV_TYPE_CODES
from pagedlm.kernels.loader import available, typed_library

_p, _i, _f, _i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_float, ctypes.c_int64
library = typed_library({
    "paged_attention_f32": ([_p, _p, _p, _p, _i, _p, _p, _p, _i, _i, _i, _i, _i, _i, _f, _i, _f,
                             _i], None),
    "prefill_attention_f32": ([_p, _p, _i64, _p, _p, _i64, _p, _p, _i, _p, _p, _p, _p, _i, _i,
                               _i, _i, _i, _i, _f, _i, _f, _i], _i),
    "prefill_attention_runs": ([_i], _i),
    "prefill_attention_bf16_amx": ([_p, _p, _i64, _p, _p, _i64, _p, _p, _p, _p, _p, _p, _i, _i,
                                    _i, _i, _i, _i, _f, _i, _f, _i], _i),
    "prefill_attention_amx_runs": ([_i], _i),
})


def _check(name: str, t: torch.Tensor, dtype: torch.dtype, ndim: int) -> None:
    if t.dtype != dtype or t.dim() != ndim or not t.is_contiguous() or t.device.type != "cpu":
        raise ValueError(f"{name}: expected a contiguous {ndim}-d CPU {dtype} tensor, got "
                         f"{t.dtype} {tuple(t.shape)} on {t.device} "
                         f"(contiguous={t.is_contiguous()})")


def paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, token_seq: torch.Tensor,
                    token_ctx_len: torch.Tensor, scale: float,
                    out: torch.Tensor | None = None, sliding_window: int | None = None,
                    logits_soft_cap: float | None = None) -> torch.Tensor:
    """Attention of each query token over its sequence's paged K/V.

    query [T, Hq, D] float32; k_cache/v_cache [num_blocks, block_size, Hkv, D] of one of
    KERNEL_KV_DTYPES (float32, bfloat16, float16: widened to float32 as they are read);
    block_tables [S, max_blocks] int32; token_seq [T] int32 (row of block_tables per token);
    token_ctx_len [T] int32 (token t attends to positions 0 .. token_ctx_len[t]-1, or only the
    last ``sliding_window`` of them). ``logits_soft_cap`` c maps each scaled score s to
    c * tanh(s / c) before the softmax. All contiguous. Returns (or fills ``out``) [T, Hq, D].

    Index values are not range-checked here (that would cost a reduction per call); an
    out-of-range block id or context length reads out of bounds.
    """
    lib = library()
    if lib is None:
        raise RuntimeError("native paged attention kernel is unavailable")
    _check("query", query, torch.float32, 3)
    kv_type = KV_TYPE_CODES.get(k_cache.dtype)
    if kv_type is None:
        raise ValueError(f"k_cache: dtype {k_cache.dtype} is not one of {KERNEL_KV_DTYPES}")
    _check("k_cache", k_cache, k_cache.dtype, 4)
    _check("v_cache", v_cache, k_cache.dtype, 4)
    _check("block_tables", block_tables, torch.int32, 2)
    _check("token_seq", token_seq, torch.int32, 1)
    _check("token_ctx_len", token_ctx_len, torch.int32, 1)
    num_tokens, num_q_heads, head_dim = query.shape
    _, block_size, num_kv_heads, cache_dim = k_cache.shape
    if v_cache.shape != k_cache.shape or cache_dim != head_dim:
        raise ValueError(f"cache shapes {tuple(k_cache.shape)}/{tuple(v_cache.shape)} do not "
                         f"match query {tuple(query.shape)}")
    if num_q_heads % num_kv_heads:
        raise ValueError(f"{num_q_heads} query heads not a multiple of {num_kv_heads} kv heads")
    if token_seq.numel() != num_tokens or token_ctx_len.numel() != num_tokens:
        raise ValueError("token_seq/token_ctx_len must have one entry per query token")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be a positive integer, got {sliding_window!r}")
    if logits_soft_cap is not None and not logits_soft_cap > 0:
        raise ValueError(f"logits_soft_cap must be positive, got {logits_soft_cap!r}")
    if out is None:
        out = torch.empty_like(query)
    else:
        _check("out", out, torch.float32, 3)
        if out.shape != query.shape:
            raise ValueError(f"out shape {tuple(out.shape)} != query shape {tuple(query.shape)}")
    if num_tokens:
        lib.paged_attention_f32(
            out.data_ptr(), query.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), kv_type,
            block_tables.data_ptr(), token_seq.data_ptr(), token_ctx_len.data_ptr(),
            num_tokens, num_q_heads, num_kv_heads, head_dim, block_size,
            block_tables.shape[1], float(scale), int(sliding_window or 0),
            float(logits_soft_cap or 0.0), torch.get_num_threads())
    return out


def prefill_attention_runs(head_dim: int) -> bool:
    """Whether `prefill_attention` runs for this head size in this build: AVX-512 and a head
    size that is a multiple of 16."""
    return available() and bool(library().prefill_attention_runs(head_dim))


def prefill_attention_amx_runs(head_dim: int) -> bool:
    """Whether `prefill_attention` takes a bfloat16 cache to the AMX kernel
    (csrc/prefill_attention_amx.c) for this head size: AMX-BF16 in the build and granted to the
    process (amx_bf16_available, asked once), a head size that is a multiple of 32."""
    return available() and bool(library().prefill_attention_amx_runs(head_dim))


def prefill_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      k_cache: torch.Tensor, v_cache: torch.Tensor, chunks: torch.Tensor,
                      block_tables: torch.Tensor, scale: float, out: torch.Tensor,
                      sliding_window: int | None = None,
                      logits_soft_cap: float | None = None, use_amx: bool = True) -> None:
    """Causal attention of prefill chunks, written into their rows of ``out``.

    out [T, Hq, D] float32 contiguous; query [T, Hq, D] and key/value [T, Hkv, D] float32 (the
    step's fresh K/V) with their heads contiguous within a row, key and value with one row
    stride (views of a fused QKV projection's output qualify). chunks [C, 3] int32: (first row,
    rows, context_len) per chunk; a chunk's rows sit at positions context_len .. context_len +
    rows - 1 and its first context_len keys are read from the caches (any of KERNEL_KV_DTYPES,
    widened as they are read) through row c of block_tables [C, max_blocks] int32.
    Indices are not range-checked here (the caller builds them once per step).

    With a bfloat16 cache, where `prefill_attention_amx_runs` and use_amx, the products run on
    AMX tiles: the queries and the softmax weights are rounded to bfloat16 (and the fresh K/V,
    which the cache's rounding leaves as they are), sums in float32. Its results are not the
    float32 kernel's bits; use_amx=False keeps that one.
    """
    lib = library()
    if lib is None or not lib.prefill_attention_runs(query.shape[-1]):
        raise RuntimeError("native prefill attention kernel is unavailable")
    _check("out", out, torch.float32, 3)
    _check("chunks", chunks, torch.int32, 2)
    _check("block_tables", block_tables, torch.int32, 2)
    _, num_q_heads, head_dim = query.shape
    if query.dtype != torch.float32 or query.stride()[1:] != (head_dim, 1):
        raise ValueError(f"query: expected float32 [T, Hq, D] with contiguous heads, got "
                         f"{query.dtype} {tuple(query.shape)} {query.stride()}")
    num_kv_heads = key.shape[1]
    if (key.dtype != torch.float32 or value.dtype != torch.float32
            or key.stride()[1:] != (head_dim, 1) or value.stride() != key.stride()
            or key.shape != value.shape or key.shape[2] != head_dim):
        raise ValueError("key/value: expected float32 [T, Hkv, D] with contiguous heads and one "
                         f"row stride, got {tuple(key.shape)} {key.stride()} and "
                         f"{tuple(value.shape)} {value.stride()}")
    if num_q_heads % num_kv_heads:
        raise ValueError(f"{num_q_heads} query heads not a multiple of {num_kv_heads} kv heads")
    kv_type = KV_TYPE_CODES.get(k_cache.dtype)
    if kv_type is None:
        raise ValueError(f"k_cache: dtype {k_cache.dtype} is not one of {KERNEL_KV_DTYPES}")
    _check("k_cache", k_cache, k_cache.dtype, 4)
    _check("v_cache", v_cache, k_cache.dtype, 4)
    if out.shape != query.shape or chunks.shape[1] != 3:
        raise ValueError(f"out {tuple(out.shape)} / chunks {tuple(chunks.shape)} do not match "
                         f"query {tuple(query.shape)}")
    if chunks.shape[0] == 0:
        return
    c = chunks.t().contiguous()
    # The one decision (the backend asks the same function whether to skip its K/V cast).
    if use_amx and kv_type == KV_TYPE_CODES[torch.bfloat16] and prefill_attention_amx_runs(
            head_dim):
        status = lib.prefill_attention_bf16_amx(
            out.data_ptr(), query.data_ptr(), query.stride(0), key.data_ptr(), value.data_ptr(),
            key.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), c[0].data_ptr(),
            c[1].data_ptr(), c[2].data_ptr(), block_tables.data_ptr(), block_tables.shape[1],
            chunks.shape[0], num_q_heads, num_kv_heads, head_dim, k_cache.shape[1],
            float(scale), int(sliding_window or 0), float(logits_soft_cap or 0.0),
            torch.get_num_threads())
        if status != 0:
            raise MemoryError("prefill attention: could not allocate its scratch buffers")
        return
    status = lib.prefill_attention_f32(
        out.data_ptr(), query.data_ptr(), query.stride(0), key.data_ptr(), value.data_ptr(),
        key.stride(0),
        k_cache.data_ptr(), v_cache.data_ptr(), kv_type, c[0].data_ptr(), c[1].data_ptr(),
        c[2].data_ptr(), block_tables.data_ptr(), block_tables.shape[1], chunks.shape[0],
        num_q_heads, num_kv_heads, head_dim, k_cache.shape[1], float(scale),
        int(sliding_window or 0), float(logits_soft_cap or 0.0), torch.get_num_threads())
    if status != 0:
        raise MemoryError("prefill attention: could not allocate its scratch buffers")
