"""Online serving benchmark, modelled on vLLM's benchmark_serving, for any OpenAI-compatible URL.

Sends random prompts at a Poisson rate (or all at once) as streaming requests and reports request
throughput, output tokens/s, and mean / median / p99 of time to first token (TTFT), time per
output token after the first (TPOT), inter-token latency (ITL) and end-to-end latency.

Acceptance workload (start the server first: `pagedlm serve`):
    python benchmarks/serving.py --base-url http://127.0.0.1:8000 --request-rate 4 \
        --duration 60 --save-plot serving.png

With --capacity it instead finds the highest Poisson rate the server sustains with TTFT p99 and
TPOT p99 within the SLO (--slo-ttft-p99-ms 1000, --slo-tpot-p99-ms 100), by bisection over
points of --capacity-duration (60) seconds and at least --capacity-min-requests (200) requests
(lib/capacity.py); compare.py's capacity workload is the same search on fresh servers:
    python benchmarks/serving.py --base-url http://127.0.0.1:8000 --capacity \
        --temperature 0 --output-json capacity.json
"""
from __future__ import annotations

import argparse
import asyncio
import math
import os
import random
import shlex
import sys
from dataclasses import asdict

from lib import capacity, client, stats
from lib.client import RequestResult
from lib.workload import arrival_times, ordinary_token_ids, text_prompts, word_prompts


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
    p.add_argument("--capacity", action="store_true",
                   help="Find the highest rate within the SLO instead (--request-rate, "
                        "--num-prompts and --duration do not apply).")
    capacity.add_args(p)
    args = p.parse_args(argv)
    try:
        args.slo, args.search = capacity.settings(args)
    except ValueError as e:
        p.error(str(e))
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
        return word_prompts(n, input_len, rng)
    return text_prompts(tokenizer, ordinary_token_ids(tokenizer), n, input_len, rng)


# ---- the run ----

def summarize(results: list[RequestResult], elapsed: float, args) -> dict:
    return {"request_rate": args.request_rate,
            **stats.serving_summary(results, elapsed, prompt_len_estimate=args.input_len)}


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
        ("Time per output token (ms)", [r.tpot * 1000 for r in ok if r.tpot is not None]),
        ("Inter-token latency (ms)", [x * 1000 for r in ok for x in r.itl]),
        ("End-to-end latency (s)", [r.latency for r in ok]),
    ]
    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5))
    for ax, (label, values) in zip(axes.flat, series):
        if values:
            ax.hist(values, bins=min(50, max(5, len(values) // 4)), color="#4c72b0")
            p = stats.distribution(values)
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


async def run(args) -> tuple[list[RequestResult], float, str]:
    rng = random.Random(args.seed)
    times = arrival_times(args.request_rate, rng, num=args.num_prompts, duration=args.duration,
                          burstiness=args.burstiness)
    prompts = make_prompts(len(times), args.input_len, load_tokenizer(args.tokenizer), rng)
    async with client.http_client(args.base_url, args.timeout, args.api_key) as http:
        endpoint = endpoint_of(args, await resolve_model(http, args.model))
        print(f"model {endpoint.model!r}, {len(times)} requests, endpoint {args.endpoint}, rate "
              f"{args.request_rate} req/s, input {args.input_len} / output {args.output_len} "
              f"tokens", flush=True)
        results, elapsed = await client.run_streamed(http, endpoint, prompts,
                                                     [args.output_len] * len(prompts), times,
                                                     args.max_concurrency)
    return results, elapsed, endpoint.model


async def resolve_model(http, model: str | None) -> str:
    return model if model is not None else await client.first_model(http)


def endpoint_of(args, model: str) -> client.Endpoint:
    return client.Endpoint(model, args.endpoint, args.ignore_eos,
                           {"temperature": args.temperature})


def run_capacity(args) -> dict:
    """--capacity: bisection on the Poisson rate (lib/capacity.py) against this one server."""
    tokenizer = load_tokenizer(args.tokenizer)

    async def point(rate: float, n: int, bound) -> tuple[list[RequestResult], float]:
        rng = random.Random(f"{args.seed}-capacity-{rate:.6f}")
        times = arrival_times(rate, rng, num=n, burstiness=args.burstiness)
        prompts = make_prompts(n, args.input_len, tokenizer, rng)
        async with client.http_client(args.base_url, args.timeout, args.api_key) as http:
            endpoint = endpoint_of(args, await resolve_model(http, args.model))
            return await client.run_streamed(http, endpoint, prompts, [args.output_len] * n,
                                             times, args.max_concurrency, ttft_bound=bound)

    def measure(rate: float) -> capacity.Point:
        n = capacity.point_size(rate, args.capacity_duration, args.capacity_min_requests)
        bound = None if args.capacity_full_points else capacity.ttft_bound(n, args.slo)
        results, elapsed = asyncio.run(point(rate, n, bound))
        p = capacity.point_of(rate, results, elapsed, bound)
        stopped = ("" if p.stopped_at_s is None else
                   f", stopped {p.stopped_at_s:.1f} s in ({bound.misses} first tokens over the "
                   f"bound)")
        print(f"{rate:.3f} req/s: {p.requests} requests ({p.failed} failed){stopped}, TTFT p99 "
              f"{p.ttft_p99_ms:.0f} ms, TPOT p99 {p.tpot_p99_ms:.1f} ms: "
              f"{'meets' if p.meets(args.slo) else 'misses'} the SLO", flush=True)
        return p

    found = capacity.find_capacity(measure, args.slo, args.search)
    print(f"capacity: {found.rate:.3f} requests/s with TTFT p99 <= {args.slo.ttft_p99_ms:.0f} ms "
          f"and TPOT p99 <= {args.slo.tpot_p99_ms:.0f} ms"
          + ("" if found.bracketed else " (no failing rate was reached: a lower bound)"))
    return found.to_json(args.slo)


def main(argv=None) -> dict:
    args = parse_args(argv)
    plt = check_plotting(args.save_plot)  # fail before the run, not after it
    print("command:", shlex.join(["python"] + sys.argv))
    if args.capacity:
        found = run_capacity(args)
        if args.output_json:
            stats.write_json(args.output_json, {"config": config_of(args), "capacity": found})
        return found
    results, elapsed, model = asyncio.run(run(args))
    summary = summarize(results, elapsed, args)
    print_table(summary, [r.error for r in results if not r.ok])
    if plt is not None and summary["successful_requests"]:
        save_plot(plt, args.save_plot, results, summary,
                  f"{model} via {args.endpoint}: {len(results)} requests at "
                  f"{args.request_rate} req/s, in {args.input_len} / out {args.output_len}")
    if args.output_json:
        stats.write_json(args.output_json, {"config": config_of(args), "model": model,
                                            "summary": summary,
                                            "requests": [asdict(r) for r in results]})
    return summary


def config_of(args) -> dict:
    return {k: (asdict(v) if k in ("slo", "search") else v) for k, v in vars(args).items()
            if k != "api_key"}


if __name__ == "__main__":
    main()
