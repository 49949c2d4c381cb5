"""Paged-attention metadata: what one step tells the backends, the cache layout, and the
helpers every backend shares.

The flat batch holds decode tokens first (one query each), then prefill chunks. K/V of every
token are written into the paged cache through the slot mapping; decodes then read their whole
context back through their block tables. A prefill chunk with no earlier context attends to its
own fresh K/V; one with earlier context (a recomputed or chunked prompt) reads the cache like a
decode does.

Cache layout per layer: [num_blocks, block_size, num_kv_heads, head_dim] for K and for V (on a
tensor-parallel rank, num_kv_heads is that rank's heads). The cache's dtype (kv_cache_dtype) may
be narrower than the model's: K/V are rounded to it when written and widened back when read,
and attention itself runs in the model's dtype.

How the attention itself is computed is an AttentionBackend's business (``backends/``): PyTorch
SDPA everywhere, or the native C kernel for float32 on the CPU. The model picks one when it is
built (``get_attn_backend``) and its ``Attention`` layers call it; ``backends.paged_attention()``
is the one-off form used by tests and tools, which picks a backend at each call.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


# A slot_mapping entry that writes nothing: the rows that pad a batch to a CUDA graph's size.
PAD_SLOT_ID = -1


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
    # The prefill chunks again as varlen arrays (what one kernel launch over every chunk
    # takes), int32 on the step's device; None when the runner did not build them (a backend
    # that wants them then builds them from `prefills`). Chunk i is flat-batch rows
    # [query_start_loc[i], query_start_loc[i + 1]), after context_lens[i] cached tokens.
    prefill_query_start_loc: torch.Tensor | None = None  # [P + 1]
    prefill_context_lens: torch.Tensor | None = None  # [P]
    prefill_block_tables: torch.Tensor | None = None  # [P, W], zero-padded
    max_prefill_query_len: int = 0  # a host int: the kernels' grid size
    # Inputs a backend builds on first use and shares across the layers of the step (the native
    # backend's kernel plan). Not for callers.
    _kernel_plan: Any = field(default=None, init=False, repr=False, compare=False)
    _prefill_plan: Any = field(default=None, init=False, repr=False, compare=False)
    # The PyTorch path's decode masks narrowed to a sliding window, by window size.
    _window_masks: dict[int, torch.Tensor] = field(default_factory=dict, init=False, repr=False,
                                                   compare=False)


def write_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
             v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    num_kv_heads, head_dim = k_cache.shape[-2:]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key.to(k_cache.dtype))
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping,
                                                         value.to(v_cache.dtype))


def gather_blocks(cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """[B, max_blocks] block ids -> [B, num_kv_heads, max_blocks * block_size, head_dim]."""
    b, nb = block_tables.shape
    _, bs, h, d = cache.shape
    return cache[block_tables].view(b, nb * bs, h, d).transpose(1, 2)
