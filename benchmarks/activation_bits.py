"""How many bits of activations a model's greedy tokens need (issue 33's fidelity figure):
transformers (float32) on a GGUF file's gguf-py-dequantized weights, with every linear layer's
input x rounded per 32-block to b bits as the block kernels round it (d = amax / (2^(b-1) - 1),
round half to even), against the same model unrounded, teacher-forced on random-token
prompts: how many positions' top tokens change, how many prompts see a change in their last
--window positions, and the chosen token's logprob error. Also x rounded to bfloat16 (the
panels' many-row steps) and the 8 bits per 16-block.

With --generated G the last G tokens of each prompt stand for generated ones: the rows then
round the prompt's positions (a many-row prefill) and the generated ones (one-row decode steps)
each at their own precision (8 bits, 16, or exact), and only the G positions whose top tokens
pick the generated tokens (the last prompt position's and on) are compared. That says whether
x held precise in one kind of step only (cheap at one row, costly in the compute-bound
many-row steps) keeps the greedy tokens.

A random-weight model's distributions are flat (its median top-2 margin is printed), so this
says which x precision holds such a file to ">= 7/8 prompts identical", whatever the kernels:
pagedlm's default takes x at 8 bits (as llama.cpp does), PAGEDLM_PRECISE_ACTIVATIONS=1 at
about 16 (two 8-bit limbs).

    python benchmarks/activation_bits.py --model /work/peers/models/llama1b/model-Q4_K_M.gguf
"""
from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

from lib import stats
from lib.workload import make_requests, ordinary_token_ids


def round_blocks(x, bits: int, block: int):
    """x rounded per `block` elements of its last dimension to `bits`-bit integers times the
    block's amax / (2^(bits-1) - 1)."""
    import torch
    shape = x.shape
    xb = x.float().reshape(-1, shape[-1] // block, block)
    amax = xb.abs().amax(-1, keepdim=True)
    top = 2 ** (bits - 1) - 1
    inv = torch.where(amax != 0, top / amax, torch.zeros_like(amax))
    return ((xb * inv).round() * (amax / top)).reshape(shape).to(x.dtype)


def split_steps(prompt_positions: int, prefill_bits: int | None, decode_bits: int | None):
    """x rounded per 32-block to prefill_bits at the first prompt_positions positions and to
    decode_bits at the rest (None: left exact)."""
    def round_x(x):
        out = x.clone()
        for part, bits in ((slice(None, prompt_positions), prefill_bits),
                           (slice(prompt_positions, None), decode_bits)):
            if bits is not None:
                out[:, part] = round_blocks(x[:, part], bits, 32)
        return out
    return round_x


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", required=True, help="A GGUF file.")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=48,
                   help="random tokens a prompt; every position is compared")
    p.add_argument("--window", type=int, default=16,
                   help="a prompt counts as changed if one of its last WINDOW positions is")
    p.add_argument("--bits", type=int, nargs="+", default=[8, 10, 12, 14, 16])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--generated", type=int, default=0, metavar="G",
                   help="split each prompt: its last G tokens are decode steps (see above)")
    p.add_argument("--output-json", default=None, metavar="PATH")
    args = p.parse_args(argv)

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    torch.set_num_threads(args.threads)
    path = Path(args.model)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                 dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    prompts = [r.prompt for r in make_requests(
        ordinary_token_ids(tokenizer), args.prompts, (args.prompt_len,) * 2, (1, 1),
        random.Random(f"{args.seed}-activation-bits"))]
    ids = torch.tensor(prompts)
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]

    def logprobs(round_x):
        hooks = [] if round_x is None else [
            m.register_forward_pre_hook(lambda _m, a: (round_x(a[0]),)) for m in linears]
        try:
            with torch.inference_mode():
                return torch.log_softmax(model(ids).logits.float(), -1)
        finally:
            for h in hooks:
                h.remove()

    ref = logprobs(None)
    best = ref.argmax(-1)
    top2 = ref.topk(2, -1).values
    margin = float((top2[..., 0] - top2[..., 1]).median())
    print(f"{len(linears)} linear layers, {ids.numel()} positions; the reference's median "
          f"top-2 margin {margin:.4f}")
    if args.generated:
        cases = [(f"prefill {a}, decode {b}", split_steps(args.prompt_len - args.generated, a, b))
                 for a, b in ((8, 8), (8, None), (8, 16), (None, 8), (16, 8), (16, 16))]
        window = slice(args.prompt_len - args.generated - 1, args.prompt_len - 1)
    else:
        cases = [(f"{b} bits per 32", lambda x, b=b: round_blocks(x, b, 32)) for b in args.bits]
        cases += [("8 bits per 16", lambda x: round_blocks(x, 8, 16)),
                  ("bfloat16", lambda x: x.bfloat16().to(x.dtype))]
        window = slice(args.prompt_len - args.window, args.prompt_len)
    # The positions counted: with --generated only those that pick generated tokens.
    scope = window if args.generated else slice(None)
    rows = []
    for label, fn in cases:
        got = logprobs(fn)
        changed = got.argmax(-1) != best
        error = (got - ref).abs().gather(-1, best[..., None]).squeeze(-1)[:, scope]
        row = {"x": label, "changed_positions": int(changed[:, scope].sum()),
               "positions": changed[:, scope].numel(),
               "prompts_identical_in_window": int((~changed[:, window].any(-1)).sum()),
               "median_logprob_error": float(error.median()),
               "max_logprob_error": float(error.max())}
        rows.append(row)
        print(f"{label:24s} positions changed {row['changed_positions']:3d}/{row['positions']}"
              f", prompts identical over the window: "
              f"{row['prompts_identical_in_window']}/{args.prompts}, logprob error median "
              f"{row['median_logprob_error']:.5f} max {row['max_logprob_error']:.4f}",
              flush=True)
    if args.output_json:
        stats.write_json(args.output_json, {
            "command": " ".join(["python", *(sys.argv if argv is None else argv)]),
            "config": vars(args), "median_top2_margin": margin, "rows": rows})
    else:
        print(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
