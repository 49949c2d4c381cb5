"""Quantized weights: the `quantization=` setting and the linear methods it selects.

A QuantizationConfig hands each layer that has a `linear_method` (every parallel linear layer
and the LM head) the method that stores and multiplies its weight, so any model built on those
layers gets quantization without model code (vLLM's `get_quant_method(layer, prefix)` idea).
The loader calls `apply` after building the model and before loading its weights.
"""
from __future__ import annotations

from pagedlm.model_executor.layers.quantization.base import QuantizationConfig
from pagedlm.model_executor.layers.quantization.gguf import GGUFConfig, default_for_gguf
from pagedlm.model_executor.layers.quantization.weight_only import Int4Config, Int8Config
from pagedlm.model_executor.model_loader.model_path import gguf_source

QUANTIZATION_METHODS: dict[str, type[QuantizationConfig]] = {
    "int8": Int8Config,
    "int4": Int4Config,
    "gguf": GGUFConfig,
}


def verify_quantization(value: object) -> str | None:
    """`value` if it names a supported method (None: float weights), else a ValueError."""
    if value is None or value in QUANTIZATION_METHODS:
        return value
    raise ValueError(f"quantization must be one of {sorted(QUANTIZATION_METHODS)} or None "
                     f"(float weights), got {value!r}.")


def resolve_quantization(name: str | None, model_dir: str) -> str | None:
    """The method `quantization=name` runs on the model in `model_dir`: None on a GGUF file
    keeps a large file in its blocks ("gguf"; see gguf.GGUF_FLOAT_COPY_LIMIT_BYTES)."""
    name = verify_quantization(name)
    source = gguf_source(model_dir)
    if name is None and source is not None:
        return default_for_gguf(source)
    return name


def get_quantization_config(name: str | None, model_dir: str, *, deterministic: bool = False
                            ) -> QuantizationConfig | None:
    """The config for `quantization=name` on the model in `model_dir` (None: unquantized);
    deterministic: ModelConfig.deterministic, which every linear method it makes gets."""
    if verify_quantization(name) is None:
        return None
    return QUANTIZATION_METHODS[name].from_model_dir(model_dir, deterministic=deterministic)


__all__ = ["QUANTIZATION_METHODS", "QuantizationConfig", "get_quantization_config",
           "resolve_quantization", "verify_quantization"]
