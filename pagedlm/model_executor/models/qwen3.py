"""Qwen3: the Llama layout plus an RMSNorm over each query and key head before rope.

Everything else (embedding, norms, MLP, pipeline stages, weight loading) is Llama's; only the
attention block differs. Qwen3's `attention_bias` covers all four projections, as Llama's does.
"""
from __future__ import annotations

import torch

from pagedlm.attention.backends import AttentionBackend
from pagedlm.attention.metadata import AttentionMetadata
from pagedlm.config import ModelConfig
from pagedlm.model_executor.layers.layernorm import RMSNorm
from pagedlm.model_executor.layers.rotary_embedding import RotaryEmbedding
from pagedlm.model_executor.models.llama import (KVCache, LlamaAttention, LlamaDecoderLayer,
                                                 LlamaForCausalLM)


class Qwen3Attention(LlamaAttention):

    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding,
                 attn_backend: AttentionBackend, layer: int) -> None:
        bias = bool(cfg.get_hf("attention_bias", False))
        super().__init__(cfg, rotary, attn_backend, layer, qkv_bias=bias, o_bias=bias)
        eps = cfg.get_hf("rms_norm_eps", 1e-6)
        # One weight per head dimension, shared by all heads, so TP ranks hold it whole.
        self.q_norm = RMSNorm(self.head_dim, eps)
        self.k_norm = RMSNorm(self.head_dim, eps)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, kv_cache: KVCache,
                meta: AttentionMetadata) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv_proj(x).split(self.split, dim=-1)
        q = self.q_norm(q.reshape(n, self.num_heads, self.head_dim))
        k = self.k_norm(k.reshape(n, self.num_kv_heads, self.head_dim))
        q, k = self.rotary(positions, q, k)
        return self.o_proj(self.attn(q, k, v, kv_cache, meta))


class Qwen3ForCausalLM(LlamaForCausalLM):

    def make_layer(self, cfg: ModelConfig, layer_idx: int, rotary: RotaryEmbedding,
                   attn_backend: AttentionBackend) -> LlamaDecoderLayer:
        return LlamaDecoderLayer(cfg, rotary, attn_backend, layer_idx,
                                 self_attn=Qwen3Attention(cfg, rotary, attn_backend, layer_idx))
