"""SpeculativeConfig: speculative decoding's settings, in vLLM's `speculative_config` shape.

A module of its own beside config.py (which EngineConfig imports it from) to keep each file
short; the same rules hold: frozen, checked in __post_init__, errors name the field.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

from pagedlm.config_checks import is_int

SPEC_METHODS = ("ngram", "draft_model")
FIELD = "speculative_config"


def _check_int(name: str, value: object, low: int) -> None:
    if not is_int(value) or value < low:
        raise ValueError(f"{FIELD}.{name} must be an integer >= {low}, got {value!r}.")


@dataclass(frozen=True)
class SpeculativeConfig:
    # "ngram" (prompt lookup) or "draft_model"; None: "draft_model" if `model` is given.
    method: str | None = None
    num_speculative_tokens: int = 0  # k: drafts verified per step and sequence (required)
    # n-gram lookup: the longest suffix of n tokens (n from max down to min) that occurred
    # earlier in the sequence proposes the tokens that followed it.
    prompt_lookup_min: int | None = None  # default 2 (1 matches too often to be worth it)
    prompt_lookup_max: int | None = None  # default max(4, prompt_lookup_min)
    model: str | None = None  # draft model: a directory or .gguf sharing the tokenizer
    # Policy (core/spec_policy.py). A step with more decoding sequences than this speculates
    # for none (batch throughput: verification rows cost compute a large batch lacks); off
    # under --deterministic, where only per-request rules may decide.
    max_batch_for_spec: int = 8
    # Per-sequence back-off: after a verification that accepted nothing, a sequence's k halves;
    # at 0 it decodes plainly for this many of its own steps, then retries with k = 1.
    backoff_retry_steps: int = 16

    def __post_init__(self) -> None:
        method = self.method
        if method is None:
            method = "draft_model" if self.model is not None else "ngram"
            object.__setattr__(self, "method", method)
        if method not in SPEC_METHODS:
            raise ValueError(f"{FIELD}.method must be one of {list(SPEC_METHODS)}, got "
                             f"{method!r}.")
        _check_int("num_speculative_tokens", self.num_speculative_tokens, 1)
        _check_int("max_batch_for_spec", self.max_batch_for_spec, 0)
        _check_int("backoff_retry_steps", self.backoff_retry_steps, 1)
        if method == "draft_model":
            if self.model is None:
                raise ValueError(f"{FIELD}.model: method 'draft_model' needs the draft "
                                 f"model's directory or .gguf file.")
            for name in ("prompt_lookup_min", "prompt_lookup_max"):
                if getattr(self, name) is not None:
                    raise ValueError(f"{FIELD}.{name} is an n-gram setting; method is "
                                     f"'draft_model'.")
            return
        if self.model is not None:
            raise ValueError(f"{FIELD}.model names a draft model, but method is 'ngram'.")
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if lo is not None:
            _check_int("prompt_lookup_min", lo, 1)
        if hi is not None:
            _check_int("prompt_lookup_max", hi, 1)
        lo = lo if lo is not None else min(2, hi if hi is not None else 2)
        hi = hi if hi is not None else max(4, lo)
        if lo > hi:
            raise ValueError(f"{FIELD}.prompt_lookup_min ({lo}) must be <= "
                             f"prompt_lookup_max ({hi}).")
        object.__setattr__(self, "prompt_lookup_min", lo)
        object.__setattr__(self, "prompt_lookup_max", hi)

    @classmethod
    def from_user(cls, value: Any) -> SpeculativeConfig | None:
        """From what the user gave: None, a SpeculativeConfig, a dict, or its JSON text (the
        command line's). Unknown keys are refused by name."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"{FIELD} must be a JSON object: {e}.") from None
        if not isinstance(value, dict):
            raise ValueError(f"{FIELD} must be a dict (or its JSON text), got "
                             f"{type(value).__name__}.")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"{FIELD}: unknown key(s) {unknown}; known: {sorted(known)}.")
        if "num_speculative_tokens" not in value:
            raise ValueError(f"{FIELD}.num_speculative_tokens is required.")
        return cls(**value)
