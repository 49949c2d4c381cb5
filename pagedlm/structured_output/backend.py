"""The interface a grammar library implements to serve structured outputs.

xgrammar implements it (xgrammar_backend.py); llguidance or outlines-core would too: the engine
only sees these three classes and the shared bitmask layout (bitmask.py).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Callable

import torch

from pagedlm.sampling_params import StructuredOutputsParams


class GrammarMatcher(ABC):
    """One sequence's position in its grammar."""

    @abstractmethod
    def accept_token(self, token_id: int) -> bool:
        """Advance by one token; False (state unchanged) if the grammar does not allow it."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """The grammar is complete and its stop token accepted: nothing more may follow."""

    @abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undo the last num_tokens accepted tokens."""


class CompiledGrammar(ABC):

    @abstractmethod
    def new_matcher(self) -> GrammarMatcher:
        """A matcher at the grammar's start."""


class StructuredOutputBackend(ABC):
    """Built once per engine with its tokenizer; compile() runs on a worker thread."""

    name: str

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: frozenset[int]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids

    @classmethod
    @abstractmethod
    def validate(cls, params: StructuredOutputsParams) -> None:
        """A quick check (no parsing, no tokenizer work) on the caller's thread: ValueError
        naming the field (structured_outputs.json, ...) for a spec this backend never takes."""

    @abstractmethod
    def compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        """The token-level grammar: the costly part, run off the step loop, on a spec that
        sandbox_compiler's function compiled within the time limit."""

    @abstractmethod
    def sandbox_state(self) -> bytes:
        """What a sandbox process (sandbox.py) needs to compile as this backend does: its
        tokenizer data, serialized."""

    @classmethod
    @abstractmethod
    def sandbox_compiler(cls, state: bytes) -> Callable[[StructuredOutputsParams], None]:
        """In the sandbox process: a function that compiles a spec with one thread, raising
        ValueError naming the field if the spec is invalid."""

    @abstractmethod
    def fill_bitmask(self, matchers: list[GrammarMatcher], bitmask: torch.Tensor,
                     rows: list[int]) -> None:
        """Row rows[i] of bitmask (int32, bitmask.py's layout) := the tokens matchers[i]
        allows."""
