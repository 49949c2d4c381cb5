"""Paged attention through Triton kernels (``pagedlm/kernels/triton/attention.py``): the GPU
path's backend, for float32, bfloat16 and float16 models over caches of any of those dtypes.

Per layer, three launches at most: the K/V write (slots < 0 skipped), one for the decode rows
(block tables and lengths read in the kernel), one for every prefill chunk (varlen: causal over
the chunk's own rows, plus its cached context through its block table). The decode path reads
nothing back to the host and sizes its grid from shapes, so a pure decode step can be captured
in a CUDA graph (worker/cuda_graph.py): padding rows have slot -1 (not written) and length 0
(zeros out).

The prefill launch takes the varlen metadata the model runner builds (AttentionMetadata's
prefill_query_start_loc, prefill_context_lens, prefill_block_tables, max_prefill_query_len).
Where they are unset (a one-off paged_attention() call, a runner that did not build them) they
are built here from ``meta.prefills``, once per step: the layers share them through the
metadata.

On the CPU it runs only when asked for (PAGEDLM_ATTENTION_BACKEND=triton) in Triton's
interpreter (TRITON_INTERPRET=1), which is how the CPU tests run the whole engine through it.
"""
from __future__ import annotations

import importlib.util

import torch

from pagedlm import envs
from pagedlm.attention.backends.abstract import AttentionBackend
from pagedlm.attention.metadata import AttentionMetadata
from pagedlm.kernels.triton import attention as triton_attention

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def triton_installed() -> bool:
    """Whether Triton can be imported (without importing it: that fixes its interpreter mode)."""
    return importlib.util.find_spec("triton") is not None


class TritonAttentionBackend(AttentionBackend):
    name = "triton"

    @classmethod
    def supports(cls, dtype: torch.dtype, device: torch.device | str) -> bool:
        """On a GPU with Triton installed; on the CPU only when PAGEDLM_ATTENTION_BACKEND names
        it and Triton runs in its interpreter (TRITON_INTERPRET=1), for tests."""
        if dtype not in DTYPES or not triton_installed():
            return False
        kind = torch.device(device).type
        if kind == "cuda":
            return True
        return (kind == "cpu" and envs.PAGEDLM_ATTENTION_BACKEND == "triton"
                and envs.TRITON_INTERPRET)

    def forward(self, query, key, value, k_cache, v_cache, meta, scale, sliding_window=None,
                logits_soft_cap=None) -> torch.Tensor:
        triton_attention.write_kv(key, value, k_cache, v_cache, meta.slot_mapping)
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        nd = meta.num_decode_tokens
        if nd:
            triton_attention.decode_attention(query[:nd], k_cache, v_cache,
                                              meta.decode_block_tables, _decode_seq_lens(meta),
                                              scale, out[:nd], sliding_window, logits_soft_cap)
        if meta.prefills:
            _ensure_prefill_inputs(meta, query.device)
            max_len = meta.max_prefill_query_len or max(p.end - p.start for p in meta.prefills)
            triton_attention.prefill_attention(
                query, key, value, k_cache, v_cache, meta.prefill_query_start_loc,
                meta.prefill_context_lens, meta.prefill_block_tables, max_len, scale, out,
                sliding_window, logits_soft_cap)
        return out


def _decode_seq_lens(meta: AttentionMetadata) -> torch.Tensor:
    """[num_decodes] keys per decode row; derived from decode_mask (on the device, no host
    read) when the runner gave only the mask, and kept on the metadata for the other layers."""
    if meta.decode_seq_lens is None:
        nd = meta.num_decode_tokens
        meta.decode_seq_lens = meta.decode_mask.reshape(nd, -1).sum(-1).to(torch.int32)
    return meta.decode_seq_lens


def _ensure_prefill_inputs(meta: AttentionMetadata, device: torch.device) -> None:
    """The varlen prefill metadata, built from meta.prefills when the runner did not: chunk
    start rows [P + 1], context lengths [P] and block tables [P, W] (zero rows for chunks
    without context, which never read them), int32, on `device`."""
    if meta.prefill_query_start_loc is not None:
        return
    chunks = meta.prefills
    for a, b in zip(chunks, chunks[1:]):
        if a.end != b.start:
            raise ValueError(f"prefill chunks must be consecutive rows of the batch (varlen), "
                             f"got rows [{a.start}, {a.end}) then [{b.start}, {b.end})")
    tables = [p.block_table.reshape(-1) if p.context_len else None for p in chunks]
    width = max((t.numel() for t in tables if t is not None), default=1)
    block_tables = torch.zeros(len(chunks), width, dtype=torch.int32)
    for i, t in enumerate(tables):
        if t is not None:
            block_tables[i, :t.numel()] = t
    starts = [p.start for p in chunks] + [chunks[-1].end]
    meta.prefill_query_start_loc = torch.tensor(starts, dtype=torch.int32).to(device)
    meta.prefill_context_lens = torch.tensor([p.context_len for p in chunks],
                                             dtype=torch.int32).to(device)
    meta.prefill_block_tables = block_tables.to(device)
    meta.max_prefill_query_len = max(p.end - p.start for p in chunks)
