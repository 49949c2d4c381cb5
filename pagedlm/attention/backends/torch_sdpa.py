"""Paged attention in plain PyTorch (the Torch SDPA backend of the seeds).

Decodes read their whole context back through their block tables in one batched gather (padded
to the longest table, masked) and one SDPA call; each prefill chunk is one SDPA call, causal over
its own fresh K/V, or masked over a gather of its blocks when it has earlier context. Runs for
every dtype and device; it is also the reference the native kernel is tested against.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedlm.attention.backends.abstract import AttentionBackend
from pagedlm.attention.paged_attention import (AttentionMetadata, PrefillChunk, gather_blocks,
                                               write_kv)


class TorchSDPABackend(AttentionBackend):
    name = "torch_sdpa"

    @classmethod
    def supports(cls, dtype: torch.dtype, device: torch.device | str) -> bool:
        return True

    def forward(self, query, key, value, k_cache, v_cache, meta, scale) -> torch.Tensor:
        write_kv(key, value, k_cache, v_cache, meta.slot_mapping)
        out = torch.empty_like(query, memory_format=torch.contiguous_format)
        decode_attention(query, k_cache, v_cache, meta, scale, out)
        for p in meta.prefills:
            prefill_attention(query, key, value, k_cache, v_cache, p, scale, out)
        return out


def prefill_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      k_cache: torch.Tensor, v_cache: torch.Tensor, p: PrefillChunk,
                      scale: float, out: torch.Tensor) -> None:
    """One prefill chunk's rows of `out`, through SDPA."""
    q = query[p.start:p.end].transpose(0, 1).unsqueeze(0)  # [1, Hq, L, D]
    if p.context_len == 0:
        k = key[p.start:p.end].transpose(0, 1).unsqueeze(0)
        v = value[p.start:p.end].transpose(0, 1).unsqueeze(0)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                           enable_gqa=True)
    else:
        total = p.context_len + (p.end - p.start)
        k = gather_blocks(k_cache, p.block_table[None])[:, :, :total]
        v = gather_blocks(v_cache, p.block_table[None])[:, :, :total]
        # Query i sits at position context_len + i and sees keys up to there.
        rows = torch.arange(p.end - p.start).unsqueeze(1) + p.context_len
        mask = torch.arange(total).unsqueeze(0) <= rows
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                           enable_gqa=True)
    out[p.start:p.end] = o.squeeze(0).transpose(0, 1)


def decode_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
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
    k = gather_blocks(k_cache, meta.decode_block_tables).where(keep, 0.0)
    v = gather_blocks(v_cache, meta.decode_block_tables).where(keep, 0.0)
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    out[:nd] = o.squeeze(2)
