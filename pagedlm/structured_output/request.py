"""A request's structured output: its grammar (being compiled, or ready) and its sequences'
matchers. Held by the request's SequenceGroup (sequence.py), so it imports nothing of the
manager that compiles grammars."""
from __future__ import annotations

import enum
import logging
from concurrent.futures import Future

from pagedlm.sampling_params import StructuredOutputsParams
from pagedlm.structured_output.backend import CompiledGrammar, GrammarMatcher

logger = logging.getLogger(__name__)


class GrammarStep(enum.Enum):
    """What a sampled token does to a sequence's grammar (StructuredOutputRequest.accept_token)."""
    CONTINUES = "continues"  # accepted; more may follow
    COMPLETES = "completes"  # accepted; the grammar allows nothing more
    BREAKS = "breaks"  # refused: the sequence ends before it, without it


class StructuredOutputRequest:
    """A request's grammar (being compiled, or ready) and one matcher per sequence."""

    def __init__(self, params: StructuredOutputsParams, grammar: Future) -> None:
        self.params = params
        self._grammar = grammar
        self._matchers: dict[int, GrammarMatcher] = {}

    @property
    def ready(self) -> bool:
        """Compiled: it may be scheduled. (One that failed never is: the engine aborts it.)"""
        return self._grammar.done() and self._grammar.exception() is None

    @property
    def error(self) -> BaseException | None:
        return self._grammar.exception() if self._grammar.done() else None

    def matcher(self, seq) -> GrammarMatcher:
        """seq's matcher. A sequence seen for the first time (the first, or one forked from it)
        starts at the grammar's start and replays its output so far."""
        m = self._matchers.get(seq.seq_id)
        if m is None:
            grammar: CompiledGrammar = self._grammar.result()
            m = self._matchers[seq.seq_id] = grammar.new_matcher()
            for t in seq.output_token_ids:
                if not m.accept_token(t):
                    raise RuntimeError(f"sequence {seq.seq_id}: its own output token {t} "
                                       f"does not match its grammar")
        return m

    def accept_token(self, seq, token_id: int) -> GrammarStep:
        """Advance seq's matcher by the token it just sampled (before it is appended). A token
        the grammar refuses was drawn from a row where nothing was left to draw: the grammar
        allows no token there (one that matches nothing, such as the regex [^\\s\\S]), or
        another mask (allowed_token_ids, bad_words, min_tokens) took away all it allowed. The
        sequence then ends without it: an output that breaks its grammar is never returned."""
        m = self.matcher(seq)
        if not m.accept_token(token_id):
            logger.info("structured output: sequence %d has no token its grammar and its other "
                        "masks all allow; ending it", seq.seq_id)
            return GrammarStep.BREAKS
        return GrammarStep.COMPLETES if m.is_terminated() else GrammarStep.CONTINUES
