"""RequestLimits: the caps on a request's lists, one of EngineConfig's parts (config.py)."""
from __future__ import annotations

from dataclasses import dataclass

from pagedlm.config_checks import is_int


@dataclass(frozen=True)
class RequestLimits:
    """Caps on a request's lists. Each is walked when the request is added, and every step
    after by the sampler (bad words, biases) or the stop check (stop strings), so one request
    with a huge list would slow every other request down. Defaults: vLLM's limits where it has
    them (1024 logit_bias entries, 128 stop_token_ids), else generous for any real use."""
    max_bad_words: int = 1000
    max_logit_bias: int = 1024
    max_stop_strings: int = 256
    max_stop_token_ids: int = 128

    def __post_init__(self) -> None:
        for name in ("max_bad_words", "max_logit_bias", "max_stop_strings",
                     "max_stop_token_ids"):
            v = getattr(self, name)
            if not is_int(v) or v < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {v!r}.")
