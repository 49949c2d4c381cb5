"""Quality of quantized weights against float32, on one model in one invocation.

For each `--quantization` (float32 first, as the reference): greedy agreement with float32
(prompts whose tokens are all identical, and the share of identical tokens up to each prompt's
first difference), the largest difference of the chosen tokens' logprobs on those common
prefixes, perplexity on a fixed text (prompt logprobs) and its ratio to float32's, and the
bytes of linear-layer weights a decode step reads.

    python benchmarks/quality.py                       # embedded SmolLM2 Q4_1 GGUF
    python benchmarks/quality.py --quantization int8 int4 gguf --max-tokens 32
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import time

from lib.op_times import linear_weight_bytes
from pagedlm import LLM, SamplingParams

PROMPTS = [
    "The capital of France is",
    "Write a short poem about the sea.",
    "def fibonacci(n):",
    "Explain in one sentence why the sky is blue.",
    "List three fruits that are red:",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "Translate to French: Good morning, how are you?",
]

# A fixed English passage (written for this benchmark) for perplexity.
TEXT = (
    "The town library opened its doors at nine every morning, and by ten the reading room was "
    "usually full. Students came to prepare for their examinations, retired teachers came to "
    "read the newspapers, and small children sat on the carpet in the corner while a volunteer "
    "read stories aloud. The building itself was old: its wooden floors creaked, the windows "
    "were tall and narrow, and in winter the radiators made a gentle knocking sound. Last year "
    "the council decided to repair the roof and to replace the heating system, which had been "
    "installed more than forty years earlier. During the work the library moved into the "
    "school gymnasium for three months. Many visitors said they missed the quiet of the old "
    "rooms, but they kept coming anyway, because the librarians knew their names and always "
    "had a recommendation ready. When the library finally returned to its building, the "
    "shelves had been rearranged, a small cafe had opened near the entrance, and the "
    "children's corner had new cushions in bright colours."
)


def chat(llm: LLM, text: str) -> str:
    tok = llm.get_tokenizer()
    if getattr(tok, "chat_template", None):
        return tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                       add_generation_prompt=True)
    return text


def greedy(llm: LLM, prompts: list[str], max_tokens: int) -> list[tuple[list[int], list[float]]]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
    outs = llm.generate([chat(llm, p) for p in prompts], params, use_tqdm=False)
    result = []
    for o in outs:
        c = o.outputs[0]
        result.append((list(c.token_ids), [lp[t].logprob for t, lp in zip(c.token_ids,
                                                                          c.logprobs)]))
    return result


def perplexity(llm: LLM, text: str) -> float:
    out = llm.generate([text], SamplingParams(max_tokens=1, prompt_logprobs=0),
                       use_tqdm=False)[0]
    ids = out.prompt_token_ids
    lps = [pos[t].logprob for t, pos in zip(ids[1:], out.prompt_logprobs[1:])]
    return math.exp(-sum(lps) / len(lps))


def agreement(ref, got) -> dict:
    """Prompts identical throughout; tokens identical before each prompt's first difference;
    the largest chosen-token logprob difference on those common prefixes."""
    same_prompts, same_tokens, total, max_dlp = 0, 0, 0, 0.0
    for (rt, rl), (gt, gl) in zip(ref, got):
        n = next((i for i, (a, b) in enumerate(zip(rt, gt)) if a != b), len(rt))
        same_prompts += n == len(rt)
        same_tokens += n
        total += len(rt)
        # Before position n both chose the same token in the same context.
        max_dlp = max([max_dlp] + [abs(a - b) for a, b in zip(rl[:n], gl[:n])])
    return {"identical_prompts": same_prompts, "prompts": len(ref),
            "token_agreement": same_tokens / total, "max_logprob_diff": max_dlp}


def measure(quantization: str | None, model: str | None, max_tokens: int) -> dict:
    t = time.perf_counter()
    llm = LLM(model=model, quantization=quantization)
    load_s = time.perf_counter() - t
    result = {"quantization": quantization or "float32", "load_s": round(load_s, 2),
              "weight_bytes": linear_weight_bytes(llm),
              "greedy": greedy(llm, PROMPTS, max_tokens), "perplexity": perplexity(llm, TEXT)}
    del llm
    gc.collect()
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="GGUF file or HF dir (default: embedded)")
    p.add_argument("--quantization", nargs="+", default=["gguf", "int8", "int4"],
                   choices=["gguf", "int8", "int4"])
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--output-json", default=None)
    args = p.parse_args()
    ref = measure(None, args.model, args.max_tokens)
    rows = [ref] + [measure(q, args.model, args.max_tokens) for q in args.quantization]
    print(f"{'weights':>8} {'MB/step':>8} {'identical':>9} {'tokens':>7} {'max|dlogp|':>10} "
          f"{'ppl':>8} {'ppl/f32':>8}")
    table = []
    for r in rows:
        a = agreement(ref["greedy"], r["greedy"])
        row = {"quantization": r["quantization"], "weight_mb": r["weight_bytes"] / 1e6,
               **a, "perplexity": r["perplexity"],
               "perplexity_ratio": r["perplexity"] / ref["perplexity"], "load_s": r["load_s"]}
        table.append(row)
        print(f"{row['quantization']:>8} {row['weight_mb']:8.1f} "
              f"{a['identical_prompts']:>5}/{a['prompts']:<3} {a['token_agreement']:7.1%} "
              f"{a['max_logprob_diff']:10.2e} {row['perplexity']:8.3f} "
              f"{row['perplexity_ratio']:8.3f}")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"max_tokens": args.max_tokens, "prompts": PROMPTS, "rows": table}, f,
                      indent=2)


if __name__ == "__main__":
    main()
