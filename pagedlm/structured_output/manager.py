"""The engine's side of structured outputs: compile off the step loop, match, fill bitmasks."""
from __future__ import annotations

import concurrent.futures as cf
import logging
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from pagedlm.sampling_params import StructuredOutputsParams
from pagedlm.structured_output.backend import (CompiledGrammar, GrammarMatcher,
                                               StructuredOutputBackend)
from pagedlm.structured_output.bitmask import GrammarBitmask, bitmask_width

logger = logging.getLogger(__name__)

SUPPORTED_BACKENDS = ("xgrammar",)
# Distinct specs whose compiled grammars are kept; a JSON schema's takes well under 1 MB.
_CACHE_SIZE = 256


def _backend_class(name: str) -> type[StructuredOutputBackend]:
    if name == "xgrammar":
        from pagedlm.structured_output.xgrammar_backend import XGrammarBackend
        return XGrammarBackend
    raise ValueError(f"structured_outputs_backend must be one of {list(SUPPORTED_BACKENDS)}, "
                     f"got {name!r}.")


class StructuredOutputRequest:
    """A request's grammar (being compiled, or ready) and one matcher per sequence."""

    def __init__(self, params: StructuredOutputsParams, grammar: Future) -> None:
        self.params = params
        self._grammar = grammar
        self._matchers: dict[int, GrammarMatcher] = {}

    @property
    def ready(self) -> bool:
        """Compiled (or failed: the engine then aborts the request): it may be scheduled."""
        return self._grammar.done()

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

    def accept_token(self, seq, token_id: int) -> bool:
        """Advance seq's matcher by the token it just sampled (before it is appended). True:
        the sequence must end here (its grammar is complete, or, where something else masked
        what the grammar wanted, the token breaks it)."""
        m = self.matcher(seq)
        if not m.accept_token(token_id):
            logger.warning("structured output: sequence %d sampled token %d, which its grammar "
                           "does not allow (min_tokens or another mask conflicts with it); "
                           "ending it", seq.seq_id, token_id)
            return True
        return m.is_terminated()


class StructuredOutputManager:

    def __init__(self, backend: str, tokenizer, vocab_size: int,
                 eos_token_ids: frozenset[int]) -> None:
        self.backend_cls = _backend_class(backend)
        self._backend_args = (tokenizer, vocab_size, eos_token_ids)
        self._backend: StructuredOutputBackend | None = None
        self._backend_lock = threading.Lock()
        self.vocab_size = vocab_size
        # One thread: compilations queue behind each other, never behind the step loop (xgrammar
        # compiles with its own threads and releases the GIL while it does).
        self._pool: ThreadPoolExecutor | None = None
        self._grammars: OrderedDict[tuple, Future] = OrderedDict()
        self._pending: list[tuple[str, StructuredOutputRequest]] = []  # (request id, ...)

    @property
    def backend(self) -> StructuredOutputBackend:
        # Built on first use, on the compile thread: the tokenizer's vocabulary scan takes a
        # while and must not hold up the step loop.
        with self._backend_lock:
            if self._backend is None:
                self._backend = self.backend_cls(*self._backend_args)
            return self._backend

    def register(self, request_id: str, params: StructuredOutputsParams
                 ) -> StructuredOutputRequest:
        """Validate (ValueError naming the field) and start compiling, unless the same spec was
        compiled before."""
        key = params.cache_key()
        fut = self._grammars.get(key)
        if fut is None or (fut.done() and fut.exception() is not None):
            self.backend_cls.validate(params)
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="pagedlm-grammar")
            fut = self._pool.submit(self._compile, params)
            self._grammars[key] = fut
            while len(self._grammars) > _CACHE_SIZE:
                self._grammars.popitem(last=False)
        else:
            self._grammars.move_to_end(key)
        request = StructuredOutputRequest(params, fut)
        if not fut.done():
            self._pending.append((request_id, request))
        return request

    def _compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        return self.backend.compile(params)

    def take_failed(self) -> list[tuple[str, BaseException]]:
        """Requests whose compilation has failed since the last call (the engine aborts them)."""
        if not self._pending:
            return []
        failed = [(rid, r.error) for rid, r in self._pending if r.error is not None]
        self._pending = [(rid, r) for rid, r in self._pending if not r.ready]
        return failed

    def wait_for_pending(self, timeout: float) -> None:
        """Block until some compilation finishes (or timeout): for a step with nothing else to
        run, instead of spinning."""
        futures = [r._grammar for _, r in self._pending]
        if futures:
            cf.wait(futures, timeout=timeout, return_when=cf.FIRST_COMPLETED)

    @property
    def has_pending(self) -> bool:
        return any(not r.ready for _, r in self._pending)

    def grammar_bitmask(self, scheduled_groups) -> GrammarBitmask | None:
        """The step's bitmask: one row per sample of a sequence that has a grammar, in the order
        the runner lays out samples (scheduled groups, their sequences, num_samples each)."""
        rows, matchers, first_rows, forks = [], [], [], []
        row = 0
        for sg in scheduled_groups:
            so = sg.group.structured_output
            for seq, k in zip(sg.seqs, sg.num_samples):
                if k and so is not None:
                    rows.extend(range(row, row + k))
                    matchers.append(so.matcher(seq))
                    first_rows.append(row)
                    if k > 1:
                        forks.append((row, k))
                row += k
        if not matchers:
            return None
        bitmask = torch.full((row, bitmask_width(self.vocab_size)), -1, dtype=torch.int32)
        self.backend.fill_bitmask(matchers, bitmask, first_rows)
        for r, k in forks:  # a prompt forking into k samples: its row for each of them
            bitmask[r + 1:r + k] = bitmask[r]
        return GrammarBitmask(rows, bitmask, self.vocab_size)

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
