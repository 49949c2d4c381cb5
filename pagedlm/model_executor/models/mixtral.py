"""Mixtral: Mistral's attention with a sparse mixture of experts in place of the MLP.

Every layer's MLP is `block_sparse_moe`: a router picks num_experts_per_tok of
num_local_experts experts per token, always renormalising their probabilities, and the
experts (w1 gate, w3 up, w2 down) run through the shared FusedMoE layer. The rest is Llama's.
Sliding windows are handled (or capped) by the engine like Mistral's.
"""
from __future__ import annotations

import torch
from torch import nn

from pagedlm.attention.backends import AttentionBackend
from pagedlm.config import ModelConfig
from pagedlm.model_executor.layers.fused_moe import (FusedMoE, TopKRouter, expert_param,
                                                     split_stacked_experts)
from pagedlm.model_executor.layers.rotary_embedding import RotaryEmbedding
from pagedlm.model_executor.models.llama import (LlamaAttention, LlamaDecoderLayer,
                                                 LlamaForCausalLM)


class MixtralMoE(nn.Module):

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        hf = cfg.hf_config
        self.gate = TopKRouter(hf.hidden_size, hf.num_local_experts, hf.num_experts_per_tok,
                               renormalize=True)
        self.experts = FusedMoE(hf.num_local_experts, hf.hidden_size, hf.intermediate_size,
                                deterministic=cfg.deterministic)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts(x, self.gate(x))


class MixtralForCausalLM(LlamaForCausalLM):

    def make_layer(self, cfg: ModelConfig, layer_idx: int, rotary: RotaryEmbedding,
                   attn_backend: AttentionBackend) -> LlamaDecoderLayer:
        attn = LlamaAttention(cfg, rotary, attn_backend, layer_idx, qkv_bias=False, o_bias=False)
        return LlamaDecoderLayer(cfg, rotary, attn_backend, layer_idx, self_attn=attn,
                                 mlp=MixtralMoE(cfg))

    def load_weights(self, weights) -> None:
        super().load_weights(split_stacked_experts(weights))

    def checkpoint_to_param(self, ckpt_name: str) -> str | tuple[str, object] | None:
        name = super().checkpoint_to_param(ckpt_name)
        if name is None:
            return None
        # Our decoder layer calls its MLP `mlp`, whatever kind it is.
        name = name.replace(".block_sparse_moe.", ".mlp.")
        return expert_param(name) or name
