"""Slow clients (--request-read-timeout, request_reading.py): a connection that does not deliver a
request's headers in time is closed, a body that pauses too long is a 408, and neither a slow
but steady body nor a long answer is cut. Over real sockets to a real uvicorn server."""
from __future__ import annotations

import json
import logging
import socket
import threading
import time

import httpx
import pytest

from pagedlm import EngineArgs
from pagedlm.engine.async_llm_engine import AsyncLLMEngine
from pagedlm.entrypoints.cli import make_parser
from tests.server_utils import assert_all_blocks_free, serve_in_thread, wait_until_idle

MODEL = "smollm2"
TIMEOUT_S = 1.0


@pytest.fixture(scope="module")
def server():
    engine = AsyncLLMEngine.from_engine_args(
        EngineArgs(max_model_len=256, num_gpu_blocks_override=32), log_stats=False,
        model_name=MODEL)
    try:
        with serve_in_thread(engine, served_model_names=[MODEL],
                             request_read_timeout=TIMEOUT_S) as running:
            yield running
    finally:
        engine.shutdown()


def _connect(server) -> socket.socket:
    host, port = server.url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=10 * TIMEOUT_S)


def _read_all(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection."""
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def _closed_within(sock: socket.socket, seconds: float) -> bytes:
    began = time.monotonic()
    data = _read_all(sock)
    assert time.monotonic() - began < seconds, "the server kept the connection open"
    return data


def _health_answers(server) -> None:
    assert httpx.get(server.url + "/health", timeout=5).status_code == 200


@pytest.mark.parametrize("sent", [b"", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n",
                                  b"G"], ids=["nothing", "half-headers", "one-byte"])
def test_a_connection_without_its_headers_in_time_is_closed(server, sent):
    with _connect(server) as sock:
        sock.sendall(sent)
        assert _closed_within(sock, 5 * TIMEOUT_S) == b""  # no request: nothing to answer
    _health_answers(server)


def test_the_next_request_s_headers_are_due_after_a_response(server):
    with _connect(server) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        first = sock.recv(65536)
        assert first.startswith(b"HTTP/1.1 200"), first
        sock.sendall(b"GET /health HTTP/1.1\r\n")  # and then nothing
        assert _closed_within(sock, 5 * TIMEOUT_S) == b""


def _post_head(length: int) -> bytes:
    return ("POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {length}\r\n\r\n").encode()


def test_a_body_that_stops_arriving_is_a_408(server):
    body = json.dumps({"model": MODEL, "prompt": "Hello", "max_tokens": 2}).encode()
    with _connect(server) as sock:
        sock.sendall(_post_head(len(body)) + body[:10])
        data = _closed_within(sock, 5 * TIMEOUT_S)
    head, _, payload = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), data[:300]
    error = json.loads(payload)["error"]
    assert error["code"] == 408 and "--request-read-timeout" in error["message"], error
    _health_answers(server)


def test_a_slow_but_steady_body_is_read(server):
    body = json.dumps({"model": MODEL, "prompt": "Hello", "max_tokens": 2}).encode()
    pieces = [body[i:i + 8] for i in range(0, len(body), 8)]
    pause = 0.6 * TIMEOUT_S
    assert pause * len(pieces) > 3 * TIMEOUT_S  # in all, far longer than the timeout
    with _connect(server) as sock:
        sock.sendall(_post_head(len(body)))
        for piece in pieces:
            time.sleep(pause)
            sock.sendall(piece)
        data = sock.recv(65536)
    assert data.startswith(b"HTTP/1.1 200"), data[:300]


def test_an_answer_longer_than_the_timeout_is_not_cut(server):
    """A streamed answer read slowly: the response is in progress while the header deadline
    passes, and the body was complete long before."""
    events = []
    with httpx.Client(timeout=30) as client, client.stream(
            "POST", server.url + "/v1/completions",
            json={"model": MODEL, "prompt": "Once upon a time", "max_tokens": 12,
                  "ignore_eos": True, "stream": True}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line)
                if len(events) == 1:
                    time.sleep(3 * TIMEOUT_S)
    assert events[-1] == "data: [DONE]" and len(events) == 13, events[-3:]


def _generated_tokens(server) -> int:
    return server.engine.metrics.snapshot.generation_tokens  # published after every step


def test_a_pipelined_client_that_leaves_aborts_its_request(server, caplog):
    """A request with another pipelined behind it, then the connection closed: the request
    being answered is aborted, as a lone one is, and nothing is logged as a server error."""
    # 2 x 200 tokens: within the fixture's 32 blocks, so run to the end it is exactly 400
    body = json.dumps({"model": MODEL, "prompt": "Once upon a time", "max_tokens": 200,
                       "n": 2, "ignore_eos": True}).encode()
    before = _generated_tokens(server)
    with _connect(server) as sock:
        sock.sendall(_post_head(len(body)) + body + b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        time.sleep(0.3)
    wait_until_idle(server.engine)
    assert _generated_tokens(server) - before < 2 * 200  # not run to the end for nobody
    assert_all_blocks_free(server.engine)
    assert not [r for r in caplog.records if r.levelname == "ERROR"], caplog.text
    _health_answers(server)


def test_many_slow_connections_do_not_starve_others(server):
    """A hundred connections holding half-sent headers, then a normal request: it is served,
    and the slow ones are all closed soon after the timeout."""
    socks = [_connect(server) for _ in range(100)]
    try:
        for sock in socks:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        _health_answers(server)
        closed = []

        def wait(sock):
            closed.append(_read_all(sock))
        threads = [threading.Thread(target=wait, args=(s,)) for s in socks]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10 * TIMEOUT_S)
        assert len(closed) == len(socks) and not any(closed)
    finally:
        for sock in socks:
            sock.close()
    wait_until_idle(server.engine)
    assert_all_blocks_free(server.engine)


def test_the_flag():
    parser = make_parser()
    assert parser.parse_args(["serve"]).request_read_timeout == 30.0
    assert parser.parse_args(["serve", "--request-read-timeout", "2.5"]).request_read_timeout \
        == 2.5
    for bad in ("0", "-1", "nan", "inf", "soon"):
        with pytest.raises(SystemExit):
            parser.parse_args(["serve", "--request-read-timeout", bad])



def test_a_client_that_stops_reading_is_cut(caplog):
    """A stream whose client reads nothing: once the socket's buffers are full (about 3 MB
    here: the loopback's send buffer grows to take what the client's small window leaves) the
    server's writes wait, and after TIMEOUT_S of that the connection is cut as a disconnect:
    the request aborted, its blocks freed. It was held until the client left."""
    caplog.set_level(logging.INFO, logger="pagedlm.entrypoints.openai.request_reading")
    engine = AsyncLLMEngine.from_engine_args(
        EngineArgs(max_model_len=2048, num_gpu_blocks_override=520), log_stats=False,
        model_name=MODEL)
    # 4 x 2000 tokens with 20 logprobs each: about 9 MB of events, 2000 steps if not cut.
    body = json.dumps({"model": MODEL, "prompt": "Once upon a time", "max_tokens": 2000,
                       "n": 4, "logprobs": 20, "ignore_eos": True, "stream": True}).encode()
    try:
        with serve_in_thread(engine, served_model_names=[MODEL],
                             request_read_timeout=TIMEOUT_S) as running:
            host, port = running.url.removeprefix("http://").split(":")
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connecting
            sock.settimeout(60)
            with sock:
                sock.connect((host, int(port)))
                sock.sendall(_post_head(len(body)) + body)
                deadline = time.monotonic() + 30
                while engine.metrics.snapshot.generation_tokens == 0:  # it started
                    assert time.monotonic() < deadline
                    time.sleep(0.05)
                wait_until_idle(engine, timeout=120)
                try:
                    data = _read_all(sock)
                except ConnectionResetError:
                    data = b""
            steps = engine.metrics.snapshot.generation_tokens / 4
            assert b"data: [DONE]" not in data, "the stream was not cut"
            assert steps < 1900, steps
            assert "read nothing for" in caplog.text
            assert_all_blocks_free(engine)
            assert httpx.get(running.url + "/health", timeout=5).status_code == 200
    finally:
        engine.shutdown()
