"""Prefix-caching benchmark: many requests sharing one long prefix, with caching on and off.

64 requests share a 1,024-token prefix (random ordinary tokens) and each adds a distinct
32-token suffix; all are submitted to ``LLM.generate`` at once. The same requests run with
``enable_prefix_caching`` on and off in one invocation, and the script prints both times, the
speed-up, the prefix-cache hit rate and the prompt tokens each run actually computed.

    python benchmarks/prefix_cache.py                      # the acceptance workload
    python benchmarks/prefix_cache.py --num-prompts 16 --output-len 8   # quicker
    python benchmarks/prefix_cache.py --baseline-commit HEAD~1   # also at an older commit
"""
import argparse
import gc
import json
import os
import random
import shlex
import sys
import time

import torch

from lib.legs import run_script_at_commit, strip_option
from pagedlm import LLM, SamplingParams


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="GGUF file or HF dir (default: embedded SmolLM2)")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--prefix-len", type=int, default=1024)
    p.add_argument("--suffix-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--output-json", default=None)
    p.add_argument("--baseline-commit", default=None, metavar="REV",
                   help="also run this benchmark on pagedlm at git commit REV and compare")
    return p.parse_args()


def make_prompts(tokenizer, args):
    rng = random.Random(args.seed)
    special = set(tokenizer.all_special_ids)
    vocab = sorted(set(tokenizer.get_vocab().values()) - special)
    prefix = [rng.choice(vocab) for _ in range(args.prefix_len)]
    return [prefix + [rng.choice(vocab) for _ in range(args.suffix_len)]
            for _ in range(args.num_prompts)]


def run(args, prompts, caching: bool) -> dict:
    llm = LLM(model=args.model, seed=args.seed, enable_prefix_caching=caching)
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    engine = llm.llm_engine
    result = {
        "prefix_caching": caching,
        "elapsed_s": round(elapsed, 3),
        "prompt_tokens": sum(len(p) for p in prompts),
        "prompt_tokens_computed": engine.stats.num_prompt_tokens,
        "hit_rate": round(engine.prefix_cache_hit_rate, 4),
        "output_tokens": sum(len(o.outputs[0].token_ids) for o in outs),
        "tokens": [o.outputs[0].token_ids for o in outs],
    }
    print(f"[prefix caching {'on ' if caching else 'off'}] {elapsed:7.2f}s | prompt tokens "
          f"computed {result['prompt_tokens_computed']} of {result['prompt_tokens']} | "
          f"hit rate {100 * result['hit_rate']:.1f}% | {engine.stats.breakdown()}", flush=True)
    del llm, engine
    gc.collect()
    return result


def main():
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print("command:", shlex.join(["python"] + sys.argv))
    print(f"load average {os.getloadavg()[0]:.2f}, torch threads {torch.get_num_threads()}")
    from pagedlm.model_executor.model_loader.model_path import resolve_model
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(resolve_model(args.model))
    prompts = make_prompts(tokenizer, args)
    on = run(args, prompts, caching=True)
    off = run(args, prompts, caching=False)
    same = on.pop("tokens") == off.pop("tokens")
    speedup = off["elapsed_s"] / on["elapsed_s"]
    print(f"speed-up with prefix caching: {speedup:.2f}x "
          f"(greedy outputs {'identical' if same else 'DIFFER'})")
    figures = {"command": shlex.join(["python"] + sys.argv), "on": on, "off": off,
               "speedup": speedup, "identical_outputs": same}
    if args.baseline_commit:
        argv = strip_option(strip_option(sys.argv[1:], "--baseline-commit"), "--output-json")
        old = run_script_at_commit(args.baseline_commit, "benchmarks/prefix_cache.py", argv)
        figures["baseline"] = old
        for mode in ("on", "off"):
            ratio = old[mode]["elapsed_s"] / figures[mode]["elapsed_s"]
            figures[f"speed_ratio_{mode}"] = ratio
            print(f"[caching {mode:3}] this tree {figures[mode]['elapsed_s']:.2f}s, "
                  f"{args.baseline_commit} {old[mode]['elapsed_s']:.2f}s: "
                  f"{ratio:.3f}x the baseline's speed")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(figures, f, indent=2)


if __name__ == "__main__":
    main()
