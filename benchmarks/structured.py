"""Structured-output throughput: the varied workload with a JSON schema on every request, then
the same requests unconstrained, in one run, with the ratio of output tokens/s.

Fairness: a schema lets a request finish early (its JSON closes; the grammar then ends it even
with ignore_eos). So the constrained run goes first, with the schema `an array of strings` (no
maxItems: its content can run to max_tokens) and ignore_eos; the unconstrained run then asks
each request for exactly the tokens its constrained twin produced (ignore_eos). Both runs do the
same prefill and decode work, token for token; each runs in a fresh process (engines built one
after another in one process differ by up to 50% in forward time: lib/legs.py), after
a warm-up request that compiles the schema (its time is reported).

Acceptance workload (issue 13; target: constrained >= 80% of unconstrained output tokens/s):
    python benchmarks/structured.py --num-prompts 128 --input-len 32:512 --output-len 16:256
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
from transformers import AutoTokenizer

from lib.legs import run_script_fresh, strip_option
from lib.stats import print_throughput as report
from lib.stats import throughput as figures
from lib.stats import write_json as write_results
from lib.workload import make_requests, ordinary_token_ids, parse_len
from pagedlm import LLM, SamplingParams, StructuredOutputsParams
from pagedlm.model_executor.model_loader.model_path import resolve_model

SCHEMA = {"type": "array", "items": {"type": "string"}}


def requests_of(tokenizer, args):
    """throughput.py's workload for these options (the same seed gives the same requests)."""
    return make_requests(ordinary_token_ids(tokenizer), args.num_prompts, args.input_len,
                         args.output_len, random.Random(args.seed))


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="HF dir or GGUF (default: embedded SmolLM2)")
    p.add_argument("--num-prompts", type=int, default=128)
    p.add_argument("--input-len", type=parse_len, default=(32, 512), help="N or LO:HI")
    p.add_argument("--output-len", type=parse_len, default=(16, 256), help="N or LO:HI")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--schema", default=json.dumps(SCHEMA), help="JSON schema of every request")
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--output-json", default=None)
    p.add_argument("--no-tqdm", action="store_true")
    p.add_argument("--leg", choices=["constrained", "unconstrained"], default=None,
                   help="(internal) run one leg in this process and write it to --output-json")
    p.add_argument("--lengths", default=None,
                   help="(internal, unconstrained leg) comma-separated output lengths")
    return p.parse_args()


def run(name, model, prompts, params, args):
    kwargs = {"max_num_seqs": args.max_num_seqs} if args.max_num_seqs else {}
    start = time.perf_counter()
    llm = LLM(model=model, seed=args.seed, **kwargs)
    load_s = time.perf_counter() - start
    warmup_s = 0.0
    if params[0].structured_outputs is not None:
        # The first structured request builds xgrammar's vocabulary table and compiles the
        # schema (cached for the rest): a one-time cost, reported apart.
        start = time.perf_counter()
        llm.generate([prompts[0]], SamplingParams(max_tokens=1,
                                                  structured_outputs=params[0].structured_outputs),
                     use_tqdm=False)
        warmup_s = time.perf_counter() - start
    llm.llm_engine.stats.__init__(llm.llm_engine.scheduler.stats)
    print(f"[{name}] running", flush=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=not args.no_tqdm)
    elapsed = time.perf_counter() - start
    st = llm.llm_engine.stats
    print(f"  step breakdown: {st.breakdown()}; {st.num_preemptions} preemptions")
    llm.shutdown()
    del llm
    gc.collect()
    return outs, elapsed, load_s, warmup_s


def constrained_leg(model_dir, prompts, requests, args):
    so = StructuredOutputsParams(json=json.loads(args.schema))
    params = [SamplingParams(temperature=1.0, top_p=1.0, max_tokens=n, ignore_eos=True,
                             structured_outputs=so) for _, n in requests]
    outs, elapsed, load_s, warmup_s = run("JSON schema", model_dir, prompts, params, args)
    lengths = [len(o.outputs[0].token_ids) for o in outs]
    closed = sum(o.outputs[0].finish_reason == "stop" for o in outs)
    valid = 0
    for o in outs:
        try:
            json.loads(o.outputs[0].text)
            valid += o.outputs[0].finish_reason == "stop"
        except ValueError:
            pass
    print(f"  {closed} of {len(outs)} requests closed their JSON before max_tokens "
          f"({valid} of those parse); warm-up (vocabulary + compile) {warmup_s:.2f}s")
    actual = [(p, n) for (p, _), n in zip(requests, lengths)]
    fig = figures(actual, elapsed, load_s)
    fig.update(warmup_s=round(warmup_s, 3), closed_early=closed, lengths=lengths)
    return fig


def unconstrained_leg(model_dir, prompts, requests, args):
    lengths = [int(n) for n in args.lengths.split(",")]
    plain = [SamplingParams(temperature=1.0, top_p=1.0, max_tokens=n, ignore_eos=True)
             for n in lengths]
    outs, elapsed, load_s, _ = run("unconstrained", model_dir, prompts, plain, args)
    assert [len(o.outputs[0].token_ids) for o in outs] == lengths
    return figures([(p, n) for (p, _), n in zip(requests, lengths)], elapsed, load_s)


def main():
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model_dir = resolve_model(args.model)
    config = {k: (f"{v[0]}:{v[1]}" if isinstance(v, tuple) else v) for k, v in vars(args).items()
              if k != "lengths"}
    config.update(model=model_dir, torch=torch.__version__, torch_threads=torch.get_num_threads(),
                  cpus=os.cpu_count(), loadavg_1m=round(os.getloadavg()[0], 2))
    if args.leg:
        requests = requests_of(AutoTokenizer.from_pretrained(model_dir), args)
        prompts = [{"prompt_token_ids": p} for p, _ in requests]
        leg = constrained_leg if args.leg == "constrained" else unconstrained_leg
        write_results(args.output_json, leg(model_dir, prompts, requests, args))
        return
    print("command:", shlex.join(["python"] + sys.argv))
    print("config:", json.dumps(config))
    argv = strip_option(sys.argv[1:], "--output-json")
    results = {"JSON schema": run_script_fresh("benchmarks/structured.py",
                                               argv + ["--leg", "constrained"])}
    lengths = results["JSON schema"].pop("lengths")
    report("JSON schema", results["JSON schema"])
    results["unconstrained"] = run_script_fresh(
        "benchmarks/structured.py",
        argv + ["--leg", "unconstrained", "--lengths", ",".join(map(str, lengths))])
    report("unconstrained", results["unconstrained"])

    ratio = (results["JSON schema"]["output_tokens_per_s"]
             / results["unconstrained"]["output_tokens_per_s"])
    results["ratio_output_tokens_per_s"] = ratio
    print()
    for name in ("JSON schema", "unconstrained"):
        report(name, results[name])
    print(f"JSON schema / unconstrained: output tokens/s {ratio:.2f}x (target >= 0.80)")
    if args.output_json:
        write_results(args.output_json, {"command": shlex.join(["python"] + sys.argv),
                                         "config": config, "results": results})


if __name__ == "__main__":
    main()
