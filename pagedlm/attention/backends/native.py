"""Paged attention through the native C + OpenMP kernels (``pagedlm/kernels/attention.py``),
float32 CPU queries over a float32, bfloat16 or float16 cache.

The rows that read the cache (decodes, and prefill chunks of at most KERNEL_MAX_CHUNK_TOKENS
tokens with earlier context) go through the kernel in one call per layer: it reads each
sequence's K/V once, straight from the blocks, instead of gathering a padded copy for SDPA. The
other prefill chunks go through the prefill kernel (``csrc/prefill_attention.c``), also one call
per layer for all of them (a bfloat16 cache on AMX tiles where the CPU has them,
``csrc/prefill_attention_amx.c``); where it cannot run (no AVX-512 in the build, a head size it
does not take) they go to SDPA, as in the PyTorch backend. The per-step index tensors are built on
first use and cached on the metadata object, so the layers of one step share them.

Deterministic mode (``NativeKernelBackend(deterministic=True)``, from ModelConfig): every row,
fresh prefill included, goes through the paged kernel over the K/V as stored in the cache
(written first). That kernel reduces a query row's keys in tiles of whole blocks from the first
key (the window's) to its context length, one thread per row and head, so the row's result
depends only on its context, the block size and the cache dtype: not on the chunk it sits in,
its place in the batch, whether its prefix was cached, or the thread count.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedlm import kernels
from pagedlm.attention.backends.abstract import AttentionBackend
from pagedlm.attention.backends.torch_sdpa import prefill_attention
from pagedlm.attention.metadata import AttentionMetadata, PrefillChunk, write_kv

# Longer chunks go to the prefill kernel (or SDPA): the decode kernel handles each query token on
# its own (dot products), which is faster for decodes and short chunks but loses to blocked
# matrix products from about 16 query tokens on (measured against SDPA's, ctx 512-2048: 0.9 vs
# 0.8 ms at 16, 4.3 vs 2.1 ms at 64).
KERNEL_MAX_CHUNK_TOKENS = 16


class NativeKernelBackend(AttentionBackend):
    name = "native_kernel"

    def __init__(self, deterministic: bool = False) -> None:
        self.deterministic = deterministic

    @classmethod
    def supports(cls, dtype: torch.dtype, device: torch.device | str) -> bool:
        """float32 on the CPU, when the kernel builds and loads (and is not disabled)."""
        return (dtype == torch.float32 and torch.device(device).type == "cpu"
                and kernels.available())

    def forward(self, query, key, value, k_cache, v_cache, meta, scale, sliding_window=None,
                logits_soft_cap=None) -> torch.Tensor:
        if _native_write(key, value, meta.slot_mapping):
            kernels.fused_ops.write_kv(key, value, k_cache, v_cache, meta.slot_mapping)
        else:
            write_kv(key, value, k_cache, v_cache, meta.slot_mapping)
        out = torch.empty_like(query, memory_format=torch.contiguous_format)
        _kernel_attention(query, k_cache, v_cache, meta, scale, out, sliding_window,
                          logits_soft_cap, every_row=self.deterministic)
        if not meta.prefills or self.deterministic:  # the kernel computed every row
            return out
        plan = prefill_plan(meta, query, key, value, k_cache)
        if plan.chunks.shape[0]:
            # A bfloat16 cache goes to the AMX kernel where it runs (Q and the softmax weights
            # rounded to bfloat16), decided here once for both the cast below and the kernel;
            # the deterministic mode never gets here (the paged kernel took every row above).
            amx = (k_cache.dtype == torch.bfloat16
                   and kernels.attention.prefill_attention_amx_runs(query.shape[-1]))
            if k_cache.dtype != key.dtype and not amx:
                # Round as the cache does, as the SDPA path does: a prompt attends to the same
                # K/V whether it is computed fresh or read back. The AMX kernel rounds the
                # fresh rows itself as it packs them, to the same products (tdpbf16ps reads
                # a subnormal as zero, the one case where its rounding and torch's differ):
                # these two casts of the step's whole K and V took 1-2.5 ms a layer on the
                # 128-request run's prefill steps (2048 rows, strided views, 2 loaded cores).
                key = key.to(k_cache.dtype).to(key.dtype)
                value = value.to(v_cache.dtype).to(value.dtype)
            kernels.attention.prefill_attention(query, key, value, k_cache, v_cache,
                                                plan.chunks, plan.block_tables, scale, out,
                                                sliding_window, logits_soft_cap,
                                                use_amx=amx)
        for p in plan.sdpa:
            prefill_attention(query, key, value, k_cache, v_cache, p, scale, out,
                              sliding_window, logits_soft_cap)
        return out


def _native_write(key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor) -> bool:
    """Whether the C cache write takes these: float32 rows whose heads are contiguous (views of
    the QKV projection are), int64 slots. One call replaces two index_copy_ and a cast per
    layer."""
    d = key.shape[-1]
    return (slots.dtype == torch.int64 and key.dtype == value.dtype == torch.float32
            and key.stride()[1:] == (d, 1) and value.stride()[1:] == (d, 1)
            and slots.is_contiguous())


@dataclass
class _KernelPlan:
    key: tuple[int, int, bool]  # (block_size, num_blocks) validated against, every_row
    rows: slice | torch.Tensor  # rows of the flat batch the kernel computes
    block_tables: torch.Tensor  # int32 [num_seqs, max_blocks]
    token_seq: torch.Tensor  # int32 [num_kernel_tokens], row of block_tables per token
    ctx_lens: torch.Tensor  # int32 [num_kernel_tokens], keys each token attends to


@dataclass
class _PrefillPlan:
    key: tuple  # (block_size, num_blocks, cache dtype, kernel runs) it was built for
    chunks: torch.Tensor  # int32 [C, 3]: first row, rows, context_len (the prefill kernel's)
    block_tables: torch.Tensor  # int32 [C, max_blocks], rows of chunks with context
    sdpa: list[PrefillChunk]  # the chunks SDPA computes


def _prefill_kernel_runs(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> bool:
    d = query.shape[-1]
    return (kernels.attention.prefill_attention_runs(d) and query.dtype == torch.float32
            and query.stride()[1:] == (d, 1) and key.dtype == value.dtype == torch.float32
            and key.stride()[1:] == (d, 1) and value.stride() == key.stride())


def prefill_plan(meta: AttentionMetadata, query: torch.Tensor, key: torch.Tensor,
                 value: torch.Tensor, k_cache: torch.Tensor) -> _PrefillPlan:
    """The step's prefill chunks that the decode kernel does not take, split between the prefill
    kernel and SDPA; built and checked once, then shared by every layer."""
    runs = _prefill_kernel_runs(query, key, value)
    plan_key = (k_cache.shape[1], k_cache.shape[0], k_cache.dtype, runs)
    plan = meta._prefill_plan
    if plan is not None and plan.key == plan_key:
        return plan
    block_size, num_blocks = k_cache.shape[1], k_cache.shape[0]
    rows, tables, sdpa = [], [], []
    for p in meta.prefills:
        if _kernel_chunk(p):
            continue
        if not runs:
            sdpa.append(p)
            continue
        rows.append((p.start, p.end - p.start, p.context_len))
        table = torch.zeros(1, dtype=torch.int32)
        if p.context_len:
            table = p.block_table[:(p.context_len + block_size - 1) // block_size]
            if table.numel() * block_size < p.context_len:
                raise ValueError(f"context length {p.context_len} exceeds the block table "
                                 f"({table.numel()} blocks of {block_size})")
            if int(table.min()) < 0 or int(table.max()) >= num_blocks:
                raise ValueError(f"block id out of range [0, {num_blocks}) in a block table")
        tables.append(table.to(torch.int32))
    block_tables = torch.zeros(len(tables), max((t.numel() for t in tables), default=1),
                               dtype=torch.int32)
    for i, t in enumerate(tables):
        block_tables[i, :t.numel()] = t
    plan = meta._prefill_plan = _PrefillPlan(
        plan_key, torch.tensor(rows, dtype=torch.int32).view(-1, 3), block_tables, sdpa)
    return plan


def _kernel_chunk(p: PrefillChunk, every_row: bool = False) -> bool:
    """Whether the kernel computes this prefill chunk: it reads earlier context and is short, or
    the kernel computes every row (deterministic mode)."""
    return every_row or (p.context_len > 0 and p.end - p.start <= KERNEL_MAX_CHUNK_TOKENS)


def _kernel_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      meta: AttentionMetadata, scale: float, out: torch.Tensor,
                      sliding_window: int | None = None,
                      logits_soft_cap: float | None = None, every_row: bool = False) -> None:
    """Decode rows and short prefill chunks with earlier context (every row when every_row),
    through the native kernel. The plan does not depend on the window, so local and global
    layers share it."""
    plan = kernel_plan(meta, k_cache, every_row)
    if plan.token_seq.numel() == 0:
        return
    if isinstance(plan.rows, slice):
        kernels.attention.paged_attention(query[plan.rows].contiguous(), k_cache, v_cache,
                                          plan.block_tables, plan.token_seq, plan.ctx_lens,
                                          scale, out=out[plan.rows],
                                          sliding_window=sliding_window,
                                          logits_soft_cap=logits_soft_cap)
    else:
        o = kernels.attention.paged_attention(query.index_select(0, plan.rows), k_cache,
                                              v_cache, plan.block_tables, plan.token_seq,
                                              plan.ctx_lens, scale,
                                              sliding_window=sliding_window,
                                              logits_soft_cap=logits_soft_cap)
        out.index_copy_(0, plan.rows, o)


def kernel_plan(meta: AttentionMetadata, k_cache: torch.Tensor,
                every_row: bool = False) -> _KernelPlan:
    """The step's kernel inputs for caches shaped like k_cache: built and checked once, then
    shared by every layer (and by the fused decode stack, layers/fused_decode.py). every_row:
    the prefill chunks without context too (deterministic mode)."""
    block_size, num_blocks = k_cache.shape[1], k_cache.shape[0]
    plan = meta._kernel_plan
    if plan is None or plan.key != (block_size, num_blocks, every_row):
        plan = meta._kernel_plan = _build_kernel_plan(meta, block_size, num_blocks, every_row)
    return plan


def _build_kernel_plan(meta: AttentionMetadata, block_size: int, num_blocks: int,
                       every_row: bool) -> _KernelPlan:
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
        if _kernel_chunk(p, every_row):  # one table row shared by the chunk's tokens
            n = p.end - p.start
            total = p.context_len + n
            table = p.block_table
            if table is None and p.context_len == 0:  # a fresh chunk: its blocks from its slots
                table = meta.slot_mapping[p.start:p.end:block_size] // block_size
            segments.append((table.reshape(1, -1), torch.tensor([total]),
                             torch.zeros(n, dtype=torch.int32),
                             torch.arange(p.context_len + 1, total + 1, dtype=torch.int32),
                             (p.start, p.end)))
    if not segments:
        empty = torch.zeros(0, dtype=torch.int32)
        return _KernelPlan((block_size, num_blocks, every_row), slice(0, 0), empty.view(0, 1),
                           empty, empty)

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
    return _KernelPlan((block_size, num_blocks, every_row), rows, block_tables,
                       torch.cat(token_seq), torch.cat([s[3] for s in segments]))
