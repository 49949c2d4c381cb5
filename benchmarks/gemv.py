"""Decode-shaped matmuls: every linear layer of a loaded model once, at a few rows.

A decode step multiplies each running sequence's one row by every weight matrix, so at small
batches its time is how fast the weights stream. This script loads the model the way the engine
does and runs each of its linear layers (and the LM head) once per pass, at each `--rows`, through
each path that can run it, reporting the median pass time and the weight bandwidth it implies:

  float32: gemv (pagedlm's row-major kernel, kernels/gemv.py), panels (its panel kernel, which
           the layers use at every row count where it runs: AVX2 or AVX-512), onednn (oneDNN's
           pre-packed GEMM, their path where the panel kernel does not run), torch (F.linear);
  bfloat16 (--dtype bfloat16): panels (bfloat16 panels, float32 x and sums, the layers' path),
           panels-dpbf16 (the same k-pair panels on vdpbf16ps, x rounded to bfloat16: the
           opt-in PAGEDLM_BF16_DPBF16=1 math, where the build has AVX512-BF16), onednn and
           torch on x rounded to bfloat16 (the bfloat16 path before the panels);
  quantized: the layer's own path (its LinearMethod.apply).

    python benchmarks/gemv.py                                  # float32, rows 1 2 4 8 16
    python benchmarks/gemv.py --rows 32 128 2048 --repeats 5 --paths panels onednn
    python benchmarks/gemv.py --quantization gguf int8 int4 --rows 1 4
    python benchmarks/gemv.py --dtype float32 bfloat16 --rows 1 8 128 --paths panels
    python benchmarks/gemv.py --dtype bfloat16 --bf16-baseline OLD.so --paths panels panels-base

--bf16-baseline takes a kernel library built from another tree (a copy of the cached .so from
~/.cache/pagedlm/kernels): its gemm_panels_bf16 runs as path panels-base on the same weights,
packed for it (plain [P, K, W] panels unless it exports gemm_panels_bf16_layout() == 2), taking
turns with this tree's kernel in the same process, so an old and a new kernel are compared on
interleaved repeats.
"""
from __future__ import annotations

import argparse
import ctypes
import gc
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pagedlm import LLM  # noqa: E402
from pagedlm.kernels import gemv  # noqa: E402
from pagedlm.model_executor.layers.linear_method import LinearMethodBase, pack_weight


def linear_layers(llm: LLM) -> list[torch.nn.Module]:
    model = llm.llm_engine.executor.worker.model
    return [m for m in model.modules()
            if isinstance(getattr(m, "linear_method", None), LinearMethodBase)]


def weight_bytes(layer: torch.nn.Module) -> int:
    if hasattr(layer, "qweight_data"):
        scale = layer.qscale
        return (layer.qweight_data.numel() * layer.qweight_data.element_size()
                + (0 if scale is None else scale.numel() * scale.element_size()))
    return layer.weight.numel() * layer.weight.element_size()


# --bf16-baseline's library (ctypes.CDLL), or None.
BASELINE: list = [None]
# Whether this build runs vdpbf16ps on bfloat16 panels (gemv.bf16_dpbf16_supported), from main.
DPBF16: list = [False]


def _baseline_panels(layer: torch.nn.Module):
    """fn(x) running BASELINE's gemm_panels_bf16 on this bfloat16 layer's weights, packed as it
    reads them (rebuilt from this tree's panels: the plain weight is dropped after packing)."""
    lib, panels = BASELINE[0], layer.panel_weight
    n, k = layer.weight.shape
    pairs = hasattr(lib, "gemm_panels_bf16_layout") and lib.gemm_panels_bf16_layout() == 2
    plain = gemv.panel_rows(panels, torch.arange(panels.shape[0] * panels.shape[2]), k)
    width = panels.shape[2]
    if pairs:
        base = panels
    else:
        base = plain.bfloat16().view(-1, width, k).transpose(1, 2).contiguous()

    fn = lib.gemm_panels_bf16
    fn.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int] * 4
    # Through the layers' wrapper (its checks and allocation), as the panels path.
    return lambda x: gemv._call("gemm_panels", fn, x, base, n, k, None)


def _dpbf16_panels(layer: torch.nn.Module):
    """fn(x) running this bfloat16 layer's k-pair panels on vdpbf16ps (the opt-in math of
    AVX512-BF16 builds), switched on for each call (two ctypes calls, well under a microsecond
    each, against passes of 10+ ms)."""
    panels, n, k = layer.panel_weight, *layer.weight.shape
    lib = gemv.library()
    before = lib.gemm_panels_bf16_dpbf16()  # the layers' setting, restored after each call

    def run(x: torch.Tensor) -> torch.Tensor:
        lib.gemm_panels_bf16_set_dpbf16(1)
        try:  # the wrapper's checks and allocation, as the panels path
            return gemv._call("gemm_panels", lib.gemm_panels_bf16, x, panels, n, k, None)
        finally:
            lib.gemm_panels_bf16_set_dpbf16(before)
    return run


def paths(layer: torch.nn.Module, onednn: bool = True):
    """name -> fn(x) for each way this layer's matmul can run (onednn: try a packed copy of a
    bfloat16 weight; oneDNN packs those only on some CPUs, warning once a layer)."""
    if hasattr(layer, "qweight_data"):
        return {"layer": lambda x: layer.linear_method.apply(layer, x)}
    out = {}
    w = layer.weight
    if w.dtype != torch.float32:  # x stays float32 on the panels; the others round it to w's
        if layer.panel_weight is not None:
            out["panels"] = lambda x: gemv.gemm_panels(x, layer.panel_weight, w.shape[0])
            if w.dtype == torch.bfloat16 and DPBF16[0]:
                out["panels-dpbf16"] = _dpbf16_panels(layer)
            if BASELINE[0] is not None and w.dtype == torch.bfloat16:
                out["panels-base"] = _baseline_panels(layer)
        packed = pack_weight(w) if onednn else None
        if packed is not None:
            out["onednn"] = lambda x: torch.ops.mkldnn._linear_pointwise(
                x.to(w.dtype), packed, None, "none", [], "")
        out["torch"] = lambda x: F.linear(x.to(w.dtype), w)
        return out
    if gemv.runs(layer.weight):
        out["gemv"] = lambda x: gemv.gemv(x, layer.weight)
    if layer.panel_weight is not None:
        out["panels"] = lambda x: gemv.gemm_panels(x, layer.panel_weight, layer.weight.shape[0])
    packed = layer.packed_weight if layer.panel_weight is None else pack_weight(layer.weight)
    if packed is not None:
        out["onednn"] = lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none",
                                                                      [], "")
    out["torch"] = lambda x: F.linear(x, layer.weight)
    return out


def in_features(layer: torch.nn.Module) -> int:
    # Quantized layers keep no float weight: column-parallel ones (whole input) have
    # input_size, row-parallel ones their slice, the LM head the embedding width.
    for name in ("input_size_per_partition", "input_size", "embedding_dim"):
        if getattr(layer, name, None):
            return getattr(layer, name)
    return layer.weight.shape[1]


def bench(layers, rows: int, repeats: int,
          only: list[str] | None = None) -> dict[str, tuple[float, float]]:
    """Median and least seconds of one pass over every layer, per path. The paths take turns
    within each repeat (in a rotating order), so a load change on a shared machine hits them
    alike."""
    first = paths(layers[0])
    per_layer = [first] + [paths(layer, "onednn" in first) for layer in layers[1:]]
    inputs = [torch.randn(rows, in_features(layer)) for layer in layers]
    names = [n for n in per_layer[0] if all(n in p for p in per_layer)
             and (only is None or n in only)]
    fns = {name: [p[name] for p in per_layer] for name in names}
    for name in names:  # warm-up (packing caches, page faults)
        for fn, x in zip(fns[name], inputs):
            fn(x)
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(repeats):
        for name in names[r % len(names):] + names[:r % len(names)]:
            t = time.perf_counter()
            for fn, x in zip(fns[name], inputs):
                fn(x)
            times[name].append(time.perf_counter() - t)
    return {name: (statistics.median(t), min(t)) for name, t in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2 GGUF")
    ap.add_argument("--quantization", nargs="+", default=["none"],
                    help="weight formats to load (none: float32)")
    ap.add_argument("--dtype", nargs="+", default=["float32"], choices=["float32", "bfloat16"],
                    help="weight dtypes to load the unquantized model in")
    ap.add_argument("--rows", nargs="+", type=int, default=[1, 2, 4, 8, 16])
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--paths", nargs="+", default=None,
                    help="paths to run (default: every one that runs the layers)")
    ap.add_argument("--threads", type=int, default=None, help="default: torch's")
    ap.add_argument("--bf16-baseline", default=None, metavar="LIBRARY",
                    help="a kernel library (.so) whose gemm_panels_bf16 runs as panels-base")
    args = ap.parse_args()
    if args.bf16_baseline:
        BASELINE[0] = ctypes.CDLL(args.bf16_baseline)
    DPBF16[0] = gemv.panel_width() > 0 and gemv.bf16_dpbf16_supported()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"threads {torch.get_num_threads()}; ms a pass: median (least) of the repeats")
    runs = [(q, "float32") for q in args.quantization if q != "none"]
    if "none" in args.quantization:
        runs += [("none", dtype) for dtype in args.dtype]
    for quant, dtype in runs:
        llm = LLM(model=args.model, quantization=None if quant == "none" else quant,
                  dtype=dtype)
        layers = linear_layers(llm)
        total = sum(weight_bytes(layer) for layer in layers)
        name = dtype if quant == "none" else quant
        print(f"\n{name}: {len(layers)} matrices, {total / 1e6:.1f} MB of weights")
        for rows in args.rows:
            times = bench(layers, rows, args.repeats, args.paths)
            cells = "  ".join(f"{name} {t * 1e3:7.2f} ({least * 1e3:7.2f}) ms "
                              f"{total / t / 1e9:5.1f} GB/s"
                              for name, (t, least) in times.items())
            print(f"  rows {rows:3d}: {cells}")
        del llm, layers
        gc.collect()


if __name__ == "__main__":
    main()
