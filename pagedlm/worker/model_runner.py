"""The ModelRunner: SchedulerOutput -> one flat batch -> model forward -> sampled tokens."""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from pagedlm.attention.paged_attention import AttentionMetadata, PrefillChunk
from pagedlm.config import ModelConfig
from pagedlm.core.scheduler import SchedulerOutput, is_decode
from pagedlm.model_executor.layers.sampler import Sampler, SamplerOutput, SamplingMetadata
from pagedlm.sampling_params import SamplingParams
from pagedlm.sequence import Sequence


@dataclass
class PromptLogprobsRequest:
    group_index: int  # into scheduler_output.scheduled_groups
    rows: slice  # rows of the flat batch whose logits score the next prompt token
    target_ids: list[int]


@dataclass
class ModelInput:
    input_ids: torch.Tensor
    positions: torch.Tensor
    attn_metadata: AttentionMetadata
    sample_rows: torch.Tensor  # flat-batch row of each sample (repeated for n > 1)
    sampling_metadata: SamplingMetadata
    prompt_logprobs: list[PromptLogprobsRequest]


@dataclass
class PromptLogprobs:
    group_index: int
    token_ids: list[int]
    logprobs: list[float]
    ranks: list[int]
    top_token_ids: list[list[int]]
    top_logprobs: list[list[float]]


@dataclass
class StepTimings:
    prepare_s: float  # building the flat batch
    forward_s: float  # model forward and logits
    sample_s: float  # sampler and prompt logprobs


@dataclass
class ModelRunnerOutput:
    sampler_output: SamplerOutput
    prompt_logprobs: list[PromptLogprobs]
    timings: StepTimings


def _num_logprobs(sp: SamplingParams) -> int:
    """Top logprobs a row needs (-1: none): the user's, or 0 where best_of ranks by the sampled
    token's logprob."""
    k = sp.logprobs if sp.logprobs is not None else -1
    return max(k, 0) if sp.best_of > sp.n else k


@dataclass
class _FlatBatch:
    """The step's tokens, decodes first (so attention can batch them), then prefill chunks."""
    input_ids: list[int]
    positions: list[int]
    slots: list[int]
    decodes: list[Sequence]
    prefills: list[tuple[Sequence, int, int]]  # (seq, first row, end row)
    last_row: dict[tuple[int, int], int]  # (group index, seq index) -> its last row


class ModelRunner:

    def __init__(self, model_config: ModelConfig, model: torch.nn.Module, block_size: int,
                 eos_token_ids: frozenset[int]) -> None:
        self.model_config = model_config
        self.model = model
        self.block_size = block_size
        self.eos_token_ids = eos_token_ids
        self.sampler = Sampler(torch.Generator().manual_seed(model_config.seed))

    def prepare_input(self, scheduler_output: SchedulerOutput) -> ModelInput:
        batch = self._build_batch(scheduler_output)
        sampling, sample_rows, prompt_lp = self._build_sampling_metadata(scheduler_output,
                                                                         batch.last_row)
        return ModelInput(torch.tensor(batch.input_ids), torch.tensor(batch.positions),
                          self._build_attn_metadata(batch), sample_rows, sampling, prompt_lp)

    def _build_batch(self, scheduler_output: SchedulerOutput) -> _FlatBatch:
        bs = self.block_size
        decodes, prefills = [], []
        for gi, sg in enumerate(scheduler_output.scheduled_groups):
            for si, (seq, n) in enumerate(zip(sg.seqs, sg.num_new_tokens)):
                (decodes if is_decode(seq, n) else prefills).append((gi, si, seq, n))
        batch = _FlatBatch([], [], [], [seq for _, _, seq, _ in decodes], [], {})
        for i, (gi, si, seq, n) in enumerate(decodes + prefills):
            start = seq.num_computed_tokens
            table = seq.block_table
            row0 = len(batch.input_ids)
            batch.input_ids += seq.token_ids[start:start + n]
            batch.positions += range(start, start + n)
            batch.slots += [table[p // bs] * bs + p % bs for p in range(start, start + n)]
            batch.last_row[(gi, si)] = len(batch.input_ids) - 1
            if i >= len(decodes):
                batch.prefills.append((seq, row0, len(batch.input_ids)))
        return batch

    @staticmethod
    def _build_attn_metadata(batch: _FlatBatch) -> AttentionMetadata:
        chunks = [PrefillChunk(row0, end, seq.num_computed_tokens,
                               torch.tensor(seq.block_table) if seq.num_computed_tokens else None)
                  for seq, row0, end in batch.prefills]
        nd = len(batch.decodes)
        block_tables = seq_lens = None
        if nd:
            width = max(len(seq.block_table) for seq in batch.decodes)
            block_tables = torch.tensor([seq.block_table + [0] * (width - len(seq.block_table))
                                         for seq in batch.decodes], dtype=torch.int32)
            seq_lens = torch.tensor([seq.num_computed_tokens + 1 for seq in batch.decodes],
                                    dtype=torch.int32)
        return AttentionMetadata(slot_mapping=torch.tensor(batch.slots), num_decode_tokens=nd,
                                 decode_block_tables=block_tables, decode_mask=None,
                                 prefills=chunks, decode_seq_lens=seq_lens)

    def _build_sampling_metadata(self, scheduler_output: SchedulerOutput,
                                 last_row: dict[tuple[int, int], int]
                                 ) -> tuple[SamplingMetadata, torch.Tensor,
                                            list[PromptLogprobsRequest]]:
        rows, params, gens, outs, prompts, stops, prompt_lp = [], [], [], [], [], [], []
        for gi, sg in enumerate(scheduler_output.scheduled_groups):
            group, sp = sg.group, sg.group.sampling_params
            # History and stop ids only where used (penalties, min_tokens): copying every
            # sequence's output each step would grow with its length.
            stop_ids = sp.stop_token_ids_with(self.eos_token_ids) if sp.min_tokens else frozenset()
            for si, (seq, k) in enumerate(zip(sg.seqs, sg.num_samples)):
                history = seq.output_token_ids if sp.has_penalties or sp.min_tokens else []
                rows += [last_row[(gi, si)]] * k
                params += [sp] * k
                gens += [group.generator] * k
                outs += [history] * k
                prompts += [group.prompt_token_ids] * k
                stops += [stop_ids] * k
            if sp.prompt_logprobs is not None and group.prompt_logprobs is None:
                seq, n = sg.seqs[0], sg.num_new_tokens[0]
                start = seq.num_computed_tokens
                end = min(start + n, seq.num_prompt_tokens - 1)  # rows that predict a prompt token
                if end > start:
                    first = last_row[(gi, 0)] - n + 1
                    prompt_lp.append(PromptLogprobsRequest(
                        gi, slice(first, first + end - start), seq.token_ids[start + 1:end + 1]))
        want_lp = [_num_logprobs(p) for p in params]
        sampling = SamplingMetadata(params=params, generators=gens, output_token_ids=outs,
                                    prompt_token_ids=prompts, stop_ids=stops,
                                    all_greedy=all(p.greedy for p in params),
                                    max_num_logprobs=max(want_lp, default=-1))
        return sampling, torch.tensor(rows, dtype=torch.long), prompt_lp

    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput, kv_caches) -> ModelRunnerOutput:
        t0 = time.perf_counter()
        inp = self.prepare_input(scheduler_output)
        t1 = time.perf_counter()
        hidden = self.model(inp.input_ids, inp.positions, kv_caches, inp.attn_metadata)
        logits = self.model.compute_logits(hidden[inp.sample_rows])
        t2 = time.perf_counter()
        sampled = self.sampler(logits, inp.sampling_metadata)
        prompt_logprobs = [self._prompt_logprobs(hidden, r, scheduler_output)
                           for r in inp.prompt_logprobs]
        return ModelRunnerOutput(sampled, prompt_logprobs,
                                 StepTimings(t1 - t0, t2 - t1, time.perf_counter() - t2))

    def _prompt_logprobs(self, hidden: torch.Tensor, req: PromptLogprobsRequest,
                         scheduler_output: SchedulerOutput) -> PromptLogprobs:
        k = scheduler_output.scheduled_groups[req.group_index].group.sampling_params.prompt_logprobs
        logprobs = torch.log_softmax(self.model.compute_logits(hidden[req.rows]), dim=-1)
        targets = torch.tensor(req.target_ids).unsqueeze(1)
        chosen = logprobs.gather(1, targets)
        ranks = (logprobs > chosen).sum(dim=-1) + 1
        top = logprobs.topk(k, dim=-1) if k else None
        return PromptLogprobs(req.group_index, req.target_ids, chosen.squeeze(1).tolist(),
                              ranks.tolist(), top.indices.tolist() if top else [],
                              top.values.tolist() if top else [])
