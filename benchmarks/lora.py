"""Multi-LoRA throughput: the same varied workload with no adapter, one adapter and four
adapters spread over the requests, in one run, with ratios to the no-adapter figures.

The adapters are random PEFT LoRAs (rank --rank on all attention and MLP projections) made for
the model with `peft` in a temporary directory. "no adapter" runs an engine with LoRA disabled
(today's default path); "no adapter, LoRA on" runs the LoRA engine with no adapter in any step
(what enabling LoRA costs by itself).

Acceptance workload (issue 11; target: 4 adapters >= 70% of the no-adapter throughput):
    python benchmarks/lora.py --num-prompts 128 --input-len 32:512 --output-len 16:256
"""
import argparse
import gc
import json
import os
import random
import shlex
import sys
import tempfile
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from lib.stats import print_throughput as report
from lib.stats import throughput as figures
from lib.stats import write_json as write_results
from lib.workload import make_requests, ordinary_token_ids, parse_len
from pagedlm import LLM, LoRARequest, SamplingParams
from pagedlm.model_executor.model_loader.model_path import resolve_model

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


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
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--num-adapters", type=int, default=4, help="of the many-adapter run")
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--skip-lora-on-base", action="store_true",
                   help="skip the 'no adapter, LoRA on' run")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--output-json", default=None)
    p.add_argument("--no-tqdm", action="store_true")
    return p.parse_args()


def make_adapters(model_dir, out_dir, n, rank, seed):
    import peft
    paths = []
    for i in range(n):
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        torch.manual_seed(seed + i)
        cfg = peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS,
                              init_lora_weights=False)
        path = os.path.join(out_dir, f"adapter{i}")
        peft.get_peft_model(base, cfg).save_pretrained(path)
        paths.append(path)
    return paths


def run(requests, args, model, loras, **engine_kwargs):
    """One engine, every request at once; loras[i % len(loras)] for request i (None: base)."""
    if args.max_num_seqs:
        engine_kwargs["max_num_seqs"] = args.max_num_seqs
    start = time.perf_counter()
    llm = LLM(model=model, seed=args.seed, **engine_kwargs)
    load_s = time.perf_counter() - start
    prompts = [{"prompt_token_ids": p} for p, _ in requests]
    params = [SamplingParams(temperature=1.0, top_p=1.0, max_tokens=n, ignore_eos=True)
              for _, n in requests]
    per_request = [loras[i % len(loras)] for i in range(len(requests))]
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=not args.no_tqdm, lora_request=per_request)
    elapsed = time.perf_counter() - start
    for out, (_, n) in zip(outs, requests):
        assert len(out.outputs[0].token_ids) == n
    st = llm.llm_engine.stats
    print(f"  step breakdown: {st.breakdown()}; {st.num_preemptions} preemptions, "
          f"{st.scheduler.num_lora_waits} adapter-slot waits")
    llm.shutdown()
    del llm
    gc.collect()
    return figures(requests, elapsed, load_s)


def main():
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model_dir = resolve_model(args.model)
    config = {k: (f"{v[0]}:{v[1]}" if isinstance(v, tuple) else v) for k, v in vars(args).items()}
    config.update(model=model_dir, torch=torch.__version__, torch_threads=torch.get_num_threads(),
                  cpus=os.cpu_count(), loadavg_1m=round(os.getloadavg()[0], 2))
    print("command:", shlex.join(["python"] + sys.argv))
    print("config:", json.dumps(config))
    requests = requests_of(AutoTokenizer.from_pretrained(model_dir), args)

    lora_engine = dict(enable_lora=True, max_loras=args.num_adapters, max_lora_rank=args.rank)
    with tempfile.TemporaryDirectory() as tmp:
        paths = make_adapters(model_dir, tmp, args.num_adapters, args.rank, args.seed)
        adapters = [LoRARequest(f"adapter{i}", i + 1, p) for i, p in enumerate(paths)]
        runs = [("no adapter", [None], {})]
        if not args.skip_lora_on_base:
            runs.append(("no adapter, LoRA on", [None], lora_engine))
        runs += [("1 adapter", adapters[:1], lora_engine),
                 (f"{args.num_adapters} adapters", adapters, lora_engine)]
        results = {}
        for name, loras, kwargs in runs:
            print(f"[{name}] running", flush=True)
            results[name] = run(requests, args, model_dir, loras, **kwargs)
            report(name, results[name])

    base = results["no adapter"]
    print()
    for name, fig in results.items():
        report(name, fig)
    ratios = {}
    for name, fig in results.items():
        if name == "no adapter":
            continue
        ratios[name] = {k: fig[k] / base[k] for k in
                        ("requests_per_s", "total_tokens_per_s", "output_tokens_per_s")}
        print(f"{name} / no adapter: total tokens/s {ratios[name]['total_tokens_per_s']:.2f}x, "
              f"output tokens/s {ratios[name]['output_tokens_per_s']:.2f}x")
    results["ratios_over_no_adapter"] = ratios
    if args.output_json:
        write_results(args.output_json, {"command": shlex.join(["python"] + sys.argv),
                                         "config": config, "results": results})


if __name__ == "__main__":
    main()
