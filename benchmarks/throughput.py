"""Offline throughput benchmark for pagedlm, modelled on vLLM's benchmark_throughput.

Random-token prompts with fixed (or uniformly drawn) input/output lengths, all
submitted to ``LLM.generate`` at once.  With ``--baseline hf`` the same requests
are also run through plain transformers ``generate`` (static batches, left
padding), so the two can be compared in one invocation.

Acceptance workload:
    python benchmarks/throughput.py --num-prompts 128 --input-len 32:512 \
        --output-len 16:256 --baseline hf

With ``--baseline-commit REV`` the same workload also runs on pagedlm as it was at commit REV
(that commit's own copy of this script, in a temporary worktree), for old-against-new ratios:
    python benchmarks/throughput.py --num-prompts 128 --input-len 32:512 \
        --output-len 16:256 --baseline-commit HEAD~1

With ``--quantization`` the pagedlm run is repeated for each weight format listed (``none``:
float32), with the bytes of weights a decode step reads and the bandwidth that implies next to
the measured memory bandwidth (a large tensor copy), e.g. single-stream decode:
    python benchmarks/throughput.py --num-prompts 1 --input-len 32 --output-len 256 \
        --temperature 0 --quantization none gguf int8 int4
With ``--trace-file FILE`` pagedlm records every step (metrics/tracer.py); ``--baseline no-trace``
runs the same workload untraced, for the tracer's cost (the trace is written at shutdown, outside
the timed part):
    python benchmarks/throughput.py --num-prompts 64 --input-len 32:256 --output-len 16:128 \
        --trace-file /tmp/run.json --baseline no-trace
What tracing *off* costs: the tracer's merge (09dd125) against its first parent (ad1039b), this
script run from a worktree of 09dd125. --repeats runs both legs N times each, in ABBA order,
each in a fresh process: here identical legs drifted by up to 50% within one invocation, so a
single pair of runs says little:
    python benchmarks/throughput.py --num-prompts 128 --input-len 32:512 \
        --output-len 16:256 --baseline-commit ad1039b --repeats 2

With ``--op-times`` the pagedlm run also reports where its time went (lib/op_times.py): the
step phases the engine hands its step observers (schedule, prepare, forward, sample, output), and
within forward every linear layer call (by the rows it multiplied, with its GFLOP/s), the LM
head, the attention layers (decode-only steps apart from steps with prefill rows) and every step
of the fused decode stack, timed by forward hooks on the model's modules
(PAGEDLM_DISABLE_FUSED_DECODE=1 splits the stack's steps into their layers). This is how the
README's account of the 128-request workload was measured.

With ``--baseline no-chunked-prefill`` the baseline is pagedlm itself with chunked prefill off,
so chunked prefill (the default) can be compared with one-step prefills:
    python benchmarks/throughput.py --num-prompts 64 --input-len 1024 --output-len 128 \
        --baseline no-chunked-prefill
With ``--deterministic --baseline default-mode`` pagedlm runs with deterministic=True and the
baseline is the same run without it (what the mode costs, issue 31):
    python benchmarks/throughput.py --num-prompts 128 --input-len 32:512 --output-len 16:256 \
        --deterministic --baseline default-mode --repeats 3
"""
import argparse
import gc
import json
import os
import random
import resource
import shlex
import sys
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import pagedlm
from lib.legs import run_script_at_commit, run_script_fresh, strip_flag, strip_option
from lib.op_times import OpTimes, linear_weight_bytes
from lib.stats import print_throughput as report
from lib.stats import throughput as figures
from lib.stats import write_json
from lib.workload import Request, make_requests, ordinary_token_ids, parse_len
from pagedlm import LLM, SamplingParams
from pagedlm.model_executor.model_loader.model_path import default_model_file


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None,
                   help="GGUF file or HF dir (default: embedded SmolLM2-135M)")
    p.add_argument("--num-prompts", type=int, default=128)
    p.add_argument("--input-len", type=parse_len, default=(128, 128), help="N or LO:HI")
    p.add_argument("--output-len", type=parse_len, default=(128, 128), help="N or LO:HI")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None)
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--num-gpu-blocks-override", type=int, default=None,
                   help="KV cache blocks, committed when the engine starts (compare.py gives its "
                        "server 6144); default: sized from free memory and faulted in as used")
    p.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction,
                   default=None, help="(default: the engine's default, on)")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=None, help="(default: the engine's default, on)")
    p.add_argument("--baseline", choices=["none", "hf", "no-chunked-prefill", "tp1", "no-trace",
                                          "default-mode"],
                   default="none", help="hf: transformers generate; no-chunked-prefill: pagedlm "
                   "without it; tp1: pagedlm on one worker (to compare with -tp / -pp); "
                   "no-trace: pagedlm without --trace-file")
    p.add_argument("--deterministic", action="store_true",
                   help="run pagedlm with deterministic=True (bitwise-reproducible outputs); "
                        "with --baseline default-mode the baseline is the same run without it")
    p.add_argument("--trace-file", default=None, metavar="FILE",
                   help="record every step: Chrome trace JSON here, step records beside it")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=None)
    p.add_argument("--pipeline-parallel-size", "-pp", type=int, default=None)
    p.add_argument("--distributed-executor-backend", choices=["uni", "mp", "ray"], default=None)
    p.add_argument("--baseline-commit", default=None, metavar="REV",
                   help="also run this workload on pagedlm at git commit REV and compare")
    p.add_argument("--repeats", type=int, default=1,
                   help="with a pagedlm baseline: run both legs this many times each, every leg "
                   "in a fresh process, in alternating order (AB BA AB...), and report each "
                   "round's ratio and the ratio of the summed times")
    p.add_argument("--hf-batch-size", type=int, default=32)
    p.add_argument("--threads", type=int, default=None,
                   help="torch.set_num_threads for both runs (default: torch's choice)")
    p.add_argument("--quantization", nargs="+", default=None,
                   choices=["none", "gguf", "int8", "int4"],
                   help="one value: the weight format of every pagedlm run (baselines and "
                        "--repeats included); several: pagedlm once per format listed, compared "
                        "with a roofline column (none: float32)")
    p.add_argument("--temperature", type=float, default=1.0, help="0: greedy")
    p.add_argument("--output-json", default=None, help="write config and all figures here")
    p.add_argument("--no-tqdm", action="store_true")
    p.add_argument("--op-times", action="store_true",
                   help="report the step phases and the time of the linear layers (by row "
                        "count), LM head, attention and fused decode stack")
    return p.parse_args()


def hf_location(model_path):
    """(dir, gguf_file or None) in the form from_pretrained wants."""
    if os.path.isfile(model_path):
        return os.path.dirname(os.path.abspath(model_path)), os.path.basename(model_path)
    return model_path, None


def workload(tokenizer, args) -> list[Request]:
    """The requests, reproducible for a given --seed."""
    return make_requests(ordinary_token_ids(tokenizer), args.num_prompts, args.input_len,
                         args.output_len, random.Random(args.seed))


def run_pagedlm(requests, args, model_file, **overrides):
    engine_kwargs = {k: v for k, v in {
        "dtype": args.dtype,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "num_gpu_blocks_override": args.num_gpu_blocks_override,
        "enable_chunked_prefill": args.enable_chunked_prefill,
        "enable_prefix_caching": args.enable_prefix_caching,
        "tensor_parallel_size": args.tensor_parallel_size,
        "pipeline_parallel_size": args.pipeline_parallel_size,
        "distributed_executor_backend": args.distributed_executor_backend,
        "trace_file": args.trace_file,
        "deterministic": args.deterministic or None,
        # One --quantization value is the run's weight format (so baselines and --repeats apply
        # to it); several are compared by run_quantizations.
        "quantization": (args.quantization[0] if args.quantization and len(args.quantization) == 1
                         and args.quantization[0] != "none" else None),
    }.items() if v is not None}
    engine_kwargs.update(overrides)
    start = time.perf_counter()
    llm = LLM(model=model_file, seed=args.seed, **engine_kwargs)
    load_s = time.perf_counter() - start

    prompts = [{"prompt_token_ids": p} for p, _ in requests]
    # temperature=1.0 (random sampling) as in vLLM's benchmark; ignore_eos pins the output length.
    params = [SamplingParams(temperature=args.temperature, top_p=1.0, max_tokens=n,
                             ignore_eos=True)
              for _, n in requests]
    op_times = attach_op_times(llm) if args.op_times else None
    usage0 = resource.getrusage(resource.RUSAGE_SELF)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=not args.no_tqdm)
    elapsed = time.perf_counter() - start
    usage1 = resource.getrusage(resource.RUSAGE_SELF)
    if op_times is not None:
        llm.llm_engine.observers.remove(op_times)
        op_times.detach()
        op_times.report(elapsed)

    assert len(outs) == len(requests), (len(outs), len(requests))
    for out, (prompt, n) in zip(outs, requests):
        assert list(out.prompt_token_ids) == prompt, "outputs not in input order"
        got = len(out.outputs[0].token_ids)
        assert got == n, f"pagedlm produced {got} tokens, asked for {n}"
    st = llm.llm_engine.stats
    print(f"pagedlm step breakdown: {st.breakdown()}; {st.num_preemptions} preemptions")
    # Page faults cost about 11 us each on this project's VMs (the host backs guest memory
    # lazily), so they are worth seeing next to the time they cost.
    print(f"pagedlm timed part (this process): "
          f"{usage1.ru_minflt - usage0.ru_minflt} page faults, "
          f"{usage1.ru_stime - usage0.ru_stime:.1f} s system time, "
          f"{usage1.ru_utime - usage0.ru_utime:.1f} s user time")
    # Only a worker in this process has its model here (tp/pp run workers elsewhere).
    weight_bytes = (linear_weight_bytes(llm) if hasattr(llm.llm_engine.executor, "worker")
                    else None)
    if hasattr(llm, "shutdown"):  # stop worker processes before the next run
        llm.shutdown()
    del llm
    gc.collect()  # free the engine's KV cache before the baseline loads its own model
    fig = figures(requests, elapsed, load_s)
    if weight_bytes is not None:
        fig["linear_weight_bytes"] = weight_bytes
    if op_times is not None:
        fig["op_times"] = op_times.to_json()
    return fig


def attach_op_times(llm) -> OpTimes:
    """OpTimes on the engine's step-observer hook and on its model's modules (lib/op_times.py);
    only a worker in this process has its model here."""
    worker = getattr(llm.llm_engine.executor, "worker", None)
    if worker is None:
        raise SystemExit("--op-times needs the model in this process: run without -tp / -pp "
                         "(or with --distributed-executor-backend uni)")
    op_times = OpTimes().attach(worker.model)
    llm.llm_engine.observers.append(op_times)
    return op_times


def memory_bandwidth_gbs(nbytes: int = 1 << 30, repeats: int = 5) -> float:
    """Best of `repeats` copies of a 1 GiB tensor: bytes read + written per second."""
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return 2 * nbytes / best / 1e9


def run_hf(requests, args, model_file, tokenizer):
    """Plain transformers: fp32 model, static batches in arrival order, left padding."""
    model_dir, gguf = hf_location(model_file)
    extra = {"gguf_file": gguf} if gguf else {}
    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, **extra).eval()
    load_s = time.perf_counter() - start
    pad_id = (tokenizer.pad_token_id if tokenizer.pad_token_id is not None
              else tokenizer.eos_token_id)

    torch.manual_seed(args.seed)
    bs = args.hf_batch_size
    num_batches = (len(requests) + bs - 1) // bs
    start = time.perf_counter()
    with torch.inference_mode():
        for b in range(num_batches):
            batch = requests[b * bs:(b + 1) * bs]
            width = max(len(p) for p, _ in batch)
            ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
            mask = torch.zeros((len(batch), width), dtype=torch.long)
            for i, (p, _) in enumerate(batch):
                ids[i, width - len(p):] = torch.tensor(p)
                mask[i, width - len(p):] = 1
            # A static batch runs until its longest request is done; min_new_tokens stops
            # EOS from ending any row early, so every request gets at least what it asked.
            n_new = max(n for _, n in batch)
            out = model.generate(ids, attention_mask=mask, do_sample=True, temperature=1.0,
                                 top_k=0, top_p=1.0, max_new_tokens=n_new,
                                 min_new_tokens=n_new, pad_token_id=pad_id)
            assert out.shape[1] - width >= n_new, (out.shape, width, n_new)
            if not args.no_tqdm:
                print(f"  hf batch {b + 1}/{num_batches}: {len(batch)} reqs, pad width {width}, "
                      f"{n_new} new tokens, {time.perf_counter() - start:.1f}s", flush=True)
    elapsed = time.perf_counter() - start
    return figures(requests, elapsed, load_s)


def main():
    args = parse_args()
    model_file = args.model or default_model_file()
    if args.threads:
        # On a shared/oversubscribed box, torch's default (one thread per core) can spin and
        # run several times slower than fewer threads; pin it for both engines alike.
        torch.set_num_threads(args.threads)
    config = {k: (f"{v[0]}:{v[1]}" if isinstance(v, tuple) else v) for k, v in vars(args).items()}
    # Load average is recorded because CPU figures are meaningless on a busy machine.
    config.update(model=model_file, torch=torch.__version__,
                  pagedlm_path=os.path.dirname(os.path.abspath(pagedlm.__file__)),
                  torch_threads=torch.get_num_threads(), cpus=os.cpu_count(),
                  loadavg_1m=round(os.getloadavg()[0], 2))
    print("command:", shlex.join(["python"] + sys.argv))
    print("config:", json.dumps(config))

    # Requests are built from the model's own tokenizer, independent of either engine
    # (the HF baseline reuses it: GGUF tokenizer conversion takes several seconds).
    model_dir, gguf = hf_location(model_file)
    tokenizer = AutoTokenizer.from_pretrained(model_dir, **({"gguf_file": gguf} if gguf else {}))
    requests = workload(tokenizer, args)

    if args.quantization and len(args.quantization) > 1:
        run_quantizations(requests, args, model_file)
        return
    baselines = [args.baseline] if args.baseline != "none" else []
    if args.baseline_commit:
        baselines.append(f"commit {args.baseline_commit}")
    # Every pagedlm baseline runs in a fresh process (lib/legs.py says why); the same
    # script with its options changed, and "--baseline none" so it runs its one leg only.
    argv = strip_option(strip_option(sys.argv[1:], "--baseline-commit"), "--output-json")
    argv = strip_option(strip_option(argv, "--repeats"), "--baseline") + ["--baseline", "none"]
    if args.repeats > 1:
        if len(baselines) != 1 or baselines[0] == "hf":
            raise SystemExit("--repeats needs exactly one pagedlm baseline (--baseline-commit, "
                             "no-trace, tp1 or no-chunked-prefill)")
        results = repeated_rounds(baselines[0], argv, args)
    else:
        results = {"pagedlm": run_pagedlm(requests, args, model_file)}
        report("pagedlm", results["pagedlm"])
    for name in baselines if args.repeats == 1 else []:
        if name == "hf":
            results[name] = run_hf(requests, args, model_file, tokenizer)
        else:
            results[name] = baseline_leg(name, argv, args)
        report("pagedlm", results["pagedlm"])  # repeated so both sit together at the end
        report(name, results[name])
        ratios = {}
        for key, label in [("requests_per_s", "requests/s"),
                           ("total_tokens_per_s", "total tokens/s"),
                           ("output_tokens_per_s", "output tokens/s")]:
            ratios[key] = results["pagedlm"][key] / results[name][key]
            print(f"{label} ratio (pagedlm / {name}): {ratios[key]:.2f}x")
        results[f"ratios_pagedlm_over_{name}"] = ratios

    if args.output_json:
        write_json(args.output_json, {"command": shlex.join(["python"] + sys.argv),
                                      "config": config, "results": results})


def baseline_leg(name, argv, args):
    """One run of a pagedlm baseline in a fresh process: its figures."""
    if name.startswith("commit "):
        old = run_script_at_commit(args.baseline_commit, "benchmarks/throughput.py",
                                   strip_option(argv, "--trace-file"))  # no tracer there
        return old["results"]["pagedlm"]
    if name == "no-trace":
        leg = strip_option(argv, "--trace-file")
    elif name == "default-mode":
        leg = strip_flag(argv, "--deterministic")
    elif name == "tp1":
        leg = argv
        for opt in ("--tensor-parallel-size", "-tp", "--pipeline-parallel-size", "-pp",
                    "--distributed-executor-backend"):
            leg = strip_option(leg, opt)
        leg += ["--distributed-executor-backend", "uni"]
    else:  # no-chunked-prefill
        leg = strip_flag(strip_flag(strip_option(argv, "--max-num-batched-tokens"),
                                    "--enable-chunked-prefill"),
                         "--no-enable-chunked-prefill") + ["--no-enable-chunked-prefill"]
    print(f"--- baseline {name}: a fresh process ---", flush=True)
    return run_script_fresh("benchmarks/throughput.py", leg)["results"]["pagedlm"]


def repeated_rounds(name, argv, args):
    """Both legs args.repeats times, each in a fresh process, the order alternating so that a
    machine drifting faster or slower over the run weighs on both alike."""
    rounds = []
    for i in range(args.repeats):
        fig = {}
        for leg in (["pagedlm", name] if i % 2 == 0 else [name, "pagedlm"]):
            print(f"=== round {i + 1} of {args.repeats}: {leg} ===", flush=True)
            fig[leg] = (run_script_fresh("benchmarks/throughput.py", argv)["results"]["pagedlm"]
                        if leg == "pagedlm" else baseline_leg(name, argv, args))
            report(leg, fig[leg])
        fig["ratio"] = fig["pagedlm"]["output_tokens_per_s"] / fig[name]["output_tokens_per_s"]
        rounds.append(fig)
    print()
    for i, fig in enumerate(rounds):
        print(f"round {i + 1}: pagedlm {fig['pagedlm']['elapsed_s']:.1f}s, {name} "
              f"{fig[name]['elapsed_s']:.1f}s: output tokens/s ratio {fig['ratio']:.3f}x")
    ours = sum(f["pagedlm"]["elapsed_s"] for f in rounds)
    theirs = sum(f[name]["elapsed_s"] for f in rounds)
    ratios = sorted(f["ratio"] for f in rounds)
    print(f"output tokens/s ratio (pagedlm / {name}) over all rounds (summed times): "
          f"{theirs / ours:.3f}x; per round {ratios[0]:.3f}x to {ratios[-1]:.3f}x")
    return {"pagedlm": rounds[0]["pagedlm"], name: rounds[0][name], "rounds": rounds,
            f"ratio_summed_pagedlm_over_{name}": theirs / ours}


def run_quantizations(requests, args, model_file):
    """pagedlm once per --quantization value, then a table with a roofline column: the weight
    bytes a decode step reads times the steps per second, against the copy bandwidth."""
    results = {}
    for q in args.quantization:
        results[q] = run_pagedlm(requests, args, model_file,
                                 quantization=None if q == "none" else q)
        report(f"pagedlm {q}", results[q])
    bandwidth = memory_bandwidth_gbs()
    steps = max(n for _, n in requests)  # decode steps of the run (one stream: its tokens)
    print(f"memory bandwidth (1 GiB tensor copy, read + write): {bandwidth:.1f} GB/s")
    print(f"{'weights':>8} {'out tok/s':>10} {'MB/step':>8} {'GB/s read':>10} {'% of copy bw':>12}")
    for q, fig in results.items():
        mb = fig.get("linear_weight_bytes", 0) / 1e6
        steps_per_s = steps / fig["elapsed_s"]
        gbs = mb * steps_per_s / 1e3
        fig["weight_read_gb_per_s"] = gbs
        print(f"{q:>8} {fig['output_tokens_per_s']:10.1f} {mb:8.1f} {gbs:10.2f} "
              f"{gbs / bandwidth:12.1%}")
    first = args.quantization[0]
    for q in args.quantization[1:]:
        print(f"output tok/s ratio ({q} / {first}): "
              f"{results[q]['output_tokens_per_s'] / results[first]['output_tokens_per_s']:.2f}x")
    if args.output_json:
        write_json(args.output_json, {"command": shlex.join(["python"] + sys.argv),
                                      "memory_bandwidth_gb_per_s": bandwidth,
                                      "results": results})


if __name__ == "__main__":
    main()
