"""Phi-3 over a flat batch with paged attention.

The decoder is Llama's (RMSNorm, rotary attention, gated MLP) with three differences handled
here: the checkpoint stores q/k/v as one `qkv_proj` and gate/up as one `gate_up_proj`, which we
cut into the parallel layers' shards at load time so each TP rank takes its own heads and
features; long-context "longrope" scaling (two factor sets; which one is used, and how that relates
to transformers, is explained in layers/rotary_embedding.py);
and an optional partial rotary embedding (`partial_rotary_factor`).

Tensor and pipeline parallelism work as in llama.py: heads and MLP features split over the TP
group, each pipeline stage builds and loads only its layers.
"""
from __future__ import annotations

from typing import Iterable, Iterator

import torch
from torch import nn

from pagedlm.attention.backends import AttentionBackend, get_attn_backend
from pagedlm.attention.metadata import AttentionMetadata
from pagedlm.config import ModelConfig
from pagedlm.distributed.utils import IntermediateTensors
from pagedlm.model_executor.layers.activation import SiluAndMul, get_act_fn
from pagedlm.model_executor.layers.layernorm import RMSNorm
from pagedlm.model_executor.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from pagedlm.model_executor.layers.rotary_embedding import RotaryEmbedding
from pagedlm.model_executor.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding
from pagedlm.model_executor.model_loader.weight_utils import load_weights_into
from pagedlm.model_executor.models.base import CausalLMBase
from pagedlm.model_executor.models.llama import LlamaAttention, LlamaDecoderLayer
from pagedlm.model_executor.models.pipeline import PPStage, make_layers

KVCache = tuple[torch.Tensor, torch.Tensor]


class _GatedAct(nn.Module):
    """[gate, up] -> act(gate) * up, for a hidden_act other than SiLU."""

    def __init__(self, act: nn.Module) -> None:
        super().__init__()
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return self.act(gate) * up


class Phi3MLP(nn.Module):

    def __init__(self, hidden: int, intermediate: int, hidden_act: str,
                 deterministic: bool = False) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden, [intermediate, intermediate])
        # The native SiluAndMul runs every row's elements through one code path already.
        act = get_act_fn(hidden_act, "hidden_act", deterministic and hidden_act != "silu")
        self.act = SiluAndMul() if isinstance(act, nn.SiLU) else _GatedAct(act)
        self.down_proj = RowParallelLinear(intermediate, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


def _phi3_layer(cfg: ModelConfig, rotary: RotaryEmbedding, attn_backend: AttentionBackend,
               layer: int) -> LlamaDecoderLayer:
    """Llama's decoder layer with Phi-3's MLP (its hidden_act). The attention is Llama's too:
    only the checkpoint's fused qkv_proj differs, and it is split at load. Phi-3's configs
    window every layer (sliding_window, e.g. 2047 in Phi-3-mini)."""
    hf = cfg.hf_config
    attn = LlamaAttention(cfg, rotary, attn_backend, layer, qkv_bias=False, o_bias=False)
    mlp = Phi3MLP(hf.hidden_size, hf.intermediate_size, cfg.get_hf("hidden_act", "silu"),
                  cfg.deterministic)
    return LlamaDecoderLayer(cfg, rotary, attn_backend, layer, self_attn=attn, mlp=mlp)


def _rotary_dim(cfg: ModelConfig) -> int:
    # transformers 5 keeps partial_rotary_factor in rope_parameters; older configs flat.
    params = cfg.get_hf("rope_parameters") or {}
    factor = params.get("partial_rotary_factor") or cfg.get_hf("partial_rotary_factor", 1.0)
    if not 0.0 < factor <= 1.0:
        raise ValueError(f"partial_rotary_factor must be in (0, 1], got {factor!r}.")
    return int(cfg.head_dim * factor)


class Phi3ForCausalLM(CausalLMBase):

    def __init__(self, cfg: ModelConfig, attn_backend: AttentionBackend | None = None) -> None:
        super().__init__()
        hf = cfg.hf_config
        self.config = cfg
        self.stage = stage = PPStage.of_this_rank(cfg.num_layers)
        self.tie_word_embeddings = bool(cfg.get_hf("tie_word_embeddings", False))
        self.embed_tokens = None
        if stage.holds_embedding(self.tie_word_embeddings):
            self.embed_tokens = VocabParallelEmbedding(hf.vocab_size, hf.hidden_size)
        max_pos = cfg.get_hf("max_position_embeddings", 0)
        rotary = RotaryEmbedding(cfg.head_dim, max(cfg.max_model_len, max_pos), cfg.rope_theta,
                                 cfg.rope_scaling, rotary_dim=_rotary_dim(cfg),
                                 max_position_embeddings=max_pos or None,
                                 max_model_len=cfg.max_model_len)
        attn_backend = attn_backend or get_attn_backend(
            cfg.compute_dtype, deterministic=cfg.deterministic)
        self.layers = make_layers(stage, lambda i: _phi3_layer(cfg, rotary, attn_backend, i))
        self.norm = self.lm_head = None
        if stage.is_last:
            self.norm = RMSNorm(hf.hidden_size, cfg.get_hf("rms_norm_eps", 1e-5))
            self.lm_head = ParallelLMHead(hf.vocab_size, hf.hidden_size)
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
            x, residual = self.embed_tokens(input_ids), None
        else:
            x, residual = intermediate_tensors.hidden_states, intermediate_tensors.residual
        for layer, kv_cache in zip(self.layers.values(), kv_caches):
            x, residual = layer(positions, x, residual, kv_cache, attn_metadata)
        if not self.stage.is_last:
            return IntermediateTensors(x, residual)
        x, _ = self.norm(x, residual)
        return x

    def _split_fused(self, weights: Iterable[tuple[str, torch.Tensor]]
                     ) -> Iterator[tuple[str, torch.Tensor]]:
        """Cut the fused qkv_proj / gate_up_proj rows into the shards the parallel layers
        load (named `...qkv_proj.q.weight` etc.), so each rank takes its own heads/features."""
        cfg, hf = self.config, self.config.hf_config
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        fused = {"qkv_proj": ((q, kv, kv), ("q", "k", "v")),
                 "gate_up_proj": ((hf.intermediate_size,) * 2, ("0", "1"))}
        for name, tensor in weights:
            stem, _, param = name.rpartition(".")
            module = stem.rpartition(".")[2]
            if module not in fused:
                yield name, tensor
                continue
            sizes, shards = fused[module]
            if tensor.shape[0] != sum(sizes):
                raise ValueError(f"weight {name!r} has {tensor.shape[0]} rows, expected "
                                 f"{sum(sizes)} ({' + '.join(map(str, sizes))}).")
            for shard, part in zip(shards, tensor.split(sizes, dim=0)):
                yield f"{stem}.{shard}.{param}", part

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        def rename(ckpt_name: str) -> str | None:
            name = ckpt_name.removeprefix("model.")
            if "rotary_emb." in name or (name == "lm_head.weight" and self.tie_word_embeddings):
                return None
            return name

        stacked = {"qkv_proj.q": ("qkv_proj", "q"), "qkv_proj.k": ("qkv_proj", "k"),
                   "qkv_proj.v": ("qkv_proj", "v"), "gate_up_proj.0": ("gate_up_proj", 0),
                   "gate_up_proj.1": ("gate_up_proj", 1)}
        load_weights_into(self, self._split_fused(weights), stacked_params=stacked,
                          rename=rename, on_this_rank=self._on_this_stage)
