"""Sequence and SequenceGroup: the engine's per-request state.

A SequenceGroup is one request (one prompt). It starts with one Sequence; with n > 1 the
Sequence is forked after the prompt is prefilled, and the children share the prompt's KV blocks.
"""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pagedlm.lora.request import LoRARequest
from pagedlm.outputs import PositionLogprobs, RequestMetrics
from pagedlm.pooling_params import PoolingParams
from pagedlm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagedlm.structured_output.request import StructuredOutputRequest


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"  # preempted by swap: its KV blocks are in the host pool
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    def __init__(self, value: str) -> None:
        # A plain attribute, set once per member: it is read for every sequence several times a
        # step, and an enum property (through `value`) cost 10x more.
        self.finished = value in ("stop", "length", "abort")


@dataclass
class DetokenizerState:
    """Incremental detokenization offsets (see engine/detokenizer.py)."""
    tokens: list[int] | list[str] = field(default_factory=list)  # ids with a fast tokenizer
    prefix_offset: int = 0
    read_offset: int = 0
    prefix_len: int = 0  # characters of tokens[prefix_offset:read_offset] decoded


@dataclass(eq=False)
class Sequence:
    seq_id: int
    token_ids: list[int]  # prompt followed by the output so far
    num_prompt_tokens: int
    # Tokens whose K/V are already in the cache; the rest are scheduled next.
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    cumulative_logprob: float = 0.0
    output_logprobs: list[PositionLogprobs] = field(default_factory=list)
    output_text: str = ""
    detok: DetokenizerState = field(default_factory=DetokenizerState)
    stop_reason: int | str | None = None
    # Prefix caching: hashes of the full blocks so far, and how many of the block table's
    # blocks are registered in the cache.
    block_hashes: list[bytes | int] = field(default_factory=list)
    num_cached_blocks: int = 0
    # Mixed into the first block's hash: only requests with the same salt share cached blocks.
    cache_salt: str | None = None
    # The adapter's (id, path), also in the first block's hash: adapters never share KV blocks.
    lora_key: tuple[int, str] | None = None
    # What the workers hold of this sequence (core/sched_output.py sends only the difference):
    # its first synced_num_tokens tokens and this block table; None: nothing yet.
    synced_num_tokens: int = 0
    synced_block_ids: list[int] | None = None
    # Speculative decoding's per-sequence back-off (core/spec_policy.py): its current k (None:
    # not decoded yet) and, at k = 0, its output length at which it tries again.
    spec_k: int | None = None
    spec_retry_at: int = 0

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    def fork(self, seq_id: int) -> "Sequence":
        """A child with the same tokens and text; its block table is set by the BlockManager."""
        return Sequence(seq_id=seq_id, token_ids=list(self.token_ids),
                        num_prompt_tokens=self.num_prompt_tokens,
                        num_computed_tokens=self.num_computed_tokens,
                        status=self.status, cumulative_logprob=self.cumulative_logprob,
                        output_logprobs=list(self.output_logprobs),
                        output_text=self.output_text, cache_salt=self.cache_salt,
                        lora_key=self.lora_key,
                        detok=DetokenizerState(list(self.detok.tokens), self.detok.prefix_offset,
                                               self.detok.read_offset, self.detok.prefix_len))


@dataclass
class OutputCursor:
    """How much of each sequence earlier outputs carried (DELTA outputs send only the rest)."""
    sent: dict[int, tuple[int, int]] = field(default_factory=dict)  # seq_id -> (tokens, chars)
    prompt_logprobs_sent: bool = False
    finish_sent: frozenset[int] = frozenset()  # seq_ids whose finish a DELTA output carried


@dataclass
class SequenceUpdates:
    """What the output processor decided in one step, for the scheduler to act on."""
    forks: list[tuple[SequenceGroup, Sequence, Sequence]] = field(default_factory=list)
    finished: list[tuple[Sequence, SequenceStatus]] = field(default_factory=list)
    # Speculative decoding: (sequence, drafts verified, drafts accepted) for each sequence that
    # verified at least one draft; its accepted drafts' K/V are in the cache.
    spec: list[tuple[Sequence, int, int]] = field(default_factory=list)
    # Multi-step decoding: (sequence, tokens its iterations after the first computed), for
    # each unfinished sequence that emitted more than one token.
    multi_step: list[tuple[Sequence, int]] = field(default_factory=list)


@dataclass(eq=False)
class SequenceGroup:
    request_id: str
    seqs: list[Sequence]
    sampling_params: SamplingParams
    prompt: str | None
    prompt_token_ids: list[int]
    arrival_time: float = field(default_factory=time.time)
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    metrics: RequestMetrics | None = None
    # Prompt logprobs collected so far (chunked prompts add to it) until complete.
    partial_prompt_logprobs: list[PositionLogprobs | None] = field(default_factory=list)
    # What earlier RequestOutputs sent, for DELTA outputs.
    cursor: OutputCursor = field(default_factory=OutputCursor)
    priority: int = 0  # lower runs first under the priority policy
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at first admission
    arrival_order: int = 0  # set by the scheduler: breaks ties in arrival order
    beam_done: bool = False
    lora_request: LoRARequest | None = None
    # Pooling runner: the request's settings (its sampling_params then only schedule the one
    # pass over the prompt) and, once the prompt has run, its embedding.
    pooling_params: PoolingParams | None = None
    embedding: list[float] | None = None
    # Its grammar and per-sequence matchers (structured_output/request.py), if it has one.
    structured_output: "StructuredOutputRequest | None" = None

    @property
    def lora_int_id(self) -> int:
        """0 for the base model."""
        return self.lora_request.lora_int_id if self.lora_request is not None else 0

    def __post_init__(self) -> None:
        if self.metrics is None:
            self.metrics = RequestMetrics(arrival_time=self.arrival_time)
        params = self.sampling_params
        if (self.prompt_logprobs is None and len(self.prompt_token_ids) == 1
                and params.prompt_logprobs is not None):
            # Complete already: no position of a one-token prompt is ever scored.
            self.prompt_logprobs = [None]

    def unfinished_seqs(self) -> list[Sequence]:
        return [s for s in self.seqs if not s.status.finished]

    def is_finished(self) -> bool:
        for s in self.seqs:  # (a loop: all() over a generator cost twice as much)
            if not s.status.finished:
                return False
        return True

    @property
    def is_fresh(self) -> bool:
        """Still one sequence with no output: its first sample forks it into best_of."""
        return len(self.seqs) == 1 and self.seqs[0].num_output_tokens == 0

    def num_samples(self, seq: Sequence, num_new_tokens: int) -> int:
        """Tokens to sample for seq after computing num_new_tokens more: 0 mid-prompt, best_of
        where a fresh prompt completes (it forks), else 1."""
        if seq.num_computed_tokens + num_new_tokens < len(seq.token_ids):
            return 0
        best_of = self.sampling_params.best_of
        return best_of if best_of > 1 and self.is_fresh else 1

    @property
    def max_num_seqs(self) -> int:
        """Sequences this group will run at once, reserved against max_num_seqs at admission."""
        if self.is_fresh:
            return self.sampling_params.best_of
        return len(self.unfinished_seqs())
