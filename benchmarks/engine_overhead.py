"""The engine's host (Python) overhead per step, on a model too small to cost anything.

A 1-layer Llama of hidden size 32 (random weights, the default model's tokenizer and vocabulary)
makes the forward pass nearly free, so a step's time is the scheduler, the block manager, the
request builder, the runner's input building, the output processing and detokenization, plus the
LM head and sampling over the 49k-token vocabulary. Two workloads, greedy with ignore_eos:

- one sequence generating 256 tokens (one stream: what bounds single-request latency);
- 128 requests of 8-token prompts generating 128 tokens each (a full decode batch).

    .venv/bin/python benchmarks/engine_overhead.py
    .venv/bin/python benchmarks/engine_overhead.py --baseline-ref HEAD~3

Each figure is the median over --runs runs of (wall time of the engine.step() loop / steps). With
`--baseline-ref REF` the same model and requests also run on pagedlm as it was at REF (a
temporary `git worktree`, imported through PYTHONPATH by a second process running this file), and
the runs alternate between the two trees, so that load on the shared machine hits both alike; the
ratios are baseline / this tree (above 1: this tree is faster). `--profile` prints cProfile's
top functions for the 128-request workload instead (in this process, this tree only).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKLOADS = {"single": (1, 256), "batch128": (128, 128)}  # (requests, output tokens)
PROMPT_LEN = 8


def build_model(out: str) -> None:
    """The 1-layer, hidden-32 Llama of tests/conftest.py's make_tiny_model shape."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from pagedlm.model_executor.model_loader.model_path import resolve_model
    tokenizer = AutoTokenizer.from_pretrained(resolve_model(None))
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                         max_position_embeddings=512, rms_norm_eps=1e-6, initializer_range=0.3,
                         tie_word_embeddings=False, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    LlamaForCausalLM(config).eval().save_pretrained(out)
    tokenizer.save_pretrained(out)


class Leg:
    """One engine on one tree's pagedlm, timing a workload per call."""

    def __init__(self, model_dir: str, output_kind: str) -> None:
        from pagedlm.engine.arg_utils import EngineArgs
        from pagedlm.engine.llm_engine import LLMEngine
        from pagedlm.sampling_params import RequestOutputKind, SamplingParams
        self.SamplingParams = SamplingParams
        self.output_kind = RequestOutputKind[output_kind]
        self.engine = LLMEngine.from_engine_args(EngineArgs(
            model=model_dir, max_model_len=512, num_gpu_blocks_override=2048,
            max_num_seqs=128))
        self.calls = 0
        for name in WORKLOADS:  # warm-up: first-use costs (kernel builds, page faults) here
            self.run(name)

    def run(self, name: str) -> dict:
        num_requests, max_tokens = WORKLOADS[name]
        rng = random.Random(0)
        params = self.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                                     output_kind=self.output_kind)
        engine = self.engine
        for i in range(num_requests):
            # Ordinary tokens (ids past the special ones), the same every run and tree.
            ids = [rng.randrange(1000, 40000) for _ in range(PROMPT_LEN)]
            engine.add_request(f"r{self.calls}-{i}", {"prompt_token_ids": ids}, params)
        self.calls += 1
        steps, tokens = 0, 0
        t0 = time.perf_counter()
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished or self.output_kind.name == "DELTA":
                    tokens += len(out.outputs[0].token_ids)
            steps += 1
        wall = time.perf_counter() - t0
        assert tokens == num_requests * max_tokens, (tokens, num_requests * max_tokens)
        return {"ms_per_step": 1e3 * wall / steps, "steps": steps, "tok_s": tokens / wall}


def leg_main(model_dir: str, output_kind: str) -> None:
    """Serve runs over stdin/stdout: one workload name per line in, one JSON line out."""
    import pagedlm
    leg = Leg(model_dir, output_kind)
    print(json.dumps({"ready": True, "pagedlm_path": os.path.dirname(pagedlm.__file__)}),
          flush=True)
    for line in sys.stdin:
        print(json.dumps(leg.run(line.strip())), flush=True)


class LegProcess:

    def __init__(self, tree: str, model_dir: str, output_kind: str) -> None:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (tree, env.get("PYTHONPATH")) if p)
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--leg", "--model-dir", model_dir,
             "--output-kind", output_kind],
            cwd=tree, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        ready = self._read()
        expected = os.path.realpath(os.path.join(tree, "pagedlm"))
        if os.path.realpath(ready["pagedlm_path"]) != expected:
            raise RuntimeError(f"the leg for {tree} imported pagedlm from "
                               f"{ready['pagedlm_path']}, not {expected}")

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"a leg exited (code {self.proc.wait()})")
        return json.loads(line)

    def run(self, name: str) -> dict:
        self.proc.stdin.write(name + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()


def _git(*args: str) -> str:
    return subprocess.run(["git", "-C", REPO, *args], check=True, capture_output=True,
                          text=True).stdout.strip()


def measure(model_dir: str, runs: int, baseline_ref: str | None, output_kind: str,
            tmp: str) -> dict:
    trees = {"this": REPO}
    if baseline_ref is not None:
        sha = _git("rev-parse", "--verify", f"{baseline_ref}^{{commit}}")
        trees["baseline"] = os.path.join(tmp, "baseline")
        _git("worktree", "add", "--detach", "-q", trees["baseline"], sha)
    legs = {}
    try:
        for name, tree in trees.items():
            legs[name] = LegProcess(tree, model_dir, output_kind)
        figures = {name: {w: [] for w in WORKLOADS} for name in trees}
        for r in range(runs):
            # Alternate which tree goes first, so neither always follows the other.
            order = list(trees) if r % 2 == 0 else list(reversed(trees))
            for w in WORKLOADS:
                for name in order:
                    figures[name][w].append(legs[name].run(w))
        report = {"runs": runs, "output_kind": output_kind, "load_avg": os.getloadavg(),
                  "trees": {}}
        for name, per_w in figures.items():
            report["trees"][name] = {w: {
                "ms_per_step": statistics.median(f["ms_per_step"] for f in fs),
                "ms_per_step_all": [round(f["ms_per_step"], 3) for f in fs],
                "steps": fs[0]["steps"],
                "tok_s": statistics.median(f["tok_s"] for f in fs)} for w, fs in per_w.items()}
        if baseline_ref is not None:
            report["baseline_ref"], report["baseline_commit"] = baseline_ref, sha
            report["speedup"] = {w: report["trees"]["baseline"][w]["ms_per_step"]
                                 / report["trees"]["this"][w]["ms_per_step"] for w in WORKLOADS}
        return report
    finally:
        for leg in legs.values():
            leg.close()
        if "baseline" in trees:
            subprocess.run(["git", "-C", REPO, "worktree", "remove", "--force",
                            trees["baseline"]], check=False)


def profile(model_dir: str, output_kind: str) -> None:
    import cProfile
    import pstats
    leg = Leg(model_dir, output_kind)
    prof = cProfile.Profile()
    prof.runcall(leg.run, "batch128")
    pstats.Stats(prof).sort_stats("tottime").print_stats(30)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--baseline-ref", default=None, metavar="REF",
                   help="also run pagedlm at this git ref (a worktree), interleaved")
    p.add_argument("--output-kind", default="FINAL_ONLY",
                   choices=["FINAL_ONLY", "DELTA", "CUMULATIVE"],
                   help="the requests' output kind (LLM.generate: FINAL_ONLY; streaming: DELTA)")
    p.add_argument("--profile", action="store_true")
    p.add_argument("--output-json", default=None)
    p.add_argument("--leg", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model-dir", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.leg:
        return leg_main(args.model_dir, args.output_kind)
    with tempfile.TemporaryDirectory(prefix="pagedlm-overhead-") as tmp:
        model_dir = os.path.join(tmp, "llama-1l-h32")
        build_model(model_dir)
        if args.profile:
            return profile(model_dir, args.output_kind)
        report = measure(model_dir, args.runs, args.baseline_ref, args.output_kind, tmp)
    for name, per_w in report["trees"].items():
        for w, f in per_w.items():
            print(f"{name:9s} {w:9s} {f['ms_per_step']:7.3f} ms/step  "
                  f"({f['steps']} steps, {f['tok_s']:8.0f} tok/s; runs {f['ms_per_step_all']})")
    for w, s in report.get("speedup", {}).items():
        print(f"speedup {w}: {s:.2f}x (baseline ms/step / this tree's)")
    print("load average:", " ".join(f"{x:.2f}" for x in report["load_avg"]))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
