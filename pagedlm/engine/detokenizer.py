"""Incremental detokenization: turn each new token into the text it adds.

Decoding one token alone is wrong for byte-level and sentencepiece vocabularies (a character can
span tokens; a leading space depends on the previous token), so each step decodes a short window
of recent tokens and emits only what lies past the already-emitted part. A window ending in an
incomplete UTF-8 sequence emits nothing until the next token completes it.
"""
from __future__ import annotations

from transformers import PreTrainedTokenizerBase

from pagedlm.sequence import DetokenizerState

# Prompt tokens kept as left context, enough for leading-space and merge decisions.
_PROMPT_CONTEXT = 5


class IncrementalDetokenizer:

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        self.special_ids = frozenset(tokenizer.all_special_ids)

    def init_state(self, prompt_ids: list[int], skip_special: bool) -> DetokenizerState:
        tokens = self.tokenizer.convert_ids_to_tokens(prompt_ids[-_PROMPT_CONTEXT - 1:],
                                                      skip_special_tokens=skip_special)
        return DetokenizerState(tokens, max(len(tokens) - _PROMPT_CONTEXT, 0), len(tokens))

    def step(self, state: DetokenizerState, token_id: int, skip_special: bool) -> str:
        if skip_special and token_id in self.special_ids:
            return ""
        state.tokens.append(self.tokenizer.convert_ids_to_tokens(token_id))
        to_string = self.tokenizer.convert_tokens_to_string
        prefix = to_string(state.tokens[state.prefix_offset:state.read_offset])
        text = to_string(state.tokens[state.prefix_offset:])
        if len(text) <= len(prefix) or text.endswith("\ufffd"):
            return ""
        # Drop tokens that can no longer affect the output, keeping the list short.
        del state.tokens[:state.prefix_offset]
        state.read_offset -= state.prefix_offset
        state.prefix_offset = state.read_offset
        state.read_offset = len(state.tokens)
        return text[len(prefix):]
