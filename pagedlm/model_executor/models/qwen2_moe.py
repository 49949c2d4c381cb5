"""Qwen2-MoE: Qwen2's attention (QKV bias) with sparse mixture-of-experts MLPs.

Layer i has a sparse MLP when it is not in `mlp_only_layers` and (i + 1) is a multiple of
`decoder_sparse_step`; the others have a dense MLP of `intermediate_size`. A sparse MLP routes
each token to num_experts_per_tok of num_experts experts (renormalised when norm_topk_prob) and
adds a shared expert, scaled per token by sigmoid(shared_expert_gate(x)).

Under tensor parallelism the routed experts and the shared expert each produce a partial sum;
the sigmoid scale is per token, so it applies to the partial sums alike and the block needs
only one all-reduce.
"""
from __future__ import annotations

import torch
from torch import nn

from pagedlm.attention.backends import AttentionBackend
from pagedlm.config import ModelConfig
from pagedlm.distributed.parallel_state import get_tp_group
from pagedlm.model_executor.layers.activation import SiluAndMul
from pagedlm.model_executor.layers.fused_moe import (FusedMoE, TopKRouter, expert_param,
                                                     sigmoid_per_element, split_stacked_experts)
from pagedlm.model_executor.layers.linear import (MergedColumnParallelLinear, ReplicatedLinear,
                                                  RowParallelLinear)
from pagedlm.model_executor.layers.rotary_embedding import RotaryEmbedding
from pagedlm.model_executor.models.llama import (LlamaAttention, LlamaDecoderLayer,
                                                 LlamaForCausalLM, LlamaMLP)


class SharedExpert(nn.Module):
    """A SiLU-gated MLP that leaves its all-reduce to the caller."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden, [intermediate, intermediate])
        self.act = SiluAndMul()
        self.down_proj = RowParallelLinear(intermediate, hidden, reduce_results=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class Qwen2MoeSparseMoeBlock(nn.Module):
    """Routed experts plus, when shared_expert_intermediate_size is set, a gated shared one."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        hf = cfg.hf_config
        self.gate = TopKRouter(hf.hidden_size, hf.num_experts, hf.num_experts_per_tok,
                               renormalize=bool(cfg.get_hf("norm_topk_prob", False)))
        self.experts = FusedMoE(hf.num_experts, hf.hidden_size, hf.moe_intermediate_size,
                                reduce_results=False, deterministic=cfg.deterministic)
        shared = cfg.get_hf("shared_expert_intermediate_size", 0)
        self.shared_expert = self.shared_expert_gate = None
        if shared:
            self.shared_expert = SharedExpert(hf.hidden_size, shared)
            self.shared_expert_gate = ReplicatedLinear(hf.hidden_size, 1)
        self.tp_group = get_tp_group()
        self.sigmoid = sigmoid_per_element if cfg.deterministic else torch.sigmoid

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.experts(x, self.gate(x))
        if self.shared_expert is not None:
            y += self.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return self.tp_group.all_reduce(y)


def is_sparse_layer(cfg: ModelConfig, layer_idx: int) -> bool:
    """Whether layer `layer_idx` has experts (transformers' rule for Qwen2/3-MoE)."""
    step = cfg.get_hf("decoder_sparse_step", 1)
    if step < 1:
        raise ValueError(f"decoder_sparse_step must be at least 1, got {step}.")
    return (layer_idx not in (cfg.get_hf("mlp_only_layers") or ())
            and cfg.get_hf("num_experts", 0) > 0 and (layer_idx + 1) % step == 0)


class Qwen2MoeForCausalLM(LlamaForCausalLM):

    def make_attention(self, cfg: ModelConfig, rotary: RotaryEmbedding,
                       attn_backend: AttentionBackend, layer_idx: int) -> nn.Module:
        # Checkpoints from before transformers 5 lack qkv_bias: Qwen2-MoE always had it.
        return LlamaAttention(cfg, rotary, attn_backend, layer_idx,
                              qkv_bias=bool(cfg.get_hf("qkv_bias", True)), o_bias=False)

    def make_layer(self, cfg: ModelConfig, layer_idx: int, rotary: RotaryEmbedding,
                   attn_backend: AttentionBackend) -> LlamaDecoderLayer:
        hf = cfg.hf_config
        mlp = (Qwen2MoeSparseMoeBlock(cfg) if is_sparse_layer(cfg, layer_idx)
               else LlamaMLP(hf.hidden_size, hf.intermediate_size))
        return LlamaDecoderLayer(cfg, rotary, attn_backend, layer_idx,
                                 self_attn=self.make_attention(cfg, rotary, attn_backend,
                                                               layer_idx),
                                 mlp=mlp)

    def load_weights(self, weights) -> None:
        super().load_weights(split_stacked_experts(weights))

    def checkpoint_to_param(self, ckpt_name: str) -> str | tuple[str, object] | None:
        name = super().checkpoint_to_param(ckpt_name)
        return None if name is None else expert_param(name) or name
