"""Online serving benchmark, modelled on vLLM's benchmark_serving, for any OpenAI-compatible URL.

Sends random prompts at a Poisson rate (or all at once) as streaming requests and reports request
throughput, output tokens/s, and mean / median / p99 of time to first token (TTFT), time per
output token after the first (TPOT), inter-token latency (ITL) and end-to-end latency.

Acceptance workload (start the server first: `pagedlm serve`):
    python benchmarks/serving.py --base-url http://127.0.0.1:8000 --request-rate 4 \
        --duration 60 --save-plot serving.png
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import shlex
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field

import httpx


@dataclass
class RequestResult:
    ok: bool = False
    error: str = ""
    start: float = 0.0  # seconds since the benchmark started
    prompt_len: int = 0  # from the server's usage when it reports it, else our estimate
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0  # end to end
    itl: list[float] = field(default_factory=list)  # gaps between successive text chunks


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000",
                   help="Server root (the API is under /v1).")
    p.add_argument("--model", default=None, help="Model name; default: the server's first.")
    p.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                   help="Bearer key (default: $OPENAI_API_KEY).")
    p.add_argument("--num-prompts", type=int, default=None,
                   help="Requests to send (default: 100, or as many as --duration holds).")
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="Mean requests per second (Poisson arrivals); inf sends all at once.")
    p.add_argument("--duration", type=float, default=None, metavar="SECONDS",
                   help="Send requests for this long at --request-rate (instead of a count).")
    p.add_argument("--burstiness", type=float, default=1.0,
                   help="Gamma shape of the gaps between arrivals; 1 is Poisson.")
    p.add_argument("--max-concurrency", type=int, default=None,
                   help="Most requests in flight at once (default: no limit).")
    p.add_argument("--input-len", type=int, default=128, help="Prompt length in tokens.")
    p.add_argument("--output-len", type=int, default=128, help="max_tokens of each request.")
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="Send vLLM's ignore_eos so every request yields --output-len tokens "
                        "(--no-ignore-eos for servers that reject unknown fields).")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--tokenizer", default="auto",
                   help="HF tokenizer directory for random-token prompts; 'auto': pagedlm's "
                        "default model if available; 'none': random words.")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="Per-request timeout (s).")
    p.add_argument("--save-plot", default=None, metavar="PNG",
                   help="Save histograms of TTFT, TPOT, ITL and latency (needs matplotlib).")
    p.add_argument("--output-json", default=None, metavar="PATH",
                   help="Save the config, the summary and every request's timings.")
    args = p.parse_args(argv)
    if args.duration is not None:
        if math.isinf(args.request_rate):
            p.error("--duration needs a finite --request-rate")
        if args.num_prompts is not None:
            p.error("give --num-prompts or --duration, not both")
    elif args.num_prompts is None:
        args.num_prompts = 100
    if args.request_rate <= 0 or args.burstiness <= 0:
        p.error("--request-rate and --burstiness must be > 0")
    return args


# ---- prompts ----

_WORDS = ("time person year way day thing man world life hand part child eye woman place work "
          "week case point number group problem fact story river mountain city garden music "
          "window paper color light water stone market winter morning letter table").split()


def load_tokenizer(spec: str):
    if spec == "none":
        return None
    try:
        from transformers import AutoTokenizer
        if spec == "auto":
            from pagedlm.model_executor.model_loader.model_path import resolve_model
            spec = resolve_model(None)
        return AutoTokenizer.from_pretrained(spec)
    except Exception as e:  # noqa: BLE001 - prompts of random words will do
        print(f"note: no tokenizer ({e.__class__.__name__}: {e}); using random-word prompts, "
              f"about one token per word", file=sys.stderr)
        return None


def make_prompts(n: int, input_len: int, tokenizer, rng: random.Random) -> list[str]:
    if tokenizer is None:
        return [" ".join(rng.choice(_WORDS) for _ in range(input_len)) for _ in range(n)]
    special = set(tokenizer.all_special_ids)
    vocab = sorted(set(tokenizer.get_vocab().values()) - special)
    prompts = []
    for _ in range(n):
        ids = [rng.choice(vocab) for _ in range(input_len)]
        # Decoding and re-encoding can change the count: trim or pad back to input_len.
        ids = tokenizer.encode(tokenizer.decode(ids), add_special_tokens=False)[:input_len]
        while len(ids) < input_len:
            ids.append(rng.choice(vocab))
        prompts.append(tokenizer.decode(ids))
    return prompts


def arrival_times(args, rng: random.Random) -> list[float]:
    """Seconds after the start at which each request is sent."""
    if math.isinf(args.request_rate):
        return [0.0] * args.num_prompts
    theta = 1.0 / (args.request_rate * args.burstiness)
    times, t = [], 0.0
    while True:
        if args.duration is None and len(times) == args.num_prompts:
            return times
        times.append(t)
        t += rng.gammavariate(args.burstiness, theta)
        if args.duration is not None and t >= args.duration:
            return times


# ---- one request ----

async def send(client: httpx.AsyncClient, args, model: str, prompt: str, t0: float,
               result: RequestResult) -> None:
    body = {"model": model, "max_tokens": args.output_len, "temperature": args.temperature,
            "stream": True, "stream_options": {"include_usage": True}}
    if args.ignore_eos:
        body["ignore_eos"] = True
    # compare.py sends the same sampling fields to every server.
    body.update(getattr(args, "extra_body", None) or {})
    if args.endpoint == "chat":
        url = "/v1/chat/completions"
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        url = "/v1/completions"
        body["prompt"] = prompt
    start = time.perf_counter()
    result.start = start - t0
    last = None
    chunks_with_text = 0
    try:
        async with client.stream("POST", url, json=body) as response:
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


# ---- the run ----

def percentiles(values: list[float]) -> dict:
    if not values:
        return {"mean": float("nan"), "median": float("nan"), "p99": float("nan")}
    ordered = sorted(values)
    idx = min(len(ordered) - 1, max(0, math.ceil(0.99 * len(ordered)) - 1))
    return {"mean": statistics.fmean(values), "median": statistics.median(values),
            "p99": ordered[idx]}


def summarize(results: list[RequestResult], elapsed: float, args) -> dict:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)
    tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    return {
        "successful_requests": len(ok),
        "failed_requests": len(results) - len(ok),
        "request_rate": args.request_rate,
        "duration_s": elapsed,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / elapsed,
        "output_throughput": out_tokens / elapsed,
        "total_token_throughput": (in_tokens + out_tokens) / elapsed,
        "ttft_ms": {k: v * 1000 for k, v in percentiles([r.ttft for r in ok]).items()},
        "tpot_ms": {k: v * 1000 for k, v in percentiles(tpot).items()},
        "itl_ms": {k: v * 1000 for k, v in percentiles([x for r in ok for x in r.itl]).items()},
        "e2el_ms": {k: v * 1000 for k, v in percentiles([r.latency for r in ok]).items()},
    }


def print_table(s: dict, errors: list[str]) -> None:
    w = 50

    def row(label, value, fmt="{:.2f}"):
        print(f"{label:<40}{fmt.format(value) if not isinstance(value, str) else value}")

    print("{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=w, c="="))
    row("Successful requests:", s["successful_requests"], "{}")
    row("Failed requests:", s["failed_requests"], "{}")
    row("Request rate (configured, req/s):", s["request_rate"])
    row("Benchmark duration (s):", s["duration_s"])
    row("Total input tokens:", s["total_input_tokens"], "{}")
    row("Total generated tokens:", s["total_output_tokens"], "{}")
    row("Request throughput (req/s):", s["request_throughput"])
    row("Output token throughput (tok/s):", s["output_throughput"])
    row("Total token throughput (tok/s):", s["total_token_throughput"])
    for key, title, short in (("ttft_ms", "Time to First Token", "TTFT"),
                              ("tpot_ms", "Time per Output Token (excl. 1st token)", "TPOT"),
                              ("itl_ms", "Inter-token Latency", "ITL"),
                              ("e2el_ms", "End-to-end Latency", "E2EL")):
        print("{s:{c}^{n}}".format(s=title, n=w, c="-"))
        row(f"Mean {short} (ms):", s[key]["mean"])
        row(f"Median {short} (ms):", s[key]["median"])
        row(f"P99 {short} (ms):", s[key]["p99"])
    print("=" * w)
    if errors:
        print(f"first error: {errors[0]}")


def check_plotting(path: str | None):
    if path is None:
        return None
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        return plt
    except ImportError:
        raise SystemExit("--save-plot needs matplotlib: pip install matplotlib "
                         "(or install pagedlm's dev extra)") from None


def save_plot(plt, path: str, results: list[RequestResult], summary: dict, title: str) -> None:
    ok = [r for r in results if r.ok]
    series = [
        ("Time to first token (ms)", [r.ttft * 1000 for r in ok]),
        ("Time per output token (ms)", [(r.latency - r.ttft) / (r.output_tokens - 1) * 1000
                                        for r in ok if r.output_tokens > 1]),
        ("Inter-token latency (ms)", [x * 1000 for r in ok for x in r.itl]),
        ("End-to-end latency (s)", [r.latency for r in ok]),
    ]
    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5))
    for ax, (label, values) in zip(axes.flat, series):
        if values:
            ax.hist(values, bins=min(50, max(5, len(values) // 4)), color="#4c72b0")
            p = percentiles(values)
            for key, style in (("median", "--"), ("p99", ":")):
                ax.axvline(p[key], color="black", linestyle=style,
                           label=f"{key} {p[key]:.1f}")
            ax.legend()
        ax.set_xlabel(label)
        ax.set_ylabel("count")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot saved to {path}")


async def resolve_model(client: httpx.AsyncClient, model: str | None) -> str:
    if model is not None:
        return model
    try:
        r = await client.get("/v1/models")
    except httpx.TransportError as e:
        raise SystemExit(f"cannot reach {client.base_url}: {e!r}") from None
    if r.status_code != 200:
        raise SystemExit(f"GET /v1/models: HTTP {r.status_code}: {r.text[:300]}"
                         + (" (pass --api-key)" if r.status_code == 401 else ""))
    return r.json()["data"][0]["id"]


async def run(args) -> tuple[list[RequestResult], float, str]:
    rng = random.Random(args.seed)
    times = arrival_times(args, rng)
    tokenizer = load_tokenizer(args.tokenizer)
    prompts = make_prompts(len(times), args.input_len, tokenizer, rng)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=args.base_url.rstrip("/"), headers=headers,
                                 timeout=args.timeout, limits=limits) as client:
        model = await resolve_model(client, args.model)
        print(f"model {model!r}, {len(times)} requests, endpoint {args.endpoint}, rate "
              f"{args.request_rate} req/s, input {args.input_len} / output {args.output_len} "
              f"tokens", flush=True)
        results = [RequestResult(prompt_len=args.input_len) for _ in times]
        semaphore = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
        t0 = time.perf_counter()

        async def launch(i: int) -> None:
            delay = times[i] - (time.perf_counter() - t0)
            if delay > 0:
                await asyncio.sleep(delay)
            if semaphore is None:
                await send(client, args, model, prompts[i], t0, results[i])
            else:
                async with semaphore:
                    await send(client, args, model, prompts[i], t0, results[i])

        await asyncio.gather(*(launch(i) for i in range(len(times))))
        elapsed = time.perf_counter() - t0
    return results, elapsed, model


def main(argv=None) -> dict:
    args = parse_args(argv)
    plt = check_plotting(args.save_plot)  # fail before the run, not after it
    print("command:", shlex.join(["python"] + sys.argv))
    results, elapsed, model = asyncio.run(run(args))
    summary = summarize(results, elapsed, args)
    print_table(summary, [r.error for r in results if not r.ok])
    if plt is not None and summary["successful_requests"]:
        save_plot(plt, args.save_plot, results, summary,
                  f"{model} via {args.endpoint}: {len(results)} requests at "
                  f"{args.request_rate} req/s, in {args.input_len} / out {args.output_len}")
    if args.output_json:
        config = {k: v for k, v in vars(args).items()}
        with open(args.output_json, "w") as f:
            json.dump({"config": config, "model": model, "summary": summary,
                       "requests": [asdict(r) for r in results]}, f, indent=1, default=str)
        print(f"results saved to {args.output_json}")
    return summary


if __name__ == "__main__":
    main()
