"""Incremental detokenization: turn each new token into the text it adds.

Decoding one token alone is wrong for byte-level and sentencepiece vocabularies (a character can
span tokens; a leading space depends on the previous token), so each step decodes a short window
of recent tokens and emits only what lies past the already-emitted part. A window ending in an
incomplete UTF-8 sequence emits nothing until the next token completes it.

With a fast (`tokenizers`) tokenizer the window holds token ids and is decoded in one call into
the Rust tokenizer; the prefix's length is kept from the step that set it, so a token costs one
decode, plus one for the new prefix when it emits text (was: an id-to-token call and two
convert_tokens_to_string calls over token strings per token, about 4x the time). Special tokens
are filtered here, by the transformers tokenizer's all_special_ids, and never by the Rust
tokenizer's own `special` flags, which differ (SmolLM2's tokenizer.json flags none of them): the
text is exactly what convert_tokens_to_string made of the same window. Other tokenizers keep
token strings and convert_tokens_to_string.
"""
from __future__ import annotations

from tokenizers import Tokenizer
from transformers import PreTrainedTokenizerBase

from pagedlm.sequence import DetokenizerState

# Prompt tokens kept as left context, enough for leading-space and merge decisions.
_PROMPT_CONTEXT = 5


class IncrementalDetokenizer:

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        self.special_ids = frozenset(tokenizer.all_special_ids)
        backend = getattr(tokenizer, "_tokenizer", None)
        # Fast: the window is ids, decoded by the Rust tokenizer (its skip_special_tokens is off:
        # skipped ids never enter the window). Otherwise it is token strings.
        self._fast = isinstance(backend, Tokenizer)
        if self._fast:
            self._decode = lambda ids, _decode=backend.decode: _decode(ids, False)
        else:
            self._decode = tokenizer.convert_tokens_to_string

    def init_state(self, prompt_ids: list[int], skip_special: bool) -> DetokenizerState:
        tail = prompt_ids[-_PROMPT_CONTEXT - 1:]
        if skip_special:
            tail = [t for t in tail if t not in self.special_ids]
        tokens = tail if self._fast else self.tokenizer.convert_ids_to_tokens(tail)
        state = DetokenizerState(tokens, max(len(tokens) - _PROMPT_CONTEXT, 0), len(tokens))
        state.prefix_len = len(self._decode(tokens[state.prefix_offset:]))
        return state

    def step(self, state: DetokenizerState, token_id: int, skip_special: bool) -> str:
        if skip_special and token_id in self.special_ids:
            return ""
        tokens = state.tokens
        tokens.append(token_id if self._fast else self.tokenizer.convert_ids_to_tokens(token_id))
        text = self._decode(tokens[state.prefix_offset:])
        prefix_len = state.prefix_len
        if len(text) <= prefix_len or text.endswith("\ufffd"):
            return ""
        # Drop tokens that can no longer affect the output, keeping the list short.
        del tokens[:state.prefix_offset]
        state.read_offset -= state.prefix_offset
        state.prefix_offset = state.read_offset
        state.read_offset = len(tokens)
        state.prefix_len = len(self._decode(tokens[state.prefix_offset:]))
        return text[prefix_len:]
