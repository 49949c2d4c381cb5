"""Build a model from its config and load its safetensors weights (this rank's part of them)."""
from __future__ import annotations

import torch

from pagedlm.attention.backends import get_attn_backend
from pagedlm.config import ModelConfig
from pagedlm.model_executor.model_loader.weight_utils import iterate_safetensors
from pagedlm.model_executor.models.registry import get_model_class

__all__ = ["get_model", "iterate_safetensors"]


def get_model(config: ModelConfig, device: torch.device | str = "cpu") -> torch.nn.Module:
    """The model for this process's rank, loaded and ready.

    Tensor- and pipeline-parallel ranks come from the groups of
    pagedlm.distributed.parallel_state (size 1 when none were initialised): each rank builds
    only its heads, features and layers, and loads its slices of the full checkpoint tensors.
    """
    cls = get_model_class(config.architecture)
    attn_backend = get_attn_backend(config.dtype, device)  # chosen once, for every layer
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
    model.load_weights(iterate_safetensors(config.model_dir))
    model.process_weights_after_loading()
    return model.eval().requires_grad_(False)
