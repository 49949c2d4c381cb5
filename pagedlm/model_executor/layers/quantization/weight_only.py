"""int8 and int4: float checkpoints quantized at load time, weights only (activations stay float).

int8: symmetric int8 per output channel (one float32 scale per row, taken over the whole row
      also when tensor parallelism splits it).
int4: 4-bit groups of 32 along the input features, each with a scale and a zero point (w = d*q
      + m, d and m in fp16: the q4_1 block, so the same kernel serves GGUF Q4_1 files). The LM
      head stays int8 under int4: the logits are what the sampler ranks, and a 4-bit head
      costs more agreement with float32 than every 4-bit layer below it (the same choice AWQ/
      GPTQ checkpoints make by leaving it unquantized).
"""
from __future__ import annotations

from torch import nn

from pagedlm.model_executor.layers.linear import RowParallelLinear
from pagedlm.model_executor.layers.linear_method import LinearMethodBase
import pagedlm.model_executor.layers.quantization.kernels as kernels
from pagedlm.model_executor.layers.quantization.base import PackedLinearMethod, QuantizationConfig
from pagedlm.model_executor.layers.vocab_embedding import VocabParallelEmbedding


class Int8LinearMethod(PackedLinearMethod):
    def pack(self, layer):
        absmax = layer.weight.detach().abs().amax(-1).float()
        if isinstance(layer, RowParallelLinear) and layer.tp_size > 1:
            # Each rank holds part of every row: scale by the whole row's max, so every
            # tensor-parallel layout runs the same int8 weights as one worker.
            absmax = layer.tp_group.all_gather(absmax[None], dim=0).amax(0)
        qweight, scale = kernels.quantize_i8(layer.weight, absmax)
        return "i8", qweight, scale


class Int4LinearMethod(PackedLinearMethod):
    def pack(self, layer):
        k = layer.weight.shape[1]
        if k % kernels.QK:
            raise ValueError(f"quantization='int4' needs every linear layer's input size (per "
                             f"tensor-parallel rank) to be a multiple of {kernels.QK}; "
                             f"{layer.quant_prefix} has {k}. Use quantization='int8'.")
        return "q4_1", kernels.quantize_q4_1(layer.weight), None


class Int8Config(QuantizationConfig):
    name = "int8"

    @classmethod
    def from_model_dir(cls, model_dir: str, *, deterministic: bool = False) -> "Int8Config":
        return cls(deterministic=deterministic)

    def get_linear_method(self, layer: nn.Module, prefix: str) -> LinearMethodBase | None:
        return Int8LinearMethod(deterministic=self.deterministic)


class Int4Config(QuantizationConfig):
    name = "int4"

    @classmethod
    def from_model_dir(cls, model_dir: str, *, deterministic: bool = False) -> "Int4Config":
        return cls(deterministic=deterministic)

    def get_linear_method(self, layer: nn.Module, prefix: str) -> LinearMethodBase | None:
        if isinstance(layer, VocabParallelEmbedding):  # the LM head
            return Int8LinearMethod(deterministic=self.deterministic)
        return Int4LinearMethod(deterministic=self.deterministic)
