"""Helpers for the serving tests: a real uvicorn server on a free local port, in a thread."""
from __future__ import annotations

import contextlib
import socket
import threading
import time
from dataclasses import dataclass

import uvicorn

from pagedlm.engine.async_llm_engine import AsyncLLMEngine
from pagedlm.entrypoints.cli_args import DEFAULT_REQUEST_READ_TIMEOUT_S
from pagedlm.entrypoints.openai.api_server import build_app
from pagedlm.entrypoints.openai.request_reading import http_protocol


@dataclass
class RunningServer:
    url: str  # http://127.0.0.1:PORT
    engine: AsyncLLMEngine

    @property
    def base_url(self) -> str:
        return self.url + "/v1"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve_in_thread(engine: AsyncLLMEngine, **app_kwargs):
    """Serve `engine` with the real app and uvicorn on 127.0.0.1:<free port> until exit, on
    the HTTP protocol run_server uses (its header deadline is app_kwargs' request_read_timeout,
    as the body's is)."""
    app = build_app(engine, **app_kwargs)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    read_timeout = app_kwargs.get("request_read_timeout", DEFAULT_REQUEST_READ_TIMEOUT_S)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_keep_alive=5,
                                           http=http_protocol(read_timeout)))
    app.state.server = server  # as run_server does: a failed engine stops the server
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the test server did not start")
        time.sleep(0.05)
    try:
        yield RunningServer(f"http://127.0.0.1:{port}", engine)
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


def wait_until_idle(engine: AsyncLLMEngine, timeout: float = 60.0) -> None:
    """Wait for the engine thread to have nothing running or waiting (aborts are applied
    between steps, so they can land a moment after the client let go)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        snap = engine.metrics.snapshot
        llm = engine.engine
        if (not llm.has_unfinished_requests() and snap.num_running == 0
                and snap.num_waiting == 0 and not llm.requests):
            return
        time.sleep(0.05)
    raise AssertionError("the engine did not become idle")


def assert_all_blocks_free(engine: AsyncLLMEngine) -> None:
    llm = engine.engine
    bm = llm.block_manager
    assert not llm.scheduler.waiting and not llm.scheduler.running
    assert llm.requests == {}
    assert not getattr(llm.scheduler, "swapped", [])
    assert bm.num_free_blocks == bm.num_blocks
    assert all(rc == 0 for rc in bm.ref_counts)
