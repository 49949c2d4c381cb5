"""Determinism probe: does a request's output depend on how the engine computed it?

A few probe prompts (random ordinary tokens), each asked greedily and with seeded
temperature-1 sampling, logprobs=5, run under each variation issue 31 lists: in a batch with
other requests, with chunked prefill at several chunk sizes or without it, with the prefix read
from the prefix cache (float32 and bfloat16 KV cache), after forced preemption (recompute and
swap), on one thread, and with the fused decode stack off. Token ids and logprobs are compared
bitwise with the probe run alone (prefix caching off, one request per generate call; the
bfloat16-cache rows against the bfloat16-cache probe run alone). Every variation runs in a
fresh process (this script with --variant) so thread counts and env vars take effect.

    .venv/bin/python benchmarks/determinism.py                 # all variations, ~6 min on 2 cores
    .venv/bin/python benchmarks/determinism.py --only batch prefix
"""
import argparse
import json
import os
import random
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from pagedlm import LLM, SamplingParams  # noqa: E402

# variant -> (engine settings, process env, torch threads, reference row)
VARIANTS = {
    "alone": ({}, {}, None),
    "alone-bf16": ({"kv_cache_dtype": "bfloat16"}, {}, None),
    "batch": ({}, {}, None),
    "batch-seqs4": ({"max_num_seqs": 4}, {}, None),
    "chunk16": ({"max_num_batched_tokens": 16, "max_num_seqs": 16}, {}, None),
    "chunk32": ({"max_num_batched_tokens": 32, "max_num_seqs": 32}, {}, None),
    "chunk64": ({"max_num_batched_tokens": 64, "max_num_seqs": 64}, {}, None),
    "no-chunk": ({"enable_chunked_prefill": False}, {}, None),
    "prefix": ({"enable_prefix_caching": True}, {}, None),
    "prefix-bf16": ({"enable_prefix_caching": True, "kv_cache_dtype": "bfloat16"}, {}, None),
    "preempt-recompute": ({"num_gpu_blocks_override": 16, "preemption_mode": "recompute"},
                          {}, None),
    "preempt-swap": ({"num_gpu_blocks_override": 16, "preemption_mode": "swap",
                      "swap_space": 0.25}, {}, None),
    "threads1": ({}, {}, 1),
    "unfused": ({}, {"PAGEDLM_DISABLE_FUSED_DECODE": "1"}, None),
}


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-probes", type=int, default=6)
    p.add_argument("--probe-len", type=int, default=48)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--num-others", type=int, default=40,
                   help="other requests in the batch, preemption and chunked rows")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--only", nargs="+", choices=sorted(VARIANTS), default=None,
                   help="run only these variations (alone and alone-bf16 always run)")
    p.add_argument("--variant", choices=sorted(VARIANTS), default=None,
                   help="(internal) run one variation here and write its rows to --out")
    p.add_argument("--out", default=None, help="(internal) JSON file for --variant")
    p.add_argument("--output-json", default=None, help="write every row and figure here")
    return p.parse_args()


def ordinary_vocab(llm):
    tok = llm.get_tokenizer()
    return sorted(set(tok.get_vocab().values()) - set(tok.all_special_ids))


def make_probes(vocab, args):
    """[(key, prompt ids, SamplingParams)]: each probe greedy and seeded, reproducible."""
    rng = random.Random(args.seed)
    probes = []
    for i in range(args.num_probes):
        ids = [rng.choice(vocab) for _ in range(args.probe_len)]
        for mode, temp, seed in (("greedy", 0.0, None), ("seeded", 1.0, 1000 + i)):
            sp = SamplingParams(temperature=temp, top_p=1.0, seed=seed, logprobs=5,
                                max_tokens=args.output_len, ignore_eos=True)
            probes.append((f"p{i}-{mode}", ids, sp))
    return probes


def make_others(vocab, args):
    rng = random.Random(args.seed + 1)
    return [([rng.choice(vocab) for _ in range(rng.randint(16, 64))],
             SamplingParams(temperature=1.0, seed=rng.randrange(2**31),
                            max_tokens=rng.randint(8, 32), ignore_eos=True))
            for _ in range(args.num_others)]


def record(out):
    c = out.outputs[0]
    lps = [sorted((t, lp.logprob) for t, lp in pos.items()) for pos in c.logprobs]
    return {"ids": list(c.token_ids), "lps": lps}


def run_alone(llm, probes):
    return {key: record(llm.generate([{"prompt_token_ids": ids}], sp, use_tqdm=False)[0])
            for key, ids, sp in probes}


def run_batch(llm, probes, others, seed):
    """Probes at shuffled places among the other requests, all in one generate call."""
    items = [(key, ids, sp) for key, ids, sp in probes] + [(None, p, sp) for p, sp in others]
    random.Random(seed).shuffle(items)
    outs = llm.generate([{"prompt_token_ids": ids} for _, ids, _ in items],
                        [sp for _, _, sp in items], use_tqdm=False)
    return {key: record(o) for (key, _, _), o in zip(items, outs) if key is not None}


def run_prefix(settings, probes, args):
    """Per probe, fresh engines: cold then re-run (prefix from the cache), and warm after a
    different request sharing the first two thirds of the prompt."""
    rows = {"cold": {}, "rerun": {}, "warm": {}}
    rng = random.Random(args.seed + 2)
    for key, ids, sp in probes:
        llm = LLM(seed=args.seed, **settings)
        rows["cold"][key] = record(llm.generate([{"prompt_token_ids": ids}], sp,
                                                use_tqdm=False)[0])
        rows["rerun"][key] = record(llm.generate([{"prompt_token_ids": ids}], sp,
                                                 use_tqdm=False)[0])
        llm.shutdown()
        llm = LLM(seed=args.seed, **settings)
        keep = args.probe_len * 2 // 3
        sibling = ids[:keep] + [rng.choice(ids) for _ in range(args.probe_len - keep)]
        llm.generate([{"prompt_token_ids": sibling}], SamplingParams(max_tokens=1),
                     use_tqdm=False)
        rows["warm"][key] = record(llm.generate([{"prompt_token_ids": ids}], sp,
                                                use_tqdm=False)[0])
        llm.shutdown()
    return rows


def run_variant(args):
    """One variation in this process: {row name: {probe key: record}} plus facts."""
    settings, _env, threads = VARIANTS[args.variant]
    if threads:
        torch.set_num_threads(threads)
    # The reference has no prefix cache: a probe's greedy and seeded runs share its prompt.
    settings = {"enable_prefix_caching": False, **settings}
    name = args.variant
    if name.startswith("prefix"):
        llm = LLM(seed=args.seed, enable_prefix_caching=False)
        probes = make_probes(ordinary_vocab(llm), args)
        llm.shutdown()
        rows = {f"{name}-{k}": v for k, v in run_prefix(settings, probes, args).items()}
        return {"rows": rows, "threads": torch.get_num_threads()}
    llm = LLM(seed=args.seed, **settings)
    vocab = ordinary_vocab(llm)
    probes, others = make_probes(vocab, args), make_others(vocab, args)
    rows = {}
    if name.startswith(("alone", "chunk", "no-chunk", "threads", "unfused")):
        rows[name if name.startswith("alone") else f"{name}-alone"] = run_alone(llm, probes)
    if not name.startswith("alone"):
        rows[f"{name}-batch"] = run_batch(llm, probes, others, args.seed)
    stats = llm.llm_engine.stats
    facts = {"threads": torch.get_num_threads(), "preemptions": stats.num_preemptions,
             "swapped_out": stats.num_swapped_out}
    llm.shutdown()
    return {"rows": rows, **facts}


def spawn(variant, args):
    _settings, env, _threads = VARIANTS[variant]
    argv = [sys.executable, os.path.abspath(__file__), "--variant", variant,
            "--num-probes", str(args.num_probes), "--probe-len", str(args.probe_len),
            "--output-len", str(args.output_len), "--num-others", str(args.num_others),
            "--seed", str(args.seed)]
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        subprocess.run(argv + ["--out", f.name], check=True, env={**os.environ, **env})
        return json.load(open(f.name))


def compare(ref, got):
    """(ids equal, logprobs bitwise equal, max |logprob diff|) for one probe. Logprobs are
    compared up to the first differing token, since later positions have other contexts."""
    same_ids = ref["ids"] == got["ids"]
    diff = 0.0
    for t, (a, b) in enumerate(zip(ref["lps"], got["lps"])):
        da, db = dict(a), dict(b)
        for tok in da.keys() & db.keys():
            diff = max(diff, abs(da[tok] - db[tok]))
        if ref["ids"][t] != got["ids"][t]:
            break
    return same_ids, same_ids and ref["lps"] == got["lps"], diff


def table(results):
    ref = {"fp32": results["alone"]["rows"]["alone"],
           "bf16": results["alone-bf16"]["rows"]["alone-bf16"]}
    head = (f"{'row':<26}{'ref':>5}{'ids g':>7}{'ids s':>7}{'lp g':>6}{'lp s':>6}"
            f"{'max|dlp|':>11}{'thr':>5}{'preempt':>9}")
    lines = [head, "-" * len(head)]
    for variant, res in results.items():
        for row, recs in res["rows"].items():
            if row in ("alone", "alone-bf16"):
                continue
            which = "bf16" if "bf16" in row else "fp32"
            counts = {"greedy": [0, 0, 0], "seeded": [0, 0, 0]}
            worst = 0.0
            for key, rec in recs.items():
                same_ids, same_lps, diff = compare(ref[which][key], rec)
                c = counts[key.rsplit("-", 1)[1]]
                c[0] += same_ids
                c[1] += same_lps
                c[2] += 1
                worst = max(worst, diff)
            g, s = counts["greedy"], counts["seeded"]
            pre = res.get("preemptions")
            pre = "" if pre is None else f"{pre}/{res.get('swapped_out', 0)}"
            lines.append(f"{row:<26}{which:>5}{g[0]:>4}/{g[2]:<2}{s[0]:>4}/{s[2]:<2}"
                         f"{g[1]:>4}/{g[2]:<1}{s[1]:>4}/{s[2]:<1}{worst:>11.3g}"
                         f"{res['threads']:>5}{pre:>9}")
    return "\n".join(lines)


def main():
    args = parse_args()
    if args.variant:
        with open(args.out, "w") as f:
            json.dump(run_variant(args), f)
        return
    names = ["alone", "alone-bf16"] + [v for v in VARIANTS if v not in ("alone", "alone-bf16")
                                       and (args.only is None or v in args.only)]
    results = {}
    for name in names:
        print(f"--- {name} ---", flush=True)
        results[name] = spawn(name, args)
    print()
    print(f"{args.num_probes} probes of {args.probe_len} tokens, {args.output_len} output tokens "
          f"each, greedy (g) and seeded (s); counts are probes equal to the reference run alone "
          f"(ids: token ids; lp: every logprob bitwise). preempt: preemptions/swapped out.")
    print(table(results))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(results, f)


if __name__ == "__main__":
    main()
