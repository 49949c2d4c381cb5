"""pagedlm on a GGUF file against transformers on the same file's gguf-py-dequantized weights
(issue 33's fidelity figure): greedy tokens and their logprobs, teacher-forced.

pagedlm generates --max-tokens greedy tokens for --prompts prompts of --prompt-len random
ordinary tokens; transformers (float32, its GGUF loader, which dequantizes with gguf-py) then
runs each prompt followed by pagedlm's tokens in one forward pass, so every position is compared
in the same context: where transformers' top token differs from pagedlm's, the gap between the
two in transformers' log-softmax (a near-tie when it is under --near-tie), and the largest
difference between pagedlm's logprob of its token and transformers' logprob of the same token.
The reference's median margin between its top two tokens says how often a difference is to be
expected: a random-weight model's distributions are flat.

    python benchmarks/gguf_fidelity.py --model /work/peers/models/llama1b/model-Q4_K_M.gguf
"""
from __future__ import annotations

import argparse
import gc
import json
import random
import shlex
import statistics
import sys
from pathlib import Path

from lib import stats
from lib.workload import make_requests, ordinary_token_ids


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
                threads: int) -> list[tuple[list[int], list[float]]]:
    import torch

    from pagedlm import LLM, SamplingParams
    torch.set_num_threads(threads)
    llm = LLM(model=model, quantization=quantization,
              max_model_len=max(len(p) for p in prompts) + max_tokens, max_num_seqs=len(prompts))
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
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--near-tie", type=float, default=0.05,
                   help="Logprob gap under which a different top token counts as a near-tie.")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-json", default=None, metavar="PATH")
    args = p.parse_args(argv)

    from pagedlm.model_executor.model_loader.model_path import resolve_model
    from transformers import AutoTokenizer
    vocab = ordinary_token_ids(AutoTokenizer.from_pretrained(resolve_model(args.model)))
    prompts = [r.prompt for r in make_requests(
        vocab, args.prompts, (args.prompt_len,) * 2, (args.max_tokens,) * 2,
        random.Random(f"{args.seed}-fidelity"))]
    quantization = None if args.quantization == "none" else args.quantization
    generated = run_pagedlm(args.model, prompts, args.max_tokens, quantization, args.threads)
    refs = reference_logprobs(args.model, [p + g[0] for p, g in zip(prompts, generated)],
                              args.max_tokens, args.threads)
    per_prompt = [compare_positions(ref, tokens, lps, args.near_tie)
                  for ref, (tokens, lps) in zip(refs, generated)]
    summary = {"identical_prompts": sum(r["identical"] for r in per_prompt),
               "prompts": len(per_prompt),
               "only_near_ties": all(r["only_near_ties"] for r in per_prompt),
               "max_gap": max((d["gap"] for r in per_prompt for d in r["differences"]),
                              default=0.0),
               "max_logprob_diff": max(r["max_logprob_diff"] for r in per_prompt),
               # How flat the reference's distributions are: a random model's top two tokens
               # are often closer than quantization moves logprobs.
               "median_top2_margin": statistics.median(
                   m for r in per_prompt for m in r["top2_margins"])}
    print(f"greedy tokens identical on {summary['identical_prompts']}/{summary['prompts']} "
          f"prompts; largest gap at a difference {summary['max_gap']:.4f} "
          f"({'all' if summary['only_near_ties'] else 'not all'} under --near-tie "
          f"{args.near_tie}); largest chosen-token logprob difference "
          f"{summary['max_logprob_diff']:.4f}; the reference's median top-2 margin "
          f"{summary['median_top2_margin']:.4f}")
    if args.output_json:
        stats.write_json(args.output_json, {
            "command": shlex.join(["python", *(sys.argv if argv is None else argv)]),
            "config": vars(args), "summary": summary, "per_prompt": per_prompt})
    else:
        print(json.dumps(per_prompt, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
