"""Build a model from its config and load its safetensors weights."""
from __future__ import annotations

import glob
import os
from typing import Iterator

import torch
from safetensors import safe_open

from pagedlm.config import ModelConfig
from pagedlm.model_executor.models.llama import LlamaForCausalLM


def iterate_safetensors(model_dir: str) -> Iterator[tuple[str, torch.Tensor]]:
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise ValueError(f"model: no *.safetensors files in {model_dir}.")
    for path in files:
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def get_model(config: ModelConfig) -> torch.nn.Module:
    # Every architecture ModelConfig accepts is the Llama block with small config differences.
    cls = LlamaForCausalLM
    old = torch.get_default_dtype()
    torch.set_default_dtype(config.dtype)
    try:
        # The meta device skips random initialisation of weights we overwrite anyway.
        with torch.device("meta"):
            model = cls(config)
    finally:
        torch.set_default_dtype(old)
    model = model.to_empty(device="cpu")
    model.load_weights(iterate_safetensors(config.model_dir))
    model.process_weights_after_loading()
    return model.eval().requires_grad_(False)
