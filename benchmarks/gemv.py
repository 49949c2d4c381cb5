"""Decode-shaped matmuls: every linear layer of a loaded model once, at a few rows.

A decode step multiplies each running sequence's one row by every weight matrix, so at small
batches its time is how fast the weights stream. This script loads the model the way the engine
does and runs each of its linear layers (and the LM head) once per pass, at each `--rows`, through
each path that can run it, reporting the median pass time and the weight bandwidth it implies:

  float32: gemv (pagedlm's row-major kernel, kernels/gemv.py), panels (its panel kernel, which
           the layers use past gemv.GEMV_MAX_ROWS on AVX-512), onednn (oneDNN's pre-packed GEMM,
           their path where the panel kernel does not run), torch (plain F.linear);
  quantized: the layer's own path (its LinearMethod.apply).

    python benchmarks/gemv.py                                  # float32, rows 1 2 4 8 16
    python benchmarks/gemv.py --quantization gguf int8 int4 --rows 1 4
"""
from __future__ import annotations

import argparse
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
from pagedlm.model_executor.layers.linear import LinearMethodBase, pack_weight  # noqa: E402


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


def paths(layer: torch.nn.Module):
    """name -> fn(x) for each way this layer's matmul can run."""
    if hasattr(layer, "qweight_data"):
        return {"layer": lambda x: layer.linear_method.apply(layer, x)}
    out = {}
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


def bench(layers, rows: int, repeats: int) -> dict[str, float]:
    """Median seconds of one pass over every layer, per path."""
    per_layer = [paths(layer) for layer in layers]
    inputs = [torch.randn(rows, in_features(layer)) for layer in layers]
    names = [n for n in per_layer[0] if all(n in p for p in per_layer)]
    result = {}
    for name in names:
        fns = [p[name] for p in per_layer]
        for fn, x in zip(fns, inputs):  # warm-up (packing caches, page faults)
            fn(x)
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            for fn, x in zip(fns, inputs):
                fn(x)
            times.append(time.perf_counter() - t)
        result[name] = statistics.median(times)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2 GGUF")
    ap.add_argument("--quantization", nargs="+", default=["none"],
                    help="weight formats to load (none: float32)")
    ap.add_argument("--rows", nargs="+", type=int, default=[1, 2, 4, 8, 16])
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    print(f"threads {torch.get_num_threads()}")
    for quant in args.quantization:
        llm = LLM(model=args.model, quantization=None if quant == "none" else quant)
        layers = linear_layers(llm)
        total = sum(weight_bytes(layer) for layer in layers)
        print(f"\n{quant}: {len(layers)} matrices, {total / 1e6:.1f} MB of weights")
        for rows in args.rows:
            times = bench(layers, rows, args.repeats)
            cells = "  ".join(f"{name} {t * 1e3:6.2f} ms {total / t / 1e9:5.1f} GB/s"
                              for name, t in times.items())
            print(f"  rows {rows:3d}: {cells}")
        del llm, layers
        gc.collect()


if __name__ == "__main__":
    main()
