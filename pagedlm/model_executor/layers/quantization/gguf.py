"""quantization="gguf": a GGUF file's Q4_0 / Q4_1 / Q8_0 matrices run as stored.

The float load path is unchanged (the converted directory's dequantized weights); next to each
layer's float weight the loader also hands the file's raw blocks, under the same HF names with
`.qweight`, through the layer's own weight loader, so tensor-parallel slicing and fused q/k/v
and gate/up shards work as for floats (slicing the input features along block boundaries).
After loading, each layer checks that its blocks dequantize bit for bit to the float weights
the float32 path runs on, keeps the blocks and drops the float copy. A layer whose file tensors
are float (F32/F16), of different block types within one fused matrix, or laid out in a way
other than a row reordering, stays on the float path.

The token embedding stays float for lookups (a few rows per token, never streamed whole); a
tied LM head gets the embedding's blocks. In the embedded SmolLM2 file that head is Q8_0 and
20% of all weights: kept float it would be read at 4 bytes a weight, more than all the Q4_1
layers together (113 MB against 66 MB a token).
"""
from __future__ import annotations

import json
import logging
import os

import torch
from torch import nn

from pagedlm.model_executor.layers.linear import LinearMethodBase, UnquantizedLinearMethod
import pagedlm.model_executor.layers.quantization.kernels as kernels
from pagedlm.model_executor.layers.quantization.base import PackedLinearMethod, QuantizationConfig
from pagedlm.model_executor.model_loader.model_path import CONVERSION_MARKER

logger = logging.getLogger(__name__)

# ggml type -> the kernel format its blocks run in (Q4_0 is converted exactly to q4_1).
RUNNABLE_TYPES = {"Q4_0": "q4_1", "Q4_1": "q4_1", "Q8_0": "q8_0"}
FLOAT_TYPES = ("F32", "F16", "BF16")


class GGUFLinearMethod(PackedLinearMethod):

    def attach(self, layer: nn.Module) -> None:
        rows, cols = layer.weight.shape
        # Its block size is only known when the first shard arrives (see _load).
        qweight = nn.Parameter(torch.empty(rows, cols // kernels.QK, 0, dtype=torch.uint8),
                               requires_grad=False)
        qweight.weight_loader = self._load
        qweight.input_block = kernels.QK  # input features per index of dim 1 (TP slicing)
        qweight.load_optional = True  # float tensors in the file leave it unloaded
        qweight.layer, qweight.qformat, qweight.shards, qweight.mixed = layer, None, set(), False
        layer.register_parameter("qweight", qweight)

    @staticmethod
    def _load(param: nn.Parameter, loaded, shard_id: object = None) -> None:
        fmt = RUNNABLE_TYPES[loaded.qtype]
        blocks = kernels.q4_0_to_q4_1(loaded.blocks) if loaded.qtype == "Q4_0" else loaded.blocks
        if param.qformat is None:
            param.data = torch.zeros(*param.shape[:2], kernels.BLOCK_BYTES[fmt],
                                     dtype=torch.uint8)
            param.qformat = fmt
        elif param.qformat != fmt:
            param.mixed = True  # e.g. q Q4_1 with v Q8_0: the float weight has them all
            return
        param.layer.weight_loader(param, blocks, shard_id)
        param.shards.add(shard_id)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        qweight = layer.qweight
        del layer.qweight
        # One shard per stacked matrix ([q, k, v], [gate, up]); one for any other layer.
        expected = len(getattr(layer, "output_sizes", None) or [None])
        if qweight.qformat is None or qweight.mixed or len(qweight.shards) != expected:
            layer.linear_method = UnquantizedLinearMethod(deterministic=self.deterministic)
            layer.linear_method.process_weights_after_loading(layer)
            return
        blocks = qweight.data
        # The float path's weights are these blocks dequantized (rounded to the model dtype).
        dequantized = kernels.dequantize(qweight.qformat, blocks).to(layer.weight.dtype)
        if not torch.equal(dequantized, layer.weight):
            raise ValueError(f"quantization='gguf': the blocks loaded for {layer.quant_prefix} do "
                             f"not dequantize to its float weights; their layout is not one "
                             f"this loader undoes. Load this model without quantization.")
        self._blocks = (qweight.qformat, blocks)
        super().process_weights_after_loading(layer)
        del self._blocks

    def pack(self, layer):
        fmt, blocks = self._blocks
        return fmt, blocks, None


class GGUFConfig(QuantizationConfig):
    name = "gguf"

    def __init__(self, gguf_path: str, *, deterministic: bool = False) -> None:
        super().__init__(deterministic=deterministic)
        self.gguf_path = gguf_path

    @classmethod
    def from_model_dir(cls, model_dir: str, *, deterministic: bool = False) -> "GGUFConfig":
        from pagedlm.model_executor.model_loader.gguf_loader import gguf_tensor_types
        marker = os.path.join(model_dir, CONVERSION_MARKER)
        if not os.path.isfile(marker):
            raise ValueError(f"quantization='gguf' needs a GGUF model file (model=PATH.gguf); "
                             f"{model_dir} is a HuggingFace directory. Use 'int8' or 'int4' "
                             f"to quantize it.")
        with open(marker) as f:
            path = json.load(f)["source"]
        bad = {name: t for name, t in gguf_tensor_types(path).items()
               if t not in RUNNABLE_TYPES and t not in FLOAT_TYPES}
        if bad:
            name, qtype = next(iter(bad.items()))
            raise ValueError(
                f"quantization='gguf': tensor {name!r} of {path} is {qtype} ({len(bad)} "
                f"tensors of types {sorted(set(bad.values()))}), which pagedlm cannot run "
                f"quantized. Supported: {', '.join(RUNNABLE_TYPES)} (and {', '.join(FLOAT_TYPES)} "
                f"tensors, kept float). Load it without quantization to run it dequantized to "
                f"float32.")
        return cls(path, deterministic=deterministic)

    def get_linear_method(self, layer: nn.Module, prefix: str) -> LinearMethodBase | None:
        return GGUFLinearMethod(deterministic=self.deterministic)

    def weights(self, float_weights):
        from pagedlm.model_executor.model_loader.gguf_loader import iterate_gguf_blocks
        yield from float_weights
        for name, blocks in iterate_gguf_blocks(self.gguf_path, tuple(RUNNABLE_TYPES)):
            yield name.removesuffix(".weight") + ".qweight", blocks

