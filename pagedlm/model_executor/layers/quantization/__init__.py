"""Quantized weights: the `quantization=` setting and the linear methods it selects.

A QuantizationConfig hands each layer that has a `linear_method` (every parallel linear layer
and the LM head) the method that stores and multiplies its weight, so any model built on those
layers gets quantization without model code (vLLM's `get_quant_method(layer, prefix)` idea).
The loader calls `apply` after building the model and before loading its weights.
"""
from __future__ import annotations

from pagedlm.model_executor.layers.quantization.base import QuantizationConfig
from pagedlm.model_executor.layers.quantization.gguf import GGUFConfig
from pagedlm.model_executor.layers.quantization.weight_only import Int4Config, Int8Config

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


def get_quantization_config(name: str | None, model_dir: str, *, deterministic: bool = False
                            ) -> QuantizationConfig | None:
    """The config for `quantization=name` on the model in `model_dir` (None: unquantized);
    deterministic: ModelConfig.deterministic, which every linear method it makes gets."""
    if verify_quantization(name) is None:
        return None
    return QUANTIZATION_METHODS[name].from_model_dir(model_dir, deterministic=deterministic)


__all__ = ["QUANTIZATION_METHODS", "QuantizationConfig", "get_quantization_config",
           "verify_quantization"]
