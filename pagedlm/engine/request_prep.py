"""A request's lists and grammar, checked and prepared before the request reaches the engine.

The engine thread runs every step: anything it does for one request delays all of them. So a
request's lists are capped (RequestLimits: each is walked every step, by the sampler or the
stop check), and what takes time is done on the caller's side, off both the engine thread and
the event loop: bad_words are tokenized on a low-priority thread (with thread_tokenizer's
tokenizer), and a grammar is checked and compiled (structured_output/manager.py) before the
request is queued. The engine thread then only checks the caps again (cheap) and builds the
sampler's tensors (token_constraints.py), in time linear in the lists.
"""
from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from pagedlm.config import EngineConfig
from pagedlm.request_limits import RequestLimits
from pagedlm.sampling_params import SamplingParams
from pagedlm.transformers_utils.tokenizer import thread_tokenizer
from pagedlm.utils import lower_thread_priority

if TYPE_CHECKING:
    from pagedlm.structured_output.manager import Compilation

# A bad word is a word or a short phrase: 256 characters leave room for any, and bound what
# max_bad_words of them cost to tokenize.
MAX_BAD_WORD_CHARS = 256


def check_request_lists(params: SamplingParams, limits: RequestLimits, vocab_size: int) -> None:
    """ValueError, naming the field and the limit, for a list past its cap or a token id past
    the vocabulary."""
    caps = (("bad_words", params.bad_words, limits.max_bad_words, "max_bad_words"),
            ("logit_bias", params.logit_bias, limits.max_logit_bias, "max_logit_bias"),
            ("stop", params.stop, limits.max_stop_strings, "max_stop_strings"),
            ("stop_token_ids", params.stop_token_ids, limits.max_stop_token_ids,
             "max_stop_token_ids"))
    for name, items, cap, setting in caps:
        if items and len(items) > cap:
            raise ValueError(f"{name} has {len(items)} entries, past the limit of {cap} "
                             f"({setting}).")
    if params.allowed_token_ids and len(params.allowed_token_ids) > vocab_size:
        raise ValueError(f"allowed_token_ids has {len(params.allowed_token_ids)} entries, more "
                         f"than the vocabulary's {vocab_size} tokens.")
    for i, word in enumerate(params.bad_words or ()):
        if len(word) > MAX_BAD_WORD_CHARS:
            raise ValueError(f"bad_words: entry {i} is {len(word)} characters long, past the "
                             f"limit of {MAX_BAD_WORD_CHARS}.")
    for name in ("logit_bias", "allowed_token_ids", "stop_token_ids"):
        ids = getattr(params, name)
        bad = [t for t in ids or () if t >= vocab_size]
        if bad:
            raise ValueError(f"{name} has token ids outside the vocabulary (size {vocab_size}): "
                             f"{bad[:5]}.")


def check_some_token_allowed(params: SamplingParams, eos_token_ids: frozenset[int]) -> None:
    """ValueError, naming the field, where the request's own settings leave its first step
    nothing to sample: an allow list that its single-token bad words, or, under min_tokens,
    its stop tokens, cover. The sampler would draw from an all-masked row: a token outside
    the list, returned as if allowed. Needs bad_words tokenized."""
    if not params.allowed_token_ids:
        return
    allowed = set(params.allowed_token_ids)
    allowed -= {w[0] for w in params.bad_words_token_ids or () if len(w) == 1}
    if not allowed:
        raise ValueError("allowed_token_ids: every allowed token is one of bad_words, so "
                         "nothing could be generated.")
    if params.min_tokens and not allowed - params.stop_token_ids_with(eos_token_ids):
        raise ValueError("min_tokens: every allowed token (allowed_token_ids, less bad_words) "
                         "would stop the request (stop_token_ids or EOS), and none may end it "
                         "before min_tokens, so nothing could be generated.")


def check_runs_in_engine(params: SamplingParams) -> None:
    """The engine runs one request as one sequence group: a beam search is a series of
    one-token requests driven above it (entrypoints/beam_search.py), and run here it would
    silently be plain greedy decoding."""
    if params.use_beam_search:
        raise ValueError("use_beam_search: beam search runs above the engine, as a series of "
                         "one-token requests: use LLM.beam_search or LLM.generate "
                         "(entrypoints/beam_search.py), or the server.")


def check_sampling_limits(params: SamplingParams, config: EngineConfig) -> None:
    """ValueError for a request past the engine's limits: more samples than max_num_seqs, more
    logprobs than max_logprobs or the vocabulary (the sampler's top-k over the vocabulary fails
    inside the step for a larger k), lists past their caps (check_request_lists). Reads only
    the config: any thread may call it (beam search does, for the request it splits up)."""
    max_num_seqs = config.scheduler_config.max_num_seqs
    name = "n" if params.best_of == params.n else "best_of"  # the field that asked for them
    if params.best_of > max_num_seqs:
        raise ValueError(f"{name} ({params.best_of}) is larger than max_num_seqs "
                         f"({max_num_seqs}).")
    mc, spec = config.model_config, config.speculative_config
    budget = config.scheduler_config.max_num_batched_tokens
    if (spec is not None and mc.deterministic and params.best_of > 1
            and params.best_of * (spec.num_speculative_tokens + 1) > budget):
        # Its sequences speculate in one step or decode plainly; whether they fit depended
        # on the budget, and so did a seeded request's tokens, which the mode rules out.
        raise ValueError(f"{name} ({params.best_of}) x (num_speculative_tokens "
                         f"{spec.num_speculative_tokens} + 1) must be <= "
                         f"max_num_batched_tokens ({budget}) under --deterministic with "
                         f"speculative decoding: a group's drafts are verified in one step.")
    limit, what = mc.max_logprobs, f"max_logprobs ({mc.max_logprobs})"
    if limit < 0 or limit > mc.vocab_size:
        limit, what = mc.vocab_size, f"the vocabulary size ({mc.vocab_size})"
    for name in ("logprobs", "prompt_logprobs"):
        value = getattr(params, name)
        if value is not None and value > limit:
            raise ValueError(f"{name} ({value}) must be <= {what}.")
    check_request_lists(params, config.request_limits, mc.vocab_size)


def clamp_max_tokens(params: SamplingParams, num_prompt_tokens: int, max_model_len: int) -> None:
    """max_tokens at most what the context leaves (None: all of it)."""
    room = max_model_len - num_prompt_tokens + 1  # the last sampled token needs no cache slot
    if params.max_tokens is None or params.max_tokens > room:
        params.max_tokens = room


def tokenize_bad_words(tokenizer, words: list[str]) -> list[list[int]]:
    """Each word's token ids as it would appear, alone and after a space (they differ), in
    order and without repeats: linear in the words."""
    seqs: dict[tuple[int, ...], None] = {}  # an ordered set
    for word in words:
        word = word.lstrip()
        for text in (word, " " + word):
            tokens = tokenizer.encode(text, add_special_tokens=False)
            if tokens:
                seqs.setdefault(tuple(tokens))
    return [list(t) for t in seqs]


class RequestPreparer:
    """The async engine's caller side: prepare() before a request is queued."""

    def __init__(self, engine) -> None:
        # An LLMEngine; not imported, not even for typing: llm_engine imports this module.
        self._engine = engine
        self._pool: ThreadPoolExecutor | None = None
        self._tokenizer = None  # thread_tokenizer's, on first use

    async def prepare(self, params) -> tuple[object, "Compilation | None"]:
        """(params, with bad_words tokenized; its grammar's compilation, done) or the
        engine's ValueError. PoolingParams pass through."""
        if not isinstance(params, SamplingParams):
            return params, None
        config = self._engine.config
        check_request_lists(params, config.request_limits, config.model_config.vocab_size)
        if params.bad_words and params.bad_words_token_ids is None:
            words = list(params.bad_words)
            tokens = await asyncio.wrap_future(self._executor().submit(self._tokenize, words))
            params = params.clone()
            params.bad_words_token_ids = tokens
        compilation = None
        if params.structured_outputs is not None:
            manager = self._engine.structured_output
            compilation = manager.prepare(params.structured_outputs)
            # Its futures cannot be cancelled: a caller giving up leaves it to the others, or,
            # where none is left before its check starts, it is dropped (manager._check).
            try:
                await asyncio.wrap_future(compilation.grammar)
            finally:
                manager.release(compilation)
        return params, compilation

    def _executor(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, "pagedlm-request-prep",
                                            initializer=lower_thread_priority)
        return self._pool

    def _tokenize(self, words: list[str]) -> list[list[int]]:
        if self._tokenizer is None:
            self._tokenizer = thread_tokenizer(self._engine.tokenizer)
        return tokenize_bad_words(self._tokenizer, words)

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
