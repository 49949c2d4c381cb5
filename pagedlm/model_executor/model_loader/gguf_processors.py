"""transformers' GGUF tensor processors (what undoes llama.cpp's layout changes per tensor), with
Llama's and the identity built here.

transformers' module of processors imports its GGUF tokenizer converters, and with them the
transformers.models package, whose import scans every model directory: about 1 s of each
quantized load of a cached Llama file on this 2-core machine, where nothing else on the serving
path needs that package. The architectures whose processor is transformers' base class (the
identity) or Llama's get these stand-ins, which do what transformers' do (tested against them
tensor by tensor); the others get transformers' own.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

# GGUF architectures transformers has no processor for: its base class, which changes nothing.
IDENTITY_ARCHITECTURES = ("qwen2", "qwen3", "phi3")


class ProcessedTensor(NamedTuple):
    """What a processor returns (transformers' GGUFTensor's fields): name None means the
    processor stored the tensor itself."""
    weights: np.ndarray
    name: str | None
    metadata: dict


class IdentityProcessor:
    """transformers' TensorProcessor: every tensor as llama.cpp stored it."""

    def __init__(self, config: dict[str, Any] | None = None) -> None:
        self.config = config or {}

    def preprocess_name(self, hf_name: str) -> str:
        return hf_name

    def perform_fallback_tensor_mapping(self, gguf_to_hf_name_map: dict[str, str], suffix: str,
                                        qual_name: str, hf_name: str) -> None:
        return None

    def process(self, weights, name: str, **kwargs) -> ProcessedTensor:
        return ProcessedTensor(weights, name, {})


class LlamaProcessor(IdentityProcessor):
    """transformers' LlamaTensorProcessor: llama.cpp's converter interleaves each head's two
    rotary halves in the q and k rows; this puts them back in halves."""

    def process(self, weights, name: str, **kwargs) -> ProcessedTensor:
        heads = self.config.get("num_attention_heads")
        kv_heads = self.config.get("num_key_value_heads")
        if (".attn_q." in name or ".attn_k." in name) and None not in (heads, kv_heads):
            n = heads if ".attn_q." in name else kv_heads
            shape = weights.shape
            weights = (weights.reshape(n, shape[0] // n // 2, 2, *shape[1:])
                       .swapaxes(2, 1).reshape(shape))
        return ProcessedTensor(weights, name, {})


def tensor_processor(arch: str, config: dict[str, Any]):
    """The processor transformers' GGUF loader uses for `arch`, given the config as a dict."""
    if arch == "llama":
        return LlamaProcessor(config)
    if arch in IDENTITY_ARCHITECTURES:
        return IdentityProcessor(config)
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor
    return TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=config)
