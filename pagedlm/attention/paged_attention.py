"""Paged attention in plain PyTorch (the Torch SDPA backend of the seeds).

The flat batch holds decode tokens first (one query each), then prefill chunks. K/V of every
token are written into the paged cache through the slot mapping; decodes then read their whole
context back through their block tables in one batched gather. A prefill chunk with no earlier
context attends to its own fresh K/V; one with earlier context (a recomputed or chunked prompt)
reads the cache like a decode does.

Cache layout per layer: [num_blocks, block_size, num_kv_heads, head_dim] for K and for V.

When the native kernel (``kernels.py``, C + OpenMP) is available and everything is float32, the
rows that read the cache (decodes, and prefill chunks of at most KERNEL_MAX_CHUNK_TOKENS tokens
with earlier context) go through it in one call per layer: it reads each sequence's K/V once,
straight from the blocks, instead of gathering a padded copy for SDPA. The per-step index
tensors it needs are built on first use and cached on the metadata object, so the layers of one
step share them. The PyTorch code below stays as the fallback (``PAGEDLM_DISABLE_KERNELS=1``)
and as the reference in the tests.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from pagedlm.attention import kernels


@dataclass
class PrefillChunk:
    start: int  # row range in the flat batch
    end: int
    context_len: int  # tokens already in the cache before this chunk
    block_table: torch.Tensor | None  # only needed when context_len > 0


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] flat cache slot of each token
    num_decode_tokens: int
    decode_block_tables: torch.Tensor | None  # [num_decodes, max_blocks], int32 (best) or int64
    # [num_decodes, 1, 1, max_blocks * block_size], True=keep. May be None when decode_seq_lens
    # is given: only the PyTorch path needs it, and builds it (once per step) if it runs.
    decode_mask: torch.Tensor | None
    prefills: list[PrefillChunk]
    # [num_decodes] int32: keys each decode attends to (its position + 1, i.e. the sequence
    # length including the token being decoded). Optional: derived from decode_mask if None.
    decode_seq_lens: torch.Tensor | None = None
    # Kernel inputs built on first use and shared by all layers of the step (not for callers).
    _kernel_plan: _KernelPlan | None = field(default=None, init=False, repr=False,
                                             compare=False)


@dataclass
class _KernelPlan:
    key: tuple[int, int]  # (block_size, num_blocks) of the cache it was validated against
    rows: slice | torch.Tensor  # rows of the flat batch the kernel computes
    block_tables: torch.Tensor  # int32 [num_seqs, max_blocks]
    token_seq: torch.Tensor  # int32 [num_kernel_tokens], row of block_tables per token
    ctx_lens: torch.Tensor  # int32 [num_kernel_tokens], keys each token attends to


def write_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
             v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    num_kv_heads, head_dim = k_cache.shape[-2:]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value)


def _gather(cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """[B, max_blocks] block ids -> [B, num_kv_heads, max_blocks * block_size, head_dim]."""
    b, nb = block_tables.shape
    _, bs, h, d = cache.shape
    return cache[block_tables].view(b, nb * bs, h, d).transpose(1, 2)


def paged_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                    scale: float) -> torch.Tensor:
    """query [T, Hq, D], key/value [T, Hkv, D] -> [T, Hq, D]."""
    write_kv(key, value, k_cache, v_cache, meta.slot_mapping)
    out = torch.empty_like(query, memory_format=torch.contiguous_format)
    use_kernel = (query.dtype == k_cache.dtype == v_cache.dtype == torch.float32
                  and query.device.type == "cpu" and k_cache.is_contiguous()
                  and v_cache.is_contiguous() and kernels.available())
    if use_kernel:
        _kernel_attention(query, k_cache, v_cache, meta, scale, out)
    else:
        _torch_decode_attention(query, k_cache, v_cache, meta, scale, out)
    for p in meta.prefills:
        if use_kernel and _kernel_chunk(p):
            continue  # done by the kernel above
        q = query[p.start:p.end].transpose(0, 1).unsqueeze(0)  # [1, Hq, L, D]
        if p.context_len == 0:
            k = key[p.start:p.end].transpose(0, 1).unsqueeze(0)
            v = value[p.start:p.end].transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                               enable_gqa=True)
        else:
            total = p.context_len + (p.end - p.start)
            k = _gather(k_cache, p.block_table[None])[:, :, :total]
            v = _gather(v_cache, p.block_table[None])[:, :, :total]
            # Query i sits at position context_len + i and sees keys up to there.
            rows = torch.arange(p.end - p.start).unsqueeze(1) + p.context_len
            mask = torch.arange(total).unsqueeze(0) <= rows
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                               enable_gqa=True)
        out[p.start:p.end] = o.squeeze(0).transpose(0, 1)
    return out


# Longer chunks go to SDPA: the kernel handles each query token on its own (dot products),
# which is faster for decodes and short chunks but loses to SDPA's blocked GEMMs from about 16
# query tokens on (measured here, ctx 512-2048: 0.9 vs 0.8 ms at 16, 4.3 vs 2.1 ms at 64).
KERNEL_MAX_CHUNK_TOKENS = 16


def _kernel_chunk(p: PrefillChunk) -> bool:
    """Whether the kernel computes this prefill chunk (it reads earlier context, and is short)."""
    return p.context_len > 0 and p.end - p.start <= KERNEL_MAX_CHUNK_TOKENS


def _torch_decode_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            meta: AttentionMetadata, scale: float, out: torch.Tensor) -> None:
    """Decode rows through a gather of the whole padded context and SDPA."""
    nd = meta.num_decode_tokens
    if not nd:
        return
    mask = meta.decode_mask
    if mask is None:  # built once per step, from decode_seq_lens
        width = meta.decode_block_tables.shape[1] * k_cache.shape[1]
        mask = torch.arange(width) < meta.decode_seq_lens.view(-1, 1)
        mask = meta.decode_mask = mask.view(nd, 1, 1, width)
    q = query[:nd].unsqueeze(2)  # [B, Hq, 1, D]
    # The cache is allocated uninitialised: zero the padding read here, or NaN bit patterns
    # would survive the mask as 0 * NaN.
    keep = mask.view(nd, 1, -1, 1)
    k = _gather(k_cache, meta.decode_block_tables).where(keep, 0.0)
    v = _gather(v_cache, meta.decode_block_tables).where(keep, 0.0)
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    out[:nd] = o.squeeze(2)


def _kernel_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      meta: AttentionMetadata, scale: float, out: torch.Tensor) -> None:
    """Decode rows and short prefill chunks with earlier context, through the native kernel."""
    block_size, num_blocks = k_cache.shape[1], k_cache.shape[0]
    plan = meta._kernel_plan
    if plan is None or plan.key != (block_size, num_blocks):
        plan = meta._kernel_plan = _build_kernel_plan(meta, block_size, num_blocks)
    if plan.token_seq.numel() == 0:
        return
    if isinstance(plan.rows, slice):
        kernels.paged_attention(query[plan.rows].contiguous(), k_cache, v_cache,
                                plan.block_tables, plan.token_seq, plan.ctx_lens, scale,
                                out=out[plan.rows])
    else:
        o = kernels.paged_attention(query.index_select(0, plan.rows), k_cache, v_cache,
                                    plan.block_tables, plan.token_seq, plan.ctx_lens, scale)
        out.index_copy_(0, plan.rows, o)


def _build_kernel_plan(meta: AttentionMetadata, block_size: int, num_blocks: int) -> _KernelPlan:
    """Index tensors for one kernel call over all cache-reading rows; checks them once."""
    # Segments: (block-table rows, keys needed per table row, table row per token,
    #            keys per token, row range in the flat batch).
    segments = []
    nd = meta.num_decode_tokens
    if nd:
        seq_lens = meta.decode_seq_lens
        if seq_lens is None:  # the mask keeps a prefix of each row
            seq_lens = meta.decode_mask.reshape(nd, -1).sum(-1)
        seq_lens = seq_lens.to(torch.int32)
        segments.append((meta.decode_block_tables, seq_lens,
                         torch.arange(nd, dtype=torch.int32), seq_lens, (0, nd)))
    for p in meta.prefills:
        if _kernel_chunk(p):  # one table row shared by the chunk's tokens
            n = p.end - p.start
            total = p.context_len + n
            segments.append((p.block_table.reshape(1, -1), torch.tensor([total]),
                             torch.zeros(n, dtype=torch.int32),
                             torch.arange(p.context_len + 1, total + 1, dtype=torch.int32),
                             (p.start, p.end)))
    if not segments:
        empty = torch.zeros(0, dtype=torch.int32)
        return _KernelPlan((block_size, num_blocks), slice(0, 0), empty.view(0, 1), empty,
                           empty)

    # Out-of-range indices would make the kernel read out of bounds: check once per step.
    for table, row_keys, _, _, _ in segments:
        if int(row_keys.max()) > table.shape[1] * block_size or int(row_keys.min()) < 0:
            raise ValueError(f"context length {int(row_keys.max())} exceeds the block table "
                             f"({table.shape[1]} blocks of {block_size})")
        used = torch.arange(table.shape[1]) < (row_keys.view(-1, 1) + block_size - 1) // block_size
        ids = table[used]
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= num_blocks):
            raise ValueError(f"block id out of range [0, {num_blocks}) in a block table")

    if len(segments) == 1:
        block_tables = segments[0][0].to(torch.int32).contiguous()
    else:
        block_tables = torch.zeros(sum(s[0].shape[0] for s in segments),
                                   max(s[0].shape[1] for s in segments), dtype=torch.int32)
    token_seq, r = [], 0
    for table, _, seq, _, _ in segments:
        if len(segments) > 1:
            block_tables[r:r + table.shape[0], :table.shape[1]] = table
        token_seq.append(seq + r)
        r += table.shape[0]
    spans = [s[4] for s in segments]
    if all(a[1] == b[0] for a, b in zip(spans, spans[1:])):
        rows = slice(spans[0][0], spans[-1][1])
    else:
        rows = torch.cat([torch.arange(a, b) for a, b in spans])
    return _KernelPlan((block_size, num_blocks), rows, block_tables, torch.cat(token_seq),
                       torch.cat([s[3] for s in segments]))
