"""The model registry: a HuggingFace `architectures` name -> the class that runs it.

Classes are named by "module:Class" and imported on first use, so asking which architectures
exist (config validation, error messages) imports no model code. Every architecture-specific
detail lives in the model's own module; the engine, loader and shared layers only see the
interface below.

A model class is built as `cls(model_config, attn_backend)` under its compute dtype (float32)
and the target device (the loader then narrows its matrices to model_config.dtype) and provides:
  forward(input_ids, positions, kv_caches, attn_metadata, intermediate_tensors=None)
      -> final hidden states [num_tokens, hidden] on the last pipeline stage, else
         IntermediateTensors;
  compute_logits(hidden) -> float32 logits [num_tokens, vocab_size];
  load_weights(iterable of (checkpoint name, full tensor)) -> None (raises ValueError naming a
      wrong, unexpected or missing weight);
  process_weights_after_loading() -> None.
"""
from __future__ import annotations

import importlib
from types import MappingProxyType

# HF architecture name -> "module under pagedlm.model_executor.models:Class".
_MODELS = MappingProxyType({
    "LlamaForCausalLM": "llama:LlamaForCausalLM",
    "MistralForCausalLM": "llama:LlamaForCausalLM",
    "Qwen2ForCausalLM": "qwen2:Qwen2ForCausalLM",
    "OPTForCausalLM": "opt:OPTForCausalLM",
    "GPT2LMHeadModel": "gpt2:GPT2LMHeadModel",
    "Phi3ForCausalLM": "phi3:Phi3ForCausalLM",
    "Qwen3ForCausalLM": "qwen3:Qwen3ForCausalLM",
    "MixtralForCausalLM": "mixtral:MixtralForCausalLM",
    "Qwen2MoeForCausalLM": "qwen2_moe:Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM": "qwen3_moe:Qwen3MoeForCausalLM",
    "Gemma2ForCausalLM": "gemma2:Gemma2ForCausalLM",
    "Gemma3ForCausalLM": "gemma3:Gemma3ForCausalLM",
})


def supported_architectures() -> tuple[str, ...]:
    return tuple(_MODELS)


def resolve_architecture(architectures: list[str] | None) -> str:
    """The first of a config's `architectures` that pagedlm runs; ValueError listing the
    supported ones otherwise."""
    for arch in architectures or ():
        if arch in _MODELS:
            return arch
    raise ValueError(f"model: architecture {list(architectures or [])} is not supported; "
                     f"pagedlm runs {', '.join(sorted(_MODELS))}.")


def get_model_class(architecture: str) -> type:
    module, _, cls = _MODELS[resolve_architecture([architecture])].partition(":")
    return getattr(importlib.import_module(f"pagedlm.model_executor.models.{module}"), cls)
