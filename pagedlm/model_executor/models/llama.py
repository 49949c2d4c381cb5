"""The Llama family (Llama 2/3, SmolLM, Mistral; the base of Qwen2, Qwen3, Mixtral and the Qwen
MoE models in their own modules) over a flat batch with paged attention.

Every tensor here is flat over the step's tokens ([num_tokens, ...]); which token belongs to which
sequence is only known to the attention metadata.

Tensor parallelism: the layers split heads and MLP features over the TP group (see
layers/linear.py); each rank's attention runs its own heads against its own KV cache.
Pipeline parallelism: a rank builds and loads only its stage's layers (pipeline.py), the
embedding on the first stage and the final norm and LM head on the last; a non-last stage's
forward returns IntermediateTensors for the next one.

Pure decode steps may run the whole stage in one native call: the decoder layer declares the
standard structure (decoder_parts) and layers/fused_decode.py decides whether its parts run
fused; anything else goes layer by layer. Both give the same values.
"""
from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from pagedlm.attention.backends import AttentionBackend, get_attn_backend
from pagedlm.attention.layer import Attention
from pagedlm.attention.metadata import AttentionMetadata
from pagedlm.config import ModelConfig
from pagedlm.distributed.utils import IntermediateTensors
from pagedlm.model_executor.layers.activation import SiluAndMul
from pagedlm.model_executor.layers.fused_decode import DecoderLayerParts, FusedDecode
from pagedlm.model_executor.layers.layernorm import RMSNorm
from pagedlm.model_executor.layers.linear import (MergedColumnParallelLinear, QKVParallelLinear,
                                                  RowParallelLinear)
from pagedlm.model_executor.layers.rotary_embedding import RotaryEmbedding
from pagedlm.model_executor.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding
from pagedlm.model_executor.model_loader.weight_utils import load_weights_into
from pagedlm.model_executor.models.base import CausalLMBase
from pagedlm.model_executor.models.pipeline import PPStage, make_layers

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

    def decoder_parts(self) -> DecoderLayerParts | None:
        """The standard structure (fused_decode.StandardDecoderLayer), when this layer is it:
        Llama's own attention and MLP blocks under this forward. A model's own block (Qwen3's
        q/k-norm attention, a mixture of experts) computes more, so such a layer is not."""
        attn, mlp = self.self_attn, self.mlp
        if (type(self).forward is not LlamaDecoderLayer.forward
                or type(attn) is not LlamaAttention or type(mlp) is not LlamaMLP):
            return None
        return DecoderLayerParts(self.input_layernorm, self.post_attention_layernorm,
                                 attn.qkv_proj, attn.o_proj, attn.rotary, attn.attn,
                                 mlp.gate_up_proj, mlp.act, mlp.down_proj)


class LlamaForCausalLM(CausalLMBase):

    # checkpoint name fragment -> (our stacked parameter, its weight_loader's shard id)
    stacked_params = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"),
                      "v_proj": ("qkv_proj", "v"), "gate_proj": ("gate_up_proj", 0),
                      "up_proj": ("gate_up_proj", 1)}

    def __init__(self, cfg: ModelConfig, attn_backend: AttentionBackend | None = None) -> None:
        super().__init__()
        hf = cfg.hf_config
        self.config = cfg
        self.stage = stage = PPStage.of_this_rank(cfg.num_layers)
        self.tie_word_embeddings = bool(cfg.get_hf("tie_word_embeddings", False))
        # The last stage needs the embedding too when the LM head is tied to it.
        self.embed_tokens = None
        if stage.holds_embedding(self.tie_word_embeddings):
            self.embed_tokens = VocabParallelEmbedding(hf.vocab_size, hf.hidden_size)
        max_pos = max(cfg.max_model_len, cfg.get_hf("max_position_embeddings", 0))
        rotary = RotaryEmbedding(cfg.head_dim, max_pos, cfg.rope_theta, cfg.rope_scaling)
        attn_backend = attn_backend or get_attn_backend(
            cfg.compute_dtype, deterministic=cfg.deterministic)
        self.layers = make_layers(stage, lambda i: self.make_layer(cfg, i, rotary, attn_backend))
        self.norm = self.lm_head = None
        if stage.is_last:
            self.norm = RMSNorm(hf.hidden_size, cfg.get_hf("rms_norm_eps", 1e-6))
            self.lm_head = ParallelLMHead(hf.vocab_size, hf.hidden_size)
            if self.tie_word_embeddings:
                self.lm_head.tie_weights(self.embed_tokens)
        self.fused_decode = FusedDecode(self.layers)

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

        kv_caches[i] is the cache of this stage's i-th layer (global layer stage.start_layer + i).
        The first stage embeds input_ids; the others continue from the previous stage's
        intermediate_tensors. Returns the final hidden states on the last stage (for
        compute_logits), IntermediateTensors on the others.
        """
        assert len(kv_caches) == len(self.layers), (
            f"{len(kv_caches)} KV caches for {len(self.layers)} layers on this stage")
        if self.stage.is_first:
            x, residual = self.embed_tokens(input_ids), None
        else:
            x, residual = intermediate_tensors.hidden_states, intermediate_tensors.residual
        fused = self.fused_decode.run(x, residual, positions, kv_caches, attn_metadata)
        if fused is not None:
            x, residual = fused
        else:
            for layer, kv_cache in zip(self.layers.values(), kv_caches):
                x, residual = layer(positions, x, residual, kv_cache, attn_metadata)
        if not self.stage.is_last:
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
