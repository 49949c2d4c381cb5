"""Where one gguf stream's time goes: ms per decode token offline, through the server, and in the
model's forward alone, with the bytes a token reads against the measured read bandwidth.

One stream as compare.py's `single` workload runs it: a 32-token prompt of random ordinary
token ids (its seed, so the same ids), 256 greedy tokens with ignore_eos, the default model's
Q4_1 file kept in its blocks (`--quantization gguf`), one sequence and a cache of exactly its
18 blocks. Every leg runs in a fresh process (see lib/legs.py for why):

- offline: LLM(...).llm_engine stepped by hand, each step timed: the median decode step (a),
  with the engine's own step phases (schedule, prepare, forward, sample, output) from its
  step-observer hook; then a decode step's model forward replayed in place (the same inputs,
  the same KV slot written again) 200 times: the model alone (embedding, the fused decode
  stack, the final norm) and the LM head apart (c);
- server: `pagedlm serve --quantization gguf` started as compare.py starts it (lib/servers.py),
  one warm-up request, then --streams streamed /v1/completions requests (token ids, as compare.py
  sends them): the median time per output token after the first (TPOT) and the median gap
  between chunks (b), with the CPU time per token of each server thread (/proc: the event
  loop's, then the others by use: the engine thread and its OpenMP worker) and of this client.

`--baseline-commit REV` runs every leg also at commit REV (a git worktree, its tree first on
PYTHONPATH; the server from that tree), legs interleaved in ABBA order over --repeats rounds, and
prints each figure's median over the rounds and the ratio to the baseline's:

    .venv/bin/python benchmarks/gguf_stream.py --repeats 5 --baseline-commit HEAD~1

`--server-env K=V` sets an environment variable for the server legs; with `--baseline-server-env
K=V` (and no --baseline-commit) the same tree runs twice, the two settings being what is compared.
`--model FILE.gguf` runs another file (one whose tokenizer is the default model's, as
benchmarks/make_gguf_model.py builds them) instead. `--bandwidth` also measures the read bandwidth
(torch.sum over 1 GiB of float32, the best of 5, at the process's thread count), for the roofline:
bytes a token reads (`weight_bytes`) over it. `--py-spy` records each server with `py-spy record
--native -r 200`; on the 2-vCPU VMs that sampling stopped the server so often that it ran at about
1 tok/s, so its legs' timings mean nothing.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

PROMPT_LEN, OUTPUT_LEN = 32, 256
MAX_LEN = PROMPT_LEN + OUTPUT_LEN
NUM_BLOCKS = -(-MAX_LEN // 16)  # room for the one sequence, as compare.py gives it


def stream_prompt(seed: int = 0) -> list[int]:
    """compare.py's first `single` request (same generator name), so the same token ids."""
    from transformers import AutoTokenizer

    from lib.workload import make_requests, ordinary_token_ids
    from pagedlm.model_executor.model_loader.model_path import default_model_file, resolve_model
    tokenizer = AutoTokenizer.from_pretrained(resolve_model(default_model_file()))
    return make_requests(ordinary_token_ids(tokenizer), 1, (PROMPT_LEN,) * 2, (OUTPUT_LEN,) * 2,
                         random.Random(f"{seed}-single"))[0].prompt


# ---- the offline leg (in its own process) ----

def offline_leg(args) -> dict:
    import torch

    import pagedlm
    from lib.op_times import linear_weight_bytes
    from lib.roofline import read_bandwidth
    from pagedlm import LLM, SamplingParams
    from pagedlm.metrics.stats import StepObserver

    prompt = stream_prompt()
    llm = LLM(args.model, quantization="gguf", max_model_len=MAX_LEN, max_num_seqs=1,
              num_gpu_blocks_override=NUM_BLOCKS, seed=0)
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=OUTPUT_LEN, ignore_eos=True)
    llm.generate([{"prompt_token_ids": prompt}],
                 SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)

    def run(tag: str) -> tuple[list[float], list[int]]:
        engine.add_request(tag, {"prompt_token_ids": prompt}, params)
        steps, tokens = [], []
        while engine.has_unfinished_requests():
            t = time.perf_counter()
            outs = engine.step()
            steps.append(time.perf_counter() - t)
            for o in outs:
                if o.finished:
                    tokens = list(o.outputs[0].token_ids)
        return steps, tokens

    steps, tokens = run("plain")
    assert len(tokens) == OUTPUT_LEN, len(tokens)

    class Phases(StepObserver):
        def __init__(self):
            self.rows = []

        def step_finished(self, step):
            t = step.times
            self.rows.append((t.schedule, t.prepare, t.forward, t.sample, t.output))

    phases = Phases()
    engine.observers.append(phases)
    steps_obs, tokens_obs = run("observed")
    engine.observers.remove(phases)
    assert tokens_obs == tokens

    # A decode step's forward, captured by a pre-hook and replayed in place.
    model = engine.executor.worker.model
    captured = {}

    def grab(m, a, kw):
        # The middle decode step (context 160 of 288): attention reads the mean context.
        if a[0].shape[0] == 1 and int(a[1][0]) == PROMPT_LEN + OUTPUT_LEN // 2:
            captured["args"], captured["kwargs"] = a, kw

    handle = model.register_forward_pre_hook(grab, with_kwargs=True)
    run("capture")
    handle.remove()
    a, kw = captured["args"], captured["kwargs"]
    model_s, head_s = [], []
    with torch.inference_mode():
        for _ in range(200):
            t0 = time.perf_counter()
            hidden = model(*a, **kw)
            t1 = time.perf_counter()
            model.compute_logits(hidden)
            t2 = time.perf_counter()
            model_s.append(t1 - t0)
            head_s.append(t2 - t1)
    fused = getattr(getattr(model, "model", model), "fused_decode", None)
    decode = steps[1:]  # the first step is the prompt's
    cols = list(zip(*phases.rows[1:]))
    return {
        "pagedlm_path": os.path.dirname(pagedlm.__file__),
        "decode_step_ms": 1e3 * statistics.median(decode),
        "decode_mean_ms": 1e3 * statistics.fmean(decode),
        "prompt_step_ms": 1e3 * steps[0],
        "observed_decode_step_ms": 1e3 * statistics.median(steps_obs[1:]),
        "phases_ms": {name: 1e3 * statistics.median(c)
                      for name, c in zip(("schedule", "prepare", "forward", "sample", "output"),
                                         cols)},
        "model_forward_ms": 1e3 * statistics.median(model_s),
        "lm_head_ms": 1e3 * statistics.median(head_s),
        "fused_decode": None if fused is None else (fused.off_reason or "on"),
        "weight_bytes": linear_weight_bytes(llm),
        "torch_threads": torch.get_num_threads(),
        "bandwidth_gbs": (read_bandwidth(torch.get_num_threads(), huge=False)["small_pages"]
                          / 1e9 if args.bandwidth else None),
        "tokens_head": tokens[:8],
    }


# ---- the server leg (in this process; the server is its own) ----

def server_leg(tree: Path, args, prompt: list[int], log_dir: Path, label: str) -> dict:
    from lib import client
    from lib.servers import (SERVED_NAME, Server, ServerSettings, SystemSpec, free_port,
                             plan_pagedlm)
    spec = SystemSpec("pagedlm:gguf", "pagedlm", extra_args=("--quantization", "gguf"))
    port = free_port()
    launch = plan_pagedlm(spec, ServerSettings(1, MAX_LEN, args.threads, args.model), port, label)
    launch.env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(tree), os.environ.get("PYTHONPATH")) if p)
    launch.env.update(dict(kv.split("=", 1) for kv in args.server_env))
    endpoint = client.Endpoint(SERVED_NAME)
    log = log_dir / f"server-{label}-{time.time_ns()}.log"

    async def go(base_url: str) -> list:
        async with client.http_client(base_url, 300) as http:
            (warm,), _ = await client.run_streamed(http, endpoint, [prompt], [8], [0.0])
            if not warm.ok:
                raise RuntimeError(f"warm-up failed: {warm.error}")
            results = []
            for _ in range(args.streams):
                (r,), _ = await client.run_streamed(http, endpoint, [prompt], [OUTPUT_LEN],
                                                    [0.0])
                if not r.ok or r.output_tokens != OUTPUT_LEN:
                    raise RuntimeError(f"stream failed: {r.error or r.output_tokens}")
                results.append(r)
            return results

    with Server(label, launch, port, log, startup_timeout=300) as server:
        pid = server.proc.pid
        if args.py_spy:
            spy = subprocess.Popen([str(Path(sys.executable).parent / "py-spy"), "record",
                                    "--native", "-r", "200", "-p", str(pid), "-f", "raw",
                                    "-o", str(log_dir / f"pyspy-{label}.txt"), "--threads"],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(1.0)
        cpu0, own0 = thread_cpu_s(pid), time.process_time()
        t0 = time.perf_counter()
        results = asyncio.run(go(f"http://127.0.0.1:{port}"))
        wall = time.perf_counter() - t0
        cpu1, own1 = thread_cpu_s(pid), time.process_time()
        if args.py_spy:
            spy.send_signal(2)
            spy.wait(timeout=60)
    tokens = (args.streams * OUTPUT_LEN + 8)
    # CPU ms per output token of each server thread and of this client (warm-up included).
    used = {k: 1e3 * (cpu1[k] - cpu0.get(k, 0.0)) / tokens for k in cpu1}
    # The other threads ranked by use (their ids change from server to server): the engine
    # thread and the OpenMP worker first.
    ranked = sorted((v, k) for k, v in used.items() if k != "main")[::-1]
    cpu = {"main": used.get("main", 0.0), **{f"thread{i + 1}": v
                                             for i, (v, _) in enumerate(ranked[:4])}}
    cpu["client"] = 1e3 * (own1 - own0) / tokens
    cpu["wall"] = 1e3 * wall / tokens
    return {"tpot_ms": 1e3 * statistics.median(r.tpot for r in results),
            "cpu_ms_per_token": cpu,
            "itl_median_ms": 1e3 * statistics.median(
                statistics.median(r.itl) for r in results),
            "ttft_ms": 1e3 * statistics.median(r.ttft for r in results),
            "tok_s": statistics.median(r.output_tokens / r.latency for r in results)}


def thread_cpu_s(pid: int) -> dict[str, float]:
    """CPU seconds (user + system) of each thread of process `pid`: "main" (the event loop),
    else "name:tid" (Python 3.11 names no OS thread, so the engine thread and the OpenMP
    worker are told apart by what they use)."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            stat = (task / "stat").read_text()
        except OSError:
            continue
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()
        tid = task.name
        key = "main" if tid == str(pid) else f"{name}:{tid}"
        out[key] = out.get(key, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return out


# ---- the harness ----

def run_offline(tree: Path, args, tmp: Path) -> dict:
    out = tmp / f"offline-{time.time_ns()}.json"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(tree), env.get("PYTHONPATH")) if p)
    argv = [sys.executable, str(Path(__file__).resolve()), "--leg", "offline",
            "--output-json", str(out)] + (["--bandwidth"] if args.bandwidth else []) + (
                ["--model", args.model] if args.model else [])
    subprocess.run(argv, check=True, cwd=tree, env=env)
    fig = json.loads(out.read_text())
    if os.path.realpath(fig["pagedlm_path"]) != os.path.realpath(tree / "pagedlm"):
        raise RuntimeError(f"the {tree} leg imported pagedlm from {fig['pagedlm_path']}")
    return fig


def flatten(fig: dict, prefix: str = "") -> dict[str, float]:
    out = {}
    for k, v in fig.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}."))
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            out[prefix + k] = float(v)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--leg", choices=["offline"], default=None, help=argparse.SUPPRESS)
    p.add_argument("--parts", default="offline,server")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--streams", type=int, default=3, help="timed streams per server")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--baseline-commit", default=None, metavar="REV")
    p.add_argument("--server-env", nargs="*", default=[], metavar="K=V")
    p.add_argument("--baseline-server-env", nargs="*", default=None, metavar="K=V",
                   help="the baseline's server env instead (with no --baseline-commit: "
                        "the same tree twice, the settings being what is compared)")
    p.add_argument("--bandwidth", action="store_true")
    p.add_argument("--model", default=None, metavar="FILE.gguf",
                   help="a GGUF file with the default model's tokenizer (default: that model)")
    p.add_argument("--py-spy", action="store_true", help="py-spy record the server legs")
    p.add_argument("--output-json", default=None)
    args = p.parse_args()
    if args.leg == "offline":
        fig = offline_leg(args)
        Path(args.output_json).write_text(json.dumps(fig, indent=1))
        return 0

    repo = HERE.parent
    parts = args.parts.split(",")
    prompt = stream_prompt()
    legs = {"this": (repo, args.server_env)}
    with tempfile.TemporaryDirectory(prefix="pagedlm-gguf-stream-") as tmp_s:
        tmp = Path(tmp_s)
        log_dir = Path(args.output_json).parent if args.output_json else tmp
        if args.baseline_commit:
            tree = tmp / "baseline"
            subprocess.run(["git", "-C", str(repo), "worktree", "add", "--detach", "-q",
                            str(tree), args.baseline_commit], check=True)
            legs["baseline"] = (tree, args.baseline_server_env or args.server_env)
        elif args.baseline_server_env is not None:
            legs["baseline"] = (repo, args.baseline_server_env)
        figs: dict[str, list[dict]] = {name: [] for name in legs}
        try:
            names = list(legs)
            for r in range(args.repeats):
                order = names if r % 2 == 0 else names[::-1]  # ABBA
                for name in order:
                    tree, env = legs[name]
                    fig: dict = {"loadavg": os.getloadavg()[0]}
                    if "offline" in parts:
                        fig["offline"] = run_offline(tree, args, tmp)
                    if "server" in parts:
                        a = argparse.Namespace(**{**vars(args), "server_env": env})
                        fig["server"] = server_leg(tree, a, prompt, log_dir, f"{name}-{r}")
                    figs[name].append(fig)
                    print(f"round {r} {name}: " + json.dumps(
                        {k: round(v, 3) for k, v in flatten(fig).items()}), flush=True)
        finally:
            if args.baseline_commit:
                subprocess.run(["git", "-C", str(repo), "worktree", "remove", "--force",
                                str(tmp / "baseline")], check=False)
    medians = {name: {} for name in figs}
    for name, runs in figs.items():
        flat = [flatten(f) for f in runs]
        for key in flat[0]:
            medians[name][key] = statistics.median(f[key] for f in flat if key in f)
    print("\nmedians over", args.repeats, "round(s):")
    for key in medians["this"]:
        line = f"  {key:40s} {medians['this'][key]:10.3f}"
        if "baseline" in medians and key in medians["baseline"]:
            b = medians["baseline"][key]
            line += f"   baseline {b:10.3f}   ratio {medians['this'][key] / b:6.3f}" if b else ""
        print(line)
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(
            {"argv": sys.argv, "runs": figs, "medians": medians}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
