"""The fused decode stack: a pipeline stage's decoder layers in one native call
(csrc/llama_decode.c) for pure decode steps.

A decoder layer takes part by declaring the standard structure (StandardDecoderLayer: a
pre-norm attention block with rotary positions, then a pre-norm SiLU-gated MLP); the stack
checks the parts it is handed (float32 RMSNorms, rotary paged attention on the native kernels,
linear layers whose LinearMethod has a native form: float32, bfloat16 or float16 weights on
the panel kernel, float32 on the GEMV kernel, or quantized, a fused layer's shards possibly
each in its own format), not the model class. When every layer qualifies, pure decode steps run
fused (at any batch size on the panel kernel or under deterministic=True, else up to
gemv.GEMV_MAX_ROWS sequences); anything else (LoRA, tensor parallelism, other dtypes,
prefills) goes layer by layer. Both give the same values.

On a GPU the same declaration lets TritonFusedLayers run the layers with each RMSNorm folded
into the GEMV after it and SiLU-and-mul into the down projection (kernels/triton/fused_gemv.py)
for steps of at most linear_method.TRITON_GEMV_MAX_ROWS tokens, under
PAGEDLM_TRITON_FUSED_NORM_ACT=1 (opt-in until a GPU measures it): 3 launches fewer a layer, the
same kernels' values.
"""
from __future__ import annotations

import ctypes
import logging
import sys
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
from torch import nn

from pagedlm import envs, kernels
from pagedlm.attention.backends import native
from pagedlm.attention.layer import Attention
from pagedlm.attention.metadata import AttentionMetadata
from pagedlm.model_executor.layers.activation import SiluAndMul
from pagedlm.model_executor.layers.layernorm import RMSNorm
from pagedlm.kernels.triton import fused_gemv
from pagedlm.model_executor.layers import linear_method as _linear_method
from pagedlm.model_executor.layers.linear import LinearBase
from pagedlm.model_executor.layers.linear_method import UnquantizedLinearMethod
from pagedlm.model_executor.layers.native_linear import NativeLinear, NativeSegments, WeightFormat
from pagedlm.model_executor.layers.rotary_embedding import RotaryEmbedding

logger = logging.getLogger(__name__)

KVCache = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class DecoderLayerParts:
    """The modules of a decoder layer whose forward is exactly (llama_decode.c's loop):

        residual += x; x = input_norm(residual)          (first layer: residual = x)
        q, k, v = split(qkv_proj(x)); q, k = rotary(positions, q, k)
        x = o_proj(attn(q, k, v))                        (attn writes k, v to the cache)
        residual += x; x = post_attention_norm(residual)
        x = down_proj(act(gate_up_proj(x)))              (act: silu(gate) * up)
    """
    input_norm: nn.Module
    post_attention_norm: nn.Module
    qkv_proj: nn.Module
    o_proj: nn.Module
    rotary: nn.Module
    attn: nn.Module
    gate_up_proj: nn.Module
    act: nn.Module
    down_proj: nn.Module


@runtime_checkable
class StandardDecoderLayer(Protocol):
    """A decoder layer that can declare the standard structure."""

    def decoder_parts(self) -> DecoderLayerParts | None:
        """Its parts, or None when its forward computes anything else."""


# llama_decode.c's structs (csrc/include/pagedlm_ops.h): the same fields in the same order.
class _Segment(ctypes.Structure):
    _fields_ = [("fmt", ctypes.c_int64), ("weight", ctypes.c_void_p),
                ("scale", ctypes.c_void_p), ("rows", ctypes.c_int64)]


_MAX_SEGMENTS = 3  # LINEAR_MAX_SEGMENTS: a fused layer's shards (q|k|v)


class _Linear(ctypes.Structure):
    _fields_ = [("nseg", ctypes.c_int64), ("seg", _Segment * _MAX_SEGMENTS),
                ("bias", ctypes.c_void_p)]


class _Layer(ctypes.Structure):
    _fields_ = [("input_norm", ctypes.c_void_p), ("post_norm", ctypes.c_void_p),
                ("qkv", _Linear), ("o", _Linear), ("gate_up", _Linear), ("down", _Linear),
                ("k_cache", ctypes.c_void_p), ("v_cache", ctypes.c_void_p),
                ("window", ctypes.c_int64)]


# dims_t.x16_rows for "every step": more rows than any step has.
_ALL_ROWS = 1 << 62


class _Dims(ctypes.Structure):
    _fields_ = [(name, ctypes.c_int64) for name in (
        "num_layers", "hidden", "num_heads", "num_kv_heads", "head_dim", "intermediate",
        "kv_type", "block_size", "rotary_half")] + [
        ("cos", ctypes.c_void_p), ("sin", ctypes.c_void_p), ("eps", ctypes.c_float),
        ("scale", ctypes.c_float), ("x16_rows", ctypes.c_int64)]


def _fusable_tensor(t: torch.Tensor | None) -> bool:
    return (t is None or (t.dtype == torch.float32 and t.is_contiguous()
                          and t.device.type == "cpu"))


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


# The element type llama_decode.c reads each float format's weight as (the activations and
# sums are float32 in all of them); the quantized formats' bytes are the kernels' own.
_FLOAT_FORMAT_DTYPES = {WeightFormat.FLOAT: torch.float32,
                        WeightFormat.FLOAT_PANELS: torch.float32,
                        WeightFormat.BF16_PANELS: torch.bfloat16,
                        WeightFormat.F16_PANELS: torch.float16}


def _linear_struct(linear: nn.Module, out_features: int, in_features: int) -> _Linear | str:
    """The layer as llama_decode.c reads it, or why it cannot."""
    if not isinstance(linear, LinearBase):
        return f"is a {type(linear).__name__}, not a linear layer"
    if linear.tp_size != 1:
        return f"is split over {linear.tp_size} tensor-parallel ranks"
    if (linear.output_size, linear.input_size) != (out_features, in_features):
        return (f"is {linear.output_size} x {linear.input_size}, the layer's shape needs "
                f"{out_features} x {in_features}")
    form = linear.linear_method.native_form(linear)
    if form is None:
        return f"runs no native kernel ({type(linear.linear_method).__name__})"
    if not _fusable_tensor(linear.bias):
        return "has a bias that is not a contiguous float32 CPU tensor"
    segments = (form.segments if isinstance(form, NativeSegments)
                else ((out_features, form),))
    if len(segments) > _MAX_SEGMENTS:
        return f"has {len(segments)} row segments, the stack takes {_MAX_SEGMENTS} at most"
    structs = []
    for rows, segment in segments:
        struct = _segment_struct(segment, rows)
        if isinstance(struct, str):
            return struct
        structs.append(struct)
    return _Linear(len(structs), (_Segment * _MAX_SEGMENTS)(*structs), _ptr(linear.bias))


def _segment_struct(form: NativeLinear, rows: int) -> _Segment | str:
    if (not form.weight.is_contiguous() or form.weight.device.type != "cpu"
            or not _fusable_tensor(form.scale)):
        return "has a weight or scale that is not a contiguous float32 CPU tensor"
    dtype = _FLOAT_FORMAT_DTYPES.get(form.fmt)
    if dtype is not None and form.weight.dtype != dtype:
        return f"has a {form.weight.dtype} weight for {form.fmt.name}, which reads {dtype}"
    return _Segment(form.fmt, form.weight.data_ptr(), _ptr(form.scale), rows)


def _layer_struct(parts: DecoderLayerParts) -> _Layer | str:
    """The layer as llama_decode.c reads it, or why it cannot."""
    norms = (parts.input_norm, parts.post_attention_norm)
    if any(type(n) is not RMSNorm or not _fusable_tensor(n.weight) for n in norms):
        return "its norms are not float32 RMSNorms"
    rotary, attn = parts.rotary, parts.attn
    if (type(rotary) is not RotaryEmbedding or not _fusable_tensor(rotary.cos)
            or not _fusable_tensor(rotary.sin)):
        return "its rotary embedding is not the float32 RotaryEmbedding"
    if (type(attn) is not Attention or not isinstance(attn.backend, native.NativeKernelBackend)
            or attn.logits_soft_cap is not None):
        return "its attention is not paged attention on the native kernels without soft cap"
    if type(parts.act) is not SiluAndMul:
        return f"its MLP activation is {type(parts.act).__name__}, not SiluAndMul"
    hidden, q = norms[0].weight.shape[0], attn.num_heads * attn.head_dim
    inter = getattr(parts.down_proj, "input_size", 0)
    # down_proj before gate_up_proj: the MLP's width is read from it.
    shapes = {"qkv": ("qkv_proj", q + 2 * attn.num_kv_heads * attn.head_dim, hidden),
              "o": ("o_proj", hidden, q), "down": ("down_proj", hidden, inter),
              "gate_up": ("gate_up_proj", 2 * inter, hidden)}
    linears = {}
    for field, (name, out_features, in_features) in shapes.items():
        linears[field] = _linear_struct(getattr(parts, name), out_features, in_features)
        if isinstance(linears[field], str):
            return f"its {name} {linears[field]}"
    return _Layer(input_norm=norms[0].weight.data_ptr(), post_norm=norms[1].weight.data_ptr(),
                  window=attn.sliding_window or 0, **linears)


class FusedDecodeStack:
    """Runs a stage's decoder layers in one call of llama_decode.c for pure decode steps.
    Same kernels, same order, same values as the layer-by-layer path.

    How many sequences: any number when every linear runs its kernel at every row count (the
    panel kernel; any kernel under deterministic=True: NativeLinear.batch_invariant); even at
    128 rows the ~20 dispatches a layer cost more than the call (the 128-request benchmark,
    same prompts in one process: 65.1 -> 62.8 and 67.2 -> 65.0 s). Otherwise
    gemv.GEMV_MAX_ROWS: past it the layers switch to another kernel (oneDNN, or a dequantized
    GEMM), which the stack would have to match."""

    def __init__(self, lib: ctypes.CDLL, dims: _Dims, layers: list[_Layer],
                 batch_invariant: bool) -> None:
        """batch_invariant: every linear's method runs its kernel at every row count."""
        self.lib, self.dims = lib, dims
        self.layers = (_Layer * len(layers))(*layers)
        self.max_rows = sys.maxsize if batch_invariant else kernels.gemv.GEMV_MAX_ROWS
        self.cache_ptrs: tuple[int, ...] = ()
        self.steps = 0  # steps it ran (tests check that it ran at all)

    @classmethod
    def build(cls, layers: list[tuple[str, nn.Module]]) -> FusedDecodeStack | str:
        """The fused stack over `layers` (one stage's (name, layer), in order), or why there
        is none."""
        if envs.PAGEDLM_DISABLE_FUSED_DECODE:
            return "PAGEDLM_DISABLE_FUSED_DECODE is set"
        if kernels.kernels_disabled():
            return "PAGEDLM_DISABLE_KERNELS is set"
        if not layers:
            return "this stage has no decoder layers"
        parts, structs = [], []
        for name, layer in layers:
            layer_parts = (layer.decoder_parts() if isinstance(layer, StandardDecoderLayer)
                           else None)
            if layer_parts is None:
                return f"decoder layer {name} ({type(layer).__name__}) is not the standard block"
            struct = _layer_struct(layer_parts)
            if isinstance(struct, str):
                return f"decoder layer {name}: {struct}"
            parts.append(layer_parts)
            structs.append(struct)
        first = parts[0]
        attn, eps = first.attn, first.input_norm.eps
        if not all(p.input_norm.eps == eps and p.post_attention_norm.eps == eps
                   and p.rotary is first.rotary and p.attn.scale == attn.scale for p in parts):
            return "the layers differ in norm eps, rotary table or attention scale"
        lib = kernels.decode_stack.library()
        if lib is None:
            return "the native kernels are unavailable (see the loader's warning)"
        forms = [lin.linear_method.native_form(lin) for p in parts
                 for lin in (p.qkv_proj, p.o_proj, p.gate_up_proj, p.down_proj)]
        batch_invariant = all(form.batch_invariant for form in forms)
        # The block formats' segments take x as the layers do: all in two limbs, or none.
        two_limbs = any(
            seg.two_limbs for form in forms
            for _, seg in (form.segments if isinstance(form, NativeSegments) else ((0, form),)))
        dims = _Dims(len(layers), first.input_norm.weight.shape[0], attn.num_heads,
                     attn.num_kv_heads, attn.head_dim, first.down_proj.input_size, 0, 0,
                     first.rotary.cos.shape[1], first.rotary.cos.data_ptr(),
                     first.rotary.sin.data_ptr(), eps, attn.scale,
                     _ALL_ROWS if two_limbs else 0)
        return cls(lib, dims, structs, batch_invariant)

    def run(self, x: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
            kv_caches: list[KVCache], meta: AttentionMetadata
            ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(x, residual) after the stage's layers, or None if this step is not one it runs."""
        m = x.shape[0]
        if (meta.prefills or meta.num_decode_tokens != m or not 0 < m <= self.max_rows
                or x.dtype != torch.float32 or positions.dtype != torch.int64
                or meta.slot_mapping.dtype != torch.int64):
            return None
        k0 = kv_caches[0][0]
        kv_type = kernels.kv_types.KV_TYPE_CODES.get(k0.dtype)
        if kv_type is None:
            return None
        ptrs = tuple(t.data_ptr() for kv in kv_caches for t in kv)
        if ptrs != self.cache_ptrs:  # first step, or a re-allocated cache
            for layer, (k, v) in zip(self.layers, kv_caches):
                layer.k_cache, layer.v_cache = k.data_ptr(), v.data_ptr()
            self.cache_ptrs = ptrs
        self.dims.kv_type, self.dims.block_size = kv_type, k0.shape[1]
        plan = native.kernel_plan(meta, k0)  # checks every block id and length once
        x = x.contiguous().clone()
        has_residual = residual is not None
        residual = (residual.contiguous().clone() if has_residual
                    else torch.empty_like(x, memory_format=torch.contiguous_format))
        positions, slots = positions.contiguous(), meta.slot_mapping.contiguous()
        if self.lib.llama_decode_f32(
                ctypes.byref(self.dims), self.layers, x.data_ptr(), residual.data_ptr(),
                int(has_residual), m, positions.data_ptr(), slots.data_ptr(),
                plan.block_tables.data_ptr(), plan.block_tables.shape[1],
                plan.ctx_lens.data_ptr(), torch.get_num_threads()) != 0:
            raise MemoryError("llama_decode_f32: no memory for its scratch buffers")
        self.steps += 1
        return x, residual


def _triton_device(t: torch.Tensor) -> bool:
    """Whether t is where TritonFusedLayers runs: a CUDA tensor. (The tests replace this to run
    the Triton kernels on CPU tensors under Triton's interpreter.)"""
    return t.is_cuda


def _triton_linear_reason(linear: nn.Module, dtype: torch.dtype) -> str | None:
    """Why UnquantizedLinearMethod.apply would not run `linear` on the Triton GEMV at decode
    batch sizes (so neither may the fused kernel), or None."""
    if not isinstance(linear, LinearBase):  # LoRA's wrappers, for one
        return f"is a {type(linear).__name__}, not a linear layer"
    if linear.tp_size != 1:
        return f"is split over {linear.tp_size} tensor-parallel ranks"
    if type(linear.linear_method).apply is not UnquantizedLinearMethod.apply:
        return f"multiplies with {type(linear.linear_method).__name__}"
    w, b = linear.weight, linear.bias
    if (w.dim() != 2 or w.dtype != dtype or not _triton_device(w) or w.stride(1) != 1
            or (b is not None and (b.dtype != dtype or not _triton_device(b)))):
        return f"has no {dtype} weight (rows contiguous) and bias on the GPU"
    return None


class TritonFusedLayers:
    """On a GPU: a stage's standard decoder layers (DecoderLayerParts) run with
    rms_norm_gemv for input norm + QKV and post-attention norm + gate_up and silu_mul_gemv for
    SiLU-and-mul + down; rotary, attention and o_proj are the layers' own modules. Steps of at
    most linear_method.TRITON_GEMV_MAX_ROWS tokens only: the rows the layers' linears would run
    on the Triton GEMV (above them cuBLAS, which has no such prologue). Whatever the step's
    kind: the layer's forward is the same for prefill and decode tokens.

    Why (kernels/triton/fused_gemv.py has the figures): one decode stream on an H200 launched
    ~335 kernels a token with ~0.85 us of idle GPU between them; these 3 launches fewer a layer
    are 90 a token for SmolLM2-135M. The values are those of the layer-by-layer path on the GPU
    (fused_ops' norm and activation, then the Triton GEMV at the same configuration), to the
    norm's sum of squares' reduction order. Grids from shapes only and no host sync: CUDA
    graphs capture it as they capture the layers."""

    def __init__(self, parts: list[DecoderLayerParts], dtype: torch.dtype) -> None:
        self.parts, self.dtype = parts, dtype
        self.steps = 0  # steps it ran (eagerly or into a graph's capture; not graph replays)

    @classmethod
    def build(cls, layers: list[tuple[str, nn.Module]]) -> TritonFusedLayers | str:
        """The fused layers over `layers` (one stage's (name, layer), in order), or why there
        are none."""
        if not envs.PAGEDLM_TRITON_FUSED_NORM_ACT:
            return "PAGEDLM_TRITON_FUSED_NORM_ACT is not set"
        if envs.PAGEDLM_DISABLE_FUSED_DECODE:  # layer by layer, as on the CPU
            return "PAGEDLM_DISABLE_FUSED_DECODE is set"
        if not envs.PAGEDLM_TRITON_GEMV:
            return "PAGEDLM_TRITON_GEMV is off: the linear layers run cuBLAS"
        if not layers:
            return "this stage has no decoder layers"
        parts, dtype = [], None
        for name, layer in layers:
            p = (layer.decoder_parts() if isinstance(layer, StandardDecoderLayer) else None)
            if p is None:
                return f"decoder layer {name} ({type(layer).__name__}) is not the standard block"
            why = cls._parts_reason(p, dtype)
            if why is not None:
                return f"decoder layer {name}: {why}"
            dtype = p.input_norm.weight.dtype
            parts.append(p)
        return cls(parts, dtype)

    @staticmethod
    def _parts_reason(p: DecoderLayerParts, dtype: torch.dtype | None) -> str | None:
        norms = (p.input_norm, p.post_attention_norm)
        dtype = dtype or norms[0].weight.dtype
        if dtype not in _linear_method.TRITON_GEMV_DTYPES:  # the layers' path this replaces
            return f"its weights are {dtype}; the Triton GEMV takes bfloat16 and float16"
        if any(type(n) is not RMSNorm or n.weight.dtype != dtype or not _triton_device(n.weight)
               or n.weight.dim() != 1 or n.weight.stride(0) != 1 for n in norms):
            return f"its norms are not {dtype} RMSNorms on the GPU"
        if type(p.act) is not SiluAndMul:
            return f"its MLP activation is {type(p.act).__name__}, not SiluAndMul"
        for name in ("qkv_proj", "gate_up_proj", "down_proj"):
            why = _triton_linear_reason(getattr(p, name), dtype)
            if why is not None:
                return f"its {name} {why}"
        hidden = norms[0].weight.shape[0]
        heads = p.attn.num_heads + 2 * p.attn.num_kv_heads
        if (p.qkv_proj.weight.shape != (heads * p.attn.head_dim, hidden)
                or p.gate_up_proj.weight.shape[1] != hidden
                or p.gate_up_proj.weight.shape[0] != 2 * p.down_proj.weight.shape[1]):
            return "its projections' shapes do not chain (hidden, heads, MLP width)"
        return None

    def run(self, x: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
            kv_caches: list[KVCache], meta: AttentionMetadata
            ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(x, residual) after the stage's layers, or None if this step is not one it runs."""
        m = x.shape[0]
        if (not 0 < m <= _linear_method.TRITON_GEMV_MAX_ROWS or x.dim() != 2
                or x.dtype != self.dtype or x.stride(1) != 1 or not _triton_device(x)
                or (residual is not None and (residual.dtype != self.dtype
                                              or residual.stride(1) != 1))):
            return None
        for p, kv_cache in zip(self.parts, kv_caches):
            # LlamaDecoderLayer.forward (DecoderLayerParts' structure) with the norms and the
            # activation inside the GEMVs after them.
            attn, norm = p.attn, p.input_norm
            qkv, residual = fused_gemv.rms_norm_gemv(x, residual, norm.weight, norm.eps,
                                                     p.qkv_proj.weight, p.qkv_proj.bias)
            q_size, kv_size = attn.num_heads * attn.head_dim, attn.num_kv_heads * attn.head_dim
            q, k, v = qkv.split((q_size, kv_size, kv_size), dim=-1)
            q, k = p.rotary(positions, q.view(m, attn.num_heads, attn.head_dim),
                            k.view(m, attn.num_kv_heads, attn.head_dim))
            x = p.o_proj(attn(q, k, v, kv_cache, meta))
            norm = p.post_attention_norm
            x, residual = fused_gemv.rms_norm_gemv(x, residual, norm.weight, norm.eps,
                                                   p.gate_up_proj.weight, p.gate_up_proj.bias)
            x = fused_gemv.silu_mul_gemv(x, p.down_proj.weight, p.down_proj.bias)
        self.steps += 1
        return x, residual


class FusedDecode:
    """Whether a pipeline stage runs its pure decode steps through a FusedDecodeStack (CPU)
    or its small steps through TritonFusedLayers (GPU).

    Decided once, at the stage's first step rather than when the model is built: the linear
    methods pack their weights after loading, and LoRA wraps the layers after that; the
    device is that step's. From then on exactly one of `stack` (built) and `off_reason` (why
    not, logged) is set.
    """

    def __init__(self, layers: nn.Module) -> None:
        """layers: the module holding the stage's decoder layers (as its children, in order)."""
        self._layers = layers
        self.stack: FusedDecodeStack | TritonFusedLayers | None = None
        self.off_reason: str | None = None

    def run(self, x: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
            kv_caches: list[KVCache], meta: AttentionMetadata
            ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(x, residual) after the stage's layers, or None: run them layer by layer."""
        if self.stack is None:
            if self.off_reason is not None:
                return None
            layers = list(self._layers.named_children())
            built = (TritonFusedLayers.build(layers) if _triton_device(x)
                     else FusedDecodeStack.build(layers))
            if isinstance(built, str):
                self.off_reason = built
                logger.debug("fused decode off: %s", built)
                return None
            self.stack = built
        return self.stack.run(x, residual, positions, kv_caches, meta)
