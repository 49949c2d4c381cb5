"""The attention kernels at the shapes of the default model, against PyTorch's SDPA, in one process.

  decode:  kernels.paged_attention for --decode-tokens tokens of 300-700 keys each over 30 layers'
           caches of --kv-cache-dtype whose blocks are handed out interleaved (as sequences
           decoding side by side get them); reports ms a step and the K/V bytes read per second.
  prefill: kernels.prefill_attention for --prompts fresh prompts of 32-512 tokens over 30 layers,
           query/key/value as views of one fused QKV output (as the model passes them), against
           the SDPA path (torch_sdpa.prefill_attention, one call per prompt, what the native
           backend ran before the prefill kernel); reports ms and GFLOP/s (causal half).

Each is timed --repeats times, alternating where there are two, and the best is kept.

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
    cache = torch.zeros(1, BLOCK, HKV, D)
    out = torch.empty(total, HQ, D)

    def kernel():
        for q, k, v in views:
            kernels.prefill_attention(q, k, v, cache, cache, chunks, tables, D ** -0.5, out)

    def sdpa():
        for q, k, v in views:
            for s, n in zip(starts, lens):
                sdpa_prefill(q, k, v, cache, cache, PrefillChunk(s, s + n, 0, None), D ** -0.5,
                             out)

    times = {"kernel": float("inf"), "sdpa": float("inf")}
    for _ in range(args.repeats):
        for name, fn in (("kernel", kernel), ("sdpa", sdpa)):
            times[name] = min(times[name], best_of(fn, 1))
    flops = sum(n * (n + 1) / 2 for n in lens) * HQ * D * 4 * LAYERS
    print(f"prefill, {args.prompts} prompts of {min(lens)}-{max(lens)} tokens ({total}), "
          f"{LAYERS} layers:")
    for name, dt in times.items():
        print(f"  {name:6s} {dt * 1e3:7.1f} ms  {flops / dt / 1e9:5.0f} GFLOP/s")
    print(f"  kernel / sdpa time: {times['kernel'] / times['sdpa']:.2f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", choices=["decode", "prefill"], default=None)
    p.add_argument("--decode-tokens", type=int, default=128)
    p.add_argument("--kv-cache-dtype", choices=["float32", "bfloat16", "float16"],
                   default="float32", help="the decode kernel's cache")
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
