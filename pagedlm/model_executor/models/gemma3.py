"""Gemma 3, text only (Gemma3ForCausalLM, model_type gemma3_text).

Gemma 2's model (gemma2.py) plus per-head RMSNorm on queries and keys, and a separate rope
base (and scaling) for the local sliding-window layers: transformers 5 keeps one set of rope
parameters per layer type in rope_parameters (converted from rope_theta /
rope_local_base_freq / rope_scaling of older configs when the config is read). Soft-capping is
off unless the config sets it.
"""
from __future__ import annotations

from pagedlm.config import ModelConfig
from pagedlm.model_executor.layers.rotary_embedding import RotaryEmbedding
from pagedlm.model_executor.models.gemma2 import Gemma2ForCausalLM, _layer_types, _max_position


class Gemma3ForCausalLM(Gemma2ForCausalLM):

    qk_norm = True

    def __init__(self, cfg: ModelConfig, attn_backend=None) -> None:
        if cfg.get_hf("use_bidirectional_attention", False):
            raise ValueError(f"use_bidirectional_attention in {cfg.model_dir}/config.json: "
                             "bidirectional (embedding) Gemma 3 models are not supported; "
                             "pagedlm generates with causal attention only.")
        super().__init__(cfg, attn_backend)

    def _rotary_tables(self, cfg: ModelConfig) -> dict[str, RotaryEmbedding]:
        params = cfg.get_hf("rope_parameters") or {}
        tables = {}
        for layer_type in set(_layer_types(cfg)):
            p = params.get(layer_type)
            if not isinstance(p, dict) or "rope_theta" not in p:
                raise ValueError(f"rope_parameters in {cfg.model_dir}/config.json has no "
                                 f"rope_theta for {layer_type!r} layers.")
            kind = p.get("rope_type") or p.get("type") or "default"
            tables[layer_type] = RotaryEmbedding(cfg.head_dim, _max_position(cfg),
                                                 p["rope_theta"],
                                                 None if kind == "default" else p)
        return tables
