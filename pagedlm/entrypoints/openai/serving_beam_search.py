"""A use_beam_search request served above the AsyncLLMEngine, as vLLM's serving layer does.

The engine runs each step's one-token requests like any other (entrypoints/beam_search.py holds
the search); this stream adds them, waits for all of a step's outputs, ranks them, and yields
the search's one final RequestOutput. To the handlers it is a request stream like the engine's:
iterated, merged, collected, and aborted (`abort()`, which aborts its pending step requests).
"""
from __future__ import annotations

import asyncio
import time
from typing import Callable

from pagedlm.engine.async_llm_engine import AsyncLLMEngine
from pagedlm.engine.request_stream import RequestStream
from pagedlm.entrypoints.beam_search import BeamSearch, new_beam_search
from pagedlm.outputs import RequestOutput
from pagedlm.sampling_params import SamplingParams


async def _final(stream: RequestStream) -> RequestOutput | None:
    """A step request's final output; None if it ended without one (aborted)."""
    out = None
    async for out in stream:
        pass
    return out if out is not None and out.finished else None


class BeamSearchStream:

    def __init__(self, engine: AsyncLLMEngine, search: BeamSearch,
                 still_served: Callable[[], bool] | None = None) -> None:
        self.engine = engine
        self.search = search
        # Whether its LoRA adapter is still served: each step adds requests afresh, and the
        # engine would load an adapter unloaded meanwhile again from its path.
        self._still_served = still_served
        self.request_id = search.request_id
        self.finished = False  # the consumer has seen the end, or it was aborted
        self._steps: list[RequestStream] = []  # the current step's requests

    @classmethod
    async def start(cls, engine: AsyncLLMEngine, request_id: str, prompt: dict,
                    params: SamplingParams, tokenizer, priority: int = 0,
                    lora_request=None, still_served: Callable[[], bool] | None = None
                    ) -> "BeamSearchStream":
        """Check the request and add its first step: the engine's ValueError for a bad one
        (then nothing is left in the engine). `prompt` holds prompt_token_ids."""
        search = new_beam_search(request_id, prompt.get("prompt"), prompt["prompt_token_ids"],
                                 params, engine.config, engine.eos_token_ids, tokenizer,
                                 time.time(), prompt.get("cache_salt"), priority, lora_request)
        stream = cls(engine, search, still_served)
        await stream._add_step()
        return stream

    async def _add_step(self) -> None:
        search = self.search
        requests = search.next_requests()
        # Added together, so that the engine thread takes them in one step.
        added = await asyncio.gather(
            *(self.engine.add_request(r.request_id, r.prompt, r.params,
                                      search.metrics.arrival_time, search.priority,
                                      search.lora_request) for r in requests),
            return_exceptions=True)
        self._steps = [s for s in added if isinstance(s, RequestStream)]
        if self.finished:  # aborted while they were being added
            self.abort()
            return
        error = next((e for e in added if isinstance(e, BaseException)), None)
        if error is not None and (search.is_first_step or not isinstance(error, ValueError)):
            self.abort()
            raise error
        for r, result in zip(requests, added):
            if isinstance(result, ValueError):  # a later step outgrew the KV cache
                search.refused(r.request_id)

    def __aiter__(self) -> "BeamSearchStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        try:
            out = await self._run()
        except BaseException:
            self.abort()
            raise
        self.finished = True
        if out is None:
            raise StopAsyncIteration
        return out

    async def _run(self) -> RequestOutput | None:
        search = self.search
        while True:
            outs = await asyncio.gather(*(_final(s) for s in self._steps))
            if any(out is None for out in outs) or self.finished:
                return None  # aborted (an adapter's removal aborts its requests)
            for out in outs:
                search.add_output(out)
            search.advance()
            if search.done:
                return search.request_output()
            if self._still_served is not None and not self._still_served():
                return None  # its adapter was unloaded: aborted, as its engine requests are
            await self._add_step()

    def abort(self) -> None:
        """Abort the pending step requests; no later step is added."""
        self.finished = True
        self.engine.abort([s.request_id for s in self._steps if not s.finished])
