"""A step's integer inputs, built on the host in one buffer and moved to the device in one copy.

Every integer a step's forward needs (token ids, positions, cache slots, the sampled rows, the
decodes' lengths and block tables, the prefill chunks' varlen arrays) is written on the host
once; on CUDA into one pinned buffer copied with one non-blocking transfer, and the step's
tensors are views of the copy. One H2D copy instead of eight or more small ones, each a
pageable (synchronous) transfer plus a launch. On the CPU the same code runs with no copy.

The int64 tensors (token ids, positions, slots, sample rows) and the int32 ones (lengths, block
tables, varlen starts: what the attention kernels index with) are two regions of one byte
buffer on a GPU, each viewed in its own type (no cast, no second transfer); on the CPU they are
two tensors over the host arrays they were built in (no copy at all).
"""
from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from typing import Any

import torch

from pagedlm.attention.metadata import AttentionMetadata, PrefillChunk
from pagedlm.lora.request import LoRARequest
from pagedlm.spec_decode.proposer import Proposal


@dataclass
class _FlatBatch:
    """The step's tokens, decodes first (so attention can batch them), then prefill chunks.
    A seq is anything with `block_ids` (the runner's CachedSequenceState, the draft model's
    own sequences)."""
    input_ids: list[int]
    positions: list[int]
    slots: list[int]
    decodes: list[tuple[Any, int]]  # (seq, computed tokens)
    prefills: list[tuple[Any, int, int, int]]  # (seq, computed, row0, end)
    last_row: dict[int, int]  # seq id -> its last row
    # Speculating sequences' drafts (seq id -> proposal): each is m+1 decode rows, not one.
    drafts: dict[int, Proposal] = field(default_factory=dict)
    # With LoRA: each sequence's adapter and token count, in row order.
    loras: list[LoRARequest | None] | None = None
    lora_counts: list[int] | None = None


@dataclass
class StepTensors:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    sample_rows: torch.Tensor  # [S] int64: the flat-batch row of each sample
    attn_metadata: AttentionMetadata


def _tensor(values: array, dtype: torch.dtype) -> torch.Tensor:
    # The array's memory as a tensor, no copy (torch.frombuffer refuses an empty buffer).
    return torch.frombuffer(values, dtype=dtype) if values else torch.empty(0, dtype=dtype)


def to_device_in_one_copy(longs: torch.Tensor, ints: torch.Tensor, device: torch.device
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Host int64 and int32 tensors -> the same on `device`, views of one buffer moved in one
    asynchronous copy (from pinned memory on CUDA: the host goes on to launch the forward).
    The int64 region comes first, so both regions are aligned."""
    n64 = 8 * longs.numel()
    host = torch.empty(n64 + 4 * ints.numel(), dtype=torch.uint8,
                       pin_memory=device.type == "cuda")
    host[:n64].view(torch.int64).copy_(longs)
    host[n64:].view(torch.int32).copy_(ints)
    buf = host.to(device, non_blocking=True)
    return buf[:n64].view(torch.int64), buf[n64:].view(torch.int32)


def build_step_tensors(batch: _FlatBatch, sample_rows: list[int],
                       device: torch.device) -> StepTensors:
    """The step's tensors on `device`, all views of one buffer (see the module docstring)."""
    ids, decodes, prefills = batch.input_ids, batch.decodes, batch.prefills
    t, ns, nd, npf = len(ids), len(sample_rows), len(decodes), len(prefills)
    # array.array, not a list: extending it and viewing it as a tensor costs a quarter of
    # torch.tensor(list) (measured: 8k ints, 1.4 vs 6 ms on a loaded core).
    wide = array("q", ids)
    wide.extend(batch.positions)
    wide.extend(batch.slots)
    wide.extend(sample_rows)
    # The int32 region: decode lengths [nd], decode block tables [nd, dw], prefill starts
    # [npf + 1], context lengths [npf], prefill block tables [npf, pw] (zero rows for chunks
    # without context, which never read them).
    narrow = array("i")
    dw = pw = 0
    if nd:
        narrow.extend([start + 1 for _, start in decodes])
        dw = max(len(seq.block_ids) for seq, _ in decodes)
        for seq, _ in decodes:
            narrow.extend(seq.block_ids)
            if len(seq.block_ids) < dw:
                narrow.extend([0] * (dw - len(seq.block_ids)))
    if npf:
        narrow.extend([row0 for _, _, row0, _ in prefills])
        narrow.append(prefills[-1][3])
        narrow.extend([start for _, start, _, _ in prefills])
        pw = max((len(seq.block_ids) for seq, start, _, _ in prefills if start), default=1)
        for seq, start, _, _ in prefills:
            table = seq.block_ids if start else []
            narrow.extend(table)
            narrow.extend([0] * (pw - len(table)))
    longs, ints = _tensor(wide, torch.int64), _tensor(narrow, torch.int32)
    if device.type != "cpu":
        longs, ints = to_device_in_one_copy(longs, ints, device)
    decode_seq_lens = decode_tables = None
    o = 0
    if nd:
        decode_seq_lens = ints[:nd]
        decode_tables = ints[nd:nd + nd * dw].view(nd, dw)
        o = nd + nd * dw
    chunks = []
    query_start_loc = context_lens = prefill_tables = None
    if npf:
        query_start_loc = ints[o:o + npf + 1]
        context_lens = ints[o + npf + 1:o + 2 * npf + 1]
        prefill_tables = ints[o + 2 * npf + 1:].view(npf, pw)
        chunks = [PrefillChunk(row0, end, start,
                               prefill_tables[i, :len(seq.block_ids)] if start else None)
                  for i, (seq, start, row0, end) in enumerate(prefills)]
    meta = AttentionMetadata(
        slot_mapping=longs[2 * t:3 * t], num_decode_tokens=nd,
        decode_block_tables=decode_tables, decode_mask=None, prefills=chunks,
        decode_seq_lens=decode_seq_lens, prefill_query_start_loc=query_start_loc,
        prefill_context_lens=context_lens, prefill_block_tables=prefill_tables,
        max_prefill_query_len=max((end - row0 for _, _, row0, end in prefills), default=0))
    return StepTensors(longs[:t], longs[t:2 * t], longs[3 * t:3 * t + ns], meta)
