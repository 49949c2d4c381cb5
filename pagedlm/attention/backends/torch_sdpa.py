"""Paged attention in plain PyTorch (the Torch SDPA backend of the seeds).

Decodes read their whole context back through their block tables in one batched gather (padded
to the longest table, masked) and one SDPA call; each prefill chunk is one SDPA call, causal over
its own fresh K/V, or masked over a gather of its blocks when it has earlier context. Runs for
every dtype and device; it is also the reference the native kernel is tested against.

A sliding window only narrows the masks. SDPA has no soft-capping, so a layer with a
logits_soft_cap computes its scores explicitly (``_attend``); layers without one keep SDPA.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedlm.attention.backends.abstract import AttentionBackend
from pagedlm.attention.metadata import (AttentionMetadata, PrefillChunk, gather_blocks,
                                       write_kv)


class TorchSDPABackend(AttentionBackend):
    name = "torch_sdpa"

    @classmethod
    def supports(cls, dtype: torch.dtype, device: torch.device | str) -> bool:
        return True

    def forward(self, query, key, value, k_cache, v_cache, meta, scale, sliding_window=None,
                logits_soft_cap=None) -> torch.Tensor:
        write_kv(key, value, k_cache, v_cache, meta.slot_mapping)
        out = torch.empty_like(query, memory_format=torch.contiguous_format)
        decode_attention(query, k_cache, v_cache, meta, scale, out, sliding_window,
                         logits_soft_cap)
        for p in meta.prefills:
            prefill_attention(query, key, value, k_cache, v_cache, p, scale, out,
                              sliding_window, logits_soft_cap)
        return out


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
            scale: float, soft_cap: float | None) -> torch.Tensor:
    """SDPA over [B, H, L, D] tensors (K/V heads grouped), causal when mask is None; with a
    soft cap, the same computed from explicit scores."""
    if soft_cap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                              scale=scale, enable_gqa=True)
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / soft_cap) * soft_cap
    if mask is None:
        n = q.shape[-2]
        mask = torch.ones(n, k.shape[-2], dtype=torch.bool, device=q.device).tril(k.shape[-2] - n)
    scores = scores.masked_fill(~mask, float("-inf"))
    # Softmax in float32, as transformers' eager attention does, then back to the model dtype.
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v)


def prefill_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      k_cache: torch.Tensor, v_cache: torch.Tensor, p: PrefillChunk,
                      scale: float, out: torch.Tensor, sliding_window: int | None = None,
                      logits_soft_cap: float | None = None) -> None:
    """One prefill chunk's rows of `out`, through SDPA."""
    n = p.end - p.start
    q = query[p.start:p.end].transpose(0, 1).unsqueeze(0)  # [1, Hq, L, D]
    if p.context_len == 0:
        k = key[p.start:p.end].transpose(0, 1).unsqueeze(0)
        v = value[p.start:p.end].transpose(0, 1).unsqueeze(0)
        if k_cache.dtype != key.dtype:
            # Round as the cache does, so a prompt attends to the same K/V whether it is
            # computed fresh or read back (prefix-cache hit, chunk, recompute): outputs must
            # not depend on which of those happened.
            k, v = k.to(k_cache.dtype).to(key.dtype), v.to(v_cache.dtype).to(value.dtype)
        mask = None  # causal
        if sliding_window is not None and sliding_window < n:
            rows = torch.arange(n, device=query.device).unsqueeze(1)
            cols = torch.arange(n, device=query.device).unsqueeze(0)
            mask = (cols <= rows) & (cols > rows - sliding_window)
    else:
        total = p.context_len + n
        k = gather_blocks(k_cache, p.block_table[None])[:, :, :total].to(query.dtype)
        v = gather_blocks(v_cache, p.block_table[None])[:, :, :total].to(query.dtype)
        # Query i sits at position context_len + i and sees keys up to there.
        rows = torch.arange(n, device=query.device).unsqueeze(1) + p.context_len
        cols = torch.arange(total, device=query.device).unsqueeze(0)
        mask = cols <= rows
        if sliding_window is not None:
            mask &= cols > rows - sliding_window
    o = _attend(q, k, v, mask, scale, logits_soft_cap)
    out[p.start:p.end] = o.squeeze(0).transpose(0, 1)


def decode_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     meta: AttentionMetadata, scale: float, out: torch.Tensor,
                     sliding_window: int | None = None,
                     logits_soft_cap: float | None = None) -> None:
    """Decode rows through a gather of the whole padded context and SDPA."""
    nd = meta.num_decode_tokens
    if not nd:
        return
    mask = meta.decode_mask
    width = meta.decode_block_tables.shape[1] * k_cache.shape[1]
    if mask is None:  # built once per step, from decode_seq_lens
        mask = torch.arange(width, device=query.device) < meta.decode_seq_lens.view(-1, 1)
        mask = meta.decode_mask = mask.view(nd, 1, 1, width)
    if sliding_window is not None:  # one mask per window size per step, shared by its layers
        windowed = meta._window_masks.get(sliding_window)
        if windowed is None:
            seq_lens = mask.reshape(nd, -1).sum(-1, keepdim=True)
            start = torch.arange(width, device=query.device) >= seq_lens - sliding_window
            windowed = meta._window_masks[sliding_window] = mask & start.view(nd, 1, 1, width)
        mask = windowed
    q = query[:nd].unsqueeze(2)  # [B, Hq, 1, D]
    # The cache is allocated uninitialised: zero the padding read here, or NaN bit patterns
    # would survive the mask as 0 * NaN.
    keep = mask.view(nd, 1, -1, 1)
    k = gather_blocks(k_cache, meta.decode_block_tables).to(query.dtype).where(keep, 0.0)
    v = gather_blocks(v_cache, meta.decode_block_tables).to(query.dtype).where(keep, 0.0)
    o = _attend(q, k, v, mask, scale, logits_soft_cap)
    out[:nd] = o.squeeze(2)
