"""A bounded soak of `pagedlm serve`: mixed valid, invalid and client-aborted requests.

    .venv/bin/python scripts/soak.py --duration 120          # the default model
    .venv/bin/python scripts/soak.py --duration 20 --model DIR --concurrency 6

Starts a server in a child process on a free local port, drives it from `--concurrency` clients
until `--duration` seconds have passed, then checks what must hold after any mix of traffic:
- no response was a 5xx, and every invalid request got a 4xx;
- /health answered every probe (one every 0.5 s throughout) within `--health-limit-s`;
- once the clients stop: 0 running, 0 waiting, 0 swapped, the KV cache empty (the Prometheus
  gauges the engine publishes from its own block pool);
- the server's RSS grew by less than `--max-rss-growth` between the end of the warm-up (the first
  fifth of the run, by which time every kind of request has run at least once) and the end.
Prints one JSON summary line and exits 1 if any check failed. Traffic goes to 127.0.0.1 only.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx
import psutil

PROMPTS = ["The capital of France is", "Once upon a time", "def fibonacci(n):",
           "List three colors:", "The quick brown fox"]


@dataclass
class Tally:
    statuses: Counter = field(default_factory=Counter)
    by_kind: Counter = field(default_factory=Counter)
    server_errors: list[str] = field(default_factory=list)
    invalid_accepted: list[str] = field(default_factory=list)
    aborted: int = 0
    health_max_s: float = 0.0
    health_failures: int = 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _invalid_bodies(model: str) -> list[tuple[str, dict | bytes]]:
    deep = b"[" * 100_000 + b"]" * 100_000
    return [
        ("seed_overflow", {"model": model, "prompt": "a", "seed": 2**70}),
        ("n_huge", {"model": model, "prompt": "a", "n": 2**40}),
        ("max_tokens_negative", {"model": model, "prompt": "a", "max_tokens": -1}),
        ("temperature_nan", b'{"model": "%s", "prompt": "a", "temperature": NaN}'
         % model.encode()),
        ("bad_json", b'{"model": '),
        ("deep_json", deep),
        ("unknown_model", {"model": "no-such-model", "prompt": "a"}),
        ("prompt_too_long", {"model": model, "prompt": "word " * 50_000, "max_tokens": 1}),
        ("bad_regex", {"model": model, "prompt": "a", "guided_regex": "(unclosed"}),
    ]


async def _valid(client: httpx.AsyncClient, model: str, rng: random.Random,
                 tally: Tally) -> None:
    kind = rng.choice(["completion", "chat", "stream", "n2", "json"])
    body: dict = {"model": model, "max_tokens": rng.randint(1, 24),
                  "temperature": rng.choice([0.0, 0.8]), "seed": rng.randint(0, 2**31)}
    path = "/v1/completions"
    if kind == "chat":
        path = "/v1/chat/completions"
        body["messages"] = [{"role": "user", "content": rng.choice(PROMPTS)}]
    else:
        body["prompt"] = rng.choice(PROMPTS)
    if kind == "n2":
        body["n"] = 2
    if kind == "json":
        body["response_format"] = {"type": "json_object"}
    if kind == "stream":
        body["stream"] = True
        async with client.stream("POST", path, json=body) as r:
            await r.aread()
            _record(tally, "valid_" + kind, r.status_code, r.text, expect_ok=True)
        return
    r = await client.post(path, json=body)
    _record(tally, "valid_" + kind, r.status_code, r.text, expect_ok=True)


async def _aborted(client: httpx.AsyncClient, model: str, rng: random.Random,
                   tally: Tally) -> None:
    body = {"model": model, "prompt": rng.choice(PROMPTS), "max_tokens": 200,
            "temperature": 0.8}
    if rng.random() < 0.5:  # a stream closed after its first chunk
        async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            async for _ in r.aiter_bytes():
                break
        tally.by_kind["aborted_stream"] += 1
    else:  # a plain request given up on before the answer
        try:
            await client.post("/v1/completions", json=body, timeout=rng.uniform(0.05, 0.5))
            tally.by_kind["aborted_late"] += 1  # it finished first: not an abort after all
        except httpx.TimeoutException:
            tally.by_kind["aborted_timeout"] += 1
    tally.aborted += 1


async def _invalid(client: httpx.AsyncClient, model: str, rng: random.Random,
                   tally: Tally) -> None:
    name, body = rng.choice(_invalid_bodies(model))
    if isinstance(body, bytes):
        r = await client.post("/v1/completions", content=body,
                              headers={"Content-Type": "application/json"})
    else:
        r = await client.post("/v1/completions", json=body)
    _record(tally, "invalid_" + name, r.status_code, r.text, expect_ok=False)


def _record(tally: Tally, kind: str, status: int, text: str, *, expect_ok: bool) -> None:
    tally.statuses[status] += 1
    tally.by_kind[kind] += 1
    if status >= 500:
        tally.server_errors.append(f"{kind}: {status} {text[:200]}")
    elif not expect_ok and status < 400:
        tally.invalid_accepted.append(f"{kind}: {status}")


async def _client(url: str, model: str, seed: int, deadline: float, tally: Tally) -> None:
    rng = random.Random(seed)
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        while time.monotonic() < deadline:
            roll = rng.random()
            fn = _valid if roll < 0.5 else _invalid if roll < 0.8 else _aborted
            await fn(client, model, rng, tally)


async def _health_probe(url: str, deadline: float, tally: Tally) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=10) as client:
        while time.monotonic() < deadline:
            t0 = time.monotonic()
            try:
                r = await client.get("/health")
                ok = r.status_code == 200
            except httpx.HTTPError:
                ok = False
            tally.health_max_s = max(tally.health_max_s, time.monotonic() - t0)
            tally.health_failures += not ok
            await asyncio.sleep(0.5)


def _gauges(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=10).text
    wanted = ("pagedlm:num_requests_running", "pagedlm:num_requests_waiting",
              "pagedlm:num_requests_swapped", "pagedlm:kv_cache_usage_perc")
    out = {}
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in wanted:
            out[name] = float(line.rsplit(" ", 1)[1])
    return out


def _wait_ready(url: str, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode} before it was ready")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise SystemExit("the server did not become ready")


def _wait_idle(url: str, timeout: float = 30.0) -> dict[str, float]:
    """Aborts land between engine steps, and the gauges are published after each step."""
    deadline = time.monotonic() + timeout
    gauges = _gauges(url)
    while time.monotonic() < deadline and any(gauges.values()):
        time.sleep(0.25)
        gauges = _gauges(url)
    return gauges


async def _drive(url: str, model: str, args, tally: Tally, server: psutil.Process
                 ) -> tuple[int, int]:
    start = time.monotonic()
    deadline = start + args.duration
    warmup_end = start + args.duration / 5
    clients = [asyncio.create_task(_client(url, model, args.seed + i, deadline, tally))
               for i in range(args.concurrency)]
    probe = asyncio.create_task(_health_probe(url, deadline, tally))
    await asyncio.sleep(max(0.0, warmup_end - time.monotonic()))
    rss_warm = server.memory_info().rss
    await asyncio.gather(*clients, probe)
    return rss_warm, server.memory_info().rss


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--duration", type=float, default=120.0, help="seconds of traffic")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--model", default=None, help="a model dir or .gguf (default: embedded)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--health-limit-s", type=float, default=1.0)
    p.add_argument("--max-rss-growth", type=float, default=0.10)
    p.add_argument("--server-arg", action="append", default=[],
                   help="an extra `pagedlm serve` argument (repeatable)")
    args = p.parse_args()

    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    name = "soak-model"
    cmd = [sys.executable, "-m", "pagedlm.entrypoints.cli", "serve",
           *([args.model] if args.model else []), "--port", str(port),
           "--served-model-name", name, "--max-model-len", "1024",
           "--kv-cache-memory", "256MiB", "--disable-log-stats", *args.server_arg]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    tally = Tally()
    try:
        _wait_ready(url, proc, timeout=300)
        server = psutil.Process(proc.pid)
        rss_warm, rss_end = asyncio.run(_drive(url, name, args, tally, server))
        gauges = _wait_idle(url)
        alive = proc.poll() is None
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            _, stderr = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, stderr = proc.communicate()
    growth = (rss_end - rss_warm) / rss_warm
    checks = {
        "no_5xx": not tally.server_errors,
        "invalid_refused": not tally.invalid_accepted,
        "health_in_time": (tally.health_failures == 0
                           and tally.health_max_s <= args.health_limit_s),
        "idle_and_empty": bool(gauges) and not any(gauges.values()),
        "rss_growth": growth < args.max_rss_growth,
        "server_alive": alive,
    }
    summary = {"ok": all(checks.values()), "checks": checks, "duration_s": args.duration,
               "requests": sum(tally.statuses.values()) + tally.aborted,
               "rss_warm_mb": round(rss_warm / 2**20, 1), "rss_end_mb": round(rss_end / 2**20, 1),
               "rss_growth": round(growth, 4), "gauges_at_end": gauges,
               # Not asdict(): it rebuilds a Counter from (key, value) pairs, counting the pairs.
               "by_kind": dict(sorted(tally.by_kind.items())),
               "statuses": {str(k): v for k, v in sorted(tally.statuses.items())},
               "server_errors": tally.server_errors[:20],
               "invalid_accepted": tally.invalid_accepted[:20], "aborted": tally.aborted,
               "health_max_s": round(tally.health_max_s, 3),
               "health_failures": tally.health_failures}
    print(json.dumps(summary))
    if not summary["ok"]:
        print(stderr[-4000:], file=sys.stderr)
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
