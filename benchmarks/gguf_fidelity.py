"""pagedlm on a GGUF file against transformers on the same file's gguf-py-dequantized weights
(issue 33's fidelity figure): greedy tokens and their logprobs, teacher-forced.

pagedlm generates --max-tokens greedy tokens for --prompts prompts (--prompt-source random:
--prompt-len random ordinary tokens; chat: short questions in the model's chat template, as users
send them); transformers (float32, its GGUF loader, which dequantizes with gguf-py) then
runs each prompt followed by pagedlm's tokens in one forward pass, so every position is compared
in the same context: where transformers' top token differs from pagedlm's, the gap between the
two in transformers' log-softmax (a near-tie when it is under --near-tie), and the largest
difference between pagedlm's logprob of its token and transformers' logprob of the same token.
The reference's median margin between its top two tokens says how often a difference is to be
expected: a random-weight model's distributions are flat.

--llamacpp runs llama.cpp's llama-server on the same file and prompts and holds its tokens to the
same reference, so the figure shows what 8-bit activations cost any engine that uses them.

    python benchmarks/gguf_fidelity.py --model /work/peers/models/llama1b/model-Q4_K_M.gguf
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import random
import shlex
import statistics
import sys
from pathlib import Path

from lib import peers, stats
from lib.servers import (LaunchPlan, Server, ServerSettings, SystemSpec, free_port,
                         plan_llamacpp, source_type)
from lib.workload import make_requests, ordinary_token_ids

# Questions of the kind a chat user sends; the model's answers to them are mostly confident,
# unlike continuations of random tokens.
CHAT_QUESTIONS = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a CPU cache is in two sentences.",
    "List three fruits that are red.",
    "How many days are there in a leap year?",
    "Give me a short tip for learning to cook.",
    "What does the Python function len do?",
    "Translate 'good morning' into Spanish.",
)


def compare_positions(ref_logprobs, tokens: list[int], got_logprobs: list[float],
                      near_tie: float) -> dict:
    """ref_logprobs: [len(tokens), vocab] log-softmax of the reference at each generated
    position (teacher-forced on `tokens`); got_logprobs: the engine's logprob of each token."""
    differences, max_diff, margins = [], 0.0, []
    for i, token in enumerate(tokens):
        row = ref_logprobs[i]
        best = int(row.argmax())
        top2 = row.topk(2).values
        margins.append(float(top2[0] - top2[1]))
        max_diff = max(max_diff, abs(float(row[token]) - got_logprobs[i]))
        if best != token:
            differences.append({"position": i, "reference_token": best, "token": token,
                                "gap": float(row[best] - row[token])})
    return {"identical": not differences, "differences": differences,
            "only_near_ties": all(d["gap"] < near_tie for d in differences),
            "max_logprob_diff": max_diff, "top2_margins": margins}


def run_pagedlm(model: str, prompts: list[list[int]], max_tokens: int, quantization: str | None,
                threads: int, max_num_seqs: int) -> list[tuple[list[int], list[float]]]:
    import torch

    from pagedlm import LLM, SamplingParams
    torch.set_num_threads(threads)
    llm = LLM(model=model, quantization=quantization,
              max_model_len=max(len(p) for p in prompts) + max_tokens, max_num_seqs=max_num_seqs)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=1, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    result = []
    for out in outputs:
        c = out.outputs[0]
        result.append((list(c.token_ids), [lp[t].logprob for t, lp in zip(c.token_ids,
                                                                           c.logprobs)]))
    llm.shutdown()
    del llm
    gc.collect()
    return result


def run_llamacpp(model: str, prompts: list[list[int]], max_tokens: int, threads: int,
                 peers_dir: Path, log_dir: Path) -> tuple[str, list[tuple[list[int], list[float]]]]:
    """llama.cpp's greedy tokens and their logprobs, one request at a time on one slot."""
    import httpx
    install = peers.setup_llamacpp(peers_dir)
    spec = SystemSpec("llamacpp", "llamacpp", gguf_type=source_type(model))
    settings = ServerSettings(concurrency=1, threads=threads, model=model,
                              max_model_len=max(len(p) for p in prompts) + max_tokens)
    port = free_port()
    launch: LaunchPlan = plan_llamacpp(spec, settings, port, install, model)
    result = []
    with Server("llamacpp", launch, port, log_dir / "llamacpp-fidelity.log", 300):
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=300) as client:
            for prompt in prompts:
                r = client.post("/completion", json={
                    "prompt": prompt, "n_predict": max_tokens, "temperature": 0.0,
                    "n_probs": 1, "ignore_eos": True, "cache_prompt": False,
                    "return_tokens": True})
                r.raise_for_status()
                probs = r.json()["completion_probabilities"]
                result.append(([p["id"] for p in probs], [p["logprob"] for p in probs]))
    return install.version, result


def chat_prompts(tokenizer, n: int) -> list[list[int]]:
    if n > len(CHAT_QUESTIONS):
        raise SystemExit(f"--prompts {n}: --prompt-source chat has {len(CHAT_QUESTIONS)}")
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                           add_generation_prompt=True)
             for q in CHAT_QUESTIONS[:n]]
    return [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]


def summarize(per_prompt: list[dict]) -> dict:
    return {"identical_prompts": sum(r["identical"] for r in per_prompt),
            "prompts": len(per_prompt),
            "only_near_ties": all(r["only_near_ties"] for r in per_prompt),
            "max_gap": max((d["gap"] for r in per_prompt for d in r["differences"]),
                           default=0.0),
            "differing_positions": sum(len(r["differences"]) for r in per_prompt),
            "max_logprob_diff": max(r["max_logprob_diff"] for r in per_prompt),
            # How flat the reference's distributions are: a random model's top two tokens
            # are often closer than quantization moves logprobs.
            "median_top2_margin": statistics.median(
                m for r in per_prompt for m in r["top2_margins"])}


def reference_logprobs(model: str, sequences: list[list[int]], generated: int, threads: int):
    """transformers' float32 log-softmax at the last `generated` positions' predictions."""
    import torch
    from transformers import AutoModelForCausalLM
    torch.set_num_threads(threads)
    path = Path(model)
    ref = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                               dtype=torch.float32)
    rows = []
    with torch.inference_mode():
        for seq in sequences:
            logits = ref(torch.tensor([seq])).logits[0].float()
            # The prediction of token j is at position j - 1.
            rows.append(torch.log_softmax(logits[-generated - 1:-1], dim=-1))
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", required=True, help="A GGUF file.")
    p.add_argument("--quantization", default="gguf",
                   help="pagedlm's quantization ('none': its default for the file).")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--prompt-source", choices=("random", "chat"), default="random")
    p.add_argument("--prompt-len", type=int, default=32, help="random prompts' length")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--near-tie", type=float, default=0.05,
                   help="Logprob gap under which a different top token counts as a near-tie.")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--max-num-seqs", type=int, default=None,
                   help="pagedlm's sequences at a time (default: all the prompts together).")
    p.add_argument("--precise-activations", action="store_true",
                   help="Run pagedlm with PAGEDLM_PRECISE_ACTIVATIONS=1 (x in two 8-bit limbs "
                        "where the kernels take them, float32 for many-row steps).")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--llamacpp", action="store_true",
                   help="Also hold llama.cpp's llama-server (from --peers-dir) to the reference.")
    p.add_argument("--peers-dir", type=Path, default=Path.home() / ".cache" / "pagedlm-peers")
    p.add_argument("--output-json", default=None, metavar="PATH")
    args = p.parse_args(argv)

    from pagedlm.model_executor.model_loader.model_path import resolve_model
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(resolve_model(args.model))
    if args.prompt_source == "chat":
        prompts = chat_prompts(tokenizer, args.prompts)
    else:
        prompts = [r.prompt for r in make_requests(
            ordinary_token_ids(tokenizer), args.prompts, (args.prompt_len,) * 2,
            (args.max_tokens,) * 2, random.Random(f"{args.seed}-fidelity"))]
    quantization = None if args.quantization == "none" else args.quantization
    if args.precise_activations:  # read as the layers' methods are made, in this process
        os.environ["PAGEDLM_PRECISE_ACTIVATIONS"] = "1"
    engines = {"pagedlm": run_pagedlm(args.model, prompts, args.max_tokens, quantization,
                                      args.threads, args.max_num_seqs or len(prompts))}
    versions = {}
    if args.llamacpp:
        log_dir = Path(args.output_json).parent if args.output_json else Path(".")
        versions["llamacpp"], engines["llamacpp"] = run_llamacpp(
            args.model, prompts, args.max_tokens, args.threads, args.peers_dir, log_dir)
    results = {}
    for name, generated in engines.items():
        refs = reference_logprobs(args.model, [p + g[0] for p, g in zip(prompts, generated)],
                                  args.max_tokens, args.threads)
        per_prompt = [compare_positions(ref, tokens, lps, args.near_tie)
                      for ref, (tokens, lps) in zip(refs, generated)]
        summary = summarize(per_prompt)
        results[name] = {"summary": summary, "per_prompt": per_prompt}
        print(f"{name}: greedy tokens identical on {summary['identical_prompts']}/"
              f"{summary['prompts']} prompts ({summary['differing_positions']} differing "
              f"positions); largest gap at a difference {summary['max_gap']:.4f} "
              f"({'all' if summary['only_near_ties'] else 'not all'} under --near-tie "
              f"{args.near_tie}); largest chosen-token logprob difference "
              f"{summary['max_logprob_diff']:.4f}; the reference's median top-2 margin "
              f"{summary['median_top2_margin']:.4f}")
    if args.output_json:
        stats.write_json(args.output_json, {
            "command": shlex.join(["python", *(sys.argv if argv is None else argv)]),
            "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "versions": versions, "summary": results["pagedlm"]["summary"],
            "per_prompt": results["pagedlm"]["per_prompt"],
            "engines": results})
    else:
        print(json.dumps({k: v["per_prompt"] for k, v in results.items()}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
