"""Qwen2: the Llama block with a bias on the query, key and value projections (always, whatever
the config says) and none on the output projection. Its per-layer sliding windows
(use_sliding_window, max_window_layers) come from the config's layer_types, as for any model."""
from __future__ import annotations

from pagedlm.attention.backends import AttentionBackend
from pagedlm.config import ModelConfig
from pagedlm.model_executor.layers.rotary_embedding import RotaryEmbedding
from pagedlm.model_executor.models.llama import (LlamaAttention, LlamaDecoderLayer,
                                                 LlamaForCausalLM)


class Qwen2ForCausalLM(LlamaForCausalLM):

    def make_layer(self, cfg: ModelConfig, layer_idx: int, rotary: RotaryEmbedding,
                   attn_backend: AttentionBackend) -> LlamaDecoderLayer:
        attn = LlamaAttention(cfg, rotary, attn_backend, layer_idx, qkv_bias=True, o_bias=False)
        return LlamaDecoderLayer(cfg, rotary, attn_backend, layer_idx, self_attn=attn)
