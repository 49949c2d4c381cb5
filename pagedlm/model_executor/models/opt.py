"""OPT (facebook/opt-*) over a flat batch with paged attention.

What sets OPT apart from the Llama family: learned absolute position embeddings, looked up at
the flat batch's `positions` plus OPT's offset of 2 (its table has two extra leading rows, a
leftover of fairseq's padding); no rotary embedding; LayerNorm either before each block
(`do_layer_norm_before`, opt-125m and most sizes) or after it (opt-350m); a plain fc1 ->
activation -> fc2 MLP; biases everywhere (`enable_bias`); and, where `word_embed_proj_dim`
differs from the hidden size (opt-350m), a `project_in` after the embedding and a
`project_out` before the LM head, which is tied to the (narrower) embedding.

Tensor parallelism: attention heads and fc1/fc2 features split over the TP group as in
llama.py; the position table, LayerNorms and the small projections are replicated. Pipeline
parallelism: each stage builds and loads only its layers; OPT has a single residual stream, so
the hidden states alone travel between stages.
"""
from __future__ import annotations

from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from pagedlm.attention.backends import AttentionBackend, get_attn_backend
from pagedlm.attention.layer import Attention
from pagedlm.attention.metadata import AttentionMetadata
from pagedlm.config import ModelConfig
from pagedlm.distributed.utils import IntermediateTensors
from pagedlm.model_executor.layers.activation import get_act_fn
from pagedlm.model_executor.layers.linear import (ColumnParallelLinear, QKVParallelLinear,
                                                  ReplicatedLinear, RowParallelLinear)
from pagedlm.model_executor.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding
from pagedlm.model_executor.model_loader.weight_utils import load_weights_into
from pagedlm.model_executor.models.base import CausalLMBase
from pagedlm.model_executor.models.pipeline import PPStage, make_layers

KVCache = tuple[torch.Tensor, torch.Tensor]

# OPT's position table starts two rows in (fairseq reserved them for padding).
POSITION_OFFSET = 2


class OPTLearnedPositionalEmbedding(nn.Module):
    """Replicated on every TP rank: it is small, and splitting it would cost an all-reduce."""

    def __init__(self, num_positions: int, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_positions + POSITION_OFFSET, dim),
                                   requires_grad=False)

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        return F.embedding(positions + POSITION_OFFSET, self.weight)


class OPTAttention(nn.Module):

    def __init__(self, cfg: ModelConfig, bias: bool, attn_backend: AttentionBackend) -> None:
        super().__init__()
        hidden = cfg.hf_config.hidden_size
        self.qkv_proj = QKVParallelLinear(hidden, cfg.head_dim, cfg.num_heads, bias=bias)
        self.num_heads, self.head_dim = self.qkv_proj.num_heads, cfg.head_dim
        self.out_proj = RowParallelLinear(hidden, hidden, bias=bias)
        self.attn = Attention(self.num_heads, self.head_dim, self.head_dim ** -0.5,
                              self.num_heads, attn_backend)

    def forward(self, x: torch.Tensor, kv_cache: KVCache,
                meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).chunk(3, dim=-1)
        return self.out_proj(self.attn(q, k, v, kv_cache, meta))


class OPTDecoderLayer(nn.Module):

    def __init__(self, cfg: ModelConfig, attn_backend: AttentionBackend) -> None:
        super().__init__()
        hf = cfg.hf_config
        bias = bool(cfg.get_hf("enable_bias", True))
        affine = bool(cfg.get_hf("layer_norm_elementwise_affine", True))
        self.pre_norm = bool(cfg.get_hf("do_layer_norm_before", True))
        self.self_attn = OPTAttention(cfg, bias, attn_backend)
        self.self_attn_layer_norm = nn.LayerNorm(hf.hidden_size, elementwise_affine=affine)
        self.fc1 = ColumnParallelLinear(hf.hidden_size, hf.ffn_dim, bias=bias)
        self.act = get_act_fn(cfg.get_hf("activation_function", "relu"), "activation_function",
                              cfg.deterministic)
        self.fc2 = RowParallelLinear(hf.ffn_dim, hf.hidden_size, bias=bias)
        self.final_layer_norm = nn.LayerNorm(hf.hidden_size, elementwise_affine=affine)

    def forward(self, x: torch.Tensor, kv_cache: KVCache,
                meta: AttentionMetadata) -> torch.Tensor:
        h = self.self_attn_layer_norm(x) if self.pre_norm else x
        x = x + self.self_attn(h, kv_cache, meta)
        if not self.pre_norm:
            x = self.self_attn_layer_norm(x)
        h = self.final_layer_norm(x) if self.pre_norm else x
        x = x + self.fc2(self.act(self.fc1(h)))
        return x if self.pre_norm else self.final_layer_norm(x)


class OPTForCausalLM(CausalLMBase):

    stage_modules = ("embed_tokens", "embed_positions", "project_in", "final_layer_norm",
                     "project_out", "lm_head")

    def __init__(self, cfg: ModelConfig, attn_backend: AttentionBackend | None = None) -> None:
        super().__init__()
        hf = cfg.hf_config
        self.config = cfg
        self.stage = stage = PPStage.of_this_rank(cfg.num_layers)
        hidden = hf.hidden_size
        proj_dim = cfg.get_hf("word_embed_proj_dim", hidden)
        self.tie_word_embeddings = bool(cfg.get_hf("tie_word_embeddings", True))
        self.embed_tokens = self.embed_positions = self.project_in = None
        if stage.holds_embedding(self.tie_word_embeddings):
            self.embed_tokens = VocabParallelEmbedding(hf.vocab_size, proj_dim)
        if stage.is_first:
            self.embed_positions = OPTLearnedPositionalEmbedding(hf.max_position_embeddings,
                                                                 hidden)
            if proj_dim != hidden:
                self.project_in = ReplicatedLinear(proj_dim, hidden)
        attn_backend = attn_backend or get_attn_backend(
            cfg.compute_dtype, deterministic=cfg.deterministic)
        self.layers = make_layers(stage, lambda i: OPTDecoderLayer(cfg, attn_backend))
        self.final_layer_norm = self.project_out = self.lm_head = None
        if stage.is_last:
            # Post-LN models end on a layer's own norm, so they have no final one.
            if (cfg.get_hf("do_layer_norm_before", True)
                    and not cfg.get_hf("_remove_final_layer_norm", False)):
                self.final_layer_norm = nn.LayerNorm(
                    hidden, elementwise_affine=bool(cfg.get_hf("layer_norm_elementwise_affine",
                                                               True)))
            if proj_dim != hidden:
                self.project_out = ReplicatedLinear(hidden, proj_dim)
            self.lm_head = ParallelLMHead(hf.vocab_size, proj_dim)
            if self.tie_word_embeddings:
                self.lm_head.tie_weights(self.embed_tokens)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[KVCache], attn_metadata: AttentionMetadata,
                intermediate_tensors: IntermediateTensors | None = None
                ) -> torch.Tensor | IntermediateTensors:
        """One step over the flat batch (see registry.py for the interface)."""
        assert len(kv_caches) == len(self.layers), (
            f"{len(kv_caches)} KV caches for {len(self.layers)} layers on this stage")
        if self.stage.is_first:
            x = self.embed_tokens(input_ids)
            if self.project_in is not None:
                x = self.project_in(x)
            x = x + self.embed_positions(positions)
        else:
            x = intermediate_tensors.hidden_states
        for layer, kv_cache in zip(self.layers.values(), kv_caches):
            x = layer(x, kv_cache, attn_metadata)
        if not self.stage.is_last:
            # A single residual stream: there is no separate residual to send.
            return IntermediateTensors(x, x.new_empty(0))
        if self.final_layer_norm is not None:
            x = self.final_layer_norm(x)
        if self.project_out is not None:
            x = self.project_out(x)
        return x

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        def rename(ckpt_name: str) -> str | None:
            # transformers saves "model.decoder.*"; the original checkpoints "decoder.*".
            name = ckpt_name.removeprefix("model.").removeprefix("decoder.")
            if name == "lm_head.weight" and self.tie_word_embeddings:
                return None
            return name

        stacked = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"),
                   "v_proj": ("qkv_proj", "v")}
        load_weights_into(self, weights, stacked_params=stacked, rename=rename,
                          on_this_rank=self._on_this_stage)
