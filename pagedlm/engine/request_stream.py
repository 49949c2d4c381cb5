"""RequestStream: one request's outputs, handed from the AsyncLLMEngine's thread to the asyncio
caller that added it (see engine/async_llm_engine.py)."""
from __future__ import annotations

import asyncio

from pagedlm.outputs import RequestOutput

END = object()  # stream sentinel: the request ended without a final output (aborted)


class RequestStream:
    """One request's RequestOutputs as an async iterator, fed from the engine thread."""

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop) -> None:
        self.request_id = request_id
        self.loop = loop
        self._queue: asyncio.Queue = asyncio.Queue()
        self.finished = False  # the consumer has seen the end (final output, abort or error)

    def _put(self, item) -> None:  # on the stream's event loop
        self._queue.put_nowait(item)

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self._queue.get()
        if item is END:
            self.finished = True
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.finished:
            self.finished = True
        return item


def deliver(items: list[tuple[RequestStream, object]]) -> None:
    """On the streams' event loop: outputs, END, or the error that ends them."""
    for stream, item in items:
        stream._put(item)
