"""Every environment variable pagedlm reads, documented in one place.

Read as attributes (`envs.PAGEDLM_DISABLE_KERNELS`), each is looked up in os.environ when it is
asked for, never at import: a test, a launcher or a worker process that sets one before the
code that needs it runs is heard, as with vLLM's envs.py. Nothing else in the package reads
os.environ; child processes' environments are written where they are started.
"""
from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    PAGEDLM_CACHE_DIR: str | None
    PAGEDLM_DISABLE_KERNELS: bool
    PAGEDLM_DISABLE_FUSED_DECODE: bool
    PAGEDLM_BF16_DPBF16: bool
    PAGEDLM_DISABLE_ONEDNN: bool
    PAGEDLM_DEFAULT_MALLOC: bool
    PAGEDLM_DISABLE_HUGE_PAGES: bool
    PAGEDLM_GGUF_IN_PLACE: bool
    PAGEDLM_PANEL_CACHE: str | None
    PAGEDLM_PRECISE_ACTIVATIONS: bool
    PAGEDLM_ATTENTION_BACKEND: str | None
    PAGEDLM_TRITON_GEMV: bool
    PAGEDLM_TRITON_FUSED_NORM_ACT: bool
    TRITON_INTERPRET: bool
    PAGEDLM_API_KEY: str | None
    PAGEDLM_ENGINE_ITERATION_TIMEOUT_S: float
    RAY_ADDRESS: str | None
    VLLM_ALLOW_RUNTIME_LORA_UPDATING: bool


def _flag(name: str, truthy: tuple[str, ...] = ("1", "true", "yes")) -> Callable[[], bool]:
    return lambda: os.environ.get(name, "").lower() in truthy


def _flag_on_unless(name: str, falsy: tuple[str, ...] = ("0", "false", "no", "off")
                    ) -> Callable[[], bool]:
    return lambda: os.environ.get(name, "").lower() not in falsy


def _string(name: str) -> Callable[[], str | None]:
    return lambda: os.environ.get(name)


def _seconds(name: str, default: float) -> Callable[[], float]:
    def read() -> float:
        text = os.environ.get(name, "")
        if not text:
            return default
        try:
            value = float(text)
        except ValueError:
            value = float("nan")
        if not 0 < value < float("inf"):
            raise ValueError(f"{name} must be a number of seconds > 0, got {text!r}.")
        return value
    return read


_VARIABLES: dict[str, Callable[[], Any]] = {
    # Where converted models (GGUF -> HF) and built native kernels are cached; unset or empty:
    # ~/.cache/pagedlm.
    "PAGEDLM_CACHE_DIR": _string("PAGEDLM_CACHE_DIR"),
    # 1/true/yes: never build or load the native kernels; every op takes its PyTorch path
    # (attention: Torch SDPA; linear layers: their GEMM path; no fused decode).
    "PAGEDLM_DISABLE_KERNELS": _flag("PAGEDLM_DISABLE_KERNELS"),
    # 1/true/yes: decode runs layer by layer instead of through the fused native decode stack
    # (CPU) or the fused Triton layers (GPU, PAGEDLM_TRITON_FUSED_NORM_ACT).
    "PAGEDLM_DISABLE_FUSED_DECODE": _flag("PAGEDLM_DISABLE_FUSED_DECODE"),
    # 1: bfloat16 k-pair panels (AVX512-BF16 builds) multiply with vdpbf16ps, rounding x to
    # bfloat16, instead of widening the pairs to float32 FMAs (kernels/gemv.py's bf16_dpbf16).
    "PAGEDLM_BF16_DPBF16": _flag("PAGEDLM_BF16_DPBF16", ("1",)),
    # 1/true/yes: linear weights stay in PyTorch's layout, not packed for oneDNN.
    "PAGEDLM_DISABLE_ONEDNN": _flag("PAGEDLM_DISABLE_ONEDNN"),
    # 1/true/yes: workers keep glibc's malloc defaults (worker/malloc_tuning.py).
    "PAGEDLM_DEFAULT_MALLOC": _flag("PAGEDLM_DEFAULT_MALLOC"),
    # 1/true/yes: the KV cache and the weight panels stay on torch's allocator (4 KiB pages)
    # instead of asking for 2 MiB transparent huge pages (huge_pages.py).
    "PAGEDLM_DISABLE_HUGE_PAGES": _flag("PAGEDLM_DISABLE_HUGE_PAGES"),
    # 1/true/yes: a GGUF file's blocks stay on the page cache's 2 MiB folios where it has them
    # (mapped_blocks.gather_blocks), instead of being moved onto fresh huge pages after the load
    # (mapped_blocks.FileMapMove). Saves the fresh memory; the stream may read slower: on the
    # 2-vCPU Xeon VM the page cache a file was just read into streamed at 19-23 GB/s, the same
    # cache a day later at 27, fresh pages at 25-27.
    "PAGEDLM_GGUF_IN_PLACE": _flag("PAGEDLM_GGUF_IN_PLACE"),
    # 1/true/yes: quantized layers take their input at about 16 bits instead of 8 (read once,
    # as each layer's method is made): the block formats (gguf's and int4's) run their kernels
    # on x in two 8-bit limbs, and their many-row steps dequantize to float32 instead of
    # bfloat16 panels for AMX. Slower (kernels/quant.py's TWO_LIMB_FORMATS gives the cost);
    # for holding a quantized file to a float reference on its dequantized weights
    # (benchmarks/gguf_fidelity.py).
    "PAGEDLM_PRECISE_ACTIVATIONS": _flag("PAGEDLM_PRECISE_ACTIVATIONS"),
    # Whether a bfloat16 or float16 checkpoint's weight panels are kept in a file of the cache,
    # which later loads of the same checkpoint map instead of packing it again (panel_cache.py):
    # "auto" (unset or empty: panels of at least 1 GiB), "always" (or 1, on), "off" (or 0,
    # never).
    "PAGEDLM_PANEL_CACHE": _string("PAGEDLM_PANEL_CACHE"),
    # "native" | "torch_sdpa" | "triton": the attention backend every model uses
    # (get_attn_backend; an error if it cannot run the model's dtype on its device). Unset or
    # empty: chosen by dtype and device (Triton on a GPU, the native kernel for float32 on the
    # CPU, else Torch SDPA).
    "PAGEDLM_ATTENTION_BACKEND": _string("PAGEDLM_ATTENTION_BACKEND"),
    # On a GPU, linear layers with 16-bit weights multiply batches of at most
    # linear_method.TRITON_GEMV_MAX_ROWS rows with pagedlm's Triton GEMV (kernels/triton/gemv.py)
    # instead of cuBLAS's F.linear, unless this is 0/false/no/off. On by default: on an H200 it
    # made one decode stream 22% and 18% faster in two runs (benchmarks/results/gpu-20261127b,c).
    "PAGEDLM_TRITON_GEMV": _flag_on_unless("PAGEDLM_TRITON_GEMV"),
    # 1/true/yes: on a GPU, decode steps of at most linear_method.TRITON_GEMV_MAX_ROWS tokens
    # run the standard Llama layers with each RMSNorm folded into the GEMV after it (QKV,
    # gate_up) and SiLU-and-mul into the down projection (kernels/triton/fused_gemv.py; 3
    # launches fewer a layer), where PAGEDLM_TRITON_GEMV is on (layers/fused_decode.py's
    # TritonFusedLayers). Off by default until a GPU run measures it (benchmarks/gpu_bench.py's
    # pagedlm_steps8_fused leg); read once, at a stage's first step.
    "PAGEDLM_TRITON_FUSED_NORM_ACT": _flag("PAGEDLM_TRITON_FUSED_NORM_ACT"),
    # Triton's own switch (1/true/yes/on): its kernels run on CPU tensors in its interpreter.
    # Read here only to know whether the Triton attention backend can run on the CPU.
    "TRITON_INTERPRET": _flag("TRITON_INTERPRET", ("1", "true", "yes", "on")),
    # The server's API key, the default of --api-key; unset: no key.
    "PAGEDLM_API_KEY": _string("PAGEDLM_API_KEY"),
    # Seconds the worker processes (mp executor) have to answer one step before the engine
    # fails as if one had died (vLLM's VLLM_ENGINE_ITERATION_TIMEOUT_S): a worker stopped or
    # stuck in a collective otherwise hung every request for good. Larger than vLLM's 60 s:
    # a full 8192-token prefill of a 1B model takes tens of seconds on two cores.
    "PAGEDLM_ENGINE_ITERATION_TIMEOUT_S": _seconds("PAGEDLM_ENGINE_ITERATION_TIMEOUT_S", 600.0),
    # A Ray cluster to join (ray.init's address); set, it also makes "ray" the default executor
    # backend for more than one worker.
    "RAY_ADDRESS": _string("RAY_ADDRESS"),
    # 1/true: the server exposes /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's
    # name and values), the default of --enable-runtime-lora-updating.
    "VLLM_ALLOW_RUNTIME_LORA_UPDATING": _flag("VLLM_ALLOW_RUNTIME_LORA_UPDATING",
                                              ("1", "true")),
}


def __getattr__(name: str) -> Any:
    if name in _VARIABLES:
        return _VARIABLES[name]()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(_VARIABLES)
