"""How a linear layer stores its weight and multiplies by it: LinearMethodBase, and
UnquantizedLinearMethod for dense float weights (quantized formats are further LinearMethods,
see quantization/); plus the loader's contexts that say where weights are created
(weights_on_meta) and where packed panels are carved from (panels_in_arena).

A float32 layer runs on pagedlm's panel kernel at every row count where the build has it (AVX2
or AVX-512): as fast as oneDNN's packed GEMM or faster from 1 row to 2048 (an AVX-512 Xeon at
2 threads, an AVX2-only EPYC at 1; gemv.py has the figures), callable from C by the fused
decode stack, and with each output one FMA chain over K whatever the batch. Without it, up to
gemv.GEMV_MAX_ROWS rows it runs on pagedlm's GEMV kernel, which streams the row-major weight
as fast as oneDNN or faster, and past them on oneDNN with a pre-packed weight: on an AVX-512
AMD EPYC, torch's default fp32 GEMM (MKL) reaches 60-140 GFLOPS on the decode and prefill
shapes of a small model, oneDNN 160-190 (see the closing notes of the core-engine issue). The
packed tensors are opaque, so the plain weight is kept for loading and inspection; except a
2-byte weight on the panel kernel, whose panels are all that is kept (2 bytes a parameter).
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import logging
from abc import ABC, abstractmethod
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from pagedlm import envs, huge_pages, prefault
from pagedlm.kernels import amx, gemv
from pagedlm.kernels.triton import gemv as triton_gemv
from pagedlm.model_executor.layers.native_linear import (PANEL_FORMATS, NativeLinear,
                                                         NativeSegments, WeightFormat)

logger = logging.getLogger(__name__)

WeightLoader = Callable[..., None]  # (param, loaded_weight, shard_id=None) -> None

# Set while the loader builds a model whose quantized layers take their weights as stored
# (quantization="gguf"): float weights are created on the meta device, holding no memory, and
# made real only for the layers that stay float. A context variable rather than a module flag:
# it holds inside the `with` and in this thread only.
_WEIGHTS_ON_META: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "pagedlm_weights_on_meta", default=False)


# Set while the loader fills a model's weights: the Arena that the panels packed as the
# checkpoint arrives (UnquantizedLinearMethod.put_rows) are carved from, so that the small ones
# share maps on huge pages instead of being copied there after the load (huge_pages.py).
_PANEL_ARENA: contextvars.ContextVar[huge_pages.Arena | None] = contextvars.ContextVar(
    "pagedlm_panel_arena", default=None)


@contextlib.contextmanager
def panels_in_arena():
    """Carve the panels packed while loading from one huge_pages.Arena (see above), and
    first from the memory `pagedlm serve` faulted in for them, if it did (prefault.py)."""
    memory = prefault.current()
    token = _PANEL_ARENA.set(huge_pages.Arena(memory=memory))
    try:
        yield
    finally:
        _PANEL_ARENA.reset(token)
        if memory is not None:
            memory.finish()  # what the panels left goes back before the KV cache is made


def _panel_zeros() -> Callable[[tuple[int, ...], torch.dtype], torch.Tensor]:
    """Where 2-byte panels are allocated: the loader's Arena while it loads, else huge pages
    for the large ones."""
    arena = _PANEL_ARENA.get()
    return arena.zeros if arena is not None else functools.partial(huge_pages.empty, zero=True)


@contextlib.contextmanager
def weights_on_meta():
    """Build linear layers' and embeddings' float weights on the meta device (see above)."""
    token = _WEIGHTS_ON_META.set(True)
    try:
        yield
    finally:
        _WEIGHTS_ON_META.reset(token)


def float_weight_device() -> torch.device | None:
    """Where a float weight is created: meta inside weights_on_meta(), else the default."""
    return torch.device("meta") if _WEIGHTS_ON_META.get() else None


def pack_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """The weight in oneDNN's blocked layout, or None where that is unavailable or disabled."""
    if (envs.PAGEDLM_DISABLE_ONEDNN or weight.device.type != "cpu"
            or weight.dtype not in (torch.float32, torch.bfloat16)
            or not torch.backends.mkldnn.is_available()):
        return None
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), batch_size=None)
        # A private op: check it agrees with F.linear once before trusting it.
        probe = torch.ones(1, weight.shape[1], dtype=weight.dtype)
        got = torch.ops.mkldnn._linear_pointwise(probe, packed, None, "none", [], "")
        if not torch.allclose(got.float(), F.linear(probe, weight).float(), rtol=1e-2, atol=1e-2):
            raise RuntimeError("packed weight disagrees with F.linear")
        return packed
    except (RuntimeError, AttributeError) as e:
        logger.warning("oneDNN weight packing unavailable, using F.linear: %s", e)
        return None


# The fewest rows a bfloat16 layer on panels runs on AMX (UnquantizedLinearMethod). AMX pads
# rows to 16, so below 16 it costs what 16 do: SmolLM2-135M's four shapes once, 2 threads,
# medians of 5 interleaved rounds, AMX / panel kernel on k-pair panels 0.143 / 0.128 ms at 8
# rows, 0.143 / 0.138 at 9, 0.142 / 0.148 at 10, 0.144 / 0.164 at 12, 0.137 / 0.215 at 16. Above
# gemv.GEMV_MAX_ROWS, so that the fused decode stack, which then stops there, runs the same
# kernel as the layers.
AMX_MIN_ROWS = 12
assert AMX_MIN_ROWS > gemv.GEMV_MAX_ROWS
# Where AVX512-BF16 runs without AMX (the Zen 4 EPYC), the fewest rows a bfloat16 layer on
# k-pair panels runs on vdpbf16ps (gemv.gemm_panels(dot=True)) instead of the widened float32
# chain: there one vdpbf16ps retires a zmm a cycle, twice the chain's rate. The 1B Llama's
# shapes, 2 threads, medians of 15, widened / vdpbf16ps ms: 8192x2048 at 1 row 0.71 / 0.79, 8
# 1.64 / 0.84, 12 2.85 / 1.48, 32 6.91 / 3.47, 128 24.39 / 11.87; 2048x8192 at 8 1.41 / 0.70,
# 32 5.73 / 2.87; 2048x2048 at 8 0.35 / 0.16. So as few as the fused decode stack, which runs
# the panel kernel up to gemv.GEMV_MAX_ROWS rows, leaves to the layers.
DPBF16_MIN_ROWS = gemv.GEMV_MAX_ROWS + 1

# The dtypes the Triton GEMV takes (UnquantizedLinearMethod.apply, PAGEDLM_TRITON_GEMV).
TRITON_GEMV_DTYPES = (torch.bfloat16, torch.float16)
# The most rows the layers send it. On an H200 (SmolLM2-135M's four shapes x 30 layers, per
# call in CUDA graphs; benchmarks/results/gpu-20261127c/gpu_gemv.json) it took 416 us a token
# against cuBLAS's 530 at 1 row and 451 against 530 at 2, tied at 4 (523 / 521) and lost at 8
# (712 / 521).
TRITON_GEMV_MAX_ROWS = 2


class LinearMethodBase(ABC):
    """How a linear layer stores its weight and multiplies by it.

    deterministic (ModelConfig.deterministic, given at construction): `apply` runs one kernel,
    with one sum order per output element, at every row count, so a row's result does not
    depend on how many other rows are in the batch or where it sits among them.
    """

    def __init__(self, *, deterministic: bool = False) -> None:
        self.deterministic = deterministic

    @abstractmethod
    def create_weights(self, layer: nn.Module, input_size_per_partition: int,
                       output_partition_sizes: list[int], input_size: int, output_size: int,
                       params_dtype: torch.dtype, weight_loader: WeightLoader) -> None:
        """Register the layer's weight parameter(s) for this rank's partition, each with a
        `weight_loader` attribute. output_partition_sizes: this rank's rows of each stacked
        matrix (e.g. [q, k, v]); input_size / output_size: the full, unsharded sizes."""

    @abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [num_tokens, input_size_per_partition] -> [num_tokens, output rows of this rank]."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Convert the loaded weights into the format `apply` runs on (once, after loading)."""

    def process_when_loaded(self, layer: nn.Module) -> bool:
        """Whether process_weights_after_loading may run as soon as the checkpoint has filled
        the layer's weight, while the rest of the model loads (model_loader.loader.
        process_as_loaded): worth it where processing frees the plain weight, which would
        otherwise sit beside the processed form of every layer loaded before it."""
        return False

    def native_form(self, layer: nn.Module) -> NativeLinear | NativeSegments | None:
        """The weight as a native kernel that computes what `apply` does reads it (for callers
        such as the fused decode stack that run the kernel themselves), or None where `apply`
        runs something else. Valid after process_weights_after_loading."""
        return None


class UnquantizedLinearMethod(LinearMethodBase):
    """A dense weight [out, in]; the matmul runs on the panel kernel's packed copy of it, or
    where that kernel does not run (no AVX2), on the GEMV kernel for a few rows and oneDNN's
    packed copy past them (gemv.py). Deterministic, it runs the GEMV kernel at every row count
    where there are no panels: its sum for one output reads one W row against one x row in a
    fixed K order, whatever the x tile the row sits in or the thread that owns the W row
    (gemv_f32.c, wrow).

    A 2-byte weight (ModelConfig.dtype bfloat16 or float16, a GGUF file's BF16 or F16
    matrices) stays in that dtype and x stays float32: it runs on panels of its dtype, which
    the kernel widens exactly as it reads them (the float32 kernel's bits on weight.float(),
    half the bytes read). Where no kernel takes the weight (without AVX2 or with
    PAGEDLM_DISABLE_KERNELS), each call widens it to a transient float32 copy for F.linear: no
    float32 copy stays resident, at the cost of reading the matrix and writing the copy again
    per call.

    bfloat16 panels go to AMX's tile unit (kernels/amx.py) from AMX_MIN_ROWS rows where the
    CPU has AMX-BF16 and K is a multiple of 32, outside the deterministic mode: x is rounded
    to bfloat16 there, so a row's bits differ from the panel kernel's, and the deterministic
    mode's promise (a row's bits do not depend on its batch) needs one kernel at every row
    count: it keeps the panels. SmolLM2-135M's four shapes once (a Sapphire Rapids-class Xeon,
    2 threads): 0.45 ms at 128 rows against the panel kernel's 1.76 and torch's bfloat16
    F.linear's 0.54, 6.3 at 2048 against 28.2 and 3.8 (csrc/amx_bf16.c has the table). Where
    the build has AVX512-BF16 but the CPU no AMX (Zen 4), the same panels go to vdpbf16ps from
    DPBF16_MIN_ROWS rows instead, x rounded to bfloat16 as on AMX. A oneDNN-packed copy beside
    the panels would double the weights' memory. The fused decode stack, which runs the panel
    kernel, then takes decode steps only up to gemv.GEMV_MAX_ROWS rows (below both switches,
    so it still computes what the layers do: native_form says `other_kernel_from`)."""

    def create_weights(self, layer, input_size_per_partition, output_partition_sizes,
                       input_size, output_size, params_dtype, weight_loader) -> None:
        # Uninitialised: the loader always fills it (and complains if the checkpoint does not).
        weight = nn.Parameter(torch.empty(sum(output_partition_sizes), input_size_per_partition,
                                          dtype=params_dtype, device=float_weight_device()),
                              requires_grad=False)
        weight.weight_loader = weight_loader
        layer.register_parameter("weight", weight)
        layer.packed_weight = layer.panel_weight = None
        layer.use_gemv = False
        layer.amx_from = layer.dot_from = 0

    def process_weights_after_loading(self, layer) -> None:
        if layer.weight.is_meta and getattr(layer, "panel_weight", None) is not None:
            return  # done before: the panels are the weight now (see below)
        # 2-byte panels stream from memory at every decode step: large ones go straight onto
        # huge pages (the worker gathers the rest there after loading; huge_pages.py). Panels
        # the loader filled row by row (put_rows) are the weight already.
        if getattr(layer, "panel_weight", None) is None:
            layer.panel_weight = (gemv.pack_panels(layer.weight, zeros=_panel_zeros())
                                  if layer.weight.element_size() == 2
                                  else gemv.pack_panels(layer.weight))
        layer.use_gemv = gemv.runs(layer.weight)
        layer.amx_from = self._amx_from(layer)
        layer.dot_from = self._dot_from(layer)
        if self.deterministic and layer.panel_weight is None and not layer.use_gemv:
            raise ValueError(f"deterministic=True needs pagedlm's native kernels for every "
                             f"linear layer; a {layer.weight.dtype} weight of shape "
                             f"{tuple(layer.weight.shape)} cannot run on them here (they take "
                             f"float32 weights, and bfloat16 or float16 ones on the panel "
                             f"kernel, which needs AVX2; not with PAGEDLM_DISABLE_KERNELS).")
        # Deterministic, oneDNN never runs: no packed copy. Nor for a 2-byte weight: oneDNN
        # would multiply float32 activations rounded to the weight's dtype.
        layer.packed_weight = (pack_weight(layer.weight)
                               if layer.panel_weight is None and not self.deterministic
                               and layer.weight.dtype == torch.float32 else None)
        # A 2-byte weight on panels is read only through them: its plain copy would make the
        # weights 4 bytes a parameter instead of 2. It is dropped for a meta stand-in with its
        # shape and dtype (a read fails loudly), unless another module reads the same
        # parameter (`weight_shared`: a tied LM head's is the embedding table).
        if (layer.panel_weight is not None and layer.weight.element_size() == 2
                and not getattr(layer, "weight_shared", False)):
            layer.weight = nn.Parameter(torch.empty_like(layer.weight, device="meta"),
                                        requires_grad=False)

    def process_when_loaded(self, layer) -> bool:
        # A 2-byte weight bound for panels, whose plain copy processing drops (above); a
        # subclass that processes its own way says for itself.
        weight = getattr(layer, "weight", None)
        return (type(self).process_weights_after_loading
                is UnquantizedLinearMethod.process_weights_after_loading
                and weight is not None and not weight.is_meta and weight.element_size() == 2
                and weight.dtype in gemv.panel_dtypes())

    def put_rows(self, layer, first: int, rows: torch.Tensor) -> bool:
        """Rows [first, first + len(rows)) of the layer's weight as its loader slices them
        from the checkpoint: where the weight is bound for panels as it loads
        (process_when_loaded), packed straight into them from the checkpoint's pages, so the
        plain weight, which processing drops, is never written. That write was a fresh page
        for every 4 KiB of the 1B Llama's 1.95 GB of bfloat16 matrices, 0.67 s of its load
        (Zen 4 EPYC; the checkpoint's own pages, read once either way, 0.13 s). False: the
        loader copies them into the weight. A layer whose panels are a view of the panels'
        file (panel_cache.py, `panels_mapped`) holds these rows already: nothing is read."""
        if getattr(layer, "panels_mapped", False):
            return True
        if getattr(layer, "weight_shared", False) or not self.process_when_loaded(layer):
            return False
        weight = layer.weight
        if layer.panel_weight is None:
            layer.panel_weight = gemv.empty_panels(*weight.shape, weight.dtype,
                                                   zeros=_panel_zeros())
        gemv.put_panel_rows(layer.panel_weight, first, rows.to(weight.dtype).contiguous())
        return True

    def _amx_from(self, layer) -> int:
        """The row count from which `apply` runs the layer on AMX; 0: never (decided once, as
        the weight is processed: a check per call cost microseconds per layer)."""
        panels = getattr(layer, "panel_weight", None)
        return (AMX_MIN_ROWS if panels is not None and panels.dtype == torch.bfloat16
                and not self.deterministic and amx.available()
                and amx.runs(layer.weight.shape[1]) else 0)

    def _dot_from(self, layer) -> int:
        """The row count from which `apply` runs the layer on vdpbf16ps; 0: never
        (deterministic, no AVX512-BF16 in the build, already every row under
        PAGEDLM_BF16_DPBF16, or a CPU with AMX, where vdpbf16ps runs at half the widened
        chain's rate even for the layers AMX does not take)."""
        panels = getattr(layer, "panel_weight", None)
        return (DPBF16_MIN_ROWS if panels is not None and panels.dtype == torch.bfloat16
                and not self.deterministic and not amx.available()
                and gemv.bf16_dot_available() and not gemv.bf16_dpbf16() else 0)

    def apply(self, layer, x, bias=None) -> torch.Tensor:
        if (x.is_cuda and x.dim() == 2 and x.shape[0] <= TRITON_GEMV_MAX_ROWS
                and x.dtype in TRITON_GEMV_DTYPES and layer.weight.dtype == x.dtype
                and envs.PAGEDLM_TRITON_GEMV):
            # Decode-sized batches on the GPU: cuBLAS runs these shapes on a few CTAs
            # (kernels/triton/gemv.py). CPU calls pay one check (is_cuda); the env var (on
            # unless 0) is read last, only for calls that qualify otherwise.
            return triton_gemv.gemv(x, layer.weight, bias)
        panels = getattr(layer, "panel_weight", None)
        if panels is not None and x.dim() == 2 and x.dtype == torch.float32:
            amx_from = getattr(layer, "amx_from", 0)
            if amx_from and x.shape[0] >= amx_from:
                return amx.gemm_panels(x, panels, layer.weight.shape[0], bias)
            dot_from = getattr(layer, "dot_from", 0)
            return gemv.gemm_panels(x, panels, layer.weight.shape[0], bias,
                                    dot=bool(dot_from) and x.shape[0] >= dot_from)
        if panels is not None and layer.weight.is_meta:  # no plain weight left for F.linear
            n = layer.weight.shape[0]
            y = gemv.gemm_panels(x.reshape(-1, x.shape[-1]).float(), panels, n, bias)
            return y.reshape(*x.shape[:-1], n).to(x.dtype)
        if (getattr(layer, "use_gemv", False) and x.dim() == 2 and x.dtype == torch.float32
                and (x.shape[0] <= gemv.GEMV_MAX_ROWS or self.deterministic)):
            return gemv.gemv(x, layer.weight, bias)
        if layer.packed_weight is not None:
            return torch.ops.mkldnn._linear_pointwise(x, layer.packed_weight, bias, "none",
                                                      [], "")
        # A 2-byte weight no kernel takes: widened for this call only (see the class).
        return F.linear(x, layer.weight.to(x.dtype), bias)

    def native_form(self, layer) -> NativeLinear | None:
        if type(self).apply is not UnquantizedLinearMethod.apply:
            return None  # a subclass that multiplies another way describes its own form
        panels = getattr(layer, "panel_weight", None)
        if panels is not None:
            return NativeLinear(PANEL_FORMATS[panels.dtype], panels,
                                other_kernel_from=(getattr(layer, "amx_from", 0)
                                                   or getattr(layer, "dot_from", 0)))
        if getattr(layer, "use_gemv", False):
            return NativeLinear(WeightFormat.FLOAT, layer.weight,
                                every_row_count=self.deterministic)
        return None  # oneDNN or F.linear


def use_deterministic_linear_methods(model: nn.Module) -> None:
    """Give every layer of `model` on the default float method the deterministic one (the
    loader calls this under ModelConfig.deterministic once the model is built, before loading;
    quantized methods get the flag from their QuantizationConfig)."""
    for module in model.modules():
        if type(getattr(module, "linear_method", None)) is UnquantizedLinearMethod:
            module.linear_method = UnquantizedLinearMethod(deterministic=True)
