"""What crosses between the engine and the workers: a step's request in, its output back.

Both sides import these types and neither imports the other, so the scheduler, the executors,
the model runner and the output processor share one definition of a step (as vLLM v1 keeps
v1/core/sched/output.py and v1/outputs.py free of the code on either side).

The request carries ids and diffs, not live objects. A request's sampling settings and prompt go
to the workers once (NewRequestData); a sequence goes once in full (NewSequenceData: a new
prompt or a fork); afterwards a step carries only what changed: the tokens appended since the
workers last saw it, the blocks appended to its table (after the part it keeps, where a
copy-on-write, a swap or given-back lookahead slots rewrote the tail), and its computed-token
count (CachedSequenceData). The workers keep the
rest (worker/model_runner.py: tokens, block tables, the request's seeded generator), so a decode
step costs a few integers per sequence however long the sequences are, and crossing a process
boundary pickles no detokenizer or metrics. Sequences are the unit (vLLM's is the request) since
a request's n > 1 sequences fork from one prefilled prompt here.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pagedlm.lora.request import LoRARequest
from pagedlm.sampling_params import SamplingParams
from pagedlm.structured_output.bitmask import GrammarBitmask


def is_decode(num_computed_tokens: int, num_new_tokens: int) -> bool:
    """One new token after a cached context: attention batches these; the rest are prefills.
    The scheduler orders a step by this rule and the model runner lays out its batch by it."""
    return num_new_tokens == 1 and num_computed_tokens > 0


# -- engine -> workers -----------------------------------------------------------------------

@dataclass
class NewRequestData:
    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    # Workers load the adapter themselves from its path (each TP rank its own slices).
    lora_request: LoRARequest | None = None


@dataclass
class NewSequenceData:
    seq_id: int
    req_id: str
    token_ids: list[int]  # prompt and output so far
    block_ids: list[int]


@dataclass
class CachedSequenceData:
    seq_ids: list[int] = field(default_factory=list)
    new_token_ids: list[list[int]] = field(default_factory=list)  # appended since last sent
    new_block_ids: list[list[int]] = field(default_factory=list)  # appended to its table
    # seq id -> how many of its table's blocks the workers keep before appending, where the
    # table was rewritten (absent: all).
    num_kept_blocks: dict[int, int] = field(default_factory=dict)


@dataclass
class ExecuteModelRequest:
    new_requests: list[NewRequestData] = field(default_factory=list)
    new_seqs: list[NewSequenceData] = field(default_factory=list)
    cached_seqs: CachedSequenceData = field(default_factory=CachedSequenceData)
    # The step, one entry per scheduled sequence, in scheduling order (aligned lists).
    seq_ids: list[int] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)  # before this step
    num_scheduled_tokens: list[int] = field(default_factory=list)
    num_samples: list[int] = field(default_factory=list)  # 0 mid-prompt, best_of at a fork
    # Speculative decoding: k lookahead slots past a decode's one new token (0: plain decode);
    # empty when nothing speculates this step.
    num_lookahead: list[int] = field(default_factory=list)
    # Multi-step decoding (core/multi_step.py): model iterations this step; > 1 only for a
    # step of decodes, whose num_lookahead slots hold the later iterations' tokens.
    num_steps: int = 1
    # Requests whose scheduled prompt chunk should also return prompt logprobs.
    prompt_logprobs_req_ids: list[str] = field(default_factory=list)
    # State the workers can drop (finished or aborted since the last step).
    finished_req_ids: list[str] = field(default_factory=list)
    finished_seq_ids: list[int] = field(default_factory=list)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host, device)
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device, host)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) on device
    # Structured outputs: the allowed tokens of the samples that have a grammar (None: none do).
    grammar_bitmask: GrammarBitmask | None = None

    @property
    def has_work(self) -> bool:
        return bool(self.seq_ids)


# -- workers -> engine -----------------------------------------------------------------------

@dataclass
class SamplerOutput:
    sampled_token_ids: list[int]
    sampled_logprobs: list[float] | None  # None unless some row wants logprobs
    ranks: list[int] | None
    top_token_ids: list[list[int]] | None
    top_logprobs: list[list[float]] | None
    # Speculative decoding: tokens each of meta.draft.spans emits (aligned with the spans);
    # a span's emitted tokens (and their logprobs) are its rows first_row..first_row+e-1, its
    # other rows are meaningless. None without drafts.
    num_emitted: list[int] | None = None


@dataclass
class PromptLogprobs:
    token_ids: list[int]
    logprobs: list[float]
    ranks: list[int]
    top_token_ids: list[list[int]]
    top_logprobs: list[list[float]]
    # The prompt position of token_ids[0]: a prompt prefilled again after a recompute
    # preemption scores its positions again, from the start.
    first_position: int = 1


@dataclass
class StepTimings:
    prepare_s: float  # building the flat batch
    forward_s: float  # model forward and logits (communication inside included)
    sample_s: float  # sampler and prompt logprobs
    comm_s: float = 0.0  # of the above, in collectives and pipeline transfers (this rank)


@dataclass
class ModelRunnerOutput:
    sampler_output: SamplerOutput
    # seq id -> its first row in sampler_output; a sequence sampled k times has k rows from
    # there (k > 1 where a prompt forks into best_of sequences).
    first_sample_row: dict[int, int]
    prompt_logprobs: dict[str, PromptLogprobs]  # req id -> this step's prompt positions
    timings: StepTimings
    # Pooling runner: seq id -> its prompt's pooled final hidden state (float32, on the host),
    # for the sequences whose prompt completed this step; nothing is sampled.
    pooled: dict[int, torch.Tensor] | None = None
    # Speculative decoding, for the sequences that verified >= 1 draft: seq id -> drafts
    # verified, and tokens emitted (its rows first_sample_row.. hold them in order).
    num_drafts: dict[int, int] = field(default_factory=dict)
    num_emitted: dict[int, int] = field(default_factory=dict)
    # Multi-step decoding: seq id -> tokens its iterations emitted (its rows first_sample_row..
    # hold them in order), for every sequence of a step that ran more than one iteration.
    multi_step_emitted: dict[int, int] = field(default_factory=dict)


@dataclass
class LoRAStats:
    """A worker's adapter counters since start-up (the engine's lora_stats())."""
    num_loads: int = 0  # adapters read from disk (reloads after an eviction included)
    num_evictions: int = 0  # adapters dropped from the cache to make room
    num_slot_loads: int = 0  # adapters copied into a device slot
    cached_ids: list[int] = field(default_factory=list)  # least recently used first
    slot_ids: list[int | None] = field(default_factory=list)
