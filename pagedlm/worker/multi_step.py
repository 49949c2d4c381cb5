"""The model runner's side of multi-step decoding (the why: core/multi_step.py).

A step of n decode rows whose sequences hold k_i lookahead slots runs K = 1 + max(k_i) model
iterations. Everything but the token ids is known on the host before the first: iteration j
puts row i at position p_i + min(j, k_i), with length l_i + min(j, k_i), writing its K/V to the
slot its block table gives for that position. So the positions, lengths and slots of every
iteration are computed on the device in one go, and only the ids pass from iteration to
iteration, as the previous iteration's samples, never through the host. The host waits once,
for the [K, n] sampled ids.

A row whose iterations are over (j > k_i) keeps running with the others (a batch's shape is
fixed, so the CUDA graph of its size replays) on its last input: the same token at the same
position, whose K/V it writes again into the same slot. (Not slot -1: only the Triton backend
skips it; the CPU backends would index with it.) It is not sampled: a seeded request draws from
its generator once per token, as in single steps.
"""
from __future__ import annotations

import dataclasses
import time

import torch

from pagedlm.attention.metadata import AttentionMetadata
from pagedlm.model_io import ExecuteModelRequest, ModelRunnerOutput, SamplerOutput, StepTimings


@dataclasses.dataclass
class DecodeIterations:
    """Iteration j's inputs are row j of each: [K, n]."""
    positions: torch.Tensor  # int64
    seq_lens: torch.Tensor  # int32
    slots: torch.Tensor  # int64; a row's last slot again once its iterations are over


def plan_iterations(positions: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
                    num_lookahead: torch.Tensor, num_iterations: int,
                    block_size: int) -> DecodeIterations:
    """positions [n] int64, seq_lens [n] int32, block_tables [n, W] int32 (covering each row's
    lookahead slots), num_lookahead [n] int64: every iteration's inputs, on their device."""
    j = torch.arange(num_iterations, device=positions.device).unsqueeze(1)
    advance = torch.minimum(j, num_lookahead.unsqueeze(0))  # [K, n]
    pos = positions.unsqueeze(0) + advance
    blocks = block_tables.gather(1, (pos // block_size).t()).t().to(torch.int64)
    return DecodeIterations(pos, seq_lens.unsqueeze(0) + advance.to(torch.int32),
                            blocks * block_size + pos % block_size)


def ready(req: ExecuteModelRequest, inp, multi_step_capable: bool) -> bool:
    """Whether this step runs its iterations: a step of plain decodes (one sample each) that
    the device can sample alone. Otherwise it runs once and the lookahead slots go back."""
    if not (multi_step_capable and req.num_steps > 1 and any(req.num_lookahead)):
        return False
    meta, sm = inp.attn_metadata, inp.sampling_metadata
    n = inp.input_ids.shape[0]
    return (not meta.prefills and meta.num_decode_tokens == n == len(req.seq_ids)
            and meta.decode_seq_lens is not None and meta.decode_block_tables is not None
            and not inp.prompt_logprobs and inp.spec_seq_ids is None
            and len(sm.params) == n and sm.max_num_logprobs < 0 and sm.draft is None
            and sm.grammar_bitmask is None and not sm.any_penalties and not sm.any_min_tokens
            and not sm.any_token_constraints)


def _subset(sm, rows: list[int]):
    """The sampling metadata of some rows (one sample each)."""
    params = [sm.params[i] for i in rows]
    return dataclasses.replace(
        sm, params=params, generators=[sm.generators[i] for i in rows],
        output_token_ids=[sm.output_token_ids[i] for i in rows] if sm.output_token_ids else [],
        prompt_token_ids=[sm.prompt_token_ids[i] for i in rows],
        stop_ids=[sm.stop_ids[i] for i in rows], all_greedy=all(p.greedy for p in params))


@torch.inference_mode()
def run_iterations(runner, req: ExecuteModelRequest, inp, kv_caches, t0: float,
                   t1: float) -> ModelRunnerOutput:
    """The step's K iterations (see the module docstring); runner: the ModelRunner."""
    k_rows = req.num_lookahead
    n, num_iter, k_min = len(k_rows), 1 + max(k_rows), min(k_rows)
    meta0 = inp.attn_metadata
    dev = inp.input_ids.device
    k_dev = torch.tensor(k_rows, dtype=torch.int64)
    k_dev = k_dev.to(dev, non_blocking=True) if dev.type != "cpu" else k_dev
    plan = plan_iterations(inp.positions, meta0.decode_seq_lens, meta0.decode_block_tables,
                           k_dev, num_iter, runner.block_size)
    sampled = torch.zeros((num_iter, n), dtype=torch.int64, device=dev)
    ids, sm = inp.input_ids, inp.sampling_metadata
    for j in range(num_iter):
        if j:
            meta = AttentionMetadata(slot_mapping=plan.slots[j], num_decode_tokens=n,
                                     decode_block_tables=meta0.decode_block_tables,
                                     decode_mask=None, prefills=[],
                                     decode_seq_lens=plan.seq_lens[j])
        else:
            meta = meta0
        hidden = runner.forward(ids, plan.positions[j], meta, kv_caches)
        if j <= k_min:  # every row still has this iteration
            sampled[j] = runner.sampler.sample_ids(runner.model.compute_logits(hidden), sm)
        else:
            rows = [i for i, k in enumerate(k_rows) if k >= j]
            index = torch.tensor(rows, dtype=torch.int64)
            index = index.to(dev, non_blocking=True) if dev.type != "cpu" else index
            logits = runner.model.compute_logits(hidden.index_select(0, index))
            sampled[j].index_copy_(0, index, runner.sampler.sample_ids(logits, _subset(sm, rows)))
        if j + 1 < num_iter:
            # A row whose iterations are over keeps its last input (its K/V is rewritten as
            # it was): the token it last sampled is its output, not the next input.
            ids = sampled[j] if j < k_min else torch.where(k_dev > j, sampled[j], ids)
    host = sampled.tolist()  # the step's one wait for the device
    t2 = time.perf_counter()
    tokens: list[int] = []
    first_row: dict[int, int] = {}
    emitted: dict[int, int] = {}
    for i, (seq_id, k) in enumerate(zip(req.seq_ids, k_rows)):
        first_row[seq_id] = len(tokens)
        emitted[seq_id] = k + 1
        tokens += [host[j][i] for j in range(k + 1)]
    return ModelRunnerOutput(SamplerOutput(tokens, None, None, None, None), first_row, {},
                             StepTimings(t1 - t0, t2 - t1, 0.0), multi_step_emitted=emitted)
