"""The Llama family (Llama 2/3, SmolLM, Mistral; the base of Qwen2, Qwen3, Mixtral and the Qwen
MoE models in their own modules) over a flat batch with paged attention.

Every tensor here is flat over the step's tokens ([num_tokens, ...]); which token belongs to which
sequence is only known to the attention metadata.

Tensor parallelism: the layers split heads and MLP features over the TP group (see
layers/linear.py); each rank's attention runs its own heads against its own KV cache.
Pipeline parallelism: a rank builds and loads only its stage's layers (get_pp_indices), the
embedding on the first stage and the final norm and LM head on the last; a non-last stage's
forward returns IntermediateTensors for the next one.

Pure decode steps run the whole stack in one native call (LlamaFusedDecode,
csrc/llama_decode.c) when every layer is the plain Llama block on the native kernels (at any
batch size on the panel kernel, else up to gemv.GEMV_MAX_ROWS sequences); anything else (LoRA,
tensor parallelism, other dtypes, prefills) goes layer by layer. Both give the same values.
"""
from __future__ import annotations

import ctypes
import functools
import logging
import sys
from pathlib import Path
from typing import Iterable

import torch
from torch import nn

from pagedlm.attention import kernels as attn_kernels
from pagedlm.attention.backends import AttentionBackend, get_attn_backend
from pagedlm.attention.backends import native
from pagedlm.attention.layer import Attention
from pagedlm.attention.metadata import AttentionMetadata
from pagedlm.config import ModelConfig
from pagedlm.distributed.parallel_state import get_pp_group
from pagedlm.distributed.utils import IntermediateTensors, get_pp_indices
from pagedlm.model_executor.layers import gemv
from pagedlm.model_executor.layers.activation import SiluAndMul
from pagedlm.model_executor.layers.layernorm import RMSNorm
from pagedlm.model_executor.layers.linear import (MergedColumnParallelLinear, QKVParallelLinear,
                                                  RowParallelLinear, UnquantizedLinearMethod)
from pagedlm.model_executor.layers.quantization import kernels as quant_kernels
from pagedlm.model_executor.layers.quantization.base import PackedLinearMethod
from pagedlm.model_executor.layers.rotary_embedding import RotaryEmbedding
from pagedlm.model_executor.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding
from pagedlm.model_executor.model_loader.weight_utils import load_weights_into
from pagedlm.model_executor.models.base import CausalLMBase
from pagedlm.utils import env_flag

logger = logging.getLogger(__name__)

KVCache = tuple[torch.Tensor, torch.Tensor]


class LlamaAttention(nn.Module):

    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding,
                 attn_backend: AttentionBackend, layer: int, qkv_bias: bool | None = None,
                 o_bias: bool | None = None) -> None:
        """layer: the global layer index (its sliding window, if any). qkv_bias / o_bias: for
        models (in their own modules) whose configs say it another way; by default read from
        the config as below."""
        super().__init__()
        hf = cfg.hf_config
        # Llama-style configs set attention_bias for all four projections.
        attention_bias = bool(cfg.get_hf("attention_bias", False))
        qkv_bias = attention_bias if qkv_bias is None else qkv_bias
        o_bias = attention_bias if o_bias is None else o_bias
        self.head_dim = cfg.head_dim
        self.qkv_proj = QKVParallelLinear(hf.hidden_size, cfg.head_dim, cfg.num_heads,
                                          cfg.num_kv_heads, bias=qkv_bias)
        # This rank's heads.
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(cfg.num_heads * cfg.head_dim, hf.hidden_size,
                                        bias=o_bias)
        self.rotary = rotary
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.split = (q_size, kv_size, kv_size)
        self.attn = Attention(self.num_heads, self.head_dim, self.head_dim ** -0.5,
                              self.num_kv_heads, attn_backend,
                              sliding_window=cfg.get_sliding_window(layer))

    def forward(self, positions: torch.Tensor, x: torch.Tensor, kv_cache: KVCache,
                meta: AttentionMetadata) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv_proj(x).split(self.split, dim=-1)
        q, k = self.rotary(positions, q.view(n, self.num_heads, self.head_dim),
                           k.view(n, self.num_kv_heads, self.head_dim))
        return self.o_proj(self.attn(q, k, v, kv_cache, meta))


class LlamaMLP(nn.Module):

    def __init__(self, hidden: int, intermediate: int, bias: bool = False) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden, [intermediate, intermediate], bias)
        self.act = SiluAndMul()
        self.down_proj = RowParallelLinear(intermediate, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):

    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding,
                 attn_backend: AttentionBackend, layer: int, self_attn: nn.Module | None = None,
                 mlp: nn.Module | None = None) -> None:
        """self_attn / mlp: a model's own attention or MLP block in place of Llama's (same
        call signatures); the norms and residual wiring are shared."""
        super().__init__()
        hf = cfg.hf_config
        eps = cfg.get_hf("rms_norm_eps", 1e-6)
        self.self_attn = self_attn or LlamaAttention(cfg, rotary, attn_backend, layer)
        self.mlp = mlp or LlamaMLP(hf.hidden_size, hf.intermediate_size,
                                   bool(cfg.get_hf("mlp_bias", False)))
        self.input_layernorm = RMSNorm(hf.hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(hf.hidden_size, eps)

    def forward(self, positions, x, residual, kv_cache, meta):
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x, kv_cache, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaForCausalLM(CausalLMBase):

    # checkpoint name fragment -> (our stacked parameter, its weight_loader's shard id)
    stacked_params = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"),
                      "v_proj": ("qkv_proj", "v"), "gate_proj": ("gate_up_proj", 0),
                      "up_proj": ("gate_up_proj", 1)}

    def __init__(self, cfg: ModelConfig, attn_backend: AttentionBackend | None = None) -> None:
        super().__init__()
        hf = cfg.hf_config
        self.config = cfg
        pp = get_pp_group()
        self.is_first_stage, self.is_last_stage = pp.is_first_rank, pp.is_last_rank
        # Global indices of this stage's layers: [start_layer, end_layer).
        self.start_layer, self.end_layer = get_pp_indices(cfg.num_layers, pp.rank_in_group,
                                                          pp.world_size)
        self.tie_word_embeddings = bool(cfg.get_hf("tie_word_embeddings", False))
        # The last stage needs the embedding too when the LM head is tied to it.
        self.embed_tokens = None
        if self.is_first_stage or (self.tie_word_embeddings and self.is_last_stage):
            self.embed_tokens = VocabParallelEmbedding(hf.vocab_size, hf.hidden_size)
        rotary = RotaryEmbedding(cfg.head_dim, max(cfg.max_model_len, cfg.get_hf("max_position_embeddings", 0)),
                                 cfg.rope_theta, cfg.rope_scaling)
        attn_backend = attn_backend or get_attn_backend(cfg.dtype)
        # Keyed by the global layer index, so parameter names match the checkpoint's.
        self.layers = nn.ModuleDict({str(i): self.make_layer(cfg, i, rotary, attn_backend)
                                     for i in range(self.start_layer, self.end_layer)})
        self.norm = self.lm_head = None
        if self.is_last_stage:
            self.norm = RMSNorm(hf.hidden_size, cfg.get_hf("rms_norm_eps", 1e-6))
            self.lm_head = ParallelLMHead(hf.vocab_size, hf.hidden_size)
            if self.tie_word_embeddings:
                self.lm_head.tie_weights(self.embed_tokens)
        # Decided at the first forward, once LoRA (if any) has wrapped its layers.
        self.fused_decode: LlamaFusedDecode | bool | None = None

    def make_layer(self, cfg: ModelConfig, layer_idx: int, rotary: RotaryEmbedding,
                   attn_backend: AttentionBackend) -> nn.Module:
        """Decoder layer `layer_idx`; models that differ from Llama only inside the layer
        (Qwen3, the MoE models) override this and reuse the rest of the class."""
        return LlamaDecoderLayer(cfg, rotary, attn_backend, layer_idx)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[KVCache], attn_metadata: AttentionMetadata,
                intermediate_tensors: IntermediateTensors | None = None
                ) -> torch.Tensor | IntermediateTensors:
        """One step over the flat batch.

        kv_caches[i] is the cache of this stage's i-th layer (global layer start_layer + i).
        The first stage embeds input_ids; the others continue from the previous stage's
        intermediate_tensors. Returns the final hidden states on the last stage (for
        compute_logits), IntermediateTensors on the others.
        """
        assert len(kv_caches) == len(self.layers), (
            f"{len(kv_caches)} KV caches for {len(self.layers)} layers on this stage")
        if self.is_first_stage:
            x, residual = self.embed_tokens(input_ids), None
        else:
            x, residual = intermediate_tensors.hidden_states, intermediate_tensors.residual
        if self.fused_decode is None:
            self.fused_decode = LlamaFusedDecode.build(self) or False
        fused = self.fused_decode and self.fused_decode.run(x, residual, positions, kv_caches,
                                                            attn_metadata)
        if fused:
            x, residual = fused
        else:
            for layer, kv_cache in zip(self.layers.values(), kv_caches):
                x, residual = layer(positions, x, residual, kv_cache, attn_metadata)
        if not self.is_last_stage:
            return IntermediateTensors(x, residual)
        x, _ = self.norm(x, residual)
        return x

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load full checkpoint tensors; each parameter's weight_loader takes this rank's part
        (parameters without one, such as the norms, are copied whole).

        Errors name the weight: a wrong shape, a weight we have no parameter for, and (after
        the loop) every parameter of this rank the checkpoint did not fill.
        """
        load_weights_into(self, weights, stacked_params=self.stacked_params,
                          rename=self.checkpoint_to_param, on_this_rank=self._on_this_stage)

    def checkpoint_to_param(self, ckpt_name: str) -> str | tuple[str, object] | None:
        """A checkpoint name -> our parameter name (None: skip it); see load_weights_into."""
        name = ckpt_name.removeprefix("model.")
        if "rotary_emb.inv_freq" in name or (name == "lm_head.weight"
                                             and self.tie_word_embeddings):
            return None
        return name


# ------------------------------------------------------------------ the fused decode stack

# A linear layer's weight format -> llama_decode.c's enum.
_FUSED_FORMATS = {"float": 0, "q4_1": 1, "q8_0": 2, "i8": 3, "float_panels": 4}


class _Linear(ctypes.Structure):
    _fields_ = [("fmt", ctypes.c_int64), ("weight", ctypes.c_void_p),
                ("scale", ctypes.c_void_p), ("bias", ctypes.c_void_p)]


class _Layer(ctypes.Structure):
    _fields_ = [("input_norm", ctypes.c_void_p), ("post_norm", ctypes.c_void_p),
                ("qkv", _Linear), ("o", _Linear), ("gate_up", _Linear), ("down", _Linear),
                ("k_cache", ctypes.c_void_p), ("v_cache", ctypes.c_void_p),
                ("window", ctypes.c_int64)]


class _Dims(ctypes.Structure):
    _fields_ = [(name, ctypes.c_int64) for name in (
        "num_layers", "hidden", "num_heads", "num_kv_heads", "head_dim", "intermediate",
        "kv_type", "block_size", "rotary_half")] + [
        ("cos", ctypes.c_void_p), ("sin", ctypes.c_void_p), ("eps", ctypes.c_float),
        ("scale", ctypes.c_float)]


@functools.lru_cache(maxsize=None)
def _fused_library() -> ctypes.CDLL | None:
    """llama_decode.c linked with the kernels it calls, built like the others."""
    sources = (*attn_kernels._SOURCES, gemv._SOURCE, quant_kernels._SOURCE,
               Path(__file__).parent / "csrc" / "llama_decode.c")
    try:
        lib = ctypes.CDLL(str(attn_kernels._build(sources, attn_kernels._HEADERS,
                                                  name="pagedlm_llama_decode")))
    except Exception as exc:  # noqa: BLE001 - any failure means "go layer by layer"
        logger.warning("pagedlm fused Llama decode unavailable, running layer by layer: %s",
                       exc)
        return None
    p, i = ctypes.c_void_p, ctypes.c_int
    lib.llama_decode_f32.argtypes = [p, p, p, p, i, i, p, p, p, i, p, i]
    lib.llama_decode_f32.restype = ctypes.c_int
    return lib


def _fusable_tensor(t: torch.Tensor | None) -> bool:
    return (t is None or (t.dtype == torch.float32 and t.is_contiguous()
                          and t.device.type == "cpu"))


def _linear_struct(layer: nn.Module, kind: type) -> _Linear | None:
    """The layer as llama_decode.c reads it, or None if it runs some other way."""
    if type(layer) is not kind or layer.tp_size != 1 or not _fusable_tensor(layer.bias):
        return None
    method = layer.linear_method
    if type(method) is UnquantizedLinearMethod and getattr(layer, "panel_weight", None) is not None:
        fmt, weight, scale = "float_panels", layer.panel_weight, None
    elif type(method) is UnquantizedLinearMethod and getattr(layer, "use_gemv", False):
        fmt, weight, scale = "float", layer.weight, None
    elif isinstance(method, PackedLinearMethod) and type(method).apply is PackedLinearMethod.apply:
        fmt, weight, scale = layer.quant_format, layer.qweight_data, layer.qscale
    else:
        return None
    if fmt not in _FUSED_FORMATS or not weight.is_contiguous() or not _fusable_tensor(scale):
        return None
    ptr = lambda t: None if t is None else t.data_ptr()  # noqa: E731
    return _Linear(_FUSED_FORMATS[fmt], weight.data_ptr(), ptr(scale), ptr(layer.bias))


class LlamaFusedDecode:
    """Runs a stage's decoder layers in one call of csrc/llama_decode.c for pure decode steps.
    Same kernels, same order, same values as the layer-by-layer path.
    `PAGEDLM_DISABLE_FUSED_DECODE=1` turns it off.

    How many sequences: any number when every linear is on the panel kernel, which the layers
    run at every row count too; even at 128 rows the ~20 dispatches a layer cost more than the
    call (the 128-request benchmark, same prompts in one process: 65.1 -> 62.8 and 67.2 ->
    65.0 s). Otherwise gemv.GEMV_MAX_ROWS: past it the layers switch to another kernel (oneDNN,
    or a dequantized GEMM), which the stack would have to match."""

    def __init__(self, lib: ctypes.CDLL, dims: _Dims, layers: list[_Layer],
                 rotary: RotaryEmbedding) -> None:
        self.lib, self.dims, self.rotary = lib, dims, rotary
        self.layers = (_Layer * len(layers))(*layers)
        panels = _FUSED_FORMATS["float_panels"]
        self.max_rows = (sys.maxsize if all(lin.fmt == panels for layer in layers
                                            for lin in (layer.qkv, layer.o, layer.gate_up,
                                                        layer.down))
                         else gemv.GEMV_MAX_ROWS)
        self.cache_ptrs: tuple[int, ...] = ()
        self.steps = 0  # steps it ran (tests check that it ran at all)

    @classmethod
    def build(cls, model: "LlamaForCausalLM") -> "LlamaFusedDecode | None":
        """The fused stack for `model`, or None (logged) when any layer is not the plain
        float32 Llama block on the native kernels."""
        if env_flag("PAGEDLM_DISABLE_FUSED_DECODE") or attn_kernels.kernels_disabled():
            return None
        layers = list(model.layers.values())
        structs = [cls._layer_struct(layer) for layer in layers]
        if not layers or any(s is None for s in structs):
            logger.debug("fused decode off: a layer is not the plain Llama block")
            return None
        first = layers[0]
        attn, mlp = first.self_attn, first.mlp
        same = all(layer.input_layernorm.eps == first.input_layernorm.eps
                   and layer.post_attention_layernorm.eps == first.input_layernorm.eps
                   and layer.self_attn.rotary is attn.rotary
                   and layer.self_attn.attn.scale == attn.attn.scale for layer in layers)
        lib = _fused_library()
        if not same or lib is None:
            return None
        dims = _Dims(len(layers), first.input_layernorm.weight.shape[0], attn.num_heads,
                     attn.num_kv_heads, attn.head_dim, mlp.down_proj.input_size_per_partition,
                     0, 0, attn.rotary.cos.shape[1], attn.rotary.cos.data_ptr(),
                     attn.rotary.sin.data_ptr(), first.input_layernorm.eps, attn.attn.scale)
        return cls(lib, dims, structs, attn.rotary)

    @staticmethod
    def _layer_struct(layer: nn.Module) -> _Layer | None:
        if (type(layer) is not LlamaDecoderLayer or type(layer.self_attn) is not LlamaAttention
                or type(layer.mlp) is not LlamaMLP or type(layer.mlp.act) is not SiluAndMul):
            return None
        attn, mlp = layer.self_attn, layer.mlp
        norms = (layer.input_layernorm, layer.post_attention_layernorm)
        if any(type(n) is not RMSNorm or not _fusable_tensor(n.weight) for n in norms):
            return None
        if (type(attn.rotary) is not RotaryEmbedding or not _fusable_tensor(attn.rotary.cos)
                or type(attn.attn) is not Attention
                or not isinstance(attn.attn.backend, native.NativeKernelBackend)
                or attn.attn.logits_soft_cap is not None):
            return None
        linears = (_linear_struct(attn.qkv_proj, QKVParallelLinear),
                   _linear_struct(attn.o_proj, RowParallelLinear),
                   _linear_struct(mlp.gate_up_proj, MergedColumnParallelLinear),
                   _linear_struct(mlp.down_proj, RowParallelLinear))
        if any(lin is None for lin in linears):
            return None
        return _Layer(norms[0].weight.data_ptr(), norms[1].weight.data_ptr(), *linears,
                      None, None, attn.attn.sliding_window or 0)

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
        kv_type = attn_kernels._KV_TYPES.get(k0.dtype)
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
