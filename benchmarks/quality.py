"""Quality of quantized weights against float32, on one model in one invocation.

For each `--quantization` (float32 first, as the reference): greedy agreement with float32
(prompts whose tokens are all identical, and the share of identical tokens up to each prompt's
first difference), the largest difference of the chosen tokens' logprobs on those common
prefixes, perplexity on a fixed corpus (prompt logprobs) and its ratio to float32's, and the
bytes of linear-layer weights a decode step reads.

The corpus is TEXT plus --ppl-passages passages of English prose from Python's own language
reference (the stdlib's pydoc_data.topics: every machine with this Python has it, and nothing is
fetched), each scored as its own prompt. A ratio of perplexities on ~100 tokens is a draw: a
1e-7 relative perturbation of every quantized layer's input moved it between x0.989 and x1.017
(tests/models/test_quantization.py). So the ratio comes with a 95% interval from the per-token
log-likelihood differences (paired: the same tokens in the same contexts).

    python benchmarks/quality.py                       # embedded SmolLM2 Q4_1 GGUF
    python benchmarks/quality.py --quantization int8 int4 gguf --max-tokens 32
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import statistics
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


def corpus(passages: int, chars: int = 1500) -> list[str]:
    """TEXT, then `passages` passages of about `chars` characters: the prose paragraphs of the
    language reference's topics in sorted order (grammar rules, headings and indented code
    left out), joined until a passage is long enough."""
    from pydoc_data.topics import topics
    out, cur = [TEXT], ""
    for key in sorted(topics):
        for para in topics[key].split("\n\n"):
            para = " ".join(para.split())
            if (not para or topics[key].find("\n   " + para[:20]) >= 0 or "::=" in para
                    or para.startswith("*" * 3) or set(para) <= set("*=-")):
                continue
            cur = f"{cur}\n\n{para}" if cur else para
            if len(cur) >= chars:
                out.append(cur)
                cur = ""
                if len(out) > passages:
                    return out
    raise ValueError(f"the language reference holds fewer than {passages} passages")


def token_logprobs(llm: LLM, texts: list[str]) -> list[float]:
    """Every token's logprob given the ones before it in its text (all but each first)."""
    outs = llm.generate(texts, SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    return [pos[t].logprob for o in outs
            for t, pos in zip(o.prompt_token_ids[1:], o.prompt_logprobs[1:])]


def perplexity_ratio(ref: list[float], got: list[float]) -> dict:
    """exp(mean NLL) of each, the ratio, and its 95% interval from the paired per-token
    differences (normal approximation; thousands of tokens)."""
    if len(ref) != len(got):
        raise ValueError(f"token counts differ: {len(ref)} vs {len(got)}")
    diff = [r - g for r, g in zip(ref, got)]  # NLL(got) - NLL(ref) per token
    mean, se = statistics.fmean(diff), statistics.stdev(diff) / math.sqrt(len(diff))
    return {"tokens": len(diff), "perplexity": math.exp(-statistics.fmean(got)),
            "perplexity_ratio": math.exp(mean),
            "ratio_95": [math.exp(mean - 1.96 * se), math.exp(mean + 1.96 * se)]}


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


def measure(quantization: str | None, model: str | None, max_tokens: int,
            texts: list[str]) -> dict:
    t = time.perf_counter()
    llm = LLM(model=model, quantization=quantization)
    load_s = time.perf_counter() - t
    result = {"quantization": quantization or "float32", "load_s": round(load_s, 2),
              "weight_bytes": linear_weight_bytes(llm),
              "greedy": greedy(llm, PROMPTS, max_tokens),
              "token_logprobs": token_logprobs(llm, texts)}
    del llm
    gc.collect()
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="GGUF file or HF dir (default: embedded)")
    p.add_argument("--quantization", nargs="+", default=["gguf", "int8", "int4"],
                   choices=["gguf", "int8", "int4"])
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--ppl-passages", type=int, default=16,
                   help="Language-reference passages (about 350 tokens each) after TEXT.")
    p.add_argument("--output-json", default=None)
    args = p.parse_args()
    texts = corpus(args.ppl_passages)
    ref = measure(None, args.model, args.max_tokens, texts)
    rows = [ref] + [measure(q, args.model, args.max_tokens, texts) for q in args.quantization]
    print(f"perplexity over {len(ref['token_logprobs'])} tokens ({len(texts)} texts)")
    print(f"{'weights':>8} {'MB/step':>8} {'identical':>9} {'tokens':>7} {'max|dlogp|':>10} "
          f"{'ppl':>8} {'ppl/f32':>8} {'95% interval':>15}")
    table = []
    for r in rows:
        a = agreement(ref["greedy"], r["greedy"])
        ppl = perplexity_ratio(ref["token_logprobs"], r["token_logprobs"])
        row = {"quantization": r["quantization"], "weight_mb": r["weight_bytes"] / 1e6,
               **a, **ppl, "load_s": r["load_s"]}
        table.append(row)
        lo, hi = ppl["ratio_95"]
        print(f"{row['quantization']:>8} {row['weight_mb']:8.1f} "
              f"{a['identical_prompts']:>5}/{a['prompts']:<3} {a['token_agreement']:7.1%} "
              f"{a['max_logprob_diff']:10.2e} {ppl['perplexity']:8.3f} "
              f"{ppl['perplexity_ratio']:8.4f} {lo:7.4f}-{hi:.4f}")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"max_tokens": args.max_tokens, "prompts": PROMPTS,
                       "ppl_texts": len(texts), "rows": table}, f, indent=2)


if __name__ == "__main__":
    main()
