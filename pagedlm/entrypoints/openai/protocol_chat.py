"""The bodies of /v1/chat/completions: the request with its tools, the response and its
streamed chunks (see protocol.py for the shared pieces, the messages among them).
"""
from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import Field

from pagedlm.entrypoints.openai.protocol import (FIRST_ERROR, LOGPROBS_LIMIT, MAX_LOGPROBS,
                                                 ChatMessage, OpenAIBaseModel, PromptLogprobs,
                                                 SamplingRequest, StrictRequest, UsageInfo)
from pagedlm.sampling_params import MAX_TOKEN_COUNT, SamplingParams


# ---- /v1/chat/completions ----

class FunctionDefinition(StrictRequest):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatCompletionToolsParam(StrictRequest):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(StrictRequest):
    name: str


class ChatCompletionNamedToolChoiceParam(StrictRequest):
    type: Literal["function"] = "function"
    function: NamedFunction


class ChatCompletionRequest(SamplingRequest):
    messages: Annotated[list[ChatMessage], FIRST_ERROR] = Field(min_length=1)
    # deprecated by OpenAI in favour of max_completion_tokens
    max_tokens: int | None = Field(None, ge=1, le=MAX_TOKEN_COUNT)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_TOKEN_COUNT)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOKEN_COUNT,
                                     description=LOGPROBS_LIMIT)
    tools: Annotated[list[ChatCompletionToolsParam], FIRST_ERROR] | None = None
    # None: "auto" when tools are given (as vLLM), else "none"
    tool_choice: Literal["none", "auto", "required"] | ChatCompletionNamedToolChoiceParam | None \
        = None
    # vLLM's chat extras
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_special_tokens: bool = False  # the chat template already holds them

    def _unsupported(self) -> str | None:
        if self.add_generation_prompt and self.continue_final_message:
            return "add_generation_prompt and continue_final_message cannot both be true."
        return super()._unsupported()

    def to_sampling_params(self, max_logprobs: int = MAX_LOGPROBS) -> SamplingParams:
        if self.top_logprobs is not None and not self.logprobs and self.top_logprobs > 0:
            raise ValueError("top_logprobs needs logprobs set to true.")
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None \
            else self.max_tokens
        return self._sampling_params(max_tokens, logprobs, self.prompt_logprobs, max_logprobs,
                                     logprobs_field="top_logprobs")


class ChatLogProb(OpenAIBaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogProbsContent(ChatLogProb):
    top_logprobs: list[ChatLogProb] = Field(default_factory=list)


class ChatCompletionLogProbs(OpenAIBaseModel):
    content: list[ChatLogProbsContent] | None = None


class FunctionCall(OpenAIBaseModel):
    name: str
    arguments: str


class ToolCall(OpenAIBaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaFunctionCall(OpenAIBaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(OpenAIBaseModel):
    """One streamed piece of a call: the first has id, type and name; later ones add
    argument text to the call at `index`."""
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None


class ChatResponseMessage(OpenAIBaseModel):
    role: str = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall] | None = None


class DeltaMessage(OpenAIBaseModel):
    role: str | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatCompletionResponseChoice(OpenAIBaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(OpenAIBaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo
    prompt_logprobs: PromptLogprobs | None = None  # vLLM's, when the request asks


class ChatCompletionStreamChoice(OpenAIBaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionStreamResponse(OpenAIBaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: UsageInfo | None = None
