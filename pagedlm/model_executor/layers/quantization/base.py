"""What every quantization method shares: the config that picks a linear method per layer, and a
linear method that multiplies by a packed weight through the native kernels."""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections import Counter
from typing import Iterable, Iterator

import torch
from torch import nn

from pagedlm import envs
from pagedlm.model_executor.layers.linear_method import LinearMethodBase, UnquantizedLinearMethod
from pagedlm.model_executor.layers.native_linear import NativeLinear, WeightFormat
import pagedlm.model_executor.layers.quantization.kernels as kernels


class QuantizationConfig(ABC):
    """One `quantization=` choice for one model. deterministic: the linear methods it makes
    run one kernel at every row count (LinearMethodBase)."""

    name: str
    # The method reads every weight from the model file itself (`weights` ignores the float
    # checkpoint): the loader then builds the model without float weights for the layers it
    # gives methods to (linear_method.weights_on_meta).
    weights_from_file: bool = False

    def __init__(self, *, deterministic: bool = False) -> None:
        self.deterministic = deterministic

    @classmethod
    @abstractmethod
    def from_model_dir(cls, model_dir: str, *, deterministic: bool = False
                       ) -> "QuantizationConfig":
        """The config for the (resolved, HF-format) model directory; ValueError if the
        method cannot run this model."""

    @abstractmethod
    def get_linear_method(self, layer: nn.Module, prefix: str) -> LinearMethodBase | None:
        """The method for `layer` (named `prefix` in the model), or None to leave it as built."""

    def apply(self, model: nn.Module) -> None:
        """Give every layer with a linear method its quantized one (before loading)."""
        # A weight held by two modules (an LM head tied to the embedding) must stay float for
        # the other one after its quantized copy is made.
        owners: dict[int, int] = {}
        for _, param in model.named_parameters(remove_duplicate=False):
            owners[id(param)] = owners.get(id(param), 0) + 1
        for prefix, module in model.named_modules():
            if not isinstance(getattr(module, "linear_method", None), LinearMethodBase):
                continue
            method = self.get_linear_method(module, prefix)
            if method is None:
                continue
            module.linear_method = method
            module.quant_prefix = prefix
            module.keep_float_weight = owners.get(id(getattr(module, "weight", None)), 0) > 1
            method.attach(module)

    def process_weights_after_loading(self, model: nn.Module) -> None:
        """Called once after the model's own process_weights_after_loading."""

    def weights(self, float_weights: Iterable[tuple[str, torch.Tensor]]
                ) -> Iterator[tuple[str, object]]:
        """The checkpoint tensors to load: the float ones, plus whatever the method's own
        parameters need."""
        yield from float_weights


# The packed formats (kernels.FORMATS) as the native matmul kernels name them: the enum member
# of the format's name in capitals.
NATIVE_FORMATS = {fmt: WeightFormat[fmt.upper()] for fmt in kernels.FORMATS}


class PackedLinearMethod(UnquantizedLinearMethod):
    """The float weight is loaded as usual; `pack` turns it into (format, qweight, scale) once
    after loading, and the matmul runs on that through `kernels.quantized_matmul`."""

    def __init__(self, *, deterministic: bool = False) -> None:
        super().__init__(deterministic=deterministic)
        # Read once: the layer's every matmul and its native form (the fused stack) agree.
        self.precise_activations = envs.PAGEDLM_PRECISE_ACTIVATIONS

    def attach(self, layer: nn.Module) -> None:
        """Called once the method is set on a built layer, before loading."""

    def pack(self, layer: nn.Module) -> tuple[str, torch.Tensor, torch.Tensor | None]:
        raise NotImplementedError

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        fmt, qweight, scale = self.pack(layer)
        layer.quant_format, layer.qweight_data, layer.qscale = fmt, qweight, scale
        layer.packed_weight = None
        if not getattr(layer, "keep_float_weight", False):
            # Nothing reads the float copy once packed: drop it, or the model would hold both.
            layer.register_parameter("weight", None)

    def apply(self, layer, x, bias=None) -> torch.Tensor:
        return kernels.quantized_matmul(layer.quant_format, x, layer.qweight_data, layer.qscale,
                                        bias, batch_invariant=self.deterministic,
                                        precise_activations=self.precise_activations)

    def native_form(self, layer) -> NativeLinear | None:
        fmt = NATIVE_FORMATS.get(layer.quant_format)
        if type(self).apply is not PackedLinearMethod.apply or fmt is None:
            return None  # a subclass that multiplies another way describes its own form
        return NativeLinear(fmt, layer.qweight_data, layer.qscale,
                            every_row_count=self.deterministic,
                            two_limbs=kernels.activation_limbs(
                                layer.quant_format, self.precise_activations) == 2)


def weight_formats(model: nn.Module) -> Counter:
    """How many layers run in each weight format ("float" for the unquantized ones)."""
    return Counter(getattr(m, "quant_format", "float") for m in model.modules()
                   if isinstance(getattr(m, "linear_method", None), LinearMethodBase))
