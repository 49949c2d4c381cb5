"""The client side of the serving benchmarks: OpenAI-compatible requests, streamed (timed token by
token) or not, sent at given arrival times, and the check that a server did the work asked."""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import httpx

from lib.workload import Request


@dataclass
class RequestResult:
    ok: bool = False
    error: str = ""
    start: float = 0.0  # seconds since the run started
    prompt_len: int = -1  # from the server's usage; -1: it reported none
    output_tokens: int = 0  # from the usage, else one per chunk with text
    ttft: float = 0.0
    latency: float = 0.0  # end to end
    itl: list[float] = field(default_factory=list)  # gaps between successive text chunks

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first; None for a single-token answer."""
        if self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


@dataclass(frozen=True)
class Endpoint:
    """Where and how every request of a run is sent."""
    model: str
    kind: str = "completions"  # or "chat" (text prompts only)
    ignore_eos: bool = True  # vLLM's field: every request yields exactly max_tokens
    sampling: dict = field(default_factory=lambda: {"temperature": 0.0})


def sampling_fields(temperature: float) -> dict:
    """The same sampling for every server: above 0, top_p / top_k / min_p are sent as no-ops,
    since llama.cpp's own defaults would otherwise truncate the distribution."""
    if temperature == 0:
        return {"temperature": 0.0}
    return {"temperature": temperature, "top_p": 1.0, "top_k": 0, "min_p": 0.0}


def _body(endpoint: Endpoint, prompt: str | list[int], max_tokens: int, stream: bool) -> dict:
    body = {"model": endpoint.model, "max_tokens": max_tokens, "stream": stream,
            **endpoint.sampling}
    if stream:
        body["stream_options"] = {"include_usage": True}
    if endpoint.ignore_eos:
        body["ignore_eos"] = True
    if endpoint.kind == "chat":
        if not isinstance(prompt, str):
            raise ValueError("the chat endpoint takes text prompts")
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return body


def _url(endpoint: Endpoint) -> str:
    return "/v1/chat/completions" if endpoint.kind == "chat" else "/v1/completions"


async def send(client: httpx.AsyncClient, endpoint: Endpoint, prompt: str | list[int],
               max_tokens: int, t0: float, result: RequestResult) -> None:
    """One streamed request, timed into result; a failure is recorded there, never raised."""
    body = _body(endpoint, prompt, max_tokens, stream=True)
    start = time.perf_counter()
    result.start = start - t0
    last = None
    chunks_with_text = 0
    try:
        async with client.stream("POST", _url(endpoint), json=body) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:300]!r}"
                return
            async for line in sse_lines(response):
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = str(chunk["error"])[:300]
                    return
                if chunk.get("usage"):
                    result.prompt_len = chunk["usage"].get("prompt_tokens", result.prompt_len)
                    result.output_tokens = chunk["usage"].get("completion_tokens", 0)
                text = "".join((c.get("text") or (c.get("delta") or {}).get("content") or "")
                               for c in chunk.get("choices", []))
                if not text:
                    continue
                now = time.perf_counter()
                if last is None:
                    result.ttft = now - start
                else:
                    result.itl.append(now - last)
                last = now
                chunks_with_text += 1
        result.latency = time.perf_counter() - start
        if result.output_tokens == 0:  # the server sent no usage: one token per chunk
            result.output_tokens = chunks_with_text
        result.ok = last is not None
        if not result.ok:
            result.error = "no text was generated"
    except Exception as e:  # noqa: BLE001 - a failed request is counted, not fatal
        result.error = f"{e.__class__.__name__}: {e}"


async def sse_lines(response):
    """Lines as server-sent events define them (split on CR/LF only). httpx's aiter_lines also
    splits on U+2028 and the like, which JSON may legally carry unescaped in a token's text."""
    buffer = b""
    async for data in response.aiter_bytes():
        buffer += data
        *lines, buffer = buffer.replace(b"\r\n", b"\n").replace(b"\r", b"\n").split(b"\n")
        for line in lines:
            yield line.decode("utf-8")
    if buffer:
        yield buffer.decode("utf-8")


@dataclass
class TtftBound:
    """Stop a run once `misses` requests are known to take longer than `seconds` to their first
    token (answered late, or still waiting past it): the run's TTFT percentile is then decided,
    and sending the rest would only wait out a queue (a capacity point far above the SLO took
    two to three times its 60 s). When it stops, `stopped_at` is the run's time and `sent` the
    number of requests sent by then."""
    seconds: float
    misses: int
    stopped_at: float | None = None
    sent: int = 0

    def missed(self, results: list[RequestResult], sent: list[bool], now: float) -> int:
        return sum(1 for r, s in zip(results, sent) if s and (
            r.ttft > self.seconds or (r.ttft == 0.0 and not r.error
                                      and now - r.start > self.seconds)))


async def run_streamed(client: httpx.AsyncClient, endpoint: Endpoint,
                       prompts: list[str] | list[list[int]], max_tokens: list[int],
                       arrivals: list[float], max_concurrency: int | None = None,
                       ttft_bound: TtftBound | None = None
                       ) -> tuple[list[RequestResult], float]:
    """Request i sent at arrivals[i] seconds after the start (at most max_concurrency in flight):
    every request's timings, and the run's wall time. With ttft_bound, the run stops early once
    its bound is decided (the requests in flight are cancelled, the unsent ones never sent)."""
    results = [RequestResult() for _ in prompts]
    sent = [False] * len(prompts)
    semaphore = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    t0 = time.perf_counter()

    async def launch(i: int) -> None:
        delay = arrivals[i] - (time.perf_counter() - t0)
        if delay > 0:
            await asyncio.sleep(delay)
        if semaphore is None:
            sent[i] = True
            await send(client, endpoint, prompts[i], max_tokens[i], t0, results[i])
        else:
            async with semaphore:
                sent[i] = True
                await send(client, endpoint, prompts[i], max_tokens[i], t0, results[i])

    runs = asyncio.gather(*(launch(i) for i in range(len(prompts))))
    if ttft_bound is None:
        await runs
        return results, time.perf_counter() - t0
    while not runs.done():
        await asyncio.wait([runs], timeout=0.1)
        now = time.perf_counter() - t0
        if not runs.done() and ttft_bound.missed(results, sent, now) >= ttft_bound.misses:
            ttft_bound.stopped_at, ttft_bound.sent = now, sum(sent)
            runs.cancel()
            # Closing the streams tells the server to drop their requests.
            await asyncio.gather(runs, return_exceptions=True)
            break
    return results, time.perf_counter() - t0


class CountMismatch(RuntimeError):
    pass


def check_counts(system: str, workload: str, index: int, request: Request,
                 prompt_tokens: int | None, completion_tokens: int | None) -> None:
    """Figures are only comparable if every system did exactly the work asked for."""
    if prompt_tokens is None or completion_tokens is None:
        raise CountMismatch(f"{system} {workload} request {index}: the server reported no usage, "
                            f"so its token counts cannot be checked")
    if prompt_tokens != len(request.prompt) or completion_tokens != request.max_tokens:
        raise CountMismatch(
            f"{system} {workload} request {index}: asked for {len(request.prompt)} prompt + "
            f"{request.max_tokens} output tokens, the server's usage says {prompt_tokens} + "
            f"{completion_tokens}")


def check_streamed(system: str, workload: str, requests: list[Request],
                   results: list[RequestResult]) -> None:
    """Every request answered, with exactly the token counts asked for."""
    for i, (request, result) in enumerate(zip(requests, results)):
        if not result.ok:
            raise RuntimeError(f"{system} {workload} request {i} failed: {result.error}")
        check_counts(system, workload, i, request,
                     None if result.prompt_len < 0 else result.prompt_len, result.output_tokens)


async def run_batch(client: httpx.AsyncClient, endpoint: Endpoint, system: str,
                    requests: list[Request]) -> float:
    """All requests at once, not streamed (the client's own work stays small next to the
    server's on a 2-core machine), each checked: the wall time."""
    async def one(i: int, r: Request) -> None:
        response = await client.post(_url(endpoint),
                                     json=_body(endpoint, r.prompt, r.max_tokens, stream=False))
        if response.status_code != 200:
            raise RuntimeError(f"{system} batch request {i}: HTTP {response.status_code}: "
                               f"{response.text[:300]}")
        usage = response.json().get("usage") or {}
        check_counts(system, "batch", i, r, usage.get("prompt_tokens"),
                     usage.get("completion_tokens"))

    start = time.perf_counter()
    await asyncio.gather(*(one(i, r) for i, r in enumerate(requests)))
    return time.perf_counter() - start


async def first_model(client: httpx.AsyncClient) -> str:
    """The name of the first model the server lists."""
    try:
        r = await client.get("/v1/models")
    except httpx.TransportError as e:
        raise SystemExit(f"cannot reach {client.base_url}: {e!r}") from None
    if r.status_code != 200:
        raise SystemExit(f"GET /v1/models: HTTP {r.status_code}: {r.text[:300]}"
                         + (" (pass --api-key)" if r.status_code == 401 else ""))
    return r.json()["data"][0]["id"]


def http_client(base_url: str, timeout: float, api_key: str | None = None) -> httpx.AsyncClient:
    """One client for a whole run, with no cap on connections (requests in flight are the
    workload's to decide)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    return httpx.AsyncClient(base_url=base_url.rstrip("/"), headers=headers, timeout=timeout,
                             limits=limits)
