"""Per-request sampling settings, validated when they are built."""
from __future__ import annotations

import copy
import enum
from dataclasses import dataclass, field

_SAMPLING_EPS = 1e-5


class RequestOutputKind(enum.Enum):
    CUMULATIVE = 0  # every output carries everything so far
    DELTA = 1  # only what is new since the last output
    FINAL_ONLY = 2  # nothing until the request finishes


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

    # Derived in __post_init__; not user settings.
    stop_strings: tuple[str, ...] = field(init=False, repr=False)
    max_stop_len: int = field(init=False, repr=False)
    all_stop_token_ids: frozenset[int] = field(init=False, repr=False)

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
        if self.use_beam_search:
            self._verify_beam_search(check, is_num)

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
