"""The bodies of /v1/completions (see protocol.py for the shared pieces)."""
from __future__ import annotations

import time
from typing import Literal

from pydantic import Field

from pagedlm.entrypoints.openai.protocol import (LOGPROBS_LIMIT, MAX_LOGPROBS, OpenAIBaseModel,
                                                 PromptInput, PromptLogprobs, SamplingRequest,
                                                 UsageInfo)
from pagedlm.sampling_params import MAX_TOKEN_COUNT, SamplingParams


# ---- /v1/completions ----

class CompletionRequest(SamplingRequest):
    prompt: PromptInput
    max_tokens: int | None = Field(16, ge=1, le=MAX_TOKEN_COUNT)
    echo: bool | None = False
    logprobs: int | None = Field(None, ge=0, le=MAX_TOKEN_COUNT, description=LOGPROBS_LIMIT)
    suffix: str | None = None
    add_special_tokens: bool = True

    def _unsupported(self) -> str | None:
        if self.suffix:
            return "suffix is not supported."
        return super()._unsupported()

    def to_sampling_params(self, max_logprobs: int = MAX_LOGPROBS) -> SamplingParams:
        prompt_logprobs = self.prompt_logprobs
        if self.echo and self.logprobs is not None:
            prompt_logprobs = max(self.logprobs, prompt_logprobs or 0)
        return self._sampling_params(self.max_tokens, self.logprobs, prompt_logprobs,
                                     max_logprobs)


class CompletionLogProbs(OpenAIBaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionResponseChoice(OpenAIBaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobs | None = None  # vLLM's, when the request asks


class CompletionResponse(OpenAIBaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo


class CompletionStreamResponse(OpenAIBaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo | None = None
