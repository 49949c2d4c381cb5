"""GPT-2 over a flat batch with paged attention.

GPT-2 is a pre-LayerNorm decoder with learned absolute positions (`wpe`, looked up at the flat
batch's `positions`), a fused query/key/value projection `c_attn`, a GELU MLP (the config's
`activation_function`, "gelu_new": the tanh approximation) and an LM head tied to `wte`. Its
checkpoint stores every projection as a Conv1D, i.e. the weight transposed ([in, out]); the
loader transposes them and cuts c_attn into its q, k and v thirds, so the parallel layers can
take each rank's heads (a plain column split of the fused [q;k;v] would hand a rank some of
q's columns and none of v's).

Tensor and pipeline parallelism work as in llama.py. GPT-2 has a single residual stream, so
only the hidden states travel between pipeline stages.
"""
from __future__ import annotations

from typing import Iterable, Iterator

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
                                                  RowParallelLinear)
from pagedlm.model_executor.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding
from pagedlm.model_executor.model_loader.weight_utils import load_weights_into
from pagedlm.model_executor.models.base import CausalLMBase
from pagedlm.model_executor.models.pipeline import PPStage, make_layers

KVCache = tuple[torch.Tensor, torch.Tensor]

# Conv1D modules, whose checkpoint weights are [in, out].
_CONV1D = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")


class GPT2PositionEmbedding(nn.Module):
    """The learned position table `wpe`, replicated on every TP rank: it is small, and
    splitting it would cost an all-reduce."""

    def __init__(self, num_positions: int, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_positions, dim), requires_grad=False)

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        return F.embedding(positions, self.weight)


class GPT2Attention(nn.Module):

    def __init__(self, cfg: ModelConfig, layer_idx: int, attn_backend: AttentionBackend) -> None:
        super().__init__()
        hidden = cfg.hf_config.hidden_size
        self.c_attn = QKVParallelLinear(hidden, cfg.head_dim, cfg.num_heads, bias=True)
        self.num_heads, self.head_dim = self.c_attn.num_heads, cfg.head_dim
        self.c_proj = RowParallelLinear(hidden, hidden, bias=True)
        scale = self.head_dim ** -0.5 if cfg.get_hf("scale_attn_weights", True) else 1.0
        if cfg.get_hf("scale_attn_by_inverse_layer_idx", False):
            scale /= layer_idx + 1
        self.attn = Attention(self.num_heads, self.head_dim, scale, self.num_heads, attn_backend)

    def forward(self, x: torch.Tensor, kv_cache: KVCache,
                meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.c_attn(x).chunk(3, dim=-1)
        return self.c_proj(self.attn(q, k, v, kv_cache, meta))


class GPT2MLP(nn.Module):

    def __init__(self, hidden: int, inner: int, act: str, deterministic: bool = False) -> None:
        super().__init__()
        self.c_fc = ColumnParallelLinear(hidden, inner, bias=True)
        self.act = get_act_fn(act, "activation_function", deterministic)
        self.c_proj = RowParallelLinear(inner, hidden, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.act(self.c_fc(x)))


class GPT2Block(nn.Module):

    def __init__(self, cfg: ModelConfig, layer_idx: int, attn_backend: AttentionBackend) -> None:
        super().__init__()
        hidden = cfg.hf_config.hidden_size
        eps = cfg.get_hf("layer_norm_epsilon", 1e-5)
        self.ln_1 = nn.LayerNorm(hidden, eps=eps)
        self.attn = GPT2Attention(cfg, layer_idx, attn_backend)
        self.ln_2 = nn.LayerNorm(hidden, eps=eps)
        self.mlp = GPT2MLP(hidden, cfg.get_hf("n_inner") or 4 * hidden,
                           cfg.get_hf("activation_function", "gelu_new"), cfg.deterministic)

    def forward(self, x: torch.Tensor, kv_cache: KVCache,
                meta: AttentionMetadata) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), kv_cache, meta)
        return x + self.mlp(self.ln_2(x))


class GPT2LMHeadModel(CausalLMBase):

    stage_modules = ("wte", "wpe", "ln_f", "lm_head")
    layers_name = "h"

    def __init__(self, cfg: ModelConfig, attn_backend: AttentionBackend | None = None) -> None:
        super().__init__()
        hf = cfg.hf_config
        self.config = cfg
        self.stage = stage = PPStage.of_this_rank(cfg.num_layers)
        hidden = hf.hidden_size
        self.tie_word_embeddings = bool(cfg.get_hf("tie_word_embeddings", True))
        self.wte = self.wpe = None
        if stage.holds_embedding(self.tie_word_embeddings):
            self.wte = VocabParallelEmbedding(hf.vocab_size, hidden)
        if stage.is_first:
            self.wpe = GPT2PositionEmbedding(hf.max_position_embeddings, hidden)
        attn_backend = attn_backend or get_attn_backend(
            cfg.compute_dtype, deterministic=cfg.deterministic)
        self.h = make_layers(stage, lambda i: GPT2Block(cfg, i, attn_backend))
        self.ln_f = self.lm_head = None
        if stage.is_last:
            self.ln_f = nn.LayerNorm(hidden, eps=cfg.get_hf("layer_norm_epsilon", 1e-5))
            self.lm_head = ParallelLMHead(hf.vocab_size, hidden)
            if self.tie_word_embeddings:
                self.lm_head.tie_weights(self.wte)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[KVCache], attn_metadata: AttentionMetadata,
                intermediate_tensors: IntermediateTensors | None = None
                ) -> torch.Tensor | IntermediateTensors:
        """One step over the flat batch (see registry.py for the interface)."""
        assert len(kv_caches) == len(self.h), (
            f"{len(kv_caches)} KV caches for {len(self.h)} layers on this stage")
        if self.stage.is_first:
            x = self.wte(input_ids) + self.wpe(positions)
        else:
            x = intermediate_tensors.hidden_states
        for block, kv_cache in zip(self.h.values(), kv_caches):
            x = block(x, kv_cache, attn_metadata)
        if not self.stage.is_last:
            # A single residual stream: there is no separate residual to send.
            return IntermediateTensors(x, x.new_empty(0))
        return self.ln_f(x)

    def _from_conv1d(self, weights: Iterable[tuple[str, torch.Tensor]]
                     ) -> Iterator[tuple[str, torch.Tensor]]:
        """Transpose the Conv1D weights to [out, in] and cut c_attn (weight and bias) into
        its q, k, v thirds, named `...c_attn.q.weight` etc. for the stacked loader."""
        hidden = self.config.hf_config.hidden_size
        for name, tensor in weights:
            # Old checkpoints carry the causal mask as buffers `attn.bias`/`attn.masked_bias`.
            if name.endswith((".attn.bias", ".attn.masked_bias")):
                continue
            stem, _, param = name.rpartition(".")
            if param == "weight" and stem.endswith(_CONV1D):
                tensor = tensor.t()
            if not stem.endswith("attn.c_attn"):
                yield name, tensor
                continue
            if tensor.shape[0] != 3 * hidden:
                raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, expected "
                                 f"{(hidden, 3 * hidden) if param == 'weight' else (3 * hidden,)}.")
            for shard, part in zip("qkv", tensor.chunk(3, dim=0)):
                yield f"{stem}.{shard}.{param}", part

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        def rename(ckpt_name: str) -> str | None:
            name = ckpt_name.removeprefix("transformer.")
            if name == "lm_head.weight" and self.tie_word_embeddings:
                return None
            return name

        stacked = {"c_attn.q": ("c_attn", "q"), "c_attn.k": ("c_attn", "k"),
                   "c_attn.v": ("c_attn", "v")}
        load_weights_into(self, self._from_conv1d(weights), stacked_params=stacked,
                          rename=rename, on_this_rank=self._on_this_stage)
