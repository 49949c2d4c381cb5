"""What the completion and chat handlers share: model checks, errors, submitting requests,
streaming responses that abort their requests when the client goes away, logprob formatting."""
from __future__ import annotations

import asyncio
import json
import logging
import math
import re
from http import HTTPStatus
from typing import AsyncIterator, Awaitable, Callable, Iterable

from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError

from pagedlm.engine.async_llm_engine import (AsyncEngineDeadError, AsyncLLMEngine,
                                             LoRANotServedError)
from pagedlm.engine.request_stream import RequestStream
from pagedlm.entrypoints.openai.prompt_worker import PromptWorker
from pagedlm.entrypoints.openai.protocol import PromptLogprobs
from pagedlm.entrypoints.openai.serving_beam_search import BeamSearchStream
from pagedlm.inputs.preprocess import PromptType
from pagedlm.lora.request import LoRARequest
from pagedlm.outputs import PositionLogprobs
from pagedlm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# Fixed names: HTTPStatus's phrases change between Python versions (413's did in 3.13).
_ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
                405: "MethodNotAllowedError", 413: "RequestEntityTooLargeError",
                415: "UnsupportedMediaTypeError",
                500: "InternalServerError", 503: "ServiceUnavailableError"}
UNTRUSTED_TEMPLATE = ("chat_template: this server does not render chat templates sent with "
                      "requests (start it with --trust-request-chat-template to allow them); "
                      "leave the field out to use the server's template.")


# The most prompts one request may carry (a completion's `prompt` list, an embedding's `input`
# list): OpenAI's limit for embedding inputs. Each is an engine request, added in one go. A list
# of prompts may also ask for at most this many sequences in all (prompts x n or best_of).
MAX_PROMPTS = 2048


class RequestAborted(Exception):
    """OpenAIServing.collect: a request ended without its final output (aborted)."""


class AddFailed(Exception):
    """OpenAIServing.add_all: the engine refused prompt `index` with `cause` (the others were
    aborted)."""

    def __init__(self, index: int, cause: ValueError) -> None:
        super().__init__(index, cause)
        self.index, self.cause = index, cause


def error_body(message: str, status: int = 400, param: str | None = None) -> dict:
    err_type = _ERROR_TYPES.get(status) or HTTPStatus(status).phrase.replace(" ", "") + "Error"
    return {"error": {"message": message, "type": err_type, "param": param, "code": status}}


def error_response(message: str, status: int = 400, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, status, param), status_code=status)


def loads_json(data: bytes | str):
    """json.loads, with nesting too deep for the parser a ValueError like any other bad JSON
    (json.loads raises RecursionError, which would be a 500)."""
    try:
        return json.loads(data)
    except RecursionError:
        raise ValueError("the JSON is nested too deeply") from None


_UNION_TAG = re.compile(r"^(str|int|float|bool|none|list|dict|tuple)\b|[\[\]-]")


def validation_error_response(e: ValidationError) -> JSONResponse:
    """pydantic's errors as one 400 (FastAPI would answer 422), naming the first bad field.

    A value that fits none of a union's types gives one error per alternative: they are merged
    into one line ("Input should be a valid string or ... array").
    """
    by_loc: dict[str, tuple[list[str], object]] = {}
    for err in e.errors(include_url=False):
        if err.get("type") == "json_invalid":
            # pydantic's message starts "Invalid JSON: " itself.
            detail = str(err.get("msg", "")).removeprefix("Invalid JSON: ")
            return error_response(f"The request body is not valid JSON: {detail}", 400)
        # Drop the union-member tags pydantic puts in the location ("stop.str", "stop.list[str]").
        loc = ".".join(str(x) for x in err.get("loc", ())
                       if isinstance(x, int) or not _UNION_TAG.search(str(x)))
        msgs, value = by_loc.setdefault(loc, ([], err.get("input")))
        if err.get("msg") not in msgs:
            msgs.append(err.get("msg", "invalid"))
    parts = []
    for loc, (msgs, value) in list(by_loc.items())[:_SHOWN_ERRORS]:
        msg = " or ".join(msgs)
        if loc and not isinstance(value, (dict, list)) and value is not None:
            msg += f", got {_shown(value)}"
        parts.append(f"{loc}: {msg}" if loc else msg)
    if len(by_loc) > _SHOWN_ERRORS:
        parts.append(f"and {len(by_loc) - _SHOWN_ERRORS} more field(s)")
    param = next((loc for loc in by_loc if loc), None)
    return error_response("; ".join(parts) or "Invalid request body.", 400, param)


# The fields a 400 names at most, each value shown up to _SHOWN_CHARS characters: an answer
# listing every bad field and value in full was as large as the request, or larger.
_SHOWN_ERRORS = 5
_SHOWN_CHARS = 80


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= _SHOWN_CHARS else f"{text[:_SHOWN_CHARS]}... ({len(text)} chars)"


def not_served(model: str | None) -> JSONResponse:
    return error_response(f"The model `{model}` does not exist.", 404, "model")


def param_from_message(message: str, known: set[str]) -> str | None:
    """SamplingParams' errors start with the field's name: report it as the error's param
    (a nested one as its dotted path, e.g. response_format.json_schema.schema)."""
    word = message.split(" ", 1)[0].strip(":,.()")
    word = _ENGINE_NAMES.get(word, word)
    return word if word.split(".", 1)[0] in known else None


# The engine's names in its errors, for what a request calls otherwise.
_ENGINE_NAMES = {"prompt_token_ids": "prompt"}


def clean_logprob(x: float | None) -> float | None:
    """JSON has no -inf or NaN."""
    if x is None:
        return None
    if math.isnan(x):
        return -9999.0
    return max(x, -9999.0)


def token_text(tokenizer, token_id: int, position: PositionLogprobs | None) -> str:
    lp = position.get(token_id) if position else None
    if lp is not None and lp.decoded_token is not None:
        return lp.decoded_token
    return tokenizer.decode([token_id])


def prompt_logprobs_field(positions: list[PositionLogprobs | None] | None,
                          prompt_token_ids: list[int], top: int) -> PromptLogprobs | None:
    """An output's prompt logprobs in vLLM's response format (-inf as -9999: JSON has none):
    each position's prompt token and its `top` alternatives. The engine may hold more (an
    echo with a larger `logprobs` asks it for those)."""
    if positions is None:
        return None
    return [None if pos is None else {
        tid: {"logprob": clean_logprob(lp.logprob), "rank": lp.rank,
              "decoded_token": lp.decoded_token}
        for tid, lp in pos.items() if tid == token or (lp.rank is not None and lp.rank <= top)}
        for token, pos in zip(prompt_token_ids, positions)]


def sse(data: str) -> str:
    return f"data: {data}\n\n"


async def json_in_pieces(head: BaseModel, field: str, items: Iterable[BaseModel]) -> Response:
    """`head` as a JSON response, with its (empty) list `field` made of `items` (choices,
    embeddings), each serialised as it comes with the event loop let in between. `items` may
    build each item as it is asked for and drop what it was built from, so that the answer's
    objects are made, dumped and freed a piece at a time. As one document a large answer held
    the loop: 1024 echoed prompts with 20 logprobs each (34 MB) were formatted and dumped in
    1.9-2.7 s; 64 prompts of 500 tokens with echo, logprobs and prompt_logprobs (64 MB) were
    then freed in one go, 0.7 s."""
    # As UTF-8 bytes throughout (what model_dump_json decodes into a str): one non-Latin-1
    # character makes a str 2-4 bytes a character, and joining and encoding 64 MB of those
    # held the loop 0.65 s.
    parts: list[bytes] = []
    for item in items:
        parts.append(item.__pydantic_serializer__.to_json(item))
        del item
        await asyncio.sleep(0)
    # The other fields are small; each is dumped on its own, so no text inside one (a model
    # name) can be mistaken for where the list goes.
    fields = head.model_dump(mode="json", exclude={field})
    pieces = []
    for name in type(head).model_fields:
        value = b"[" + b",".join(parts) + b"]" if name == field else json.dumps(
            fields[name], ensure_ascii=False, separators=(",", ":")).encode()
        pieces.append(json.dumps(name).encode() + b":" + value)
    return Response(b"{" + b",".join(pieces) + b"}", media_type="application/json")


async def merge_streams(streams: list[RequestStream]) -> AsyncIterator[tuple[int, object]]:
    """Yield (index, output) from several request streams as outputs arrive."""
    if len(streams) == 1:
        async for item in streams[0]:
            yield 0, item
        return
    pending = {asyncio.ensure_future(anext(s)): i for i, s in enumerate(streams)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for fut in done:
                i = pending.pop(fut)
                try:
                    item = fut.result()
                except StopAsyncIteration:
                    continue
                pending[asyncio.ensure_future(anext(streams[i]))] = i
                yield i, item
    finally:
        for fut in pending:
            fut.cancel()


# How a stream the server's shutdown cut short ends.
_SHUTDOWN_CUT_EVENTS = sse(json.dumps(error_body(
    "The server is shutting down: this request was cancelled before it finished.", 503))) \
    + sse("[DONE]")


class EngineStreamingResponse(StreamingResponse):
    """A StreamingResponse that runs `on_close` however it ends: finished, failed, or cancelled
    because the client disconnected (even before the body generator first ran)."""

    def __init__(self, content, on_close: Callable[[], None], cut_events: str = "",
                 **kwargs) -> None:
        """cut_events: what to send, where it still can be, when the stream is cut short."""
        super().__init__(content, media_type="text/event-stream", **kwargs)
        self._on_close = on_close
        self._cut_events = cut_events

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        except asyncio.CancelledError:
            # uvicorn cancels what still runs at --timeout-graceful-shutdown's end (or at a
            # second Ctrl-C): each such stream logged a 60-line traceback as an application
            # error, and its client saw the stream stop mid-way as if complete. One line, and
            # the client is told.
            logger.info("a stream still running was cut short by the server's shutdown")
            try:
                await send({"type": "http.response.body", "body": self._cut_events.encode(),
                            "more_body": False})
            except Exception:  # noqa: BLE001 - not started, or the connection is gone
                pass
        finally:
            self._on_close()
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                try:
                    await aclose()
                except BaseException:  # noqa: BLE001 - best effort: the request is aborted
                    pass


class OpenAIServing:

    def __init__(self, engine: AsyncLLMEngine, served_model_names: list[str],
                 models=None, *, prompts: PromptWorker,
                 trust_request_chat_template: bool = False) -> None:
        self.engine = engine
        self.served_model_names = served_model_names
        self.models = models  # OpenAIServingModels: LoRA adapters by name
        # Tokenizing and template rendering happen on the worker's thread; this copy is for
        # the event loop's small decodes (logprob tokens, echoed prompts).
        self.prompts = prompts
        self.tokenizer = engine.get_tokenizer()
        self.max_model_len = engine.model_config.max_model_len
        self.max_logprobs = engine.model_config.max_logprobs
        self.trust_request_chat_template = trust_request_chat_template

    def check_generates(self, model: str | None) -> JSONResponse | None:
        """check_model, then a pooling server's 400 for completions and chat at once: after
        the context's check, a long max_tokens was refused for the context instead."""
        if (err := self.check_model(model)) is not None:
            return err
        if self.engine.model_config.runner == "pooling":
            return error_response("This server runs runner='pooling' (`--runner pooling`): it "
                                  "computes embeddings (/v1/embeddings) and cannot generate "
                                  "text.", 400, "model")
        return None

    def refuse_request_template(self, template: str | None) -> JSONResponse | None:
        """A request's own chat_template is code run by the server: refused unless trusted
        (vLLM's --trust-request-chat-template, after CVE-2025-61620)."""
        if template is None or self.trust_request_chat_template:
            return None
        return error_response(UNTRUSTED_TEMPLATE, 400, "chat_template")

    def check_model(self, model: str | None) -> JSONResponse | None:
        if self.models is not None:
            return self.models.check(model)
        if model is None or model in self.served_model_names:
            return None
        return not_served(model)

    def adapter(self, model: str | None
                ) -> tuple[LoRARequest | None, Callable[[], bool] | None] | JSONResponse:
        """The request's adapter (None: a base model) and the check that it is still served
        (AsyncLLMEngine.add_request's lora_served), or the 404 of a model unloaded since
        check_model passed: lora_for's None for it ran the request on the base model, under
        the adapter's name."""
        if self.models is None or self.models.is_base_model(model):
            return None, None
        lora = self.models.lora_for(model)
        if lora is None:
            return not_served(model)
        return lora, lambda: self.models.lora_for(model) is lora

    def model_name(self, model: str | None) -> str:
        return model if model is not None else self.served_model_names[0]

    async def submit(self, request_id: str, prompts: list[PromptType], params: SamplingParams,
                     priority: int = 0, cache_salt: str | None = None,
                     model: str | None = None, max_tokens_field: str = "max_tokens"
                     ) -> list[RequestStream | BeamSearchStream] | JSONResponse:
        """Add one engine request per prompt, all or nothing; an error becomes a response.
        A use_beam_search request is a search run here, above the engine.
        max_tokens_field: the request's name for params.max_tokens (for the error)."""
        if (too_long := self.check_context(prompts, params, max_tokens_field)) is not None:
            return too_long
        per_prompt = max(params.n, params.best_of or params.n)
        if len(prompts) > 1 and len(prompts) * per_prompt > MAX_PROMPTS:
            # 2048 prompts x n=256 were 524,288 sequences: minutes of the engine's time, while
            # the requests behind them waited (first come, first served).
            field = "best_of" if (params.best_of or 0) > params.n else "n"
            return error_response(
                f"{field}: {len(prompts)} prompts x {per_prompt} sequences each are "
                f"{len(prompts) * per_prompt} sequences; a request may ask for at most "
                f"{MAX_PROMPTS}.", 400, field)
        if cache_salt is not None:
            prompts = [{**p, "cache_salt": cache_salt} for p in prompts]
        if isinstance(adapter := self.adapter(model), JSONResponse):
            return adapter
        lora, served = adapter
        streams: list[RequestStream | BeamSearchStream] = []
        try:
            if params.use_beam_search:
                for i, prompt in enumerate(prompts):
                    rid = request_id if len(prompts) == 1 else f"{request_id}-{i}"
                    streams.append(await BeamSearchStream.start(
                        self.engine, rid, prompt, params, self.tokenizer, priority, lora,
                        served))
            else:
                streams = await self.add_all(request_id, prompts, lambda rid, prompt: (
                    self.engine.add_request(rid, prompt, params, priority=priority,
                                            lora_request=lora, lora_served=served)))
        except LoRANotServedError:
            self.abort(streams)
            return not_served(model)
        except AddFailed as failed:
            e = failed.cause
            return error_response(str(e), 400, param_from_message(str(e), _PARAMS))
        except ValueError as e:
            self.abort(streams)
            return error_response(str(e), 400, param_from_message(str(e), _PARAMS))
        except AsyncEngineDeadError as e:
            self.abort(streams)
            return error_response(str(e), 500)
        except BaseException:
            self.abort(streams)  # cancelled: the client went away while we waited
            raise
        return streams

    async def add_all(self, request_id: str, prompts: list[PromptType],
                      add: Callable[[str, PromptType], Awaitable[RequestStream]]
                      ) -> list[RequestStream]:
        """add(request id, prompt) for every prompt at once, all or nothing. Each add waits
        for the engine thread to take it between two steps, so one after another a list of N
        prompts took N steps to start (50 one-token prompts: 61 s on a busy 2-core machine);
        together they start in one. Where one fails the others are aborted, and its error is
        raised: an invalid prompt's ValueError as AddFailed, naming which; cancelled (the
        client left), each aborts what it added."""
        tasks = [asyncio.ensure_future(add(request_id if len(prompts) == 1
                                           else f"{request_id}-{i}", prompt))
                 for i, prompt in enumerate(prompts)]
        try:
            await asyncio.wait(tasks)
        except BaseException:
            for t in tasks:
                t.cancel()  # one still waiting aborts its request as it ends (add_request)
            self.abort([t.result() for t in tasks
                        if t.done() and not t.cancelled() and t.exception() is None])
            raise
        streams = [t.result() for t in tasks if t.exception() is None]
        for i, t in enumerate(tasks):
            if (e := t.exception()) is not None:
                self.abort(streams)
                if isinstance(e, ValueError):
                    raise AddFailed(i, e)
                raise e  # the engine's (AsyncEngineDeadError), not the request's
        return streams

    def check_context(self, prompts: list[PromptType], params: SamplingParams,
                      max_tokens_field: str = "max_tokens") -> JSONResponse | None:
        """As OpenAI and vLLM do: prompt plus max_tokens over the context is a 400, not a
        silently shortened completion. A prompt longer than the context is refused here with
        the engine's message, before its ids travel to the engine thread, which checks each
        id before the length (a 4M-id prompt's request took 2.29 s that way, 1.65 s refused
        here)."""
        for prompt in prompts:
            ids = prompt.get("prompt_token_ids") if isinstance(prompt, dict) else None
            if ids is not None and len(ids) > self.max_model_len:
                message = (f"prompt is too long: {len(ids)} tokens, but max_model_len is "
                           f"{self.max_model_len}.")
                return error_response(message, 400, param_from_message(message, _PARAMS))
            if ids is None or params.max_tokens is None:
                continue
            if len(ids) + params.max_tokens > self.max_model_len:
                return error_response(
                    f"This model's maximum context length is {self.max_model_len} tokens. "
                    f"However, you requested {len(ids) + params.max_tokens} tokens "
                    f"({len(ids)} in the prompt, {params.max_tokens} in the completion). "
                    f"Please reduce the length of the prompt or of {max_tokens_field}.", 400,
                    max_tokens_field)
        return None

    def abort(self, streams: list[RequestStream | BeamSearchStream]) -> None:
        for s in streams:
            if isinstance(s, BeamSearchStream) and not s.finished:
                s.abort()
        self.engine.abort([s.request_id for s in streams
                           if isinstance(s, RequestStream) and not s.finished])

    async def collect(self, streams: list[RequestStream]) -> list:
        """The final output of each stream (FINAL_ONLY requests); aborts them if cancelled.
        RequestAborted where one ended without it: the engine aborted it (its LoRA adapter was
        unloaded meanwhile)."""
        async def last(stream: RequestStream):
            out = None
            async for out in stream:
                pass
            return out

        try:
            finals = await asyncio.gather(*(last(s) for s in streams))
        finally:
            self.abort(streams)
        if any(f is None for f in finals):
            raise RequestAborted
        return finals

    def _aborted_error(self, model: str | None) -> dict:
        """The error for a request the engine aborted before it finished: a 404 naming `model`
        where it is an adapter unloaded meanwhile (the only way a client can cause this), else
        the server's own doing."""
        if (gone := self.check_model(model)) is not None:
            return error_body(f"The model `{model}` was unloaded while this request ran; "
                              f"the request was aborted.", gone.status_code, "model")
        return error_body("The server aborted this request before it finished.", 500)

    def aborted_response(self, model: str | None) -> JSONResponse:
        """The answer to a request collect() found aborted (RequestAborted)."""
        body = self._aborted_error(model)
        return JSONResponse(body, status_code=body["error"]["code"])

    def aborted_event(self, model: str | None) -> str:
        """The error event that ends a stream whose request the engine aborted; without it
        the stream ended with [DONE] as if the answer were complete."""
        return sse(json.dumps(self._aborted_error(model)))

    def streaming_response(self, body: AsyncIterator[str],
                           streams: list[RequestStream]) -> EngineStreamingResponse:
        return EngineStreamingResponse(body, on_close=lambda: self.abort(streams),
                                       cut_events=_SHUTDOWN_CUT_EVENTS)

    @staticmethod
    def stream_error(e: BaseException) -> str:
        status = 400 if isinstance(e, ValueError) else 500
        logger.error("request failed mid-stream: %r", e)
        return sse(json.dumps(error_body(str(e) or repr(e), status)))


def _known_params() -> set[str]:
    from pagedlm.entrypoints.openai.protocol_chat import ChatCompletionRequest
    from pagedlm.entrypoints.openai.protocol_completion import CompletionRequest
    return (set(SamplingParams.__dataclass_fields__) | set(CompletionRequest.model_fields)
            | set(ChatCompletionRequest.model_fields))


_PARAMS = _known_params()
