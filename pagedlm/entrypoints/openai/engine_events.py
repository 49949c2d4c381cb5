"""The views GET /engine/events streams (the web page's live engine view), shared.

A view is a scan of the queues and block reference counts on the engine thread, and its JSON a
few kilobytes: taken for each subscriber, 200 open pages made the engine take 800 views a
second, and 4 completions that ran in 2.1 s alone took 5.1 s. One view is taken per tick for all
subscribers, whatever their number, and serialised once.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json

from pagedlm.engine.async_llm_engine import AsyncLLMEngine


class EngineEvents:
    """One app's view events (on its event loop): the latest, while it is younger than
    max_age_s, else a new one, which concurrent callers wait for together."""

    def __init__(self, engine: AsyncLLMEngine, max_age_s: float,
                 max_subscribers: int = 32) -> None:
        self.engine = engine
        self.max_age_s = max_age_s
        # Each open stream may hold a view's event in its socket's buffers (about 1 byte a KV
        # block: 0.4 MB with 400k blocks): 1000 subscribers that never read took 815 MB.
        self.max_subscribers = max_subscribers
        self.subscribers = 0
        self._latest: tuple[float, str] | None = None  # (loop time taken, the SSE event)
        self._taking: asyncio.Future | None = None

    def subscribe(self) -> bool:
        """Count a stream in; False when max_subscribers are open (the caller answers 503)."""
        if self.subscribers >= self.max_subscribers:
            return False
        self.subscribers += 1
        return True

    def unsubscribe(self) -> None:
        self.subscribers -= 1

    async def next_event(self) -> str:
        """The view as one server-sent event; AsyncEngineDeadError once the engine failed."""
        loop = asyncio.get_running_loop()
        if self._latest is not None and loop.time() - self._latest[0] < self.max_age_s:
            return self._latest[1]
        if self._taking is None:
            self._taking = asyncio.ensure_future(self._take(loop))
        # Shielded: a subscriber that leaves must not cancel the others' view.
        return await asyncio.shield(self._taking)

    async def _take(self, loop: asyncio.AbstractEventLoop) -> str:
        try:
            view = await self.engine.engine_view()
            event = f"data: {json.dumps(dataclasses.asdict(view), separators=(',', ':'))}\n\n"
            self._latest = (loop.time(), event)
            return event
        finally:
            self._taking = None
