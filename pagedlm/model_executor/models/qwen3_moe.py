"""Qwen3-MoE: Qwen3's attention (per-head RMSNorm on queries and keys) with Qwen2-MoE's sparse
layers, without a shared expert; norm_topk_prob says whether the top-k weights are
renormalised."""
from __future__ import annotations

from torch import nn

from pagedlm.attention.backends import AttentionBackend
from pagedlm.config import ModelConfig
from pagedlm.model_executor.layers.rotary_embedding import RotaryEmbedding
from pagedlm.model_executor.models.qwen2_moe import Qwen2MoeForCausalLM
from pagedlm.model_executor.models.qwen3 import Qwen3Attention


class Qwen3MoeForCausalLM(Qwen2MoeForCausalLM):

    def make_attention(self, cfg: ModelConfig, rotary: RotaryEmbedding,
                       attn_backend: AttentionBackend, layer_idx: int) -> nn.Module:
        return Qwen3Attention(cfg, rotary, attn_backend, layer_idx)
