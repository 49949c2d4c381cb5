"""The bodies of /tokenize and /detokenize (see protocol.py for the shared pieces)."""
from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field

from pagedlm.entrypoints.openai.protocol import (FIRST_ERROR, ChatMessage, OpenAIBaseModel,
                                                 StrictRequest, TokenIds)
from pagedlm.entrypoints.openai.protocol_chat import ChatCompletionToolsParam


# ---- /tokenize and /detokenize (vLLM's shapes) ----

class TokenizeCompletionRequest(StrictRequest):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool | None = False


class TokenizeChatRequest(StrictRequest):
    model: str | None = None
    messages: Annotated[list[ChatMessage], FIRST_ERROR] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False  # the chat template already holds them
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool | None = False
    # As vLLM's: given to the chat template, as chat completions give them (tool_choice auto).
    tools: Annotated[list[ChatCompletionToolsParam], FIRST_ERROR] | None = None


TokenizeRequest = TokenizeCompletionRequest | TokenizeChatRequest


class TokenizeResponse(OpenAIBaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(StrictRequest):
    model: str | None = None
    tokens: TokenIds = Field(description="Token ids of the server's vocabulary.")


class DetokenizeResponse(OpenAIBaseModel):
    prompt: str
