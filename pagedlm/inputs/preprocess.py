"""The InputPreprocessor: turns what a user passes as a prompt into token ids."""
from __future__ import annotations

from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

# What generate() accepts for one prompt: text, {"prompt": text} or {"prompt_token_ids": ids};
# a dict may add "cache_salt" (as vLLM's): only prompts with the same salt share cached blocks.
PromptType = str | dict


@dataclass
class ProcessedPrompt:
    prompt: str | None
    prompt_token_ids: list[int]
    cache_salt: str | None = None


class InputPreprocessor:

    def __init__(self, tokenizer: PreTrainedTokenizerBase, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size

    def process(self, prompt: PromptType) -> ProcessedPrompt:
        processed = self._tokenize(prompt)
        if isinstance(prompt, dict) and prompt.get("cache_salt") is not None:
            salt = prompt["cache_salt"]
            if not isinstance(salt, str) or not salt:
                raise ValueError(f"cache_salt must be a non-empty string, got {salt!r}.")
            processed.cache_salt = salt
        return processed

    def _tokenize(self, prompt: PromptType) -> ProcessedPrompt:
        if isinstance(prompt, str):
            return ProcessedPrompt(prompt, self.tokenizer.encode(prompt))
        if not isinstance(prompt, dict):
            raise ValueError(f"prompt must be a string or a dict with 'prompt' or "
                             f"'prompt_token_ids', got {type(prompt).__name__}.")
        if "prompt_token_ids" in prompt:
            ids = prompt["prompt_token_ids"]
            if not isinstance(ids, (list, tuple)) or not all(
                    isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise ValueError("prompt_token_ids must be a list of integers.")
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(f"prompt_token_ids contains ids outside the vocabulary "
                                 f"[0, {self.vocab_size}): {bad[:5]}.")
            return ProcessedPrompt(prompt.get("prompt"), list(ids))
        if "prompt" in prompt:
            if not isinstance(prompt["prompt"], str):
                raise ValueError("prompt['prompt'] must be a string.")
            return ProcessedPrompt(prompt["prompt"], self.tokenizer.encode(prompt["prompt"]))
        raise ValueError(f"prompt dict needs a 'prompt' or 'prompt_token_ids' key, got "
                         f"{sorted(prompt)}.")
