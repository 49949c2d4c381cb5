"""Per-request sampling settings, validated when they are built."""
from __future__ import annotations

import copy
import enum
import json
from dataclasses import dataclass, field

_SAMPLING_EPS = 1e-5


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
            if isinstance(self.json, str):
                try:
                    parsed = json.loads(self.json)
                except ValueError as e:
                    raise ValueError(f"{name} is not valid JSON: {e}.") from None
            else:
                parsed = self.json
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
    # bad_words as token id sequences; set by the engine (it needs the tokenizer).
    bad_words_token_ids: list[list[int]] | None = field(default=None, init=False, repr=False)

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

    def _verify(self) -> None:
        def check(ok: bool, name: str, msg: str) -> None:
            if not ok:
                raise ValueError(f"{name} {msg}, got {getattr(self, name)!r}.")

        def is_int(v) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        def is_num(v) -> bool:
            return isinstance(v, (int, float)) and not isinstance(v, bool)

        check(is_int(self.n) and self.n >= 1, "n", "must be an integer >= 1")
        check(is_num(self.temperature) and self.temperature >= 0, "temperature",
              "must be a number >= 0")
        check(is_num(self.top_p) and 0 < self.top_p <= 1, "top_p", "must be in (0, 1]")
        check(is_int(self.top_k) and self.top_k >= 0, "top_k",
              "must be an integer: -1 or 0 (disabled), or >= 1")
        check(is_num(self.min_p) and 0 <= self.min_p <= 1, "min_p", "must be in [0, 1]")
        check(self.seed is None or is_int(self.seed), "seed", "must be an integer or None")
        check(is_num(self.presence_penalty) and -2 <= self.presence_penalty <= 2,
              "presence_penalty", "must be in [-2, 2]")
        check(is_num(self.frequency_penalty) and -2 <= self.frequency_penalty <= 2,
              "frequency_penalty", "must be in [-2, 2]")
        check(is_num(self.repetition_penalty) and self.repetition_penalty > 0,
              "repetition_penalty", "must be a number > 0")
        check(self.max_tokens is None or (is_int(self.max_tokens) and self.max_tokens >= 1),
              "max_tokens", "must be an integer >= 1 or None")
        check(is_int(self.min_tokens) and self.min_tokens >= 0, "min_tokens",
              "must be an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be <= max_tokens "
                             f"({self.max_tokens}).")
        check(isinstance(self.stop, list) and all(isinstance(s, str) and s for s in self.stop),
              "stop", "must be a string or a list of non-empty strings")
        check(isinstance(self.stop_token_ids, list)
              and all(is_int(t) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
              "must be a list of non-negative integers")
        check(self.logprobs is None or (is_int(self.logprobs) and self.logprobs >= 0),
              "logprobs", "must be an integer >= 0 or None")
        check(self.prompt_logprobs is None
              or (is_int(self.prompt_logprobs) and self.prompt_logprobs >= 0),
              "prompt_logprobs", "must be an integer >= 0 or None")
        for name in ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens",
                     "use_beam_search"):
            check(isinstance(getattr(self, name), bool), name, "must be a bool")
        check(is_int(self.best_of) and self.best_of >= self.n, "best_of",
              f"must be an integer >= n ({self.n!r})")
        self._verify_token_constraints(check, is_int, is_num)
        if self.use_beam_search:
            self._verify_beam_search(check, is_num)

    def _verify_token_constraints(self, check, is_int, is_num) -> None:
        check(self.structured_outputs is None
              or isinstance(self.structured_outputs, StructuredOutputsParams),
              "structured_outputs", "must be a StructuredOutputsParams or None")
        check(self.logit_bias is None or (
            isinstance(self.logit_bias, dict)
            and all(is_int(k) and k >= 0 for k in self.logit_bias)
            and all(is_num(v) and -100 <= v <= 100 for v in self.logit_bias.values())),
            "logit_bias", "must map token ids (integers >= 0) to biases in [-100, 100]")
        check(self.allowed_token_ids is None or (
            isinstance(self.allowed_token_ids, list) and self.allowed_token_ids
            and all(is_int(t) and t >= 0 for t in self.allowed_token_ids)),
            "allowed_token_ids", "must be a non-empty list of token ids (integers >= 0)")
        check(self.bad_words is None or (
            isinstance(self.bad_words, list)
            and all(isinstance(w, str) and w.strip() for w in self.bad_words)),
            "bad_words", "must be a list of non-empty strings")

    def _verify_beam_search(self, check, is_num) -> None:
        check(self.greedy, "temperature", "must be 0 with use_beam_search")
        check(self.top_p == 1.0, "top_p", "must be 1 with use_beam_search")
        check(self.top_k == 0, "top_k", "must be -1 or 0 with use_beam_search")
        check(self.min_p == 0.0, "min_p", "must be 0 with use_beam_search")
        check(not self.stop, "stop", "is not supported with use_beam_search")
        for name in ("presence_penalty", "frequency_penalty"):
            check(getattr(self, name) == 0, name, "must be 0 with use_beam_search")
        check(self.repetition_penalty == 1, "repetition_penalty",
              "must be 1 with use_beam_search")
        check(is_num(self.length_penalty), "length_penalty", "must be a number")
        check(self.early_stopping in (True, False, "never"), "early_stopping",
              "must be True, False or 'never'")
        check(self.structured_outputs is None, "structured_outputs",
              "is not supported with use_beam_search")
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
