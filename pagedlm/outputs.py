"""What the engine hands back to users: RequestOutput and CompletionOutput."""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple


class Logprob(NamedTuple):
    """A tuple, not a dataclass: the collector stops tracking a tuple of numbers and strings
    at its first pass, and a request's logprobs can be a million of these (64 echoed prompts
    of 500 tokens, 21 candidates each), which full collections otherwise walk every time."""
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One dict per position: token id -> Logprob (the sampled/actual token plus the top-k).
PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[PositionLogprobs] | None
    finish_reason: str | None = None  # "stop", "length", "abort" or None while running
    stop_reason: int | str | None = None  # the stop string or token that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[PositionLogprobs | None] | None
    # Under RequestOutputKind.DELTA a sequence whose finish an earlier output carried is left
    # out (as vLLM's per-sequence deltas do): match completions by their .index.
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0


@dataclass
class BeamSearchSequence:
    """One beam of LLM.beam_search: as in vLLM, tokens and text include the prompt."""
    tokens: list[int]
    text: str
    cum_logprob: float
    finish_reason: str | None = None


@dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]  # best first


@dataclass
class EmbeddingOutput:
    embedding: list[float]  # after the request's truncation (dimensions) and normalisation

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class EmbeddingRequestOutput:
    """What a pooling engine returns per prompt (vLLM's name): `.outputs.embedding`."""
    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0
