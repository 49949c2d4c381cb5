"""Resident memory at each stage of `LLM(...)` loading a model, in fresh processes (issue 33:
a bfloat16 checkpoint's peak RSS against llama.cpp's).

Each child process resets its peak (`/proc/self/clear_refs` 5) at every stage boundary, so a
stage's VmHWM is the peak reached within it; VmRSS, RssAnon and RssFile (mapped file pages) are
read at its end. While the checkpoint is read, the most file pages and anonymous memory seen at
any tensor are recorded too. Stages:

  imports     python, torch and pagedlm imported
  engine      configs, tokenizer, worker set up (until get_model)
  build       the model class constructed (weights allocated, not yet touched)
  narrow      weights given their storage dtype (store_weights_in)
  load        the checkpoint copied into the weights (the model's load_weights)
  process     process_weights_after_loading (panel packing, quantization)
  trim        malloc_trim after loading
  ready       the rest of LLM() (KV cache, runner)
  generate    one request of --prompt-len tokens and --max-tokens greedy tokens

With --serve the child runs `pagedlm serve` with the same settings instead, up to where it would
start answering (stage `ready`).

    .venv/bin/python benchmarks/load_memory.py --model /work/peers/models/llama1b/bf16 \\
        --dtype bfloat16 --runs 3 [--tree /path/to/another/checkout]

Figures are GiB (2**30 bytes); medians over --runs, one process after another.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIELDS = ("VmHWM", "VmRSS", "RssAnon", "RssFile")
GIB = 2**30


def status() -> dict[str, int]:
    """This process's memory fields, in bytes."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in FIELDS:
                out[key] = int(value.split()[0]) * 1024
    return out


def child(args) -> None:
    stages: list[dict] = []

    def mark(name: str, **extra) -> None:
        stages.append({"stage": name, **status(), **extra})
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM := VmRSS from here

    import torch  # noqa: F401

    from pagedlm import LLM, SamplingParams
    from pagedlm.model_executor.model_loader import loader
    from pagedlm.model_executor.models.base import CausalLMBase
    from pagedlm.worker import worker
    mark("imports")

    def around(owner, name: str, before: str | None, after: str | None) -> None:
        fn = getattr(owner, name)

        def wrapped(*a, **k):
            if before:
                mark(before)
            result = fn(*a, **k)
            if after:
                mark(after)
            return result
        setattr(owner, name, wrapped)

    around(worker, "get_model", "engine", None)
    around(loader, "materialize_weights", "build", None)
    around(loader, "store_weights_in", None, "narrow")
    around(loader, "round_other_weights", "load", None)
    around(CausalLMBase, "process_weights_after_loading", None, "process")
    around(worker, "release_freed_memory", None, "trim")
    reading = {"most_file": 0, "most_anon": 0}
    iterate = loader.iterate_safetensors

    def iterate_watched(model_dir):
        for item in iterate(model_dir):
            yield item
            now = status()  # after the consumer copied the tensor
            reading["most_file"] = max(reading["most_file"], now["RssFile"])
            reading["most_anon"] = max(reading["most_anon"], now["RssAnon"])
    loader.iterate_safetensors = iterate_watched

    max_len = args.prompt_len + args.max_tokens
    if args.serve:
        # `pagedlm serve` as benchmarks/lib/servers.py starts it, up to the moment it would
        # start answering.
        import uvicorn

        from pagedlm.entrypoints.cli import main as cli
        uvicorn.Server.run = lambda self, sockets=None: mark("ready")
        cli(["serve", "--model", args.model, "--dtype", args.dtype, "--port", "0",
             "--max-num-seqs", "1", "--max-model-len", str(max_len),
             "--num-gpu-blocks-override", str(-(-max_len // 16))])
    else:
        llm = LLM(args.model, dtype=args.dtype, max_model_len=max_len, max_num_seqs=1,
                  num_gpu_blocks_override=-(-max_len // 16))
        mark("ready")
        prompt = {"prompt_token_ids": list(range(100, 100 + args.prompt_len))}
        llm.generate([prompt], SamplingParams(max_tokens=args.max_tokens, temperature=0,
                                              ignore_eos=True), use_tqdm=False)
        mark("generate")
    for s in stages:
        if s["stage"] == "load":
            s.update(reading)
    print("STAGES " + json.dumps(stages))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--serve", action="store_true",
                   help="`pagedlm serve` instead of LLM(), stopped before it serves (no "
                        "generate stage)")
    p.add_argument("--tree", default=REPO, help="the pagedlm checkout to import")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args)
        return
    print("command:", " ".join(sys.argv))
    env = dict(os.environ, PYTHONPATH=os.path.abspath(args.tree))
    runs = []
    for _ in range(args.runs):
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--child",
                               *sys.argv[1:]], env=env, capture_output=True, text=True,
                              cwd=args.tree)
        line = next((x for x in proc.stdout.splitlines() if x.startswith("STAGES ")), None)
        if proc.returncode or line is None:
            sys.exit(f"child failed:\n{proc.stderr[-3000:]}")
        runs.append(json.loads(line.removeprefix("STAGES ")))
    print(f"{'stage':10} {'peak':>7} {'rss':>7} {'anon':>7} {'file':>7}   (GiB, median of "
          f"{len(runs)}; peak: VmHWM within the stage)")
    for i, s in enumerate(runs[0]):
        med = {k: statistics.median(r[i][k] for r in runs) / GIB for k in FIELDS}
        print(f"{s['stage']:10} {med['VmHWM']:7.3f} {med['VmRSS']:7.3f} {med['RssAnon']:7.3f} "
              f"{med['RssFile']:7.3f}")
        if "most_file" in s:
            most = {k: statistics.median(r[i][k] for r in runs) / GIB
                    for k in ("most_file", "most_anon")}
            print(f"{'':10} while reading: most file pages {most['most_file']:.3f}, "
                  f"most anonymous {most['most_anon']:.3f}")
    peaks = [max(s["VmHWM"] for s in r) for r in runs]
    print(f"peak over all stages: median {statistics.median(peaks) / GIB:.3f} GiB "
          f"({statistics.median(peaks) / 1e9:.3f} GB), runs "
          f"{', '.join(f'{x / GIB:.3f}' for x in peaks)}")


if __name__ == "__main__":
    main()
