"""Per-request sampling settings, validated when they are built."""
from __future__ import annotations

import copy
import enum
import json
import math
from dataclasses import dataclass, field

from pagedlm.structured_output.limits import check_spec_size, parse_json_schema

_SAMPLING_EPS = 1e-5

# The ranges a request's values may take, so that none can fail inside an engine step (where
# an error would end every request): each fits the type it reaches. The engine checks its own,
# tighter limits where it knows them (max_num_seqs, max_logprobs, the vocabulary,
# max_model_len) before queueing.
# seed: torch.Generator.manual_seed takes a signed 64-bit integer (vLLM's bounds); priority
# has the same range.
INT64_MIN, INT64_MAX = -2**63, 2**63 - 1
# Counts in tokens and token ids (max_tokens, min_tokens, top_k, logprobs, stop_token_ids...):
# every vocabulary and context fits in int32, and torch indexes with int64.
MAX_TOKEN_COUNT = 2**31 - 1
# n and best_of: OpenAI caps n at 128, and vLLM's clients ask for a few. A fixed bound keeps an
# absurd count from reaching anything; the engine then checks best_of against its max_num_seqs,
# the real limit (a request's sequences must fit in one running batch).
MAX_N = 1024
# Beam scores divide by generated_length ** length_penalty: with |length_penalty| <= 32 that
# stays a finite, non-zero float for any length below 2**31 (2**(31*32) < 1.8e308).
MAX_LENGTH_PENALTY = 32.0
# logit_bias values, as OpenAI bounds them.
MAX_LOGIT_BIAS = 100.0


def short_repr(value, limit: int = 200) -> str:
    """repr for error messages, cut short: a request may carry a list of a million ids, or an
    integer too long for Python to print at all."""
    try:
        text = repr(value)
    except ValueError:  # int -> str beyond sys.get_int_max_str_digits()
        return f"<{type(value).__name__} too large to print>"
    return text if len(text) <= limit else text[:limit] + "..."


class RequestOutputKind(enum.Enum):
    CUMULATIVE = 0  # every output carries everything so far
    DELTA = 1  # only what is new since the last output
    FINAL_ONLY = 2  # nothing until the request finishes


@dataclass
class StructuredOutputsParams:
    """Constrain the output to a JSON schema, a regex, one of several strings, an EBNF (GBNF)
    grammar or any JSON object: vLLM v1's names. Exactly one of the kinds is set."""

    json: str | dict | None = None  # a JSON schema (dict or its JSON text)
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # EBNF as xgrammar reads it (GBNF-like; root rule `root`)
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    whitespace_pattern: str | None = None
    # Where the spec came from, named in its errors instead of structured_outputs.<kind> (the
    # server's request field, e.g. response_format.json_schema.schema).
    source_field: str | None = field(default=None, repr=False, compare=False)

    _KINDS = ("json", "regex", "choice", "grammar", "json_object")

    def __post_init__(self) -> None:
        set_kinds = [k for k in self._KINDS if getattr(self, k) not in (None, False)]
        if len(set_kinds) != 1:
            raise ValueError(f"{self.source_field or 'structured_outputs'} must set exactly one "
                             f"of json, regex, choice, grammar or json_object, got "
                             f"{set_kinds or 'none'}.")
        name = self.source_field or "structured_outputs." + set_kinds[0]
        if self.json is not None:
            parsed = parse_json_schema(name, self.json)  # within its size and depth bounds
            if not isinstance(parsed, (dict, bool)):
                raise ValueError(f"{name} must be a JSON schema (an object), got "
                                 f"{type(parsed).__name__}.")
        if self.regex is not None and (not isinstance(self.regex, str) or not self.regex):
            raise ValueError(f"{name} must be a non-empty string, got {self.regex!r}.")
        if self.grammar is not None and (not isinstance(self.grammar, str)
                                         or not self.grammar.strip()):
            raise ValueError(f"{name} must be a non-empty string, got {self.grammar!r}.")
        if self.choice is not None and (
                not isinstance(self.choice, (list, tuple)) or not self.choice
                or not all(isinstance(c, str) and c for c in self.choice)):
            raise ValueError(f"{name} must be a non-empty list of non-empty strings, got "
                             f"{self.choice!r}.")
        if self.json_object is not None and self.json_object is not True:
            raise ValueError(f"{name} must be True or None, got {self.json_object!r}.")
        if not isinstance(self.disable_any_whitespace, bool):
            raise ValueError("structured_outputs.disable_any_whitespace must be a bool, got "
                             f"{self.disable_any_whitespace!r}.")
        if self.whitespace_pattern is not None and not isinstance(self.whitespace_pattern, str):
            raise ValueError("structured_outputs.whitespace_pattern must be a string, got "
                             f"{self.whitespace_pattern!r}.")
        check_spec_size(self, name)

    @property
    def kind(self) -> str:
        return next(k for k in self._KINDS if getattr(self, k) not in (None, False))

    @property
    def field_name(self) -> str:
        """The field a user set, for error messages: e.g. structured_outputs.json."""
        return self.source_field or "structured_outputs." + self.kind

    def cache_key(self) -> tuple:
        """What identifies the compiled grammar: equal keys share one compilation."""
        kind = self.kind
        spec = getattr(self, kind)
        if kind == "json" and not isinstance(spec, str):
            spec = json.dumps(spec, sort_keys=True)
        elif kind == "choice":
            spec = tuple(spec)
        return kind, spec, self.disable_any_whitespace, self.whitespace_pattern


@dataclass
class SamplingParams:
    """What a request wants generated and how: the vLLM field names and defaults."""

    n: int = 1
    best_of: int | None = None  # sequences generated; the n best are returned (default n)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # Beam search with best_of beams (vLLM's classic parameters); scores follow transformers:
    # cumulative logprob / generated_length ** length_penalty.
    use_beam_search: bool = False
    length_penalty: float = 1.0
    early_stopping: bool | str = False  # True, False or "never", as in transformers
    structured_outputs: StructuredOutputsParams | None = None
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit, in [-100, 100]
    allowed_token_ids: list[int] | None = None  # only these can be sampled
    bad_words: list[str] | None = None  # never generated (as token sequences)

    # Derived in __post_init__; not user settings.
    stop_strings: tuple[str, ...] = field(init=False, repr=False)
    max_stop_len: int = field(init=False, repr=False)
    all_stop_token_ids: frozenset[int] = field(init=False, repr=False)
    # bad_words as token id sequences; set by the engine (it needs the tokenizer), or before the
    # request reaches it (engine/request_prep.py).
    bad_words_token_ids: list[list[int]] | None = field(default=None, init=False, repr=False)
    # logit_bias, allowed_token_ids and bad_words as the sampler applies them (tensors, built
    # once when the request is added: model_executor/layers/token_constraints.py, a
    # TokenConstraints; typed `object` because this module is a leaf that imports no layer).
    token_constraints: object | None = field(default=None, init=False, repr=False,
                                             compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        # Anything but None / a list / a tuple is left as is for _verify to reject by name.
        if self.stop is None or isinstance(self.stop, (list, tuple)):
            self.stop = list(self.stop or [])
        if self.stop_token_ids is None or isinstance(self.stop_token_ids, (list, tuple)):
            self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        if self.best_of is None:
            self.best_of = self.n
        if isinstance(self.logit_bias, dict):
            # OpenAI clients send the ids as JSON object keys, i.e. strings.
            try:
                self.logit_bias = {int(k): v for k, v in self.logit_bias.items()}
            except (TypeError, ValueError):
                pass  # left for _verify to reject by name
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        self._verify()
        self.stop_strings = tuple(self.stop)
        self.max_stop_len = max(map(len, self.stop_strings), default=0)
        self.all_stop_token_ids = frozenset(self.stop_token_ids)

    def verify(self) -> None:
        """Normalise and check every field again, and recompute what derives from them: the
        fields are plain attributes, which a caller may have changed since construction."""
        self.__post_init__()

    def _verify(self) -> None:
        def check(ok: bool, name: str, msg: str) -> None:
            if not ok:
                raise ValueError(f"{name} {msg}, got {short_repr(getattr(self, name))}.")

        def is_int(v) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        def is_num(v) -> bool:
            """A finite number: NaN and infinities make no sense in any setting."""
            return (isinstance(v, (int, float)) and not isinstance(v, bool)
                    and math.isfinite(v))

        def is_count(v, lo: int, hi: int = MAX_TOKEN_COUNT) -> bool:
            return is_int(v) and lo <= v <= hi

        check(is_count(self.n, 1, MAX_N), "n", f"must be an integer in [1, {MAX_N}]")
        check(is_num(self.temperature) and self.temperature >= 0, "temperature",
              "must be a finite number >= 0")
        check(is_num(self.top_p) and 0 < self.top_p <= 1, "top_p", "must be in (0, 1]")
        check(is_count(self.top_k, 0), "top_k",
              f"must be an integer: -1 or 0 (disabled), or in [1, {MAX_TOKEN_COUNT}]")
        check(is_num(self.min_p) and 0 <= self.min_p <= 1, "min_p", "must be in [0, 1]")
        check(self.seed is None or is_count(self.seed, INT64_MIN, INT64_MAX), "seed",
              "must be None or an integer in [-2**63, 2**63 - 1]")
        check(is_num(self.presence_penalty) and -2 <= self.presence_penalty <= 2,
              "presence_penalty", "must be in [-2, 2]")
        check(is_num(self.frequency_penalty) and -2 <= self.frequency_penalty <= 2,
              "frequency_penalty", "must be in [-2, 2]")
        check(is_num(self.repetition_penalty) and self.repetition_penalty > 0,
              "repetition_penalty", "must be a finite number > 0")
        check(self.max_tokens is None or is_count(self.max_tokens, 1), "max_tokens",
              f"must be None or an integer in [1, {MAX_TOKEN_COUNT}]")
        check(is_count(self.min_tokens, 0), "min_tokens",
              f"must be an integer in [0, {MAX_TOKEN_COUNT}]")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be <= max_tokens "
                             f"({self.max_tokens}).")
        check(isinstance(self.stop, list) and all(isinstance(s, str) and s for s in self.stop),
              "stop", "must be a string or a list of non-empty strings")
        check(isinstance(self.stop_token_ids, list)
              and all(is_count(t, 0) for t in self.stop_token_ids), "stop_token_ids",
              f"must be a list of token ids (integers in [0, {MAX_TOKEN_COUNT}])")
        for name in ("logprobs", "prompt_logprobs"):
            check(getattr(self, name) is None or is_count(getattr(self, name), 0), name,
                  f"must be None or an integer in [0, {MAX_TOKEN_COUNT}]")
        for name in ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens",
                     "use_beam_search"):
            check(isinstance(getattr(self, name), bool), name, "must be a bool")
        check(is_count(self.best_of, self.n, MAX_N), "best_of",
              f"must be an integer in [n ({self.n!r}), {MAX_N}]")
        # Checked with or without beam search: a request carries no number that fails later.
        check(is_num(self.length_penalty) and abs(self.length_penalty) <= MAX_LENGTH_PENALTY,
              "length_penalty", f"must be a finite number in [-{MAX_LENGTH_PENALTY:g}, "
              f"{MAX_LENGTH_PENALTY:g}]")
        self._verify_token_constraints(check, is_count, is_num)
        if self.use_beam_search:
            self._verify_beam_search(check)

    def _verify_token_constraints(self, check, is_count, is_num) -> None:
        check(self.structured_outputs is None
              or isinstance(self.structured_outputs, StructuredOutputsParams),
              "structured_outputs", "must be a StructuredOutputsParams or None")
        check(self.logit_bias is None or (
            isinstance(self.logit_bias, dict)
            and all(is_count(k, 0) for k in self.logit_bias)
            and all(is_num(v) and abs(v) <= MAX_LOGIT_BIAS for v in self.logit_bias.values())),
            "logit_bias", f"must map token ids (integers in [0, {MAX_TOKEN_COUNT}]) to finite "
            f"biases in [-100, 100]")
        check(self.allowed_token_ids is None or (
            isinstance(self.allowed_token_ids, list) and self.allowed_token_ids
            and all(is_count(t, 0) for t in self.allowed_token_ids)),
            "allowed_token_ids", f"must be a non-empty list of token ids (integers in "
            f"[0, {MAX_TOKEN_COUNT}])")
        check(self.bad_words is None or (
            isinstance(self.bad_words, list)
            and all(isinstance(w, str) and w.strip() for w in self.bad_words)),
            "bad_words", "must be a list of strings that are neither empty nor whitespace "
            "only (each word is matched from its first non-space character)")

    def _verify_beam_search(self, check) -> None:
        check(self.greedy, "temperature", "must be 0 with use_beam_search")
        check(self.top_p == 1.0, "top_p", "must be 1 with use_beam_search")
        check(self.top_k == 0, "top_k", "must be -1 or 0 with use_beam_search")
        check(self.min_p == 0.0, "min_p", "must be 0 with use_beam_search")
        check(not self.stop, "stop", "is not supported with use_beam_search")
        for name in ("presence_penalty", "frequency_penalty"):
            check(getattr(self, name) == 0, name, "must be 0 with use_beam_search")
        check(self.repetition_penalty == 1, "repetition_penalty",
              "must be 1 with use_beam_search")
        check(self.early_stopping in (True, False, "never"), "early_stopping",
              "must be True, False or 'never'")
        if self.structured_outputs is not None:  # named as the request set it
            raise ValueError(f"{self.structured_outputs.field_name} is not supported with "
                             f"use_beam_search: a beam search ranks the raw distribution.")
        # A search ranks each step's top candidates of the raw distribution: these would be
        # ignored (a 200 whose beams break them), not applied.
        for name in ("logit_bias", "allowed_token_ids", "bad_words"):
            check(not getattr(self, name), name, "is not supported with use_beam_search")

    @property
    def greedy(self) -> bool:
        return self.temperature < _SAMPLING_EPS

    @property
    def ranked_at_end(self) -> bool:
        """best_of > n picks its outputs once every candidate is done: nothing to stream."""
        return self.best_of > self.n

    def stop_token_ids_with(self, eos_token_ids: frozenset[int]) -> frozenset[int]:
        """Every token id that stops this request: its stop_token_ids, and EOS unless ignored."""
        if self.ignore_eos:
            return self.all_stop_token_ids
        return self.all_stop_token_ids | eos_token_ids

    @property
    def has_penalties(self) -> bool:
        return (self.presence_penalty != 0 or self.frequency_penalty != 0
                or self.repetition_penalty != 1)

    @property
    def has_token_constraints(self) -> bool:
        """Some logits processing besides penalties: a bias, an allow list or bad words."""
        return bool(self.logit_bias or self.allowed_token_ids or self.bad_words)

    @property
    def allows_multi_step(self) -> bool:
        """Whether its next tokens can be sampled on the device without the host in between
        (multi-step decoding): nothing that reads the output so far (penalties, min_tokens,
        bad_words), nothing returned per token besides the id (logprobs, best_of's ranking),
        no per-token logits processing besides temperature and truncation."""
        return (self.logprobs is None and not self.has_penalties and not self.min_tokens
                and not self.has_token_constraints and not self.ranked_at_end
                and self.structured_outputs is None)

    def clone(self) -> "SamplingParams":
        return copy.deepcopy(self)


@dataclass
class BeamSearchParams:
    """LLM.beam_search settings, as vLLM names them."""
    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def to_sampling_params(self) -> SamplingParams:
        return SamplingParams(n=self.beam_width, best_of=self.beam_width, use_beam_search=True,
                              temperature=self.temperature, max_tokens=self.max_tokens,
                              ignore_eos=self.ignore_eos, length_penalty=self.length_penalty,
                              include_stop_str_in_output=self.include_stop_str_in_output)
