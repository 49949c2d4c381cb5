"""Hardening of the HTTP layer (issue 29): chat templates sent with requests, tokenizing and
rendering off the event loop, the API key on every route, the request-body limit, deeply nested
JSON.

Two servers (real uvicorn, in threads of this process) share one engine: `server` is configured
as `pagedlm serve` is by default, plus an API key and runtime LoRA updating; `trusted` renders
request chat templates (--trust-request-chat-template) and takes bodies of at most 1 MiB. Every
hostile request must get a 4xx while /health, probed from another thread, answers within 1 s.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import gc
import json
import socket
import threading
import time
import tracemalloc
from pathlib import Path

import httpx
import psutil
import pytest

from pagedlm import EngineArgs
from pagedlm.engine.async_llm_engine import AsyncLLMEngine
from pagedlm.entrypoints.cli import make_parser
from pagedlm.entrypoints.cli_args import DEFAULT_MAX_REQUEST_BODY_VALUES
from pagedlm.entrypoints.openai.protocol import UsageInfo
from pagedlm.entrypoints.openai.routes import ENGINE_EVENTS_PER_S
from pagedlm.entrypoints.openai.protocol_completion import (CompletionLogProbs,
                                                            CompletionResponse,
                                                            CompletionResponseChoice)
from pagedlm.entrypoints.openai.serving_engine import MAX_PROMPTS, json_in_pieces
from pagedlm.entrypoints.openai.prompt_worker import (MAX_CHARS_PER_TOKEN, RENDER_TIMEOUT_S,
                                                      render_chat)
from pagedlm.entrypoints.openai.tool_parsers import get_tool_parser
from pagedlm.entrypoints.openai.tool_parsers.constrained import (NamedFunctionParser,
                                                                 RequiredToolsParser)
from pagedlm.entrypoints.openai.tool_parsers.streaming import ToolCallStreamer
from tests.server_utils import assert_all_blocks_free, serve_in_thread, wait_until_idle

MODEL = "smollm2-hardening"
API_KEY = "sk-hardening-test"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MAX_MODEL_LEN = 512
MAX_CHARS = MAX_MODEL_LEN * MAX_CHARS_PER_TOKEN
SMALL_BODY_LIMIT = 2**20  # the trusted server's
SMALL_VALUES_LIMIT = 1000  # the trusted server's
DEEP = "[" * 100_000 + "]" * 100_000
USER = [{"role": "user", "content": "Name a colour."}]
# Nested loops writing output: 10^10 copies of the message if nothing stops them.
NESTED_LOOPS = ("{% for i in range(100000) %}{% for j in range(100000) %}"
                "{{ messages[0]['content'] }}{% endfor %}{% endfor %}")
# Nested loops writing nothing: only the render deadline stops them.
SPIN = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
PLAIN = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
HERMES = (Path(__file__).resolve().parents[2] / "examples"
          / "tool_chat_template_hermes_chatml.jinja").read_text()


@pytest.fixture(scope="module")
def engine():
    engine = AsyncLLMEngine.from_engine_args(
        EngineArgs(max_model_len=MAX_MODEL_LEN, num_gpu_blocks_override=64),
        log_stats=False, model_name=MODEL)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def server(engine):
    with serve_in_thread(engine, served_model_names=[MODEL], api_key=API_KEY,
                         enable_runtime_lora_updating=True) as running:
        yield running


@pytest.fixture(scope="module")
def trusted(engine):
    with serve_in_thread(engine, served_model_names=[MODEL], trust_request_chat_template=True,
                         max_request_body_bytes=SMALL_BODY_LIMIT,
                         max_request_body_values=SMALL_VALUES_LIMIT) as running:
        yield running


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def thttp(trusted):
    with httpx.Client(base_url=trusted.url, timeout=120) as client:
        yield client


def _error(r: httpx.Response, status: int, param: str | None = None) -> dict:
    assert r.status_code == status, r.text[:500]
    err = r.json()["error"]
    assert err["code"] == status and err["message"] and err["type"], err
    if param is not None:
        assert err["param"] == param, err
    return err


@contextlib.contextmanager
def health_answers_within_1s(url: str):
    """Probes /health from a thread for as long as the block runs (once before it starts);
    every answer must be a 200 within 1 s."""
    stop, first = threading.Event(), threading.Event()
    latencies: list[float] = []
    failures: list[str] = []

    def probe() -> None:
        with httpx.Client(timeout=30) as client:
            while True:
                t0 = time.monotonic()
                try:
                    status = client.get(url + "/health").status_code
                except httpx.HTTPError as e:
                    status = repr(e)
                latencies.append(time.monotonic() - t0)
                if status != 200:
                    failures.append(str(status))
                first.set()
                if stop.wait(0.02):
                    return

    thread = threading.Thread(target=probe, daemon=True)
    thread.start()
    assert first.wait(30)
    try:
        yield latencies
    finally:
        stop.set()
        thread.join(60)
    assert not failures, failures
    assert max(latencies) < 1.0, f"/health took {max(latencies):.2f} s"


# ---- finding 3: chat templates sent with requests ----

def test_request_chat_template_refused_unless_trusted(server, http):
    for path, body in (("/v1/chat/completions", {"model": MODEL, "messages": USER,
                                                 "max_tokens": 1, "chat_template": PLAIN}),
                       ("/tokenize", {"messages": USER, "chat_template": PLAIN})):
        err = _error(http.post(path, json=body), 400, "chat_template")
        assert "--trust-request-chat-template" in err["message"]
    # Without the field the server's own template renders.
    r = http.post("/tokenize", json={"messages": USER})
    assert r.status_code == 200 and r.json()["count"] > 0


def test_trusted_template_renders(trusted, thttp):
    tok = trusted.engine.get_tokenizer()
    r = thttp.post("/tokenize", json={"messages": USER, "chat_template": PLAIN})
    assert r.status_code == 200, r.text
    assert r.json()["tokens"] == tok.encode("[user] Name a colour.\n", add_special_tokens=False)
    r = thttp.post("/v1/chat/completions", json={"model": MODEL, "messages": USER,
                                                 "max_tokens": 2, "chat_template": PLAIN})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == len(tok.encode("[user] Name a colour.\n"))


def test_trusted_template_output_is_bounded(trusted, thttp):
    with health_answers_within_1s(trusted.url):
        for path, body in (("/v1/chat/completions", {"model": MODEL, "messages": USER,
                                                     "max_tokens": 1,
                                                     "chat_template": NESTED_LOOPS}),
                           ("/tokenize", {"messages": USER, "chat_template": NESTED_LOOPS})):
            t0 = time.monotonic()
            err = _error(thttp.post(path, json=body), 400, "messages")
            assert str(MAX_CHARS) in err["message"] and "max_model_len" in err["message"]
            # cut off after MAX_CHARS characters, not after 10^10 copies
            assert time.monotonic() - t0 < RENDER_TIMEOUT_S


def test_trusted_template_that_loops_without_output_is_stopped(trusted, thttp):
    with health_answers_within_1s(trusted.url) as latencies:
        t0 = time.monotonic()
        err = _error(thttp.post("/tokenize", json={"messages": USER, "chat_template": SPIN}),
                     400, "chat_template")
        took = time.monotonic() - t0
    assert "took longer than" in err["message"]
    assert RENDER_TIMEOUT_S <= took < RENDER_TIMEOUT_S + 10
    assert len(latencies) >= 3  # /health answered again and again while the template ran
    # The worker thread is free again.
    r = thttp.post("/tokenize", json={"prompt": "hello"})
    assert r.status_code == 200 and r.json()["count"] > 0


def test_render_chat_matches_transformers(engine):
    tok = engine.get_tokenizer()
    messages = [{"role": "system", "content": "Be brief."}, *USER,
                {"role": "assistant", "content": "Blue is "}]
    tools = [{"type": "function", "function": {
        "name": "paint", "description": "Paint a wall.",
        "parameters": {"type": "object", "properties": {"colour": {"type": "string"}}}}}]
    for template in (None, HERMES):
        for gen, cont in ((True, False), (False, False), (False, True)):
            for tool_list in (None, tools):
                expected = tok.apply_chat_template(
                    messages, tools=tool_list, chat_template=template, tokenize=False,
                    add_generation_prompt=gen, continue_final_message=cont)
                assert render_chat(tok, messages, chat_template=template, tools=tool_list,
                                   add_generation_prompt=gen, continue_final_message=cont,
                                   max_model_len=MAX_MODEL_LEN) == expected


# ---- finding 5b: prompts are refused by length before they are tokenized ----

def test_huge_prompts_are_refused_without_stalling(server, http):
    huge = "hello world " * 700_000  # 8.4 MB: took the event loop 6.6 s to tokenize
    with health_answers_within_1s(server.url):
        for path, body, param in (
                ("/v1/completions", {"model": MODEL, "prompt": huge, "max_tokens": 1},
                 "prompt"),
                ("/v1/completions", {"model": MODEL, "prompt": ["hi", huge], "max_tokens": 1},
                 "prompt.1"),
                ("/tokenize", {"prompt": huge}, "prompt"),
                ("/v1/chat/completions", {"model": MODEL, "max_tokens": 1,
                                          "messages": [{"role": "user", "content": huge}]},
                 "messages"),
                ("/tokenize", {"messages": [{"role": "user", "content": huge}]}, "messages")):
            err = _error(http.post(path, json=body), 400, param)
            assert str(MAX_CHARS) in err["message"], err


def test_prompt_length_limit_is_exact(http):
    # At the limit the prompt is tokenized (and is then too many tokens for the engine);
    # one character more is refused untokenized.
    at_limit = _error(http.post("/v1/completions", json={
        "model": MODEL, "prompt": "a b " * (MAX_CHARS // 4), "max_tokens": 1}), 400)
    assert "tokens" in at_limit["message"] and "characters" not in at_limit["message"]
    over = _error(http.post("/v1/completions", json={
        "model": MODEL, "prompt": "a b " * (MAX_CHARS // 4) + "c", "max_tokens": 1}),
        400, "prompt")
    assert f"{MAX_CHARS + 1} characters" in over["message"]


def test_huge_embedding_input_is_refused():
    engine = AsyncLLMEngine.from_engine_args(
        EngineArgs(runner="pooling", max_model_len=MAX_MODEL_LEN, num_gpu_blocks_override=16),
        log_stats=False, model_name=MODEL)
    try:
        with serve_in_thread(engine, served_model_names=[MODEL]) as pooled:
            with health_answers_within_1s(pooled.url):
                r = httpx.post(pooled.url + "/v1/embeddings", timeout=60,
                               json={"model": MODEL, "input": "hello world " * 700_000})
            assert str(MAX_CHARS) in _error(r, 400, "input")["message"]
            ok = httpx.post(pooled.url + "/v1/embeddings", timeout=60,
                            json={"model": MODEL, "input": "hello"})
            assert ok.status_code == 200 and len(ok.json()["data"]) == 1
            wait_until_idle(engine)
            assert_all_blocks_free(engine)
    finally:
        engine.shutdown()


# ---- finding 4: the API key covers every route but /health and the page ----

KEYED_ROUTES = [
    ("GET", "/v1/models", None), ("GET", "/metrics", None), ("GET", "/version", None),
    ("GET", "/openapi.json", None), ("GET", "/docs", None), ("GET", "/redoc", None),
    ("POST", "/tokenize", {"prompt": "hi"}), ("POST", "/detokenize", {"tokens": [1, 2]}),
    ("POST", "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 1}),
    ("POST", "/v1/chat/completions", {"model": MODEL, "messages": USER, "max_tokens": 1}),
    ("POST", "/v1/unload_lora_adapter", {"lora_name": "none"}),
]


@pytest.mark.parametrize("method, path, body", KEYED_ROUTES)
def test_api_key_on_every_route(server, method, path, body):
    for headers, message in (({}, "Missing API key"),
                             ({"Authorization": "Bearer wrong"}, "Incorrect API key")):
        r = httpx.request(method, server.url + path, json=body, headers=headers, timeout=60)
        assert message in _error(r, 401)["message"]
        assert r.headers["www-authenticate"] == "Bearer"
    r = httpx.request(method, server.url + path, json=body, headers=AUTH, timeout=60)
    # /v1/unload_lora_adapter of an unknown adapter: past the key, the route's own 404
    assert r.status_code == (404 if "unload" in path else 200), r.text[:300]


def test_the_key_scheme_is_case_insensitive(server):
    """RFC 9110: the scheme ("bearer", "BEARER") is case-insensitive; the key is not."""
    url = server.url + "/v1/models"
    for value in (f"bearer {API_KEY}", f"BEARER  {API_KEY}", f"Bearer {API_KEY}"):
        assert httpx.get(url, headers={"Authorization": value}).status_code == 200, value
    for value in (f"Bearer {API_KEY.upper()}", f"Basic {API_KEY}", API_KEY, f"Bearer{API_KEY}"):
        assert httpx.get(url, headers={"Authorization": value}).status_code == 401, value


def test_engine_events_needs_the_key(server):
    assert httpx.get(server.url + "/engine/events").status_code == 401
    with httpx.stream("GET", server.url + "/engine/events", headers=AUTH, timeout=30) as r:
        assert r.status_code == 200
        assert next(r.iter_lines()).startswith("data: ")


def test_engine_events_streams_are_capped(server):
    """At most 32 engine view streams at once (each may hold a large view's event in its
    socket's buffers: 1000 unread subscribers took 815 MB); the next is a 503, and a closed
    one frees its place."""
    url = server.url + "/engine/events"
    with contextlib.ExitStack() as stack:
        client = stack.enter_context(httpx.Client(headers=AUTH, timeout=30))
        streams = [stack.enter_context(client.stream("GET", url)) for _ in range(32)]
        assert all(s.status_code == 200 for s in streams)
        r = client.get(url)
        assert r.status_code == 503, r.text[:200]
        assert "32 engine view streams are open" in r.json()["error"]["message"]
    with httpx.stream("GET", url, headers=AUTH, timeout=30) as r:
        assert r.status_code == 200


def test_engine_events_take_one_view_a_tick_for_all_pages(server, engine):
    """Each subscriber had its own view taken on the engine thread four times a second: 200
    open pages slowed 4 completions from 2.1 to 5.1 s. They now share one a tick."""
    taken = 0
    real = engine.engine_view

    async def counted():
        nonlocal taken
        taken += 1
        return await real()

    def subscribe(_) -> list[str]:
        with httpx.stream("GET", server.url + "/engine/events", headers=AUTH, timeout=30) as r:
            assert r.status_code == 200
            lines = (line for line in r.iter_lines() if line.startswith("data: {"))
            return [next(lines) for _ in range(4)]

    engine.engine_view = counted  # counts the calls to the real one
    try:
        start = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(20) as pool:
            events = [e for got in pool.map(subscribe, range(20)) for e in got]
        elapsed = time.monotonic() - start
    finally:
        del engine.engine_view
    assert len(events) == 80 and all('"block_map"' in e for e in events)
    # A rate bound, not a timing: a view is taken only once the last is 1/ENGINE_EVENTS_PER_S
    # old and none is being taken, so at most one a tick (plus the first) however slow the
    # machine; taken per subscriber, as before, it was 80.
    assert 1 <= taken <= elapsed * ENGINE_EVENTS_PER_S + 2, (taken, elapsed)


def test_health_and_page_are_open(server):
    assert httpx.get(server.url + "/health").status_code == 200
    page = httpx.get(server.url + "/")
    assert page.status_code == 200 and "<html" in page.text.lower()
    assert httpx.get(server.url + "/static/app.js").status_code == 200
    # a CORS preflight carries no credentials: it must pass
    r = httpx.options(server.url + "/v1/chat/completions", headers={
        "Origin": "http://example.com", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"]


# ---- finding 6: the request-body limit ----

def _raw_request(url: str, head: str) -> tuple[int, dict]:
    """Sends only a request's head and reads the response: a server answering has not waited
    for the body."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(head.encode())
        data = b""
        while b"\r\n\r\n" not in data or not data.rstrip().endswith(b"}"):
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    status = int(data.split(b" ", 2)[1])
    return status, json.loads(data.split(b"\r\n\r\n", 1)[1])


def test_declared_body_over_the_default_limit_is_413_before_it_is_sent(server):
    status, body = _raw_request(server.url, (
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer {API_KEY}\r\nContent-Length: {32 * 2**20 + 1}\r\n\r\n"))
    assert status == 413
    assert body["error"]["type"] == "RequestEntityTooLargeError"
    assert str(32 * 2**20) in body["error"]["message"]


def _chunks(total: int, size: int = 2**20):
    piece = b" " * size  # JSON whitespace: the body would parse if it were read whole
    yield b'{"prompt": "x"'
    for _ in range(total // size):
        yield piece
    yield b"}"


@pytest.mark.parametrize("declared", [True, False], ids=["content-length", "chunked"])
def test_large_body_is_413_without_buffering(trusted, declared):
    total = 128 * 2**20
    headers = {"Content-Type": "application/json"}
    if declared:
        headers["Content-Length"] = str(sum(len(c) for c in _chunks(total)))
    gc.collect()
    rss_before = psutil.Process().memory_info().rss
    # RSS does not come back down once memory is freed, so a body buffered by an earlier test
    # would hide this one's; tracemalloc's peak (all threads: the server's too) does not.
    tracemalloc.start()
    try:
        with health_answers_within_1s(trusted.url):
            r = httpx.post(trusted.url + "/tokenize", content=_chunks(total), headers=headers,
                           timeout=120)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    gc.collect()
    grown = psutil.Process().memory_info().rss - rss_before
    err = _error(r, 413)
    assert err["type"] == "RequestEntityTooLargeError" and str(SMALL_BODY_LIMIT) in err["message"]
    # Buffered whole, the body would take 128 MiB, and 256 MiB at the peak (chunks, then
    # joined): measured without the limit. With it, at most the limit is held.
    assert peak < 16 * 2**20, f"peak Python allocations {peak / 2**20:.0f} MiB"
    assert grown < 48 * 2**20, f"RSS grew by {grown / 2**20:.0f} MiB"


def test_body_under_the_limit_is_read(trusted, thttp):
    body = b'{"prompt": "hello"' + b" " * (SMALL_BODY_LIMIT - 100) + b"}"
    r = thttp.post("/tokenize", content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == 200 and r.json()["count"] > 0


def test_detokenize_takes_as_many_ids_as_the_longest_text(http):
    ok = http.post("/detokenize", json={"tokens": [5] * MAX_CHARS})
    assert ok.status_code == 200 and ok.json()["prompt"], ok.text[:300]
    err = _error(http.post("/detokenize", json={"tokens": [5] * (MAX_CHARS + 1)}), 400, "tokens")
    assert str(MAX_CHARS) in err["message"], err


def test_bodies_with_more_values_than_the_limit_are_413_before_parsing(server, http, trusted):
    limit = DEFAULT_MAX_REQUEST_BODY_VALUES
    over = b'{"max_tokens": 1, "prompt": [' + b",".join([b"5"] * (limit + 1)) + b"]}"
    for path in ("/v1/completions", "/tokenize", "/detokenize", "/v1/load_lora_adapter"):
        err = _error(http.post(path, content=over,
                               headers={"Content-Type": "application/json"}), 413)
        assert str(limit) in err["message"] and "--max-request-body-values" in err["message"]
    over_small = b'{"prompt": [' + b",".join([b"5"] * (SMALL_VALUES_LIMIT + 1)) + b"]}"
    err = _error(httpx.post(trusted.url + "/tokenize", content=over_small,
                            headers={"Content-Type": "application/json"}), 413)
    assert str(SMALL_VALUES_LIMIT) in err["message"], err
    # At the limit the body is parsed (and the prompt is then too long for the model).
    at = b'{"max_tokens": 1, "prompt": [' + b",".join([b"5"] * (limit - 1)) + b"]}"
    err = _error(http.post("/v1/completions", content=at,
                           headers={"Content-Type": "application/json"}), 400, "prompt")
    assert f"{limit - 1} tokens" in err["message"], err


def test_a_list_of_prompts_starts_in_one_step(server, http, engine):
    wait_until_idle(engine)
    steps = engine.engine.stats.num_steps
    n = 24
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": [[5, 6]] * n,
                                           "max_tokens": 1, "temperature": 0})
    assert r.status_code == 200 and len(r.json()["choices"]) == n, r.text[:300]
    # One after another each prompt took a step of its own to be added: n steps at least.
    assert engine.engine.stats.num_steps - steps < n // 2
    err = _error(http.post("/v1/completions", json={
        "model": MODEL, "prompt": [[5]] * (MAX_PROMPTS + 1), "max_tokens": 1}), 400, "prompt")
    assert str(MAX_PROMPTS) in err["message"], err
    err = _error(http.post("/v1/completions", json={
        "model": MODEL, "prompt": [[5]] * 64, "n": 64, "max_tokens": 1}), 400, "n")
    assert "4096 sequences" in err["message"] and str(MAX_PROMPTS) in err["message"], err
    # One bad prompt among many: a 400 naming it, and every other one aborted.
    bad = [[5, 6]] * 8 + [[10**9]] + [[5, 6]] * 8
    _error(http.post("/v1/completions", json={"model": MODEL, "prompt": bad, "max_tokens": 4}),
           400, "prompt")
    wait_until_idle(engine)
    assert_all_blocks_free(engine)


def test_chat_messages_are_checked_alike_by_chat_and_tokenize(http):
    bad_args = [*USER, {"role": "assistant", "tool_calls": [
        {"id": "a", "type": "function", "function": {"name": "f", "arguments": "nope"}}]}]
    no_text = [*USER, {"role": "user", "content": [{"type": "text", "text": "a"},
                                                   {"type": "text"}]}]
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    for messages, param, words in ((bad_args, "messages.1.tool_calls.0.function.arguments",
                                    "JSON object"),
                                   (no_text, "messages.1.content.1", "needs its 'text'"),
                                   (image, "messages.0.content.0", "'image_url'")):
        for path, extra in (("/v1/chat/completions", {"model": MODEL, "max_tokens": 1}),
                            ("/tokenize", {})):
            err = _error(http.post(path, json={**extra, "messages": messages}), 400, param)
            assert words in err["message"], (path, err)


def test_unknown_fields_are_logged_in_one_short_line(server, http, caplog):
    fields = ",".join(f'"field{i}": 1' for i in range(100_000))
    body = ('{"model": "%s", "prompt": "hi", "max_tokens": 1, %s}' % (MODEL, fields)).encode()
    with caplog.at_level("INFO", logger="pagedlm.entrypoints.openai.routes"):
        r = http.post("/v1/completions", content=body,
                      headers={"Content-Type": "application/json"})
    assert r.status_code == 200, r.text[:300]
    lines = [rec.getMessage() for rec in caplog.records if "unknown request field" in
             rec.getMessage()]
    assert len(lines) == 1 and "100000 unknown" in lines[0] and "'field0'" in lines[0], lines
    assert len(lines[0]) < 500, len(lines[0])


def test_body_cut_off_mid_upload_is_not_a_server_error(server, caplog):
    host, port = server.url.removeprefix("http://").split(":")
    with caplog.at_level("ERROR"):
        with socket.create_connection((host, int(port)), timeout=30) as sock:
            sock.sendall((
                "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                f"\r\nAuthorization: Bearer {API_KEY}\r\nContent-Length: 1000\r\n\r\n"
                '{"prompt": ').encode())
            sock.shutdown(socket.SHUT_WR)  # the client is gone before the body's end
            data = b""
            while chunk := sock.recv(65536):
                data += chunk
        # Whatever reaches a client that left is not a 500, and nothing is logged as an error
        # (it was the catch-all's traceback, then uvicorn's, for every such connection).
        assert not data.startswith(b"HTTP/1.1 500"), data[:300]
        time.sleep(0.5)
    assert not [r for r in caplog.records if r.name.startswith("pagedlm")], caplog.text[:2000]


# ---- finding 7: deeply nested JSON is a 400 on every route ----

def _deep_arguments_chat() -> dict:
    return {"model": MODEL, "max_tokens": 1, "messages": [
        *USER, {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "paint", "arguments": '{"a": ' + DEEP + "}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "done"}]}


def test_long_answers_are_serialised_with_the_loop_let_in():
    """A 34 MB answer (1024 echoed prompts with 20 logprobs each) was one json.dumps on the
    event loop, holding every other client for 1.9-2.7 s; it is written a choice at a time.
    The text must be the same JSON, whatever the other fields hold."""
    choices = [CompletionResponseChoice(
        index=i, text=f"é\"{i}\"\u2028", finish_reason="stop",
        logprobs=CompletionLogProbs(tokens=["a", "\U0001F600"], token_logprobs=[None, -0.5],
                                    text_offset=[0, 1], top_logprobs=[None, {"b": -1.0}]),
        prompt_logprobs=[None, {7: {"logprob": -2.0, "rank": 1, "decoded_token": "x"}}])
        for i in range(50)]
    response = CompletionResponse(id="cmpl-1", model='m "choices":[] ü', choices=choices,
                                  usage=UsageInfo(prompt_tokens=1, completion_tokens=2,
                                                  total_tokens=3))
    ticks = 0

    async def other_client():
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0)

    async def serialise():
        ticker = asyncio.ensure_future(other_client())
        await asyncio.sleep(0)
        try:
            return await json_in_pieces(response.model_copy(update={"choices": []}), "choices",
                                        iter(choices))
        finally:
            ticker.cancel()

    answer = asyncio.run(serialise())
    assert ticks >= len(choices)
    assert answer.media_type == "application/json"
    assert json.loads(answer.body) == json.loads(response.model_dump_json())
    assert list(json.loads(answer.body)) == list(type(response).model_fields)


def test_deep_json_is_400(server, http):
    deep_chat = _deep_arguments_chat()
    cases = [
        ("/tokenize", DEEP, None), ("/tokenize", '{"prompt": ' + DEEP + "}", None),
        ("/detokenize", DEEP, None), ("/detokenize", '{"tokens": ' + DEEP + "}", None),
        ("/v1/load_lora_adapter", DEEP, None),
        ("/v1/load_lora_adapter", '{"lora_name": "a", "lora_path": ' + DEEP + "}", None),
        ("/v1/unload_lora_adapter", DEEP, None),
        ("/v1/completions", '{"prompt": ' + DEEP + "}", None),
        ("/v1/chat/completions", DEEP, None),
        ("/v1/chat/completions", json.dumps(deep_chat),
         "messages.1.tool_calls.0.function.arguments"),
        ("/tokenize", json.dumps({"messages": deep_chat["messages"]}),
         "messages.1.tool_calls.0.function.arguments"),
    ]
    with health_answers_within_1s(server.url):
        for path, body, param in cases:
            r = http.post(path, content=body, headers={"Content-Type": "application/json"})
            err = _error(r, 400, param)
            assert "Internal" not in err["message"], (path, err)


@pytest.mark.parametrize("make_parser, text", [
    (lambda: get_tool_parser("hermes")(),
     '<tool_call>{"name": "f", "arguments": {"a": ' + DEEP + "}}</tool_call>"),
    (lambda: get_tool_parser("hermes")(),
     '<tool_call>{"arguments": {"a": ' + DEEP + '}, "name": "f"}</tool_call>'),
    (lambda: get_tool_parser("llama3_json")(), '{"name": "f", "parameters": ' + DEEP + "}"),
    (lambda: get_tool_parser("llama3_json")(), '{"parameters": ' + DEEP + ', "name": "f"}'),
    (lambda: get_tool_parser("pythonic")(), "[f(a=" + DEEP + ")]"),
    (lambda: get_tool_parser("pythonic")(), "[f(a=" + "-" * 100_000 + "1)]"),
    (lambda: NamedFunctionParser("f"), '{"a": ' + DEEP + "}"),
    (lambda: RequiredToolsParser(), '[{"name": "f", "parameters": {"a": ' + DEEP + "}}]"),
], ids=["hermes", "hermes-args-first", "llama3", "llama3-args-first", "pythonic",
        "pythonic-unary", "named", "required"])
def test_tool_parsers_survive_deep_nesting(make_parser, text):
    """A model can write such text (within max_tokens): the call is invalid, not a 500."""
    extracted = make_parser().extract_tool_calls(text)
    assert not extracted.tools_called and extracted.content == text
    streamer = ToolCallStreamer(make_parser())
    for i in range(0, len(text), len(text) // 7 + 1):
        streamer.feed(text[i:i + len(text) // 7 + 1], final=False)
    streamer.feed("", final=True)


# ---- flags, and the server still serves ----

def test_flags():
    serve = make_parser().parse_args(["serve"])
    assert serve.trust_request_chat_template is False
    assert serve.max_request_body_bytes == 32 * 2**20
    assert serve.max_request_body_values == DEFAULT_MAX_REQUEST_BODY_VALUES
    ns = make_parser().parse_args(["serve", "--trust-request-chat-template",
                                   "--max-request-body-bytes", "64MiB",
                                   "--max-request-body-values", "1000"])
    assert ns.trust_request_chat_template and ns.max_request_body_bytes == 64 * 2**20
    assert ns.max_request_body_values == 1000


def test_still_serves_and_every_block_is_free(server, http, trusted, engine):
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "The sky is",
                                           "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": USER,
                                                "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] is not None
    wait_until_idle(engine)
    assert_all_blocks_free(engine)


def test_a_500_says_the_connection_closes(engine, monkeypatch):
    """An unexpected error is a 500, after which uvicorn closes the connection: the answer
    says so, so that a keep-alive client does not send its next request into a reset."""
    from pagedlm.entrypoints.openai.serving_tokenization import OpenAIServingTokenization

    async def broken(self, request):
        raise RuntimeError("a bug")

    monkeypatch.setattr(OpenAIServingTokenization, "detokenize", broken)
    with serve_in_thread(engine) as running:
        port = int(running.url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            body = b'{"tokens": [1, 2]}'
            s.sendall(b"POST /detokenize HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                      b"\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
            data = b""
            while chunk := s.recv(65536):
                data += chunk
    head = data.split(b"\r\n\r\n", 1)[0].lower()
    assert head.startswith(b"http/1.1 500"), data[:300]
    assert b"\r\nconnection: close" in head, head
    assert b"a bug" in data


# ---- bodies of many invalid values ----

N_BAD = 400_000  # under the default --max-request-body-values (2^19)


@pytest.mark.parametrize("path,body,param", [
    ("/detokenize", {"tokens": [-1] * N_BAD}, "tokens.0"),
    ("/v1/completions", {"model": MODEL, "prompt": [-1] * N_BAD}, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": [[1, 2]] * 100_000 + [[-5]]}, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": "Hi", "stop": [None] * N_BAD}, "stop"),
    ("/v1/completions", {"model": MODEL, "prompt": "Hi",
                         "logit_bias": {str(i): "x" for i in range(N_BAD // 2)}},
     "logit_bias.0"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [None] * N_BAD}, "messages.0"),
], ids=["detokenize", "prompt ids", "prompt lists", "stop", "logit_bias", "messages"])
def test_many_invalid_values_get_a_short_400_at_once(server, http, path, body, param):
    """A body of hundreds of thousands of bad values: pydantic reported each of them (three
    times over a prompt's union of lists), which held the event loop 4-15 s and answered a
    33-67 MB 400. Each list now stops at its first bad item and the answer names at most a
    few fields."""
    with health_answers_within_1s(server.url):
        r = http.post(path, content=json.dumps(body),
                      headers={"content-type": "application/json"})
    err = _error(r, 400, param)
    assert len(r.content) < 2000, len(r.content)
    assert err["message"].startswith(param.split(".")[0]), err
