"""The OpenAI-compatible HTTP server: a FastAPI app over an AsyncLLMEngine, run by uvicorn.

Routes (in routes.py): POST /v1/completions, POST /v1/chat/completions, POST /v1/embeddings
(with --runner pooling), POST /tokenize, POST /detokenize, GET /v1/models, GET /health,
GET /metrics (Prometheus), GET /version; with runtime LoRA updating
(--enable-runtime-lora-updating or VLLM_ALLOW_RUNTIME_LORA_UPDATING=true),
POST /v1/load_lora_adapter and /v1/unload_lora_adapter. With an API key, every route but
/health and the page needs `Authorization: Bearer KEY`. A body over --max-request-body-bytes is a
413. Errors are OpenAI's JSON: {"error": {"message", "type", "param", "code"}}.
GET / is a web page (static files in ./static): a chat with the served model and a live engine
view fed by GET /engine/events (server-sent events; it needs the API key like /v1/*).

    pagedlm serve [MODEL] --port 8000      (see pagedlm/entrypoints/cli.py)
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import hmac
import logging
import signal
import threading

import uvicorn
from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from fastapi.staticfiles import StaticFiles
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

import pagedlm
from pagedlm import envs
from pagedlm.engine.async_llm_engine import AsyncLLMEngine
from pagedlm.entrypoints.cli_args import (DEFAULT_MAX_REQUEST_BODY_BYTES,
                                           DEFAULT_MAX_REQUEST_BODY_VALUES,
                                           DEFAULT_REQUEST_READ_TIMEOUT_S)
from pagedlm.entrypoints.openai.openapi import install_openapi
from pagedlm.entrypoints.openai.prompt_worker import PromptWorker
from pagedlm.entrypoints.openai.engine_events import EngineEvents
from pagedlm.entrypoints.openai.request_reading import RequestBodyMiddleware, http_protocol
from pagedlm.entrypoints.openai.routes import (API_BODY_MODELS, ENGINE_EVENTS_PER_S,
                                               LORA_BODY_MODELS, STATIC_DIR, ServingState,
                                               api_router, lora_router, server_router)
from pagedlm.entrypoints.openai.serving_chat import OpenAIServingChat
from pagedlm.entrypoints.openai.serving_completion import OpenAIServingCompletion
from pagedlm.entrypoints.openai.serving_embedding import OpenAIServingEmbedding
from pagedlm.entrypoints.openai.serving_engine import error_body, error_response
from pagedlm.entrypoints.openai.serving_models import LoRAModulePath, OpenAIServingModels
from pagedlm.entrypoints.openai.serving_tokenization import OpenAIServingTokenization
from pagedlm.entrypoints.openai.server_start import ServerStart, start_server
from pagedlm.entrypoints.openai.tool_parsers import TOOL_PARSERS, get_tool_parser

logger = logging.getLogger(__name__)


# Open with an API key: the load balancer's probe, and the page, which then asks for the key.
OPEN_PATHS = ("/health", "/")
OPEN_PREFIXES = ("/static/",)


class APIKeyMiddleware:
    """Pure ASGI (streaming and disconnects pass through untouched): every route needs the key
    but /health and the page (/, /static/*); tokenizer routes, metrics (which name the loaded
    adapters), the version and the API documents included. CORS preflights (OPTIONS) pass: a
    browser sends them without credentials. The page reads /engine/events with fetch() and
    this header rather than with EventSource (which cannot send headers): a key in the query
    string would end up in access logs and browser history."""

    def __init__(self, app, api_key: str) -> None:
        self.app = app
        self.expected = api_key.encode()

    async def __call__(self, scope, receive, send) -> None:
        path = scope.get("path", "")
        if (scope["type"] != "http" or scope.get("method") == "OPTIONS"
                or path in OPEN_PATHS or path.startswith(OPEN_PREFIXES)):
            return await self.app(scope, receive, send)
        given = Headers(scope=scope).get("authorization", "")
        # The scheme's case is the client's (RFC 9110: case-insensitive), the key's is not.
        scheme, _, key = given.strip().partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(key.strip().encode(),
                                                                 self.expected):
            message = ("Missing API key: send it as 'Authorization: Bearer KEY'." if not given
                       else "Incorrect API key provided.")
            response = JSONResponse(error_body(message, 401), status_code=401,
                                    headers={"WWW-Authenticate": "Bearer"})
            return await response(scope, receive, send)
        return await self.app(scope, receive, send)


# How often the server looks at its engine, and how long responses still open when the engine
# failed get to finish (they have their error already) before the server closes them.
ENGINE_WATCH_INTERVAL_S = 0.5
ENGINE_FAILED_GRACE_S = 3.0


@contextlib.asynccontextmanager
async def stop_server_when_engine_fails(app: FastAPI, engine: AsyncLLMEngine):
    """vLLM's terminate_if_errored: an engine that failed (a step raised, a worker died) never
    runs again, so the uvicorn.Server in app.state.server is asked to stop, and run_server
    then exits non-zero for a supervisor to restart it. Without app.state.server nothing is
    stopped (/health answers 503 meanwhile)."""
    async def watch() -> None:
        while not engine.errored:
            await asyncio.sleep(ENGINE_WATCH_INTERVAL_S)
        server = getattr(app.state, "server", None)
        if server is None:
            return
        logger.error("the engine failed (its error is logged above): stopping the server")
        server.should_exit = True
        await asyncio.sleep(ENGINE_FAILED_GRACE_S)
        server.force_exit = True  # e.g. a client that stopped reading its stream

    task = asyncio.create_task(watch())
    try:
        yield
    finally:
        task.cancel()


def build_app(engine: AsyncLLMEngine, *, served_model_names: list[str] | None = None,
              api_key: str | None = None, allowed_origins: list[str] | None = None,
              allowed_methods: list[str] | None = None,
              allowed_headers: list[str] | None = None,
              allow_credentials: bool = False,
              lora_modules: list[LoRAModulePath] | None = None,
              enable_runtime_lora_updating: bool | None = None,
              chat_template: str | None = None, enable_auto_tool_choice: bool = False,
              tool_call_parser: str | None = None, trust_request_chat_template: bool = False,
              max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES,
              max_request_body_values: int = DEFAULT_MAX_REQUEST_BODY_VALUES,
              request_read_timeout: float = DEFAULT_REQUEST_READ_TIMEOUT_S) -> FastAPI:
    """The FastAPI app serving `engine`. The caller owns the engine (and shuts it down).
    lora_modules are loaded at start-up (an invalid one stops it). Runtime LoRA updating:
    None reads VLLM_ALLOW_RUNTIME_LORA_UPDATING. chat_template replaces the tokenizer's;
    tool_choice "auto" needs enable_auto_tool_choice and a tool_call_parser name. A request's
    own chat_template is refused (400) unless trust_request_chat_template. A body over
    max_request_body_bytes, or holding more than max_request_body_values JSON values, is a
    413; one that pauses for longer than request_read_timeout seconds, a 408 (run_server
    bounds the headers' time too: request_reading.py)."""
    if enable_auto_tool_choice and tool_call_parser is None:
        raise ValueError("enable_auto_tool_choice needs a tool_call_parser (one of "
                         f"{', '.join(sorted(TOOL_PARSERS))}).")
    auto_parser = get_tool_parser(tool_call_parser) if tool_call_parser is not None else None
    names = served_model_names or [engine.model_config.model or "default"]
    models = OpenAIServingModels(engine, names, lora_modules)
    if enable_runtime_lora_updating is None:
        enable_runtime_lora_updating = envs.VLLM_ALLOW_RUNTIME_LORA_UPDATING

    prompts = PromptWorker(engine.get_tokenizer(), engine.model_config.max_model_len)

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        try:
            await models.init_static_loras()
            async with stop_server_when_engine_fails(_app, engine):
                yield
        finally:
            prompts.shutdown()

    app = FastAPI(title="pagedlm OpenAI-compatible server", version=pagedlm.__version__,
                  lifespan=lifespan)
    shared = dict(prompts=prompts, trust_request_chat_template=trust_request_chat_template)
    app.state.serving = ServingState(
        engine=engine, models=models, max_body_values=max_request_body_values,
        completion=OpenAIServingCompletion(engine, names, models, **shared),
        chat=OpenAIServingChat(engine, names, models, chat_template=chat_template,
                               tool_parser=auto_parser if enable_auto_tool_choice else None,
                               **shared),
        embedding=OpenAIServingEmbedding(engine, names, models, **shared),
        tokenization=OpenAIServingTokenization(engine, names, models,
                                               chat_template=chat_template, **shared),
        engine_events=EngineEvents(engine, max_age_s=1 / ENGINE_EVENTS_PER_S))

    @app.exception_handler(StarletteHTTPException)
    async def http_exception(_, exc: StarletteHTTPException):
        return error_response(str(exc.detail), exc.status_code)

    @app.exception_handler(ClientDisconnect)
    async def client_gone(_, exc: ClientDisconnect):
        # The client left while its body was still arriving: nobody reads an answer, and it
        # is not the server's error (the catch-all below would log two tracebacks for it).
        logger.debug("client disconnected before its request body was read")
        return Response(status_code=499)

    @app.exception_handler(Exception)
    async def unhandled(_, exc: Exception):
        logger.exception("unhandled error: %r", exc)
        response = error_response(f"Internal server error: {exc!r}", 500)
        # Starlette re-raises after this answer and uvicorn then closes the connection: say
        # so, or a keep-alive client sends its next request into a reset.
        response.headers["Connection"] = "close"
        return response

    app.include_router(server_router)
    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")
    # The request bodies the OpenAPI document shows: those of the routes this app serves.
    body_models = list(API_BODY_MODELS)
    if enable_runtime_lora_updating:
        app.include_router(lora_router)
        body_models[:0] = LORA_BODY_MODELS
    app.include_router(api_router)
    install_openapi(app, body_models)
    app.add_middleware(RequestBodyMiddleware, max_bytes=max_request_body_bytes,
                       timeout_s=request_read_timeout)
    if api_key:  # outside the size limit: a request without the key is not read at all
        app.add_middleware(APIKeyMiddleware, api_key=api_key)
    # Added last, so outermost: error responses (a 401 too) carry the CORS headers.
    # An empty list allows none (it allowed every origin); only None means the default.
    app.add_middleware(CORSMiddleware,
                       allow_origins=["*"] if allowed_origins is None else allowed_origins,
                       allow_credentials=allow_credentials,
                       allow_methods=["*"] if allowed_methods is None else allowed_methods,
                       allow_headers=["*"] if allowed_headers is None else allowed_headers)
    return app


class _Terminated(Exception):
    """SIGTERM, raised by uvicorn again after its graceful shutdown."""


def _raise_terminated(signum: int, frame) -> None:
    raise _Terminated


def run_server(args: argparse.Namespace, start: ServerStart | None = None) -> None:
    """`pagedlm serve`: build the engine from the flags (or take the one `start` is building),
    serve until interrupted. If the engine fails (a step raised, a worker died), the server
    stops and this exits with status 1."""
    if start is None:
        start = start_server(args)
    engine, names, sock = start.engine, start.served_model_names, start.sock
    try:
        engine.wait_built()
    except BaseException:
        start.close()
        raise
    try:
        app = build_app(engine, served_model_names=names, api_key=args.api_key,
                        allowed_origins=args.allowed_origins,
                        allowed_methods=args.allowed_methods,
                        allowed_headers=args.allowed_headers,
                        allow_credentials=args.allow_credentials,
                        lora_modules=args.lora_modules,
                        enable_runtime_lora_updating=args.enable_runtime_lora_updating or None,
                        chat_template=args.chat_template,
                        enable_auto_tool_choice=args.enable_auto_tool_choice,
                        tool_call_parser=args.tool_call_parser,
                        trust_request_chat_template=args.trust_request_chat_template,
                        max_request_body_bytes=args.max_request_body_bytes,
                        max_request_body_values=args.max_request_body_values,
                        request_read_timeout=args.request_read_timeout)
        config = uvicorn.Config(app, host=args.host, port=args.port,
                                log_level=args.uvicorn_log_level,
                                timeout_keep_alive=args.timeout_keep_alive,
                                timeout_graceful_shutdown=args.timeout_graceful_shutdown,
                                http=http_protocol(args.request_read_timeout))
        host, port = sock.getsockname()[:2]
        logger.info("serving %s on http://%s:%d (OpenAI API under /v1)", ", ".join(names),
                    host, port)
        server = uvicorn.Server(config)
        app.state.server = server  # stop_server_when_engine_fails stops it
        # cli.main kept the cyclic collector off through the start. What the start built (the
        # modules, the engine, the app) lives as long as the server: frozen, a full collection
        # walks only what serving allocates. Freezing without collecting first keeps the
        # start's garbage for good, 1.1 MB of small objects (functions, argparse's actions, no
        # tensors: 1B Q4_K_M and bf16 starts); a collection would cost 0.17 s of the start.
        gc.freeze()
        gc.enable()
        # uvicorn raises the signal it caught again once its shutdown is done, under the
        # handler it found. SIGINT's raises KeyboardInterrupt; SIGTERM's default killed the
        # process there (-15), before the engine's shutdown below: no trace file written (its
        # temporary file left), Ray's processes left to outlive us by 30-40 s.
        main = threading.current_thread() is threading.main_thread()
        previous = signal.signal(signal.SIGTERM, _raise_terminated) if main else None
        # A closed terminal's SIGHUP killed the server at once by its default action: streams
        # cut without their end, no engine shutdown. It now stops the server as SIGTERM does;
        # under nohup (SIGHUP ignored) it stays ignored.
        hangup = signal.getsignal(signal.SIGHUP) if main else None
        if hangup == signal.SIG_DFL:
            signal.signal(signal.SIGHUP, lambda _s, frame: server.handle_exit(signal.SIGTERM,
                                                                               frame))
        try:
            server.run(sockets=[sock])
        except (KeyboardInterrupt, _Terminated):
            pass  # a server stopped with Ctrl-C, SIGTERM or SIGHUP stopped cleanly (0), unlike
            # a start cut short (130)
        finally:
            if main:
                signal.signal(signal.SIGTERM, previous)
                signal.signal(signal.SIGHUP, hangup)
    finally:
        engine.shutdown()
        sock.close()
    if engine.errored:
        # The interpreter's last garbage collection walks the whole heap (seconds on a busy
        # machine); a supervisor waiting to restart us gains nothing from it.
        gc.freeze()
        raise SystemExit("error: the engine failed (its error is logged above); exiting")
