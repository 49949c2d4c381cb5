"""The attention kernels at the shapes of the default model, against PyTorch's SDPA, in one process.

  decode:  kernels.paged_attention for --decode-tokens tokens of 300-700 keys each over 30 layers'
           caches of --kv-cache-dtype whose blocks are handed out interleaved (as sequences
           decoding side by side get them); reports ms a step and the K/V bytes read per second.
  prefill: kernels.prefill_attention for --prompts fresh prompts of 32-512 tokens over 30 layers,
           query/key/value as views of one fused QKV output (as the model passes them), against
           the SDPA path (torch_sdpa.prefill_attention, one call per prompt, what the native
           backend ran before the prefill kernel); reports ms and GFLOP/s (causal half).

           With --kv-cache-dtype bfloat16, also the AMX kernel (csrc/prefill_attention_amx.c)
           that a bfloat16 cache gets where the CPU has AMX, against the float32 kernel.

Each is timed --repeats times, alternating where there are several; the prefill reports the
best and the median of its rounds.

    python benchmarks/attention.py
    python benchmarks/attention.py --only prefill --prompts 16
    python benchmarks/attention.py --only decode --kv-cache-dtype bfloat16
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pagedlm.kernels import attention as kernels  # noqa: E402
from pagedlm.attention.backends.torch_sdpa import prefill_attention as sdpa_prefill  # noqa: E402
from pagedlm.attention.metadata import PrefillChunk  # noqa: E402

LAYERS, HQ, HKV, D, BLOCK = 30, 9, 3, 64, 16  # SmolLM2-135M


def best_of(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def decode(args, g: torch.Generator) -> None:
    ctx = torch.randint(300, 700, (args.decode_tokens,), dtype=torch.int32, generator=g)
    nb = (ctx + BLOCK - 1) // BLOCK
    tables = torch.zeros(args.decode_tokens, int(nb.max()), dtype=torch.int32)
    nxt = 0
    for j in range(int(nb.max())):  # block j of every sequence, then block j + 1 ...
        for s in range(args.decode_tokens):
            if j < nb[s]:
                tables[s, j], nxt = nxt, nxt + 1
    dtype = getattr(torch, args.kv_cache_dtype)
    caches = [(torch.randn(nxt, BLOCK, HKV, D, generator=g).to(dtype),
               torch.randn(nxt, BLOCK, HKV, D, generator=g).to(dtype)) for _ in range(LAYERS)]
    query = torch.randn(args.decode_tokens, HQ, D, generator=g)
    seqs = torch.arange(args.decode_tokens, dtype=torch.int32)

    def step():
        for k, v in caches:
            kernels.paged_attention(query, k, v, tables, seqs, ctx, D ** -0.5)

    dt = best_of(step, args.repeats)
    nbytes = int(ctx.sum()) * HKV * D * caches[0][0].element_size() * 2 * LAYERS
    print(f"decode, {args.decode_tokens} tokens of 300-700 keys, {LAYERS} layers, "
          f"{args.kv_cache_dtype} cache: "
          f"{dt * 1e3:.1f} ms a step, {nbytes / dt / 1e9:.1f} GB/s of K/V")


def prefill(args, g: torch.Generator) -> None:
    lens = torch.randint(32, 513, (args.prompts,), generator=g).tolist()
    total = sum(lens)
    qkvs = [torch.randn(total, (HQ + 2 * HKV) * D, generator=g) for _ in range(LAYERS)]
    views = [(x[:, :HQ * D].view(total, HQ, D), x[:, HQ * D:(HQ + HKV) * D].view(total, HKV, D),
              x[:, (HQ + HKV) * D:].view(total, HKV, D)) for x in qkvs]
    starts = [sum(lens[:i]) for i in range(len(lens))]
    chunks = torch.tensor([(s, n, 0) for s, n in zip(starts, lens)], dtype=torch.int32)
    tables = torch.zeros(len(lens), 1, dtype=torch.int32)
    dtype = getattr(torch, args.kv_cache_dtype)
    cache = torch.zeros(1, BLOCK, HKV, D, dtype=dtype)
    out = torch.empty(total, HQ, D)
    if dtype != torch.float32:  # fresh K/V rounded as the cache rounds them (as the backend)
        for x in qkvs:
            x[:, HQ * D:].copy_(x[:, HQ * D:].to(dtype).float())

    def run(use_amx):
        for q, k, v in views:
            kernels.prefill_attention(q, k, v, cache, cache, chunks, tables, D ** -0.5, out,
                                      use_amx=use_amx)

    def sdpa():
        for q, k, v in views:
            for s, n in zip(starts, lens):
                sdpa_prefill(q, k, v, cache, cache, PrefillChunk(s, s + n, 0, None), D ** -0.5,
                             out)

    fns = {"kernel": lambda: run(False), "sdpa": sdpa}
    if dtype == torch.bfloat16 and kernels.prefill_attention_amx_runs(D):
        fns["amx"] = lambda: run(True)  # the default for a bfloat16 cache
    times = {name: [] for name in fns}
    for _ in range(args.repeats):  # interleaved rounds: kernel, sdpa, amx, kernel, ...
        for name, fn in fns.items():
            times[name].append(best_of(fn, 1))
    flops = sum(n * (n + 1) / 2 for n in lens) * HQ * D * 4 * LAYERS
    print(f"prefill, {args.prompts} prompts of {min(lens)}-{max(lens)} tokens ({total}), "
          f"{LAYERS} layers, {args.kv_cache_dtype} cache (kernel: float32 products; amx: "
          f"bfloat16 tiles), {args.repeats} rounds:")
    for name, ts in times.items():
        ts = sorted(ts)
        med = ts[len(ts) // 2]
        print(f"  {name:6s} best {ts[0] * 1e3:7.1f} ms  median {med * 1e3:7.1f} ms "
              f"(max {ts[-1] * 1e3:7.1f})  {flops / ts[0] / 1e9:5.0f} GFLOP/s at best")
    best = {name: min(ts) for name, ts in times.items()}
    print(f"  kernel / sdpa time: {best['kernel'] / best['sdpa']:.2f}")
    if "amx" in best:
        print(f"  amx / kernel time: {best['amx'] / best['kernel']:.2f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", choices=["decode", "prefill"], default=None)
    p.add_argument("--decode-tokens", type=int, default=128)
    p.add_argument("--kv-cache-dtype", choices=["float32", "bfloat16", "float16"],
                   default="float32",
                   help="the cache of both: a bfloat16 one adds the AMX prefill kernel")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    if not kernels.available():
        sys.exit("the native attention kernels are unavailable here (no gcc, or disabled)")
    g = torch.Generator().manual_seed(args.seed)
    print(f"torch threads: {torch.get_num_threads()}")
    if args.only in (None, "decode"):
        decode(args, g)
    if args.only in (None, "prefill"):
        if not kernels.prefill_attention_runs(D):
            sys.exit("this build has no prefill kernel (no AVX-512)")
        prefill(args, g)


if __name__ == "__main__":
    main()
