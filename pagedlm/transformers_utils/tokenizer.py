"""Tokenizer loading and the set of ids that end generation."""
from __future__ import annotations

import copy
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
            tokenizer = PreTrainedTokenizerFast.from_pretrained(path)
        else:
            from transformers import AutoTokenizer
            tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise ValueError(f"tokenizer: could not load a tokenizer from {path}: {e}") from e
    if isinstance(tokenizer, PreTrainedTokenizerFast):
        # A fast tokenizer's encode changes its Rust object only to make the truncation,
        # padding and special-token splitting it holds match the call's; a thread reading
        # the object meanwhile would fail ("Already borrowed"). Set here to what every call
        # of pagedlm's asks (none, none, the tokenizer's default), encode never changes it,
        # and threads can share it (thread_tokenizer).
        backend = tokenizer.backend_tokenizer
        if backend.truncation is not None:
            backend.no_truncation()
        if backend.padding is not None:
            backend.no_padding()
        backend.encode_special_tokens = bool(getattr(tokenizer, "split_special_tokens", False))
    return tokenizer


def thread_tokenizer(tokenizer: PreTrainedTokenizerBase) -> PreTrainedTokenizerBase:
    """The tokenizer for another thread (the event loop, the prompt worker, request
    preparation) to encode and decode with while the engine thread detokenizes: a fast
    tokenizer from get_tokenizer itself, any other class a copy of its own.

    Why share: a copy rebuilds the Rust tokenizer from its JSON, 0.1-0.15 s holding the GIL
    (49k tokens, SmolLM2's vocabulary), and `pagedlm serve` made two before it was ready.
    Encoding and decoding only read a fast tokenizer's state once get_tokenizer has fixed
    it; nothing in pagedlm passes truncation, padding or split_special_tokens to a call."""
    if isinstance(tokenizer, PreTrainedTokenizerFast):
        return tokenizer
    return copy.deepcopy(tokenizer)


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
