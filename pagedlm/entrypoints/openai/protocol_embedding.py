"""The bodies of /v1/embeddings (see protocol.py for the shared pieces)."""
from __future__ import annotations

import time
from typing import Literal

from pydantic import Field

from pagedlm.entrypoints.openai.protocol import OpenAIBaseModel, PromptInput, StrictRequest
from pagedlm.sampling_params import INT64_MAX, INT64_MIN, MAX_TOKEN_COUNT


# ---- /v1/embeddings (a server started with --runner pooling) ----

class EmbeddingRequest(StrictRequest):
    model: str | None = None
    input: PromptInput = Field(
        description="A text, a list of texts, a token array, or a list of token arrays.")
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(
        None, ge=1, le=MAX_TOKEN_COUNT,
        description="Only for models trained for matryoshka representations.")
    user: str | None = None
    # vLLM's extras
    add_special_tokens: bool = True
    normalize: bool | None = Field(None, description="None: the server's pooler setting.")
    priority: int = Field(0, ge=INT64_MIN, le=INT64_MAX)


class EmbeddingData(OpenAIBaseModel):
    index: int
    object: Literal["embedding"] = "embedding"
    embedding: list[float] | str = Field(
        description="Floats, or with encoding_format 'base64' their little-endian float32 "
                    "bytes in base64.")


class EmbeddingUsage(OpenAIBaseModel):
    prompt_tokens: int = 0
    total_tokens: int = 0


class EmbeddingResponse(OpenAIBaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[EmbeddingData]
    usage: EmbeddingUsage
