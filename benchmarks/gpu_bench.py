"""Issue 35's GPU figures in one invocation, as JSON: pagedlm against transformers eager (no
torch.compile) on a random-weight model of SmolLM2-135M's shape, on the same GPU.

Legs, each in its own process under its own time limit (a hung or failed leg is recorded and
the next one runs; the JSON is rewritten after every leg, so a killed run keeps what it had):
- pagedlm: LLM(device=cuda, bfloat16), warm: one stream of 256 tokens, then 128 requests
  (prompts 32-512 tokens, outputs 16-256, seeded, ignore_eos) handed over at once; each timed
  RUNS times, the median kept. pagedlm_steps8: the same with num_scheduler_steps=8
  (multi-step decoding); pagedlm_steps8_cublas without the Triton GEMV, pagedlm_steps8_fused
  with the fused norm/activation GEMVs (PAGEDLM_TRITON_FUSED_NORM_ACT=1; the leg records
  whether they ran, under "fused_decode").
- serving, serving_steps8: `pagedlm serve` on the device (the second with
  --num-scheduler-steps 8, serving_steps8_eagerload also with CUDA_MODULE_LOADING=EAGER);
  Poisson arrivals at 20 requests/s for 15 s, streamed with httpx; TTFT p50/p99, TPOT, and
  where slow first tokens and long gaps fall (stalls).
- hf_float32, hf_bfloat16: transformers generate, warm, on the same stream and the same 128
  requests as one left-padded batch (each row runs to the longest output; only the tokens a
  request asked for count: useful tokens/s).
Ratios are against the better transformers figure of each workload; the targets are checked on
pagedlm's better leg of each (its settings named beside the figure).

The model's weights are random, and random tokens are often pieces of a UTF-8 character (byte
tokens, partial merges) that a stream holds back until the character completes: a client then
sees no text for many tokens, which inflated the time to first token and the gaps between
chunks in the first H200 runs (3 of 305 requests streamed no text at all). So the prepare leg
zeroes the output embedding rows of every token that is special or is not whole text on its
own: the greedy argmax never picks them, every token streams text, and the compute is the same.

    python benchmarks/gpu_bench.py --out gpu_bench.json             # on the GPU machine
    python benchmarks/gpu_bench.py --dry-run --out /tmp/bench.json  # CPU, tiny sizes: plumbing

Runs where transformers 5.17+ and pagedlm import (scripts/gpu_check.sh sets PYTHONPATH); the
model comes from .gpu_assets/ (scripts/gpu_assets.py) or, here, the embedded GGUF's metadata.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from lib.stats import throughput, write_json  # noqa: E402
from lib.workload import make_requests, ordinary_token_ids  # noqa: E402

WARM_SEED = 1000  # warm-up requests: seed + this
LEGS = ("pagedlm", "pagedlm_steps8", "pagedlm_steps8_cublas", "pagedlm_steps8_fused", "serving",
        "serving_steps8", "serving_steps8_eagerload", "hf_float32", "hf_bfloat16")
# Seconds each leg may take, start-up included (a leg's process is killed past it).
LEG_TIMEOUT = {"prepare": 90, "hf_float32": 70, "hf_bfloat16": 80}
RUNS = 3  # timed runs of each pagedlm workload (the median is kept)


def leg_steps(leg: str) -> int:
    """num_scheduler_steps of a pagedlm leg: 'pagedlm_steps8_cublas' -> 8."""
    found = re.search(r"_steps(\d+)", leg)
    return int(found.group(1)) if found else 1


def leg_env(leg: str) -> None:
    """A leg ending in _cublas runs without the Triton GEMV (PAGEDLM_TRITON_GEMV=0): cuBLAS's
    F.linear on decode-sized batches too. One ending in _fused runs the Llama layers' steps of
    <= 2 rows with each RMSNorm folded into the GEMV after it and SiLU-and-mul into the down
    GEMV (PAGEDLM_TRITON_FUSED_NORM_ACT=1: 3 launches fewer a layer, 90 a token here).
    One ending in _eagerload starts its server with CUDA_MODULE_LOADING=EAGER: CUDA loads
    every kernel of cuBLAS and torch at start-up instead of at a kernel's first launch. The
    serving legs of gpu-20261127d had one ~0.3 s pause a run, every stream waiting, with no
    Triton compile then; a cuBLAS kernel first picked for a prompt step larger than the
    warm-up's, and loaded then, is the suspect this leg tests."""
    if leg.endswith("_eagerload"):
        os.environ["CUDA_MODULE_LOADING"] = "EAGER"
    if leg.endswith("_cublas"):
        os.environ["PAGEDLM_TRITON_GEMV"] = "0"
    if leg.endswith("_fused"):
        os.environ["PAGEDLM_TRITON_FUSED_NORM_ACT"] = "1"
# Issue 35's targets.
TARGETS = {"single_tok_s": 1000, "single_ratio": 20, "batch_ratio": 10, "ttft_p99_ms": 100}


def sizes(dry_run: bool) -> dict:
    if dry_run:  # CPU plumbing check: a 2-layer model and a handful of short requests
        return dict(stream_tokens=16, num_requests=6, input_len=(8, 24), output_len=(4, 12),
                    rate=4.0, serve_s=2.0, layers=2, kv_blocks=512, max_model_len=256)
    return dict(stream_tokens=256, num_requests=128, input_len=(32, 512), output_len=(16, 256),
                rate=20.0, serve_s=15.0, layers=None, kv_blocks=8192, max_model_len=1024)


def workload(tokenizer, size: dict, seed: int):
    """(the one stream's request, the batch's requests): the same ids in every leg."""
    vocab = ordinary_token_ids(tokenizer)
    rng = random.Random(seed)
    stream = make_requests(vocab, 1, (32, 32), (size["stream_tokens"],) * 2, rng)[0]
    batch = make_requests(vocab, size["num_requests"], size["input_len"], size["output_len"],
                          rng)
    return stream, batch


def sync(device: str) -> None:
    import torch
    if device.startswith("cuda"):
        torch.cuda.synchronize()


# ---- legs (each runs in its own process: `--leg NAME`) ----

def leg_prepare(args, size) -> dict:
    import torch
    from tests.gpu.assets import write_random_smollm2
    from transformers import AutoTokenizer
    overrides = {"num_hidden_layers": size["layers"]} if size["layers"] else {}
    write_random_smollm2(args.model_dir, torch.bfloat16, **overrides)
    silenced = silence_partial_tokens(args.model_dir, AutoTokenizer.from_pretrained(
        args.model_dir))
    return {"model_dir": args.model_dir, "overrides": overrides,
            "tokens_never_generated": silenced}


def silence_partial_tokens(model_dir: str, tokenizer) -> int:
    """Zero the output embedding rows of the special tokens and of those that are not whole
    text alone (see the module docstring); returns how many."""
    from safetensors.torch import load_file, save_file
    path = Path(model_dir) / "model.safetensors"
    tensors = load_file(path)
    name = "lm_head.weight" if "lm_head.weight" in tensors else "model.embed_tokens.weight"
    special = set(tokenizer.all_special_ids)
    bad = [t for t in range(tensors[name].shape[0])
           if t in special or t >= len(tokenizer)
           or not (text := tokenizer.decode([t])) or "\ufffd" in text]
    tensors[name][bad] = 0
    save_file(tensors, str(path), metadata={"format": "pt"})
    return len(bad)


def leg_pagedlm(args, size, steps: int) -> dict:
    from pagedlm import LLM, SamplingParams
    result: dict = {"num_scheduler_steps": steps}
    t0 = time.perf_counter()
    llm = LLM(args.model_dir, device=args.device, dtype="bfloat16", seed=args.seed,
              max_model_len=size["max_model_len"], max_num_seqs=size["num_requests"],
              num_gpu_blocks_override=size["kv_blocks"], num_scheduler_steps=steps)
    result["load_s"] = round(time.perf_counter() - t0, 3)
    config = llm.llm_engine.config
    result["engine"] = {"device": str(getattr(config, "device", args.device)),
                        "compute_dtype": str(config.model_config.compute_dtype),
                        "enforce_eager": getattr(config.model_config, "enforce_eager", None)}
    stream, batch = workload(llm.get_tokenizer(), size, args.seed)
    # Warm-up prompts of the same shapes, other ids: the timed prompts must not be in the
    # prefix cache.
    warm_stream, warm_batch = workload(llm.get_tokenizer(), size, args.seed + WARM_SEED)

    def run(requests) -> float:
        prompts = [{"prompt_token_ids": list(p)} for p, _ in requests]
        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
                  for _, n in requests]
        sync(args.device)
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        sync(args.device)
        elapsed = time.perf_counter() - start
        for out, (_, n) in zip(outs, requests):
            assert len(out.outputs[0].token_ids) == n, "a request did not get its tokens"
        return elapsed

    run([(warm_stream.prompt, 16)])  # warm-up: the first steps, allocator, Triton compiles
    run([(p, 2) for p, _ in warm_batch])
    for name, requests in (("single", [stream]), ("batch", batch)):
        times = sorted(run(requests) for _ in range(RUNS))
        result[name] = throughput(requests, times[len(times) // 2])
        result[name]["runs_s"] = [round(t, 4) for t in times]
    try:  # where the time goes, for the next round of work (after the timed runs)
        result["profile"] = profile(run, stream, batch, args.device)
    except Exception as e:  # noqa: BLE001 - a profile must not cost the figures
        result["profile"] = f"failed: {e.__class__.__name__}: {e}"
    try:  # which fused decode path ran, if any (the _fused leg must show TritonFusedLayers)
        fused = llm.llm_engine.executor.worker.model.fused_decode
        result["fused_decode"] = {"stack": type(fused.stack).__name__ if fused.stack else None,
                                  "off_reason": fused.off_reason,
                                  "eager_steps": getattr(fused.stack, "steps", 0)}
    except AttributeError as e:
        result["fused_decode"] = f"not found: {e}"
    try:  # the one-worker executor's runner (CUDA graphs: helper C's CUDAGraphRunner)
        graphs = llm.llm_engine.executor.worker.runner.cuda_graphs
    except AttributeError as e:
        graphs, result["cuda_graphs"] = None, f"not found: {e}"
    if graphs is not None:
        result["cuda_graphs"] = {"sizes": getattr(graphs, "sizes", None),
                                 "replays": getattr(graphs, "replays", None),
                                 "capture_s": getattr(graphs, "capture_s", None)}
    llm.shutdown()
    return result


def profile(run, stream, batch, device: str) -> dict:
    """The one-stream run under torch.profiler (GPU kernel time against wall time, the top
    kernels) and under cProfile (the host's top functions), and the 128-request run under
    cProfile."""
    import cProfile
    import io
    import pstats

    import torch
    out: dict = {}
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        wall = run([stream])
    events = prof.key_averages()

    def device_us(e) -> float:
        return float(getattr(e, "self_device_time_total", None)
                     or getattr(e, "self_cuda_time_total", 0.0) or 0.0)
    kernels = sorted((e for e in events if device_us(e) > 0), key=device_us, reverse=True)
    out["single_wall_s"] = round(wall, 4)
    out["single_device_busy_s"] = round(sum(device_us(e) for e in kernels) / 1e6, 4)
    out["single_top_kernels"] = [[e.key[:90], e.count, round(device_us(e) / 1e3, 3)]
                                 for e in kernels[:15]]
    out["single_top_host_ops"] = [[e.key[:90], e.count, round(e.self_cpu_time_total / 1e3, 3)]
                                  for e in sorted(events, key=lambda e: e.self_cpu_time_total,
                                                  reverse=True)[:15]]
    for name, requests in (("single", [stream]), ("batch", batch)):
        prof_py = cProfile.Profile()
        prof_py.enable()
        run(requests)
        prof_py.disable()
        text = io.StringIO()
        pstats.Stats(prof_py, stream=text).sort_stats("tottime").print_stats(25)
        out[f"{name}_cprofile_tottime"] = text.getvalue().splitlines()[:45]
    return out


def leg_hf(args, size, dtype_name: str) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    dtype = getattr(torch, dtype_name)
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=dtype)
    model = model.to(args.device).eval()
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    result: dict = {"load_s": round(time.perf_counter() - t0, 3),
                    "attn_implementation": model.config._attn_implementation}
    stream, batch = workload(tokenizer, size, args.seed)
    warm_stream, warm_batch = workload(tokenizer, size, args.seed + WARM_SEED)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0

    def run(requests) -> float:
        """One left-padded batch, every row to the longest output asked for."""
        width = max(len(p) for p, _ in requests)
        ids = torch.full((len(requests), width), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, (prompt, _) in enumerate(requests):
            ids[row, width - len(prompt):] = torch.tensor(prompt)
            mask[row, width - len(prompt):] = 1
        new = max(n for _, n in requests)
        sync(args.device)
        start = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(ids.to(args.device), attention_mask=mask.to(args.device),
                                 max_new_tokens=new, min_new_tokens=new, do_sample=False,
                                 top_k=None, top_p=None, pad_token_id=pad)
        sync(args.device)
        elapsed = time.perf_counter() - start
        assert out.shape[1] == width + new, "transformers stopped early"
        return elapsed

    run([(warm_stream.prompt, 16)])  # warm-up (the 17 tok/s bfloat16 one was cold)
    run([(p, 2) for p, _ in warm_batch])
    result["single"] = throughput([stream], run([stream]))
    result["batch"] = throughput(batch, run(batch))
    return result


def leg_serving(args, size, steps: int) -> dict:
    from lib import servers
    from lib.client import Endpoint, check_streamed, first_model, http_client, run_streamed
    from lib.stalls import stall_timeline
    from lib.stats import serving_summary
    from lib.workload import arrival_times
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    vocab = ordinary_token_ids(tokenizer)
    rng = random.Random(args.seed + 1)
    arrivals = arrival_times(size["rate"], rng, duration=size["serve_s"])
    requests = make_requests(vocab, len(arrivals), size["input_len"], size["output_len"], rng)
    port = servers.free_port()
    argv = [sys.executable, "-m", "pagedlm.entrypoints.cli", "serve", args.model_dir,
            "--host", "127.0.0.1", "--port", str(port), "--device", args.device,
            "--dtype", "bfloat16", "--max-model-len", str(size["max_model_len"]),
            "--num-scheduler-steps", str(steps),
            "--max-num-seqs", "128", "--num-gpu-blocks-override", str(size["kv_blocks"]),
            "--uvicorn-log-level", "warning"]
    plan = servers.LaunchPlan(argv, {"PYTHONUNBUFFERED": "1"}, "pagedlm (this tree)")
    log = Path(args.log_dir) / "gpu_bench_server.log"
    result: dict = {"num_scheduler_steps": steps, "rate": size["rate"],
                    "duration_s": size["serve_s"],
                    "num_requests": len(requests), "server_log": str(log)}

    async def client_side() -> None:
        async with http_client(f"http://127.0.0.1:{port}", timeout=60) as client:
            # Special tokens as text: a random-weight model may pick nothing but special
            # tokens for a short output (3 of 305 requests did on an H200), and a request with
            # no text has no time to first token.
            endpoint = Endpoint(model=await first_model(client),
                                sampling={"temperature": 0.0, "skip_special_tokens": False})
            # Warm-up: staggered requests through every layer of the server and every kind
            # of step (prefill alone, mixed with decodes, decodes of many batch sizes).
            warm = [r.prompt for r in make_requests(vocab, 24, size["input_len"], (8, 8),
                                                    random.Random(args.seed + WARM_SEED))]
            await run_streamed(client, endpoint, warm, [16] * len(warm),
                               [0.02 * i for i in range(len(warm))])
            t_wall = time.time()
            results, elapsed = await run_streamed(client, endpoint,
                                                  [r.prompt for r in requests],
                                                  [r.max_tokens for r in requests], arrivals)
            summary = serving_summary(results, elapsed)
            result.update(summary)
            result["stalls"] = stall_timeline(results, t_wall)
            result["ttft_ms"]["p50"] = result["ttft_ms"]["median"]
            failed = [r.error for r in results if not r.ok][:3]
            if failed:
                result["first_errors"] = failed
            try:  # every request answered with the token counts asked for
                check_streamed("pagedlm", "serving", requests, results)
            except Exception as e:  # noqa: BLE001 - recorded beside the figures
                result["check_error"] = str(e)

    with servers.Server("pagedlm", plan, port, log, startup_timeout=90) as server:
        result["startup_s"] = round(server.startup_s, 3)
        asyncio.run(client_side())
    return result


def run_leg(args) -> None:
    # A time limit arrives as SIGTERM: unwind (the serving leg's server is stopped on the way).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(f"leg {args.leg}: terminated"))
    size = sizes(args.dry_run)
    leg_env(args.leg)
    if args.leg == "prepare":
        result = leg_prepare(args, size)
    elif args.leg.startswith("pagedlm"):
        result = leg_pagedlm(args, size, leg_steps(args.leg))
    elif args.leg.startswith("serving"):
        result = leg_serving(args, size, leg_steps(args.leg))
    else:
        result = leg_hf(args, size, args.leg.removeprefix("hf_"))
    Path(args.leg_out).write_text(json.dumps(result, indent=2, default=str))


# ---- the parent: one process per leg ----

def stop(proc: subprocess.Popen) -> None:
    """SIGTERM to the leg's process group (a leg unwinds: its server is stopped on the way),
    SIGKILL 20 s later."""
    for sig, wait_s in ((signal.SIGTERM, 20), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
            proc.wait(timeout=wait_s)
            return
        except ProcessLookupError:
            return
        except subprocess.TimeoutExpired:
            continue


def spawn(args, leg: str, timeout: float) -> dict:
    # Beside the model, not in the log folder: the device tool brings back only 8 files.
    leg_out = Path(args.model_dir).parent / f"gpu_bench_{leg}.json"
    leg_out.unlink(missing_ok=True)
    cmd = [sys.executable, __file__, "--leg", leg, "--leg-out", str(leg_out),
           "--model-dir", args.model_dir, "--device", args.device, "--seed", str(args.seed),
           "--log-dir", args.log_dir] + (["--dry-run"] if args.dry_run else [])
    print(f"[{time.strftime('%H:%M:%S')}] leg {leg} (limit {timeout:.0f} s)", flush=True)
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, start_new_session=True)
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        stop(proc)
        rc = f"timed out after {timeout:.0f} s"
    except BaseException:  # this process is stopped: so is the leg (and its server)
        stop(proc)
        raise
    wall = round(time.perf_counter() - start, 1)
    print(f"[{time.strftime('%H:%M:%S')}] leg {leg}: rc {rc}, {wall} s", flush=True)
    if rc == 0 and leg_out.is_file():
        return {"ok": True, "wall_s": wall, **json.loads(leg_out.read_text())}
    return {"ok": False, "wall_s": wall, "error": f"rc {rc} (its output is in the log above)"}


def ratios(report: dict) -> dict:
    legs = report["legs"]
    out: dict = {}
    for workload in ("single", "batch"):
        hf = [legs[k][workload]["output_tokens_per_s"] for k in ("hf_float32", "hf_bfloat16")
              if legs.get(k, {}).get("ok")]
        ours = {k: legs[k][workload]["output_tokens_per_s"] for k in legs
                if k.startswith("pagedlm") and legs[k].get("ok")}
        for k, tok_s in ours.items():
            out[f"{k}_{workload}_tok_s"] = tok_s
        if ours:
            best = max(ours, key=ours.get)
            out[f"best_pagedlm_{workload}"] = best
            out[f"best_pagedlm_{workload}_tok_s"] = ours[best]
            if hf:
                out[f"best_hf_{workload}_tok_s"] = max(hf)
                out[f"{workload}_ratio_vs_best_hf"] = ours[best] / max(hf)
    ttft = {k: legs[k]["ttft_ms"]["p99"] for k in legs
            if k.startswith("serving") and legs[k].get("ok") and "ttft_ms" in legs[k]}
    for k, p99 in ttft.items():
        out[f"{k}_ttft_p99_ms"] = p99
    if ttft:
        best = min(ttft, key=ttft.get)
        out["best_serving"] = best
        out["ttft_p99_ms"] = ttft[best]
    targets = {}
    if "best_pagedlm_single_tok_s" in out:
        targets["single_tok_s >= 1000"] = (out["best_pagedlm_single_tok_s"]
                                           >= TARGETS["single_tok_s"])
    if "single_ratio_vs_best_hf" in out:
        targets["single >= 20x best hf"] = out["single_ratio_vs_best_hf"] >= TARGETS[
            "single_ratio"]
    if "batch_ratio_vs_best_hf" in out:
        targets["batch >= 10x best hf"] = out["batch_ratio_vs_best_hf"] >= TARGETS["batch_ratio"]
    if "ttft_p99_ms" in out:
        targets["ttft p99 < 100 ms"] = out["ttft_p99_ms"] < TARGETS["ttft_p99_ms"]
    out["targets_met"] = targets
    return out


def machine(device: str) -> dict:
    import platform
    import torch
    info = {"python": platform.python_version(), "torch": torch.__version__,
            "device": device, "dry_run_note": None}
    try:
        import transformers
        import triton
        info["transformers"], info["triton"] = transformers.__version__, triton.__version__
    except ImportError as e:
        info["import_error"] = str(e)
    if device.startswith("cuda") and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="gpu_bench.json")
    p.add_argument("--device", default=None, help="default: cuda, or cpu with --dry-run")
    p.add_argument("--dry-run", action="store_true", help="tiny sizes (CPU plumbing check)")
    p.add_argument("--legs", default=",".join(LEGS), help=f"comma-separated of {LEGS}")
    p.add_argument("--model-dir", default=None, help="default: a fresh one under /tmp")
    p.add_argument("--log-dir", default=None, help="default: the --out file's folder")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--leg", choices=("prepare",) + LEGS, help=argparse.SUPPRESS)
    p.add_argument("--leg-out", help=argparse.SUPPRESS)
    args = p.parse_args()
    args.device = args.device or ("cpu" if args.dry_run else "cuda")
    args.log_dir = args.log_dir or str(Path(args.out).resolve().parent)
    if args.leg:
        run_leg(args)
        return
    Path(args.log_dir).mkdir(parents=True, exist_ok=True)
    args.model_dir = args.model_dir or str(Path(tempfile.mkdtemp(prefix="gpu_bench_")) / "model")
    legs = [leg for leg in args.legs.split(",") if leg]
    unknown = set(legs) - set(LEGS)
    if unknown:
        raise SystemExit(f"unknown legs {sorted(unknown)}; choose from {LEGS}")
    report = {"command": sys.argv, "sizes": sizes(args.dry_run), "machine": machine(args.device),
              "legs": {}}
    if args.dry_run:
        report["machine"]["dry_run_note"] = "tiny sizes: the plumbing, not a figure"
    # The overall limit (gpu_check.sh's `timeout`) arrives as SIGTERM: the running leg is
    # stopped and recorded as such.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("gpu_bench: terminated"))
    if not (Path(args.model_dir) / "config.json").is_file():
        report["legs"]["prepare"] = spawn(args, "prepare", LEG_TIMEOUT["prepare"])
        write_json(args.out, report)
    for leg in legs:
        try:
            report["legs"][leg] = spawn(args, leg, LEG_TIMEOUT.get(leg, 110))
        except SystemExit:
            report["legs"][leg] = {"ok": False, "error": "stopped by the overall time limit"}
            write_json(args.out, report)
            raise
        report["summary"] = ratios(report)
        write_json(args.out, report)
    print(json.dumps(report["summary"], indent=2))
    failed = [leg for leg, r in report["legs"].items() if not r["ok"]]
    if failed:
        raise SystemExit(f"failed legs: {failed} (see {args.out})")


if __name__ == "__main__":
    main()
