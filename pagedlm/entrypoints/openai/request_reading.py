"""How the server reads a request: bounds on its body's size (--max-request-body-bytes) and on
how slowly a client may send it (--request-read-timeout).

A body over the size limit is a 413 before it is buffered: a declared Content-Length over the
limit is answered at once (the app never runs); a chunked body is counted as the app reads it,
and reading stops at the first chunk past the limit (uvicorn discards the rest of an unread
body).

uvicorn times out only an idle keep-alive connection, and only until its first byte: a client
that opens connections and sends their headers a byte at a time, or a body slower still, holds
each connection, its socket and its buffers for as long as it likes, and enough of them leave
the server no sockets for anyone else (the "slowloris" attack). So:
- a connection must deliver a request's headers within the timeout of connecting or of its
  previous response, else it is closed (`http_protocol`: there is no request yet to answer);
- a request's body must arrive with no pause longer than the timeout between the pieces of
  data the server receives, else the request is a 408 and its connection closed
  (`RequestBodyMiddleware`). A pause, not a total: a large prompt over a slow link still
  arrives as long as it keeps arriving, as with nginx's client_body_timeout. Only body data
  counts: a chunked upload that sends each chunk's size line apart from its data, the data
  after a pause as long as the timeout, is cut.
A request being answered is not timed: generation takes as long as it takes, and a client's
disconnect still aborts it. A client that stops reading its answer is: once the socket's buffers
are full its writes wait, and a connection whose writes have waited for the timeout is cut, as
a disconnect (its request aborted, its KV blocks freed). A client that never read a stream or the
engine view held its connection and the buffered answer (0.8 MB for each engine view
subscriber) for as long as it liked, and the server's shutdown with it.
"""
from __future__ import annotations

import asyncio
import logging

from fastapi.responses import JSONResponse
from starlette.datastructures import Headers

from pagedlm.entrypoints.openai.serving_engine import error_body

logger = logging.getLogger(__name__)


def http_protocol(timeout_s: float) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol (httptools where installed, else h11: its own choice) with the
    header and write-stall deadlines above."""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    class HeadDeadlineProtocol(AutoHTTPProtocol):  # type: ignore[misc, valid-type]
        _head_timer: asyncio.TimerHandle | None = None
        _write_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            # Requests still being answered when a pipelined one arrived after them.
            self._earlier: list = []
            self._arm_head_timer()

        def on_headers_complete(self) -> None:
            # httptools' protocol only (h11's leaves a pipelined request unparsed): a request
            # pipelined behind one being answered becomes `self.cycle`, and connection_lost
            # tells only that one of the disconnect. The one being answered then never heard
            # of it: its generation ran to the end for nobody, and its response's write to
            # the closed transport raised (two tracebacks logged per connection).
            previous = self.cycle
            super().on_headers_complete()
            if previous is not None and previous is not self.cycle \
                    and not previous.response_complete:
                self._earlier.append(previous)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._earlier = [c for c in self._earlier if not c.response_complete]
            self._arm_head_timer()  # the next request's headers are due in their turn

        def pause_writing(self) -> None:  # the transport's buffer is full: the client lags
            super().pause_writing()
            if self._write_timer is None:
                self._write_timer = self.loop.call_later(timeout_s, self._write_deadline)

        def resume_writing(self) -> None:
            super().resume_writing()
            if self._write_timer is not None:
                self._write_timer.cancel()
                self._write_timer = None

        def _write_deadline(self) -> None:
            self._write_timer = None
            if not self.transport.is_closing():
                logger.info("closing a connection whose client read nothing for %g s", timeout_s)
                # abort, not close: close would wait to send the buffer nobody reads.
                self.transport.abort()

        def connection_lost(self, exc) -> None:
            for timer in (self._head_timer, self._write_timer):
                if timer is not None:
                    timer.cancel()
            for cycle in self._earlier:  # as uvicorn tells its current cycle
                if not cycle.response_complete:
                    cycle.disconnected = True
                    cycle.message_event.set()
            self._earlier = []
            super().connection_lost(exc)

        def _arm_head_timer(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
            self._head_timer = self.loop.call_later(timeout_s, self._head_deadline)

        def _head_deadline(self) -> None:
            self._head_timer = None
            cycle = self.cycle
            if cycle is not None and not cycle.response_complete:
                return  # its headers came: the request is being read or answered
            if not self.transport.is_closing():
                self.transport.close()

    return HeadDeadlineProtocol


class _BodyRefused(Exception):
    """Raised from the app's receive(): the body broke a bound; `response` says which."""

    def __init__(self, response: JSONResponse) -> None:
        super().__init__(response)
        self.response = response


class RequestBodyMiddleware:
    """Pure ASGI: a body over `max_bytes` is a 413, one that pauses for longer than
    `timeout_s` between pieces a 408 (see the module). Only the body's reads are bounded: once
    it is complete, receive() is the app's wait for a disconnect, which lasts as long as the
    response does."""

    def __init__(self, app, max_bytes: int, timeout_s: float) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s

    def _too_large(self) -> JSONResponse:
        return JSONResponse(error_body(
            f"The request body is larger than this server accepts ({self.max_bytes} bytes; "
            f"see --max-request-body-bytes).", 413), status_code=413)

    def _stalled(self) -> JSONResponse:
        return JSONResponse(error_body(
            f"The request body stopped arriving: nothing for {self.timeout_s:g} s (see "
            f"--request-read-timeout).", 408), status_code=408,
            headers={"Connection": "close"})

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = Headers(scope=scope).get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_bytes:
            return await self._too_large()(scope, receive, send)
        received = 0
        body_done = started = False

        async def bounded_receive():
            nonlocal received, body_done
            if body_done:
                return await receive()
            # A deadline on this task rather than wait_for's task of its own: the read runs
            # as it would unbounded, with no task to create per piece of the body.
            try:
                async with asyncio.timeout(self.timeout_s):
                    message = await receive()
            except TimeoutError:
                raise _BodyRefused(self._stalled()) from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise _BodyRefused(self._too_large())
            if message["type"] != "http.request" or not message.get("more_body", False):
                body_done = True
            return message

        async def tracking_send(message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, bounded_receive, tracking_send)
        except _BodyRefused as refused:
            if started:  # a handler reading its body after answering: nothing left to say
                return
            await refused.response(scope, receive, send)
