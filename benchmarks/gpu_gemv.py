"""Decode-sized linear layers on the GPU: cuBLAS (F.linear) against pagedlm's Triton GEMV
(pagedlm/kernels/triton/gemv.py), as JSON, to decide whether PAGEDLM_TRITON_GEMV should be on.

SmolLM2-135M's four weight shapes (bfloat16 [out, in]: qkv 576->960, o 576->576, gate_up
576->3072, down 1536->576) at 1 and 8 rows, each timed three ways (CUDA events):
- eager_us: the median of 200 single calls, warm (one weight, L2-resident), launch included;
- graph_cold_us: per call, inside a captured CUDA graph of 30 calls on 30 copies of the weight
  (a model's 30 layers), L2 flushed before each replay: launch cost gone and the weights read
  from memory, as in a decode step (the median of 20 replays, divided by 30);
- graph_warm_us: the same graph replayed without the flush.
For the Triton GEMV, its default configuration and a small sweep of others (BLOCK_N, split-K,
warps); "best" gives, per row bucket and shape, the fastest by graph_cold_us, in the form of
gemv.TUNED's entries. Every result's max abs difference from F.linear and from the float32 matmul
of the same inputs is recorded. The sweep stops adding configurations past --budget-s (Triton
compiles each new one: about a second), so the run stays under 30 s.

    python benchmarks/gpu_gemv.py --out gpu_gemv.json     # on the GPU machine
    python benchmarks/gpu_gemv.py --rows 1 2 4 8 --budget-s 40 --out gpu_gemv.json  # every bucket
    python benchmarks/gpu_gemv.py --plumbing --out /tmp/gemv.json   # CPU: the code paths only

Without CUDA it writes a JSON note and exits 0. --plumbing runs the same loops on CPU tensors
under TRITON_INTERPRET with shapes divided by 16, 3 layers and wall-clock timers (no graphs, no
events): the figures mean nothing, the code paths are exercised.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import statistics
import time

from lib.stats import write_json

# name: (N, K) of SmolLM2-135M's linear layers.
SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
ROWS = (1, 8)
LAYERS = 30
EAGER_CALLS = 200
REPLAYS = 20
FLUSH_BYTES = 256 << 20  # > the L2 of an H100/H200 (50-60 MB), several times over


def candidates(tg, m: int, n: int, k: int, device, long_k: int = 1024) -> list:
    """The default configuration first, then the sweep around gemv.rule_config (duplicates
    dropped): other BLOCK_Ns (programs), warps and K steps; split-K from K = long_k."""
    default = tg.default_config(m, n, k, device)
    bm = tg.row_bucket(m)
    sms = tg._sm_count(device)
    out = [default]
    out += [tg.rule_config(bm, n, k, sms, block_n=bn) for bn in (4, 8, 16, 32)]
    out += [dataclasses.replace(default, num_warps=nw) for nw in (1, 2, 4, 8)]
    out += [dataclasses.replace(default, block_k=bk) for bk in (64, 128, 256, 512)
            if bk <= tg._pow2(k)]
    if k >= long_k:  # split-K only where K is long (down: 1536)
        for bn, split in ((16, 2), (16, 4), (8, 2)):
            out.append(dataclasses.replace(tg.rule_config(bm, n, k, sms, block_n=bn),
                                           split_k=split))
    seen, unique = set(), []
    for c in out:
        if c not in seen:
            seen.add(c)
            unique.append(c)
    return unique


class CudaTimer:
    def __init__(self, torch):
        self.torch = torch
        self.flush_buf = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device="cuda")

    def _event(self):
        return self.torch.cuda.Event(enable_timing=True)

    def eager_us(self, fn) -> float:
        torch = self.torch
        for _ in range(20):
            fn()
        pairs = []
        for _ in range(EAGER_CALLS):
            start, end = self._event(), self._event()
            start.record()
            fn()
            end.record()
            pairs.append((start, end))
        torch.cuda.synchronize()
        return statistics.median(s.elapsed_time(e) for s, e in pairs) * 1e3

    def graph_us(self, calls) -> tuple[float, float]:
        """(cold, warm) microseconds a call, the calls captured in one graph."""
        torch = self.torch
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up (and any compile) outside the capture
            for c in calls:
                c()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for c in calls:
                c()
        graph.replay()
        result = []
        for flush in (True, False):
            pairs = []
            for _ in range(REPLAYS):
                if flush:
                    self.flush_buf.zero_()
                start, end = self._event(), self._event()
                start.record()
                graph.replay()
                end.record()
                pairs.append((start, end))
            torch.cuda.synchronize()
            result.append(statistics.median(s.elapsed_time(e) for s, e in pairs) * 1e3
                          / len(calls))
        graph.reset()
        return result[0], result[1]


class WallTimer:
    """--plumbing: the same calls, timed by the wall clock (the interpreter's figures mean
    nothing)."""

    def eager_us(self, fn) -> float:
        t0 = time.perf_counter()
        for _ in range(3):
            fn()
        return (time.perf_counter() - t0) / 3 * 1e6

    def graph_us(self, calls) -> tuple[float, float]:
        t0 = time.perf_counter()
        for c in calls:
            c()
        us = (time.perf_counter() - t0) / len(calls) * 1e6
        return us, us


def run(args) -> dict:
    import torch
    import torch.nn.functional as F

    from pagedlm.kernels.triton import gemv as tg

    plumbing = args.plumbing
    device = torch.device("cpu" if plumbing else "cuda")
    if not plumbing:
        torch.backends.cuda.matmul.allow_tf32 = False  # the float32 reference stays float32
    layers = 3 if plumbing else LAYERS
    shapes = {name: (n // 16, k // 16) for name, (n, k) in SHAPES.items()} if plumbing \
        else SHAPES
    timer = WallTimer() if plumbing else CudaTimer(torch)
    dtype = torch.bfloat16
    t_start = time.monotonic()
    g = torch.Generator(device=device).manual_seed(0)
    cases = []  # (entry, x, weights, the float32 reference, cuBLAS's output, candidates)
    # Pass 1: cuBLAS and the default configuration of every shape and row count.
    for name, (n, k) in shapes.items():
        # Weights of a trained model's scale (std 0.02): sums of a few units, like a layer's.
        ws = [(torch.randn(n, k, generator=g, device=device) * 0.02).to(dtype)
              for _ in range(layers)]
        for m in args.rows:
            x = torch.randn(m, k, generator=g, device=device).to(dtype)
            want = x.float() @ ws[0].float().T
            ref = F.linear(x, ws[0])
            entry = {"shape": name, "n": n, "k": k, "rows": m,
                     "max_abs_ref": want.abs().max().item(),
                     "cublas": {"eager_us": timer.eager_us(lambda x=x, w=ws[0]: F.linear(x, w)),
                                "max_abs_err_vs_fp32": (ref.float() - want).abs().max().item()}}
            cold, warm = timer.graph_us([lambda x=x, w=w: F.linear(x, w) for w in ws])
            entry["cublas"].update(graph_cold_us=cold, graph_warm_us=warm)
            entry["triton"] = []
            cases.append((entry, x, ws, want, ref,
                          candidates(tg, m, n, k, device, 64 if plumbing else 1024)))

    def measure(entry, x, ws, want, ref, cfg, default):
        y = tg.gemv(x, ws[0], None, cfg)
        rec = {"config": repr(cfg), "default": default,
               "programs": -(-entry["n"] // cfg.block_n) * cfg.split_k,
               "max_abs_diff_vs_cublas": (y.float() - ref.float()).abs().max().item(),
               "max_abs_err_vs_fp32": (y.float() - want).abs().max().item()}
        if default:
            rec["eager_us"] = timer.eager_us(lambda: tg.gemv(x, ws[0], None, cfg))
        cold, warm = timer.graph_us([lambda w=w: tg.gemv(x, w, None, cfg) for w in ws])
        rec.update(graph_cold_us=cold, graph_warm_us=warm)
        entry["triton"].append(rec)

    for entry, x, ws, want, ref, cands in cases:
        measure(entry, x, ws, want, ref, cands[0], True)
    # Pass 2: the sweep, one configuration of every case at a time, while the budget lasts
    # (each new configuration compiles), so that a cut-off leaves every shape the same ones.
    for i in range(1, max(len(c[-1]) for c in cases)):
        for entry, x, ws, want, ref, cands in cases:
            if i >= len(cands):
                continue
            if time.monotonic() - t_start > args.budget_s:
                entry["triton"].append({"config": repr(cands[i]), "skipped": "past --budget-s"})
                continue
            measure(entry, x, ws, want, ref, cands[i], False)

    results, best = [], {}
    totals = {m: {"cublas": 0.0, "triton_default": 0.0, "triton_best": 0.0}
              for m in args.rows}
    for entry, *_ in cases:
        m, n, k = entry["rows"], entry["n"], entry["k"]
        timed = [r for r in entry["triton"] if "graph_cold_us" in r]
        fastest = min(timed, key=lambda r: r["graph_cold_us"])
        entry["triton_best"] = fastest["config"]
        best[f"({tg.row_bucket(m)}, {n}, {k})"] = fastest["config"]
        totals[m]["cublas"] += entry["cublas"]["graph_cold_us"] * layers
        totals[m]["triton_default"] += timed[0]["graph_cold_us"] * layers
        totals[m]["triton_best"] += fastest["graph_cold_us"] * layers
        results.append(entry)
        print(f"{entry['shape']:8s} m={m}: cuBLAS {entry['cublas']['graph_cold_us']:.2f} us, "
              f"Triton default {timed[0]['graph_cold_us']:.2f}, best "
              f"{fastest['graph_cold_us']:.2f} ({fastest['config']}), max |diff| vs cuBLAS "
              f"{max(r['max_abs_diff_vs_cublas'] for r in timed):.3g}", flush=True)
    # Accuracy: both round the same float32 products once, in different sum orders, so their
    # largest errors against the float32 matmul are about equal (half a unit in the last place
    # of the largest outputs, one unit where an order lands across a rounding boundary).
    worst = [(e["shape"], e["rows"], r["config"]) for e in results for r in e["triton"]
             if "max_abs_err_vs_fp32" in r
             and r["max_abs_err_vs_fp32"] > 2 * e["cublas"]["max_abs_err_vs_fp32"] + 1e-6]
    per_token = {f"rows_{m}": {key: round(v, 2) for key, v in t.items()}
                 for m, t in totals.items()}
    print("per token (us, 4 shapes x", layers, "layers):", per_token,
          "| accuracy:", "ok" if not worst else f"over 2x cuBLAS's error: {worst}")
    return {"results": results, "best": best, "per_token_us": per_token,
            "per_token_note": f"graph_cold_us summed over the 4 shapes x {layers} layers",
            "accuracy_ok": not worst, "over_2x_cublas_error": worst,
            "seconds": round(time.monotonic() - t_start, 1)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="gpu_gemv.json")
    p.add_argument("--budget-s", type=float, default=18.0,
                   help="no new sweep configuration past this many seconds")
    p.add_argument("--rows", type=int, nargs="+", default=list(ROWS),
                   help="batch rows to time (1..8; default 1 8)")
    p.add_argument("--plumbing", action="store_true",
                   help="CPU: run the code paths under TRITON_INTERPRET, tiny shapes")
    args = p.parse_args()
    if not all(1 <= m <= 8 for m in args.rows):
        p.error("--rows: the GEMV takes 1 to 8 rows")
    if args.plumbing:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton
    import torch
    info = {"benchmark": "gpu_gemv", "torch": torch.__version__,
            "python": platform.python_version()}
    if not args.plumbing and not torch.cuda.is_available():
        info["note"] = "no CUDA: nothing measured (this benchmark needs a GPU)"
        write_json(args.out, info)
        return
    import triton
    info["triton"] = triton.__version__
    if not args.plumbing:
        props = torch.cuda.get_device_properties(0)
        info.update(device=props.name, sms=props.multi_processor_count)
    else:
        info["note"] = "plumbing: CPU tensors under TRITON_INTERPRET, figures meaningless"
    info.update(run(args))
    write_json(args.out, info)


if __name__ == "__main__":
    main()
