"""Build a model from its config and load its safetensors weights (this rank's part of them)."""
from __future__ import annotations

import torch

from pagedlm.attention.backends import get_attn_backend
import logging

from pagedlm.config import ModelConfig
from pagedlm.model_executor.layers.linear import use_deterministic_linear_methods
from pagedlm.model_executor.layers.quantization import get_quantization_config
from pagedlm.model_executor.layers.quantization.base import weight_formats
from pagedlm.model_executor.model_loader.weight_utils import iterate_safetensors
from pagedlm.model_executor.models.registry import get_model_class

__all__ = ["get_model", "iterate_safetensors"]

logger = logging.getLogger(__name__)


def get_model(config: ModelConfig, device: torch.device | str = "cpu") -> torch.nn.Module:
    """The model for this process's rank, loaded and ready.

    Tensor- and pipeline-parallel ranks come from the groups of
    pagedlm.distributed.parallel_state (size 1 when none were initialised): each rank builds
    only its heads, features and layers, and loads its slices of the full checkpoint tensors.
    """
    cls = get_model_class(config.architecture)
    quant_config = get_quantization_config(config.quantization, config.model_dir,
                                           deterministic=config.deterministic)
    # Chosen once, for every layer.
    attn_backend = get_attn_backend(config.dtype, device, deterministic=config.deterministic)
    old = torch.get_default_dtype()
    torch.set_default_dtype(config.dtype)
    try:
        # Built in place: every weight is created with torch.empty (nothing is initialised just
        # to be overwritten) and each parameter keeps its weight_loader attribute and ties,
        # which moving from the meta device with to_empty() would drop.
        with torch.device(device):
            model = cls(config, attn_backend)
    finally:
        torch.set_default_dtype(old)
    if config.deterministic:
        use_deterministic_linear_methods(model)
    weights = iterate_safetensors(config.model_dir)
    if quant_config is not None:
        quant_config.apply(model)
        weights = quant_config.weights(weights)
    model.load_weights(weights)
    model.process_weights_after_loading()
    if quant_config is not None:
        logger.info("quantization=%r: linear layers by weight format: %s",
                    config.quantization, dict(weight_formats(model)))
    return model.eval().requires_grad_(False)
