"""The ModelRunner: the step's ExecuteModelRequest -> one flat batch -> forward -> samples.

It keeps each request's and sequence's state between steps (tokens, block table, sampling
settings, the seeded generator), updated from the ids and diffs the engine sends
(model_io.py), so the same runner serves in-process and in worker processes. Its output
maps sequence ids to rows of the sampler's output.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from pagedlm.attention.metadata import AttentionMetadata
from pagedlm.config import ModelConfig
from pagedlm.distributed import IntermediateTensors
from pagedlm.lora.request import LoRARequest
from pagedlm.model_executor.layers.pooler import Pooler
from pagedlm.model_executor.layers.rejection_sampler import DraftMetadata, DraftSpan
from pagedlm.model_executor.layers.sampler import Sampler, SamplingMetadata
from pagedlm.model_io import (ExecuteModelRequest, ModelRunnerOutput, PromptLogprobs,
                              SamplerOutput, StepTimings, is_decode)
from pagedlm.sampling_params import SamplingParams
from pagedlm.spec_decode.proposer import Proposal, ProposalRequest, Proposer
from pagedlm.structured_output.bitmask import GrammarBitmask
from pagedlm.worker import multi_step
from pagedlm.worker.cuda_graph import CUDAGraphRunner
from pagedlm.worker.step_inputs import _FlatBatch, build_step_tensors


@dataclass
class CachedRequestState:
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    # Seeded requests draw from their own generator so results do not depend on batching.
    generator: torch.Generator | None
    seq_ids: set[int]
    lora_request: LoRARequest | None = None


@dataclass
class CachedSequenceState:
    req_id: str
    token_ids: list[int]
    block_ids: list[int]
    num_prompt_tokens: int


@dataclass
class PromptLogprobsRequest:
    req_id: str
    rows: slice  # rows of the flat batch whose logits score the next prompt token
    target_ids: list[int]
    first_position: int  # the prompt position of target_ids[0]


@dataclass
class ModelInput:
    input_ids: torch.Tensor
    positions: torch.Tensor
    attn_metadata: AttentionMetadata
    sample_rows: torch.Tensor  # flat-batch row of each sample (repeated for n > 1)
    sampling_metadata: SamplingMetadata
    prompt_logprobs: list[PromptLogprobsRequest]
    first_sample_row: dict[int, int]  # seq id -> its first row of sample_rows
    last_row: dict[int, int] | None = None  # seq id -> its last row of the flat batch
    spec_seq_ids: list[int] | None = None  # the sequence of each of sampling_metadata.draft


def _num_logprobs(sp: SamplingParams) -> int:
    """Top logprobs a row needs (-1: none): the user's, or 0 where best_of ranks by the sampled
    token's logprob."""
    k = sp.logprobs if sp.logprobs is not None else -1
    return max(k, 0) if sp.best_of > sp.n else k


def _move_bitmask_rows(mask: GrammarBitmask, engine_rows: list[int], num_rows: int
                       ) -> GrammarBitmask:
    """The engine's grammar bitmask (one row per sample as it counts them) on this step's
    sample rows, where drafted sequences have more rows than the engine counted."""
    rows = [engine_rows[r] for r in mask.rows]
    bitmask = torch.full((num_rows, mask.bitmask.shape[1]), -1, dtype=mask.bitmask.dtype)
    bitmask[rows] = mask.bitmask[mask.rows]
    return GrammarBitmask(rows, bitmask, mask.vocab_size)


class ModelRunner:

    def __init__(self, model_config: ModelConfig, model: torch.nn.Module, block_size: int,
                 eos_token_ids: frozenset[int], lora_manager=None,
                 proposer: Proposer | None = None) -> None:
        self.model_config = model_config
        self.model = model
        self.block_size = block_size
        self.eos_token_ids = eos_token_ids
        # The step's tensors are made where the model runs (not on the meta device of a
        # parameter that stands in for a weight held in another form, e.g. packed panels).
        self.device = next(p.device for p in model.parameters() if not p.is_meta)
        # Generators live on the model's device: the sampler draws where the logits are.
        self.sampler = Sampler(torch.Generator(self.device).manual_seed(model_config.seed))
        self.requests: dict[str, CachedRequestState] = {}
        self.seqs: dict[int, CachedSequenceState] = {}
        self.lora_manager = lora_manager  # a WorkerLoRAManager, or None without LoRA
        self.pooler = (Pooler(model_config.pooler_config)
                       if model_config.runner == "pooling" else None)
        self.proposer = proposer  # speculative decoding's drafts (None: off)
        # Pure decode steps replay CUDA graphs through it once the worker has captured them.
        self.cuda_graphs: CUDAGraphRunner | None = None

    # -- state --------------------------------------------------------------------------------
    def update_states(self, req: ExecuteModelRequest) -> None:
        dropped = []
        for rid in req.finished_req_ids:
            state = self.requests.pop(rid, None)
            if self.pooler is not None:
                self.pooler.drop(rid)
            for seq_id in state.seq_ids if state else ():
                if self.seqs.pop(seq_id, None) is not None:
                    dropped.append(seq_id)
        for seq_id in req.finished_seq_ids:
            seq = self.seqs.pop(seq_id, None)
            if seq is not None:
                dropped.append(seq_id)
                if seq.req_id in self.requests:
                    self.requests[seq.req_id].seq_ids.discard(seq_id)
        if dropped and self.proposer is not None:
            self.proposer.drop(dropped)
        for new in req.new_requests:
            sp = new.sampling_params
            gen = (torch.Generator(self.device).manual_seed(sp.seed) if sp.seed is not None
                   else None)
            self.requests[new.req_id] = CachedRequestState(new.prompt_token_ids, sp, gen, set(),
                                                           new.lora_request)
        for new in req.new_seqs:
            state = self.requests[new.req_id]
            state.seq_ids.add(new.seq_id)
            self.seqs[new.seq_id] = CachedSequenceState(new.req_id, new.token_ids, new.block_ids,
                                                        len(state.prompt_token_ids))
        cached = req.cached_seqs
        kept = cached.num_kept_blocks
        for seq_id, tokens, blocks in zip(cached.seq_ids, cached.new_token_ids,
                                          cached.new_block_ids):
            seq = self.seqs[seq_id]
            seq.token_ids += tokens
            if kept and seq_id in kept:
                del seq.block_ids[kept[seq_id]:]
            seq.block_ids += blocks

    # -- inputs -------------------------------------------------------------------------------
    def prepare_input(self, req: ExecuteModelRequest) -> ModelInput:
        batch = self._build_batch(req, self._propose(req))
        sampling, sample_rows, first_row, spec_ids = self._build_sampling_metadata(req, batch)
        dev = self.device
        if self.lora_manager is not None:
            self.lora_manager.set_active_loras(batch.loras, batch.lora_counts, dev)
        step = build_step_tensors(batch, sample_rows, dev)
        return ModelInput(step.input_ids, step.positions, step.attn_metadata, step.sample_rows,
                          sampling, self._prompt_logprobs_requests(req, batch), first_row,
                          batch.last_row, spec_ids)

    def _propose(self, req: ExecuteModelRequest) -> dict[int, Proposal]:
        """Drafts for the sequences the scheduler gave lookahead slots (at most that many)."""
        if self.proposer is None or not req.num_lookahead:
            return {}
        asks = [ProposalRequest(seq_id, self.seqs[seq_id].token_ids, k,
                                self.seqs[seq_id].block_ids)
                for seq_id, k in zip(req.seq_ids, req.num_lookahead) if k]
        proposals = self.proposer.propose(asks) if asks else []
        return {a.seq_id: p for a, p in zip(asks, proposals)
                if 0 < len(p.token_ids) <= a.num_tokens}

    def _build_batch(self, req: ExecuteModelRequest,
                     drafts: dict[int, Proposal] | None = None) -> _FlatBatch:
        """A speculating sequence is m+1 decode rows (its last token and its m drafts at the
        next positions, each attending to the rows before it): what decoding them one at a
        time would compute, in one pass."""
        bs = self.block_size
        drafts = drafts or {}
        decodes, prefills = [], []
        for seq_id, start, n in zip(req.seq_ids, req.num_computed_tokens,
                                    req.num_scheduled_tokens):
            (decodes if is_decode(start, n) else prefills).append((seq_id, start, n))
        batch = _FlatBatch([], [], [], [], [], {}, drafts)
        if self.lora_manager is not None:
            batch.loras, batch.lora_counts = [], []
        num_decodes = len(decodes)
        for i, (seq_id, start, n) in enumerate(decodes + prefills):
            seq = self.seqs[seq_id]
            if n == 1 and i < num_decodes and batch.loras is None and seq_id not in drafts:
                # A plain decode row (most rows of a step): what the general path below does
                # for it, without its slices and ranges.
                table = seq.block_ids
                batch.input_ids.append(seq.token_ids[start])
                batch.positions.append(start)
                batch.slots.append(table[start // bs] * bs + start % bs)
                batch.last_row[seq_id] = len(batch.input_ids) - 1
                batch.decodes.append((seq, start))
                continue
            tokens = seq.token_ids[start:start + n]
            if seq_id in drafts:
                tokens = tokens + drafts[seq_id].token_ids
            n = len(tokens)
            if batch.loras is not None:
                batch.loras.append(self.requests[seq.req_id].lora_request)
                batch.lora_counts.append(n)
            table = seq.block_ids
            row0 = len(batch.input_ids)
            batch.input_ids += tokens
            batch.positions += range(start, start + n)
            batch.slots += [table[p // bs] * bs + p % bs for p in range(start, start + n)]
            batch.last_row[seq_id] = len(batch.input_ids) - 1
            if i < num_decodes:
                batch.decodes += [(seq, start + j) for j in range(n)]
            else:
                batch.prefills.append((seq, start, row0, len(batch.input_ids)))
        return batch

    def _build_sampling_metadata(self, req: ExecuteModelRequest, batch: _FlatBatch
                                 ) -> tuple[SamplingMetadata, list[int], dict[int, int],
                                            list[int] | None]:
        rows, params, gens, outs, prompts, stops = [], [], [], [], [], []
        first_row: dict[int, int] = {}
        spans, spec_ids = [], []
        # Our row of each of the engine's sample rows (drafted sequences take more rows).
        engine_rows: list[int] = []
        # Flags over every row, gathered here per sequence (not by scans over the rows later):
        # the sampler's all-greedy path then costs no per-row Python work.
        constrained = penalties = min_tokens = False
        all_greedy = True
        max_lp = -1
        no_stops: frozenset[int] = frozenset()
        drafts, bitmask = batch.drafts, req.grammar_bitmask
        for seq_id, k in zip(req.seq_ids, req.num_samples):
            if not k:
                continue
            seq = self.seqs[seq_id]
            state = self.requests[seq.req_id]
            sp = state.sampling_params
            # History and stop ids only where used (penalties, min_tokens): copying every
            # sequence's output each step would grow with its length.
            stop_ids = sp.stop_token_ids_with(self.eos_token_ids) if sp.min_tokens else no_stops
            has_penalties = sp.has_penalties
            wants_history = has_penalties or sp.min_tokens or sp.bad_words
            history = seq.token_ids[seq.num_prompt_tokens:] if wants_history else []
            constrained = constrained or sp.has_token_constraints
            penalties = penalties or has_penalties
            min_tokens = min_tokens or bool(sp.min_tokens)
            all_greedy = all_greedy and sp.greedy
            max_lp = max(max_lp, _num_logprobs(sp))
            if bitmask is not None:
                engine_rows += range(len(rows), len(rows) + k)
            first_row[seq_id] = len(rows)
            proposal = drafts.get(seq_id) if drafts else None
            if proposal is not None:
                # Row j verifies the j-th draft: the drafts before it count as generated
                # (penalties, min_tokens, bad_words see them).
                d = proposal.token_ids
                spans.append(DraftSpan(len(rows), d, proposal.probs))
                spec_ids.append(seq_id)
                last = batch.last_row[seq_id]
                rows += range(last - len(d), last + 1)
                outs += [history + d[:j] if wants_history else []
                         for j in range(len(d) + 1)]
                k = len(d) + 1
            else:
                rows += [batch.last_row[seq_id]] * k
                outs += [history] * k
            params += [sp] * k
            gens += [state.generator] * k
            prompts += [state.prompt_token_ids] * k
            stops += [stop_ids] * k
        if spans and bitmask is not None:
            bitmask = _move_bitmask_rows(bitmask, engine_rows, len(rows))
        sampling = SamplingMetadata(params=params, generators=gens, output_token_ids=outs,
                                    prompt_token_ids=prompts, stop_ids=stops,
                                    all_greedy=all_greedy, max_num_logprobs=max_lp,
                                    any_token_constraints=constrained,
                                    any_penalties=penalties, any_min_tokens=min_tokens,
                                    grammar_bitmask=bitmask,
                                    draft=DraftMetadata(spans) if spans else None)
        return sampling, rows, first_row, spec_ids if spans else None

    def _prompt_logprobs_requests(self, req: ExecuteModelRequest, batch: _FlatBatch
                                  ) -> list[PromptLogprobsRequest]:
        if not req.prompt_logprobs_req_ids:
            return []
        wanted = set(req.prompt_logprobs_req_ids)
        out = []
        for seq_id, start, n in zip(req.seq_ids, req.num_computed_tokens,
                                    req.num_scheduled_tokens):
            seq = self.seqs[seq_id]
            if seq.req_id not in wanted:
                continue
            wanted.discard(seq.req_id)  # the request's first sequence scores its prompt
            stop = min(start + n, seq.num_prompt_tokens - 1)  # rows that predict a prompt token
            if stop > start:
                row0 = batch.last_row[seq_id] - n + 1
                out.append(PromptLogprobsRequest(seq.req_id, slice(row0, row0 + stop - start),
                                                 seq.token_ids[start + 1:stop + 1], start + 1))
        return out

    # -- the step -----------------------------------------------------------------------------
    @torch.inference_mode()
    def execute_model(self, req: ExecuteModelRequest, kv_caches,
                      intermediate_tensors: IntermediateTensors | None = None
                      ) -> ModelRunnerOutput | IntermediateTensors:
        """The step on this rank: the sampled tokens on the last pipeline stage, else the
        hidden states for the next stage. kv_caches: this stage's layers, in order."""
        t0 = time.perf_counter()
        self.update_states(req)
        inp = self.prepare_input(req)
        t1 = time.perf_counter()
        if intermediate_tensors is None and multi_step.ready(
                req, inp, self.proposer is None and self.pooler is None
                and self.lora_manager is None):
            return multi_step.run_iterations(self, req, inp, kv_caches, t0, t1)
        hidden = self.forward(inp.input_ids, inp.positions, inp.attn_metadata, kv_caches,
                              intermediate_tensors)
        if isinstance(hidden, IntermediateTensors):
            return hidden
        if self.pooler is not None:
            return self._pool(req, inp, hidden, t0, t1)
        logits = self.model.compute_logits(hidden[inp.sample_rows])
        t2 = time.perf_counter()
        sampled = self.sampler(logits, inp.sampling_metadata)
        prompt_logprobs = {r.req_id: self._prompt_logprobs(hidden, r) for r in inp.prompt_logprobs}
        out = ModelRunnerOutput(sampled, inp.first_sample_row, prompt_logprobs,
                                StepTimings(t1 - t0, t2 - t1, time.perf_counter() - t2))
        if inp.spec_seq_ids:
            spans = inp.sampling_metadata.draft.spans
            for seq_id, span, e in zip(inp.spec_seq_ids, spans, sampled.num_emitted):
                out.num_drafts[seq_id] = len(span.token_ids)
                out.num_emitted[seq_id] = e
        return out

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata, kv_caches,
                intermediate_tensors: IntermediateTensors | None = None):
        """The model on a step's inputs: through the CUDA graph of its size where one fits."""
        graphs, size = self.cuda_graphs, None
        if graphs is not None and intermediate_tensors is None:
            size = graphs.size_for(input_ids.shape[0], kv_caches, meta)
        if size is not None:
            return graphs.run(size, input_ids, positions, meta)
        return self.model(input_ids, positions, kv_caches, meta, intermediate_tensors)

    def _pool(self, req: ExecuteModelRequest, inp: ModelInput, hidden: torch.Tensor,
              t0: float, t1: float) -> ModelRunnerOutput:
        """The pooling runner's step: every scheduled sequence is a prompt (or a chunk of one);
        those that complete it get their pooled vector."""
        t2 = time.perf_counter()
        pooled = {}
        for seq_id, start, n, k in zip(req.seq_ids, req.num_computed_tokens,
                                       req.num_scheduled_tokens, req.num_samples):
            last = inp.last_row[seq_id]
            vec = self.pooler.add_chunk(self.seqs[seq_id].req_id, hidden[last - n + 1:last + 1],
                                        start, done=k > 0)
            if vec is not None:
                pooled[seq_id] = vec
        return ModelRunnerOutput(SamplerOutput([], None, None, None, None), {}, {},
                                 StepTimings(t1 - t0, t2 - t1, time.perf_counter() - t2),
                                 pooled=pooled)

    def _prompt_logprobs(self, hidden: torch.Tensor, req: PromptLogprobsRequest
                         ) -> PromptLogprobs:
        k = self.requests[req.req_id].sampling_params.prompt_logprobs
        # float32, as the sampler's: a GPU model's bfloat16 logits would round the logprobs.
        logprobs = torch.log_softmax(self.model.compute_logits(hidden[req.rows]).float(),
                                     dim=-1)
        targets = torch.tensor(req.target_ids, device=logprobs.device).unsqueeze(1)
        chosen = logprobs.gather(1, targets)
        ranks = (logprobs > chosen).sum(dim=-1) + 1
        top = logprobs.topk(k, dim=-1) if k else None
        return PromptLogprobs(req.target_ids, chosen.squeeze(1).tolist(), ranks.tolist(),
                              top.indices.tolist() if top else [],
                              top.values.tolist() if top else [], req.first_position)
