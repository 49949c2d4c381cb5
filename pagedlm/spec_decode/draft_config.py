"""A draft model's config, checked against the target's before anything is loaded.

Separate from draft_model.py (the worker's proposer) so that the engine's config building
(arg_utils) can call it: it reads config files only.
"""
from __future__ import annotations

import dataclasses
import os

from pagedlm.config import ModelConfig
from pagedlm.model_executor.layers.quantization import (get_quantization_config,
                                                        resolve_quantization)
from pagedlm.model_executor.model_loader.model_path import resolve_model

FIELD = "speculative_config.model"


def _eos_ids(config: ModelConfig) -> frozenset[int]:
    eos = config.get_hf("eos_token_id")
    return frozenset(eos if isinstance(eos, (list, tuple)) else [eos] if eos is not None else [])


def draft_model_config(model: str | os.PathLike[str], target: ModelConfig) -> ModelConfig:
    """The draft's ModelConfig, checked against the target's before anything is loaded: the
    path exists and holds a model pagedlm runs, and its vocabulary (size and EOS ids) is the
    target's, since its token ids are verified as the target's. Errors name the field."""
    if not isinstance(model, (str, os.PathLike)):
        raise ValueError(f"{FIELD} must be the path of a model directory or a .gguf file, got "
                         f"{model!r}.")
    path = os.path.expanduser(os.fspath(model))
    if not os.path.exists(path):
        raise ValueError(f"{FIELD}: {path!r} does not exist; expected a local model directory "
                         f"or a .gguf file.")
    try:
        model_dir = resolve_model(path)
        quantization = resolve_quantization(None, model_dir)
        get_quantization_config(quantization, model_dir)
        draft = ModelConfig.from_dir(path, model_dir, "auto", None, target.seed,
                                     quantization=quantization,
                                     deterministic=target.deterministic,
                                     device_type=target.device_type)
    except ValueError as e:
        raise ValueError(f"{FIELD}: {e}") from None
    if draft.vocab_size != target.vocab_size:
        raise ValueError(f"{FIELD}: the draft model's vocabulary has {draft.vocab_size} tokens "
                         f"and the target's {target.vocab_size}; a draft model must share the "
                         f"target's tokenizer.")
    if _eos_ids(draft) and _eos_ids(target) and _eos_ids(draft) != _eos_ids(target):
        raise ValueError(f"{FIELD}: the draft model's EOS token ids {sorted(_eos_ids(draft))} "
                         f"differ from the target's {sorted(_eos_ids(target))}; a draft model "
                         f"must share the target's tokenizer.")
    # The target's weight dtype (a 2-byte target gets a 2-byte draft); positions past the
    # draft's own context are not drafted (DraftModelProposer.propose).
    return dataclasses.replace(draft, dtype=target.dtype,
                               max_model_len=min(target.max_model_len,
                                                 draft.derived_max_model_len))


def check_draft_model(model: str | os.PathLike[str], target: ModelConfig) -> None:
    """Raise ValueError naming speculative_config.model for a draft the target cannot use."""
    draft_model_config(model, target)
