"""The Llama family (Llama 2/3, SmolLM, Mistral, Qwen2) over a flat batch with paged attention.

Every tensor here is flat over the step's tokens ([num_tokens, ...]); which token belongs to which
sequence is only known to the attention metadata.
"""
from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from pagedlm.attention.paged_attention import AttentionMetadata, paged_attention
from pagedlm.config import ModelConfig
from pagedlm.model_executor.layers.activation import SiluAndMul
from pagedlm.model_executor.layers.layernorm import RMSNorm
from pagedlm.model_executor.layers.linear import Linear, StackedLinear
from pagedlm.model_executor.layers.rotary_embedding import RotaryEmbedding
from pagedlm.model_executor.layers.vocab_embedding import VocabEmbedding

KVCache = tuple[torch.Tensor, torch.Tensor]


class LlamaAttention(nn.Module):

    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding) -> None:
        super().__init__()
        hf = cfg.hf_config
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        # Qwen2 always has QKV bias; Llama-style configs say so with attention_bias.
        bias = cfg.architecture == "Qwen2ForCausalLM" or bool(hf.get("attention_bias", False))
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = StackedLinear(hf["hidden_size"], {"q": q_size, "k": kv_size, "v": kv_size},
                                      bias=bias)
        self.o_proj = Linear(q_size, hf["hidden_size"], bias=bool(hf.get("attention_bias", False))
                             and cfg.architecture != "Qwen2ForCausalLM")
        self.rotary = rotary
        self.split = (q_size, kv_size, kv_size)
        self.scale = self.head_dim ** -0.5

    def forward(self, positions: torch.Tensor, x: torch.Tensor, kv_cache: KVCache,
                meta: AttentionMetadata) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv_proj(x).split(self.split, dim=-1)
        q = q.view(n, self.num_heads, self.head_dim)
        k = k.view(n, self.num_kv_heads, self.head_dim)
        q, k = self.rotary(positions, q, k)
        v = v.reshape(n, self.num_kv_heads, self.head_dim)
        out = paged_attention(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale)
        return self.o_proj(out.view(n, -1))


class LlamaMLP(nn.Module):

    def __init__(self, hidden: int, intermediate: int, bias: bool = False) -> None:
        super().__init__()
        self.gate_up_proj = StackedLinear(hidden, {"gate": intermediate, "up": intermediate}, bias)
        self.act = SiluAndMul()
        self.down_proj = Linear(intermediate, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):

    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding) -> None:
        super().__init__()
        hf = cfg.hf_config
        eps = hf.get("rms_norm_eps", 1e-6)
        self.self_attn = LlamaAttention(cfg, rotary)
        self.mlp = LlamaMLP(hf["hidden_size"], hf["intermediate_size"], bool(hf.get("mlp_bias", False)))
        self.input_layernorm = RMSNorm(hf["hidden_size"], eps)
        self.post_attention_layernorm = RMSNorm(hf["hidden_size"], eps)

    def forward(self, positions, x, residual, kv_cache, meta):
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x, kv_cache, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaForCausalLM(nn.Module):

    # checkpoint name fragment -> (our stacked parameter, shard)
    stacked_params = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"),
                      "v_proj": ("qkv_proj", "v"), "gate_proj": ("gate_up_proj", "gate"),
                      "up_proj": ("gate_up_proj", "up")}

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        hf = cfg.hf_config
        self.config = cfg
        self.embed_tokens = VocabEmbedding(hf["vocab_size"], hf["hidden_size"])
        rotary = RotaryEmbedding(cfg.head_dim, max(cfg.max_model_len, hf.get("max_position_embeddings", 0)),
                                 cfg.rope_theta, cfg.rope_scaling)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, rotary) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(hf["hidden_size"], hf.get("rms_norm_eps", 1e-6))
        self.tie_word_embeddings = bool(hf.get("tie_word_embeddings", False))
        self.lm_head = Linear(hf["hidden_size"], hf["vocab_size"])

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[KVCache], meta: AttentionMetadata) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches):
            x, residual = layer(positions, x, residual, kv_cache, meta)
        x, _ = self.norm(x, residual)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def process_weights_after_loading(self) -> None:
        for module in self.modules():
            if isinstance(module, Linear):
                module.process_weights_after_loading()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        if self.tie_word_embeddings:  # re-tie: materialising meta tensors unties them
            self.lm_head.weight = self.embed_tokens.weight
        params = dict(self.named_parameters())
        loaded: dict[str, set[str]] = {}
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if "rotary_emb.inv_freq" in name or (name == "lm_head.weight" and self.tie_word_embeddings):
                continue
            frag = next((f for f in self.stacked_params if f".{f}." in name), None)
            if frag is not None:
                stacked, shard = self.stacked_params[frag]
                name = name.replace(frag, stacked)
                module_name, param_name = name.rsplit(".", 1)
                self.get_submodule(module_name).load_shard(param_name, shard, tensor)
            elif name in params:
                if params[name].shape != tensor.shape:
                    raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, "
                                     f"expected {tuple(params[name].shape)}.")
                params[name].data.copy_(tensor)
                shard = ""
            else:
                raise ValueError(f"unexpected weight {name!r} in the checkpoint.")
            loaded.setdefault(name, set()).add(shard)
        missing = []
        for name in params:
            module = self.get_submodule(name.rsplit(".", 1)[0]) if "." in name else self
            want = set(module.shard_sizes) if isinstance(module, StackedLinear) else {""}
            if loaded.get(name, set()) != want:
                missing.append(name)
        if missing:
            raise ValueError(f"the checkpoint lacks weights for {missing[:4]}"
                             f"{' and more' if len(missing) > 4 else ''}.")
