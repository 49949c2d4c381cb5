"""The OpenAI API's shared request and response pieces (pydantic), with vLLM's extra sampling
fields: the base models, errors, usage, the conversation message, the sampling fields that
completions and chat share (SamplingRequest), and the bodies of the server's own routes (models,
version, LoRA adapters). Each endpoint's bodies are in protocol_<endpoint>.py, next to its
serving_<endpoint>.py.

Requests are validated strictly from JSON (a string is not an integer), and fields this server
does not know are accepted and ignored, as in vLLM. Every number has the range SamplingParams
accepts (shown in the OpenAPI document), and NaN and infinities are refused. to_sampling_params()
maps a request onto SamplingParams, whose own validation names the offending field.
"""
from __future__ import annotations

import json
import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from typing_extensions import TypedDict  # pydantic needs it, not typing's, before Python 3.12

from pagedlm.sampling_params import (INT64_MAX, INT64_MIN, MAX_LENGTH_PENALTY, MAX_LOGIT_BIAS,
                                     MAX_N, MAX_TOKEN_COUNT, RequestOutputKind, SamplingParams,
                                     StructuredOutputsParams)

# The most logprobs a request may ask for per position when the caller does not say (vLLM's
# default max_logprobs; the server passes its engine's).
MAX_LOGPROBS = 20

# A token id as a request carries it: the engine checks it against its vocabulary.
TokenId = Annotated[int, Field(ge=0, le=MAX_TOKEN_COUNT)]
# A request's lists (and logit_bias) stop validating at their first bad item. pydantic
# reports every one by default, each list in a union too: a 2 MB prompt of 500,000 ids of -1
# made 1.5 million errors, held the event loop 15 s and answered a 67 MB 400 (measured).
FIRST_ERROR = Field(fail_fast=True)
TokenIds = Annotated[list[TokenId], FIRST_ERROR]
Strings = Annotated[list[str], FIRST_ERROR]
# A prompt (or embedding input): text, texts, token ids, or lists of token ids.
PromptInput = str | Strings | TokenIds | Annotated[list[TokenIds], FIRST_ERROR]
LOGPROBS_LIMIT = "At most the server's --max-logprobs (default 20)."


def random_uuid() -> str:
    return uuid.uuid4().hex


class OpenAIBaseModel(BaseModel):
    model_config = ConfigDict(extra="allow")


class StrictRequest(OpenAIBaseModel):
    # JSON has no NaN or Infinity, but Python's json (and pydantic's parser) read them, and
    # 1e309 reads as infinity: no request setting means anything with them.
    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)


# ---- errors ----

class ErrorInfo(OpenAIBaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(OpenAIBaseModel):
    error: ErrorInfo


# ---- shared pieces ----

class StreamOptions(StrictRequest):
    include_usage: bool | None = True
    continuous_usage_stats: bool | None = False


class UsageInfo(OpenAIBaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


# ---- the conversation (chat, tokenize) ----

class ChatContentPart(StrictRequest):
    type: str
    text: str | None = None


class FunctionCallParam(StrictRequest):
    name: str
    arguments: str  # a JSON object, as text (OpenAI's shape)


class ChatMessageToolCall(StrictRequest):
    """A tool call of an earlier assistant turn, sent back in `messages`."""
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallParam


class ChatMessage(StrictRequest):
    role: str
    content: str | Annotated[list[ChatContentPart], FIRST_ERROR] | None = None
    name: str | None = None
    tool_calls: Annotated[list[ChatMessageToolCall], FIRST_ERROR] | None = None  # assistant turns
    tool_call_id: str | None = None  # tool turns: the call this is the result of

    def to_template_dict(self, index: int) -> dict:
        """The message as chat templates read it; `index`: its place in `messages`, which
        errors name (messages.<index>.content.<part>)."""
        content = self.content
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if part.type != "text":
                    raise ValueError(f"messages.{index}.content.{j}: content parts of type "
                                     f"{part.type[:40]!r} are not supported; only 'text'.")
                if part.text is None:
                    raise ValueError(f"messages.{index}.content.{j}: a content part of type "
                                     f"'text' needs its 'text' string.")
                texts.append(part.text)
            content = "\n".join(texts)
        msg = {"role": self.role, "content": content or ""}
        if self.name is not None:
            msg["name"] = self.name
        if self.tool_calls:
            msg["tool_calls"] = [
                # Templates read the arguments as a mapping (transformers' chat-template
                # convention), so the JSON text is parsed; checked by check_tool_messages.
                {"id": c.id, "type": c.type,
                 "function": {"name": c.function.name,
                              "arguments": json.loads(c.function.arguments)}}
                for c in self.tool_calls]
        if self.tool_call_id is not None:
            msg["tool_call_id"] = self.tool_call_id
        return msg


# ---- the sampling fields completions and chat share ----

class JsonSchemaResponseFormat(StrictRequest):
    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False,
                              populate_by_name=True)
    name: str | None = None
    description: str | None = None
    # "schema" would shadow pydantic's BaseModel.schema.
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(StrictRequest):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaResponseFormat | None = None


# The older guided_* fields vLLM still accepts, and the StructuredOutputsParams kind of each.
_GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                  "guided_grammar": "grammar"}


class SamplingRequest(StrictRequest):
    """Fields both endpoints share: OpenAI's, then vLLM's extras."""
    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N, description="At most the server's --max-num-seqs.")
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    stop: str | Strings | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = Field(0.0, ge=-2, le=2)
    frequency_penalty: float | None = Field(0.0, ge=-2, le=2)
    logit_bias: Annotated[dict[str, Annotated[float, Field(ge=-MAX_LOGIT_BIAS,
                                                           le=MAX_LOGIT_BIAS)]],
                          FIRST_ERROR] | None \
        = Field(None, description="Token id (as a string) -> a bias added to its logit.")
    user: str | None = None
    # vLLM's extra sampling fields
    top_k: int | None = Field(None, ge=-1, le=MAX_TOKEN_COUNT,
                              description="-1 or 0: no top-k.")
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0)
    min_tokens: int = Field(0, ge=0, le=MAX_TOKEN_COUNT)
    stop_token_ids: TokenIds | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_TOKEN_COUNT,
                                        description=LOGPROBS_LIMIT)
    best_of: int | None = Field(None, ge=1, le=MAX_N,
                                description="At least n; at most the server's --max-num-seqs.")
    use_beam_search: bool = False
    length_penalty: float = Field(1.0, ge=-MAX_LENGTH_PENALTY, le=MAX_LENGTH_PENALTY)
    early_stopping: bool | Literal["never"] = False
    # with --scheduling-policy priority: lower runs first
    priority: int = Field(0, ge=INT64_MIN, le=INT64_MAX)
    # Prefix-cache isolation (vLLM's field): only requests with the same salt share blocks.
    cache_salt: str | None = None
    # Structured outputs and token constraints (OpenAI's response_format, vLLM's extras).
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None  # StructuredOutputsParams' fields
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: Strings | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None
    allowed_token_ids: TokenIds | None = None
    bad_words: Strings | None = None

    def _unsupported(self) -> str | None:
        if self.stream and self.prompt_logprobs:
            # As vLLM: they are returned with the whole answer, which a stream never sends.
            return "prompt_logprobs are not available when stream is true."
        return None

    def _structured_outputs(self) -> StructuredOutputsParams | None:
        """The one structured-output spec among the fields that can carry one; errors name the
        request's field."""
        found: list[tuple[str, dict]] = []
        if self.structured_outputs is not None:
            found.append(("structured_outputs", dict(self.structured_outputs)))
        for name, kind in _GUIDED_FIELDS.items():
            if (value := getattr(self, name)) is not None:
                extra = {}
                if self.guided_whitespace_pattern is not None:
                    extra["whitespace_pattern"] = self.guided_whitespace_pattern
                found.append((name, {kind: value, **extra}))
        fmt = self.response_format
        if fmt is not None and fmt.type == "json_object":
            found.append(("response_format", {"json_object": True}))
        elif fmt is not None and fmt.type == "json_schema":
            if fmt.json_schema is None or fmt.json_schema.json_schema is None:
                raise ValueError("response_format.json_schema.schema is required with type "
                                 "'json_schema'.")
            found.append(("response_format.json_schema.schema",
                          {"json": fmt.json_schema.json_schema}))
        if not found:
            return None
        if len(found) > 1:
            raise ValueError(f"{found[1][0]}: only one structured output constraint may be "
                             f"given, got {', '.join(name for name, _ in found)}.")
        name, spec = found[0]
        if name == "structured_outputs":
            known = set(StructuredOutputsParams.__dataclass_fields__) - {"source_field"}
            if unknown := sorted(set(spec) - known):
                raise ValueError(f"structured_outputs has unknown fields {unknown}; known: "
                                 f"{sorted(known)}.")
            kinds = [k for k in StructuredOutputsParams._KINDS if spec.get(k) not in (None, False)]
            source = f"structured_outputs.{kinds[0]}" if len(kinds) == 1 else name
        else:
            source = name
        return StructuredOutputsParams(**spec, source_field=source)

    def _sampling_params(self, max_tokens: int | None, logprobs: int | None,
                         prompt_logprobs: int | None, max_logprobs: int,
                         logprobs_field: str = "logprobs") -> SamplingParams:
        """max_logprobs: the engine's (-1: no limit here, the engine checks the vocabulary);
        checked here so that the error names the request's field (chat's top_logprobs)."""
        if (msg := self._unsupported()) is not None:
            raise ValueError(msg)
        for name, value in ((logprobs_field, logprobs), ("prompt_logprobs", prompt_logprobs)):
            if value is not None and 0 <= max_logprobs < value:
                raise ValueError(f"{name} must be <= {max_logprobs} (the server's "
                                 f"--max-logprobs), got {value}.")
        kwargs: dict[str, Any] = dict(
            n=self.n, seed=self.seed, stop=self.stop, stop_token_ids=self.stop_token_ids,
            max_tokens=max_tokens, min_tokens=self.min_tokens, ignore_eos=self.ignore_eos,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output, logprobs=logprobs,
            prompt_logprobs=prompt_logprobs, best_of=self.best_of,
            use_beam_search=self.use_beam_search, length_penalty=self.length_penalty,
            early_stopping=self.early_stopping,
            structured_outputs=self._structured_outputs(), logit_bias=self.logit_bias,
            allowed_token_ids=self.allowed_token_ids, bad_words=self.bad_words,
            output_kind=RequestOutputKind.DELTA if self.stream else RequestOutputKind.FINAL_ONLY)
        for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                     "presence_penalty", "frequency_penalty"):
            if (value := getattr(self, name)) is not None:  # None: SamplingParams' default
                kwargs[name] = value
        return SamplingParams(**kwargs)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class PromptLogprob(TypedDict):
    """One candidate at one prompt position, in vLLM's `prompt_logprobs` format (keyed by
    token id). A plain dict, not a model: a dict of numbers and strings is not tracked by the
    garbage collector, and an answer can hold a million of these (64 prompts of 500 tokens,
    21 candidates each), whose models made each full collection take up to 0.5 s."""
    logprob: float
    rank: int | None
    decoded_token: str | None


# Per prompt position: None for the first (nothing to score it against), else token id ->
# PromptLogprob for the prompt's token and the top alternatives.
PromptLogprobs = list[dict[int, PromptLogprob] | None]


# ---- /v1/models ----

class ModelCard(OpenAIBaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "pagedlm"
    root: str | None = None
    parent: str | None = None  # a LoRA adapter's base model
    max_model_len: int | None = None


class ModelList(OpenAIBaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard] = Field(default_factory=list)


# ---- the other routes' bodies (for the OpenAPI document) ----

class VersionResponse(OpenAIBaseModel):
    version: str


class LoadLoRAAdapterRequest(OpenAIBaseModel):
    lora_name: str
    lora_path: str
    base_model_name: str | None = None


class UnloadLoRAAdapterRequest(OpenAIBaseModel):
    lora_name: str
