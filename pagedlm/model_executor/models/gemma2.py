"""Gemma 2 over a flat batch with paged attention (Gemma 3's text model builds on it).

What sets Gemma apart from Llama: embeddings scaled by sqrt(hidden) (in the model dtype, as
transformers does), RMSNorm with (1 + w), a GeGLU MLP (tanh-approximated GELU), the attention
scale from query_pre_attn_scalar instead of head_dim, norms after attention and after the MLP
as well as before, attention and final logit soft-capping, local sliding-window layers
interleaved with global ones (config.layer_types), and an LM head tied to the embedding.

The residual stream is carried as in llama.py (hidden, residual), so pipeline stages hand over
the same IntermediateTensors; weight loading and the pipeline bookkeeping are Llama's.
"""
from __future__ import annotations

import torch
from torch import nn

from pagedlm.attention.backends import AttentionBackend, get_attn_backend
from pagedlm.attention.layer import Attention
from pagedlm.attention.metadata import AttentionMetadata
from pagedlm.config import ModelConfig
from pagedlm.distributed.utils import IntermediateTensors
from pagedlm.model_executor.layers.activation import GeluAndMul
from pagedlm.model_executor.layers.layernorm import GemmaRMSNorm
from pagedlm.model_executor.layers.linear import (MergedColumnParallelLinear, QKVParallelLinear,
                                                  RowParallelLinear)
from pagedlm.model_executor.layers.rotary_embedding import RotaryEmbedding
from pagedlm.model_executor.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding
from pagedlm.model_executor.models.llama import LlamaForCausalLM
from pagedlm.model_executor.models.pipeline import PPStage, make_layers

KVCache = tuple[torch.Tensor, torch.Tensor]

# transformers' activation names -> torch's GELU approximation.
_GELU = {"gelu_pytorch_tanh": "tanh", "gelu_new": "tanh", "gelu_fast": "tanh",
         "gelu": "none"}


def _gelu_approximation(cfg: ModelConfig) -> str:
    name = cfg.get_hf("hidden_activation") or cfg.get_hf("hidden_act") or "gelu_pytorch_tanh"
    if name not in _GELU:
        raise ValueError(f"hidden_activation {name!r} in {cfg.model_dir}/config.json is not "
                         f"supported for Gemma (one of {sorted(_GELU)}).")
    return _GELU[name]


def _positive(cfg: ModelConfig, key: str) -> float | None:
    value = cfg.get_hf(key)
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                              or value <= 0):
        raise ValueError(f"{key} in {cfg.model_dir}/config.json must be a positive number or "
                         f"null, got {value!r}.")
    return value


def _layer_types(cfg: ModelConfig) -> list[str]:
    """Each layer's type; transformers' Gemma configs always fill layer_types."""
    types = cfg.get_hf("layer_types") or ["full_attention"] * cfg.num_layers
    unknown = set(types) - {"sliding_attention", "full_attention"}
    if unknown:
        raise ValueError(f"layer_types in {cfg.model_dir}/config.json has unsupported "
                         f"types {sorted(unknown)} (sliding_attention, full_attention).")
    return types


def _max_position(cfg: ModelConfig) -> int:
    return max(cfg.max_model_len, cfg.get_hf("max_position_embeddings", 0))


class GemmaAttention(nn.Module):
    """Grouped-query attention with Gemma's scale and soft cap, optional per-head q/k norms
    (Gemma 3) and this layer's window and rotary table."""

    def __init__(self, cfg: ModelConfig, layer: int, rotary: RotaryEmbedding,
                 attn_backend: AttentionBackend, qk_norm: bool) -> None:
        super().__init__()
        hf = cfg.hf_config
        bias = bool(cfg.get_hf("attention_bias", False))
        self.head_dim = cfg.head_dim
        self.qkv_proj = QKVParallelLinear(hf.hidden_size, cfg.head_dim, cfg.num_heads,
                                          cfg.num_kv_heads, bias=bias)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(cfg.num_heads * cfg.head_dim, hf.hidden_size, bias=bias)
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.split = (q_size, kv_size, kv_size)
        self.q_norm = self.k_norm = None
        if qk_norm:  # over each head's features, so every TP rank holds the whole weight
            eps = cfg.get_hf("rms_norm_eps", 1e-6)
            self.q_norm = GemmaRMSNorm(self.head_dim, eps)
            self.k_norm = GemmaRMSNorm(self.head_dim, eps)
        self.rotary = rotary
        scalar = _positive(cfg, "query_pre_attn_scalar") or cfg.head_dim
        self.attn = Attention(self.num_heads, self.head_dim, scalar ** -0.5, self.num_kv_heads,
                              attn_backend, sliding_window=cfg.get_sliding_window(layer),
                              logits_soft_cap=_positive(cfg, "attn_logit_softcapping"))

    def forward(self, positions: torch.Tensor, x: torch.Tensor, kv_cache: KVCache,
                meta: AttentionMetadata) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv_proj(x).split(self.split, dim=-1)
        q = q.reshape(n, self.num_heads, self.head_dim)
        k = k.reshape(n, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(positions, q, k)
        return self.o_proj(self.attn(q, k, v, kv_cache, meta))


class GemmaMLP(nn.Module):

    def __init__(self, hidden: int, intermediate: int, approximate: str,
                 deterministic: bool = False) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden, [intermediate, intermediate],
                                                       bias=False)
        self.act = GeluAndMul(approximate, deterministic)
        self.down_proj = RowParallelLinear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class GemmaDecoderLayer(nn.Module):
    """Sandwich norms: input -> attention -> post-attention norm -> add; pre-FF norm -> MLP ->
    post-FF norm -> add. Takes and returns (hidden, residual) like Llama's layer, the previous
    layer's last add being done here (or the embedding becoming the residual)."""

    def __init__(self, cfg: ModelConfig, layer: int, rotary: RotaryEmbedding,
                 attn_backend: AttentionBackend, qk_norm: bool) -> None:
        super().__init__()
        hf = cfg.hf_config
        eps = cfg.get_hf("rms_norm_eps", 1e-6)
        self.self_attn = GemmaAttention(cfg, layer, rotary, attn_backend, qk_norm)
        self.mlp = GemmaMLP(hf.hidden_size, hf.intermediate_size, _gelu_approximation(cfg),
                            cfg.deterministic)
        self.input_layernorm = GemmaRMSNorm(hf.hidden_size, eps)
        self.post_attention_layernorm = GemmaRMSNorm(hf.hidden_size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hf.hidden_size, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(hf.hidden_size, eps)

    def forward(self, positions, x, residual, kv_cache, meta):
        residual = x if residual is None else residual + x
        h = self.self_attn(positions, self.input_layernorm(residual), kv_cache, meta)
        residual = residual + self.post_attention_layernorm(h)
        h = self.mlp(self.pre_feedforward_layernorm(residual))
        return self.post_feedforward_layernorm(h), residual


class Gemma2ForCausalLM(LlamaForCausalLM):
    """Gemma 2. Gemma 3 overrides `_rotary_tables` (a rope base per layer type) and
    `qk_norm`; the rest of the model is shared."""

    qk_norm = False

    def __init__(self, cfg: ModelConfig, attn_backend: AttentionBackend | None = None) -> None:
        nn.Module.__init__(self)
        hf = cfg.hf_config
        self.config = cfg
        self.stage = stage = PPStage.of_this_rank(cfg.num_layers)
        self.tie_word_embeddings = bool(cfg.get_hf("tie_word_embeddings", True))
        self.final_logit_softcap = _positive(cfg, "final_logit_softcapping")
        self.embed_tokens = None
        if stage.holds_embedding(self.tie_word_embeddings):
            self.embed_tokens = VocabParallelEmbedding(hf.vocab_size, hf.hidden_size)
        # transformers rounds sqrt(hidden) to the model dtype before multiplying: the weights'
        # dtype here (float32 activations are then scaled by the constant it would use).
        self.embed_scale = float(torch.tensor(hf.hidden_size ** 0.5, dtype=cfg.dtype))
        attn_backend = attn_backend or get_attn_backend(
            cfg.compute_dtype, deterministic=cfg.deterministic)
        rotary, layer_types = self._rotary_tables(cfg), _layer_types(cfg)
        self.layers = make_layers(stage, lambda i: GemmaDecoderLayer(
            cfg, i, rotary[layer_types[i]], attn_backend, self.qk_norm))
        self.norm = self.lm_head = None
        if stage.is_last:
            self.norm = GemmaRMSNorm(hf.hidden_size, cfg.get_hf("rms_norm_eps", 1e-6))
            self.lm_head = ParallelLMHead(hf.vocab_size, hf.hidden_size)
            if self.tie_word_embeddings:
                self.lm_head.tie_weights(self.embed_tokens)

    def _rotary_tables(self, cfg: ModelConfig) -> dict[str, RotaryEmbedding]:
        """Layer type ("sliding_attention" / "full_attention") -> its rotary table. Gemma 2
        has one rope base, so every type shares one table."""
        table = RotaryEmbedding(cfg.head_dim, _max_position(cfg), cfg.rope_theta,
                                cfg.rope_scaling)
        return {t: table for t in _layer_types(cfg)}

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[KVCache], attn_metadata: AttentionMetadata,
                intermediate_tensors: IntermediateTensors | None = None
                ) -> torch.Tensor | IntermediateTensors:
        assert len(kv_caches) == len(self.layers), (
            f"{len(kv_caches)} KV caches for {len(self.layers)} layers on this stage")
        if self.stage.is_first:
            x = self.embed_tokens(input_ids)
            x, residual = x * torch.tensor(self.embed_scale, dtype=x.dtype), None
        else:
            x, residual = intermediate_tensors.hidden_states, intermediate_tensors.residual
        for layer, kv_cache in zip(self.layers.values(), kv_caches):
            x, residual = layer(positions, x, residual, kv_cache, attn_metadata)
        if not self.stage.is_last:
            return IntermediateTensors(x, residual)
        return self.norm(x if residual is None else residual + x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head is None:
            raise RuntimeError("only the last pipeline stage computes logits")
        logits = self.lm_head(hidden)
        if self.final_logit_softcap is not None:
            cap = self.final_logit_softcap
            logits = torch.tanh(logits / cap) * cap
        return logits.float()
