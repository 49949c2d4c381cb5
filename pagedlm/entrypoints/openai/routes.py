"""The server's routes, as FastAPI routers that build_app includes (see api_server.py).

The handlers find what they serve with on `app.state.serving` (a ServingState, built once per
app), so one router serves every app. Three routers, included in this order: the server's own
routes (health, version, metrics, the page, the engine view, the model list), the runtime LoRA
routes (only when runtime updating is on), and the OpenAI API (completions, chat, embeddings,
tokenizing). The POST routes read their JSON bodies themselves (see openapi.py); the bodies each
router's routes read are listed next to it for the OpenAPI document.
"""
from __future__ import annotations

import asyncio
import logging
import os
from dataclasses import dataclass
from typing import Awaitable

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ValidationError

import pagedlm
from pagedlm.engine.async_llm_engine import AsyncEngineDeadError, AsyncLLMEngine
from pagedlm.entrypoints.openai.engine_events import EngineEvents
from pagedlm.entrypoints.openai.openapi import SSE_CONTENT, json_body, responses, sse_content
from pagedlm.entrypoints.openai.protocol import (LoadLoRAAdapterRequest, ModelList,
                                                 UnloadLoRAAdapterRequest, VersionResponse)
from pagedlm.entrypoints.openai.protocol_chat import ChatCompletionRequest, ChatCompletionResponse
from pagedlm.entrypoints.openai.protocol_completion import CompletionRequest, CompletionResponse
from pagedlm.entrypoints.openai.protocol_embedding import EmbeddingRequest, EmbeddingResponse
from pagedlm.entrypoints.openai.protocol_tokenization import (DetokenizeRequest, DetokenizeResponse,
                                                              TokenizeChatRequest,
                                                              TokenizeCompletionRequest,
                                                              TokenizeResponse)
from pagedlm.entrypoints.openai.serving_chat import OpenAIServingChat
from pagedlm.entrypoints.openai.serving_completion import OpenAIServingCompletion
from pagedlm.entrypoints.openai.serving_embedding import OpenAIServingEmbedding
from pagedlm.entrypoints.openai.serving_engine import (EngineStreamingResponse, error_response,
                                                       loads_json, validation_error_response)
from pagedlm.entrypoints.openai.serving_models import OpenAIServingModels
from pagedlm.entrypoints.openai.serving_tokenization import OpenAIServingTokenization

logger = logging.getLogger(__name__)

STATIC_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "static")
# The engine view's refresh rate: each view is a scan of the queues and block reference counts
# on the engine thread, taken only while a page is connected.
ENGINE_EVENTS_PER_S = 4.0
# Each events response ends after this long and the page reconnects at once: uvicorn's graceful
# shutdown waits for open responses, so an endless stream would hold up Ctrl-C for as long as a
# page stays open.
ENGINE_EVENTS_MAX_S = 5.0


@dataclass(frozen=True)
class ServingState:
    """What the routes serve with: one app's engine and its serving objects."""
    engine: AsyncLLMEngine
    models: OpenAIServingModels
    max_body_values: int  # --max-request-body-values
    completion: OpenAIServingCompletion
    chat: OpenAIServingChat
    embedding: OpenAIServingEmbedding
    tokenization: OpenAIServingTokenization
    engine_events: EngineEvents  # GET /engine/events' views, shared by its subscribers


def _serving(raw: Request) -> ServingState:
    return raw.app.state.serving


async def _listen_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def with_cancellation(handler: Awaitable[Response], request: Request) -> Response:
    """Run a handler, cancelling it if the client disconnects first (its requests abort)."""
    handler_task = asyncio.ensure_future(handler)
    disconnect_task = asyncio.ensure_future(_listen_for_disconnect(request))
    try:
        await asyncio.wait([handler_task, disconnect_task],
                           return_when=asyncio.FIRST_COMPLETED)
    finally:
        disconnect_task.cancel()
        if not handler_task.done():
            handler_task.cancel()
    if handler_task.done() and not handler_task.cancelled():
        return handler_task.result()
    logger.debug("client disconnected before the response was ready")
    return Response(status_code=499)  # nobody reads it


# How many unknown field names the log line shows (a body can carry millions).
_SHOWN_UNKNOWN_FIELDS = 8


def _is_json(content_type: str) -> bool:
    """application/json or application/*+json (parameters aside): with no Content-Type, what
    FastAPI parses as JSON, and so vLLM."""
    kind = content_type.split(";", 1)[0].strip().lower()
    return kind == "application/json" or (kind.startswith("application/")
                                          and kind.endswith("+json")
                                          and len(kind) > len("application/+json"))


def _charset(content_type: str) -> str | None:
    """The charset parameter of a Content-Type, lower case and unquoted; None without one."""
    for param in content_type.split(";")[1:]:
        name, _, value = param.partition("=")
        if name.strip().lower() == "charset":
            return value.strip().strip('"').lower()
    return None


async def _body(raw: Request) -> bytes | Response:
    """The request's body, or a 415 for a body sent as something other than uncompressed
    JSON, or a 413 where it holds more JSON values than the server parses
    (--max-request-body-values; cli_args.py says why). Commas bound the values from above: one
    inside a string counts too, which a body of text reaches only far past any prompt length
    the server takes.

    A browser sends text/plain and form bodies from any page without asking the server first
    (no CORS preflight): read as JSON, they let a page its user visits use a server without an
    API key on their machine, and read the answers."""
    # Every Content-Type header: a second one must not slip a type past the first.
    for content_type in raw.headers.getlist("content-type"):
        if not _is_json(content_type):
            return error_response(f"The request body must be JSON (Content-Type: "
                                  f"application/json), not {content_type[:100]!r}.", 415)
        # JSON is UTF-8 (RFC 8259): a body in another charset would be read as UTF-8 anyway,
        # its non-ASCII text garbled or refused as invalid bytes.
        charset = _charset(content_type)
        if charset not in (None, "utf-8", "utf8"):
            return error_response(f"The request body must be UTF-8 JSON; charset "
                                  f"{charset[:40]!r} is not supported.", 415)
    # A compressed body would be parsed as it came and refused as "not valid JSON".
    for encoding in raw.headers.getlist("content-encoding"):
        if encoding.strip().lower() not in ("", "identity"):
            return error_response(f"Content-Encoding {encoding[:40]!r} is not supported: send "
                                  f"the request body uncompressed.", 415)
    body = await raw.body()
    limit = _serving(raw).max_body_values
    if len(body) > limit and (values := body.count(b",") + 1) > limit:
        return error_response(
            f"The request body holds up to {values} JSON values; this server parses at most "
            f"{limit} (see --max-request-body-values).", 413)
    return body


def _validate(body: bytes, model: type[BaseModel]) -> BaseModel | Response:
    # pydantic's JSON parser has its own depth limit: deep nesting is a json_invalid 400.
    try:
        request = model.model_validate_json(body)
    except ValidationError as e:
        return validation_error_response(e)
    if request.model_extra:
        names = list(request.model_extra)
        shown = ", ".join(repr(n[:40]) for n in names[:_SHOWN_UNKNOWN_FIELDS])
        logger.info("ignoring %d unknown request field(s): %s%s", len(names), shown,
                    ", ..." if len(names) > _SHOWN_UNKNOWN_FIELDS else "")
    return request


async def _parse(raw: Request, model: type[BaseModel]) -> BaseModel | Response:
    body = await _body(raw)
    return body if isinstance(body, Response) else _validate(body, model)


# --- The server's own routes --------------------------------------------------------------

server_router = APIRouter()


# HEAD too: some load balancers' health checks send it (two routes: one operation id each).
@server_router.head("/health", response_class=Response,
                    responses=responses(None, 503,
                                        ok_description="The engine is running (no body)."))
@server_router.get("/health", response_class=Response,
                   responses=responses(None, 503,
                                       ok_description="The engine is running (no body)."))
async def health(raw: Request) -> Response:
    engine = _serving(raw).engine
    if engine.is_running:
        return Response(status_code=200)
    # 503, as vLLM answers for a dead engine: a failed one never comes back, and the server is
    # on its way out (see stop_server_when_engine_fails).
    return error_response(f"The engine is not running: {engine.dead_error!r}", 503)


# The other GET routes answer HEAD as well (HTTP asks it of every GET resource, and uptime
# probes send it); kept out of the schema, where each route has one operation.
@server_router.head("/version", include_in_schema=False)
@server_router.get("/version", response_model=VersionResponse,
                   responses=responses(None, 401, 500))
async def version() -> dict:
    return {"version": pagedlm.__version__}


@server_router.head("/metrics", include_in_schema=False)
@server_router.get("/metrics", responses=responses(None, 401, 500, ok_content={
    CONTENT_TYPE_LATEST.split(";")[0]: {"schema": {"type": "string"}}},
    ok_description="Prometheus metrics (text exposition format)."))
async def metrics(raw: Request) -> Response:
    return Response(generate_latest(_serving(raw).engine.metrics.registry),
                    media_type=CONTENT_TYPE_LATEST)


@server_router.api_route("/", methods=["GET", "HEAD"], include_in_schema=False)
async def index() -> Response:
    return FileResponse(os.path.join(STATIC_DIR, "index.html"),
                        headers={"Cache-Control": "no-cache"})


@server_router.get("/engine/events", responses=responses(
    None, 401, 500, 503, ok_content=sse_content(
        "One event per engine view: `data:` is the view as JSON (queues, KV block map, "
        "tokens per step)."),
    ok_description="The engine view as server-sent events, a few per second; the stream "
                   "ends after a few seconds and the page reconnects."))
async def engine_events(raw: Request) -> Response:
    engine = _serving(raw).engine

    async def events():
        end = loop.time() + ENGINE_EVENTS_MAX_S
        while loop.time() < end:
            try:
                yield await _serving(raw).engine_events.next_event()
            except AsyncEngineDeadError:  # the stream ends; /health says why
                return
            await asyncio.sleep(1 / ENGINE_EVENTS_PER_S)

    if not engine.is_running:
        return error_response(f"The engine is not running: {engine.dead_error!r}", 500)
    source = _serving(raw).engine_events
    if not source.subscribe():
        return error_response(f"{source.max_subscribers} engine view streams are open, the "
                              f"most served at once; try again later.", 503)
    loop = asyncio.get_running_loop()
    return EngineStreamingResponse(events(), on_close=source.unsubscribe,
                                   headers={"Cache-Control": "no-cache"})


@server_router.head("/v1/models", include_in_schema=False)
@server_router.get("/v1/models", response_model=ModelList, responses=responses(None, 401, 500))
async def list_models(raw: Request) -> dict:
    return ModelList(data=_serving(raw).models.cards()).model_dump()


# --- Runtime LoRA updating ----------------------------------------------------------------

lora_router = APIRouter()
LORA_BODY_MODELS: tuple[type[BaseModel], ...] = (LoadLoRAAdapterRequest,
                                                 UnloadLoRAAdapterRequest)
_LORA_OK = {"text/plain": {"schema": {"type": "string"}}}


async def _json_object(raw: Request) -> dict | Response:
    data = await _body(raw)
    if isinstance(data, Response):
        return data
    try:
        body = loads_json(data or b"{}")
    except ValueError as e:  # bad JSON, too deep, or bytes that are not UTF-8 at all
        return error_response(f"The request body is not valid JSON: {e}", 400)
    if not isinstance(body, dict):
        return error_response("The body must be a JSON object.", 400)
    return body


@lora_router.post("/v1/load_lora_adapter", openapi_extra=json_body(LoadLoRAAdapterRequest),
                  responses=responses(None, 400, 401, 408, 413, 415, 500, ok_content=_LORA_OK))
async def load_lora_adapter(raw: Request) -> Response:
    body = await _json_object(raw)
    if isinstance(body, Response):
        return body
    err = await _serving(raw).models.load_lora(body.get("lora_name"), body.get("lora_path"),
                                               body.get("base_model_name"))
    return err or PlainTextResponse(
        f"Success: LoRA adapter '{body['lora_name']}' added successfully.")


@lora_router.post("/v1/unload_lora_adapter", openapi_extra=json_body(UnloadLoRAAdapterRequest),
                  responses=responses(None, 400, 401, 404, 408, 413, 415, 500, ok_content=_LORA_OK))
async def unload_lora_adapter(raw: Request) -> Response:
    body = await _json_object(raw)
    if isinstance(body, Response):
        return body
    err = await _serving(raw).models.unload_lora(body.get("lora_name"))
    return err or PlainTextResponse(
        f"Success: LoRA adapter '{body['lora_name']}' removed successfully.")


# --- The OpenAI API -----------------------------------------------------------------------

api_router = APIRouter()
API_BODY_MODELS: tuple[type[BaseModel], ...] = (
    CompletionRequest, ChatCompletionRequest, EmbeddingRequest, TokenizeCompletionRequest,
    TokenizeChatRequest, DetokenizeRequest)


@api_router.post("/v1/completions", openapi_extra=json_body(CompletionRequest),
                 responses=responses(CompletionResponse, 400, 401, 404, 408, 413, 415, 500,
                                     ok_content=SSE_CONTENT))
async def create_completion(raw: Request) -> Response:
    request = await _parse(raw, CompletionRequest)
    if isinstance(request, Response):
        return request
    return await with_cancellation(_serving(raw).completion.create_completion(request), raw)


@api_router.post("/v1/chat/completions", openapi_extra=json_body(ChatCompletionRequest),
                 responses=responses(ChatCompletionResponse, 400, 401, 404, 408, 413, 415, 500,
                                     ok_content=SSE_CONTENT))
async def create_chat_completion(raw: Request) -> Response:
    request = await _parse(raw, ChatCompletionRequest)
    if isinstance(request, Response):
        return request
    return await with_cancellation(_serving(raw).chat.create_chat_completion(request), raw)


@api_router.post("/v1/embeddings", openapi_extra=json_body(EmbeddingRequest),
                 responses=responses(EmbeddingResponse, 400, 401, 404, 408, 413, 415, 500))
async def create_embedding(raw: Request) -> Response:
    request = await _parse(raw, EmbeddingRequest)
    if isinstance(request, Response):
        return request
    return await with_cancellation(_serving(raw).embedding.create_embedding(request), raw)


def _has_messages(body: bytes) -> bool:
    """Whether a /tokenize body is a conversation (rendered by the chat template)."""
    try:
        return "messages" in loads_json(body)
    except (ValueError, TypeError):  # bad JSON (too deep too), not UTF-8, not a container
        return False  # the parse reports the bad body


@api_router.post("/tokenize",
                 openapi_extra=json_body(TokenizeCompletionRequest, TokenizeChatRequest),
                 responses=responses(TokenizeResponse, 400, 401, 404, 408, 413, 415, 500))
async def tokenize(raw: Request) -> Response:
    body = await _body(raw)
    if isinstance(body, Response):
        return body
    is_chat = _has_messages(body)
    request = await _parse(raw, TokenizeChatRequest if is_chat else TokenizeCompletionRequest)
    if isinstance(request, Response):
        return request
    return await _serving(raw).tokenization.tokenize(request)


@api_router.post("/detokenize", openapi_extra=json_body(DetokenizeRequest),
                 responses=responses(DetokenizeResponse, 400, 401, 404, 408, 413, 415, 500))
async def detokenize(raw: Request) -> Response:
    request = await _parse(raw, DetokenizeRequest)
    if isinstance(request, Response):
        return request
    return await _serving(raw).tokenization.detokenize(request)
