"""Tokenizer loading and the set of ids that end generation."""
from __future__ import annotations

import json
import os

from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

# Classes that are nothing but tokenizer.json: loading them directly skips AutoTokenizer's
# first-call imports (~1.5 s of a ~4 s cached start-up, measured here). AutoTokenizer is
# imported only for other classes: importing it imports the transformers.models package,
# 0.7-1 s of a start-up here.
_GENERIC_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")


def get_tokenizer(path: str) -> PreTrainedTokenizerBase:
    try:
        if _tokenizer_class(path) in _GENERIC_CLASSES:
            return PreTrainedTokenizerFast.from_pretrained(path)
        from transformers import AutoTokenizer
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise ValueError(f"tokenizer: could not load a tokenizer from {path}: {e}") from e


def _tokenizer_class(path: str) -> str | None:
    config = os.path.join(path, "tokenizer_config.json")
    if not os.path.exists(os.path.join(path, "tokenizer.json")) or not os.path.exists(config):
        return None
    with open(config) as f:
        return json.load(f).get("tokenizer_class")


def eos_token_ids(model_dir: str, tokenizer: PreTrainedTokenizerBase) -> frozenset[int]:
    """The tokenizer's EOS plus generation_config's (which may list several, as Llama 3 does)."""
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    path = os.path.join(model_dir, "generation_config.json")
    if os.path.exists(path):
        with open(path) as f:
            eos = json.load(f).get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    return frozenset(ids)
