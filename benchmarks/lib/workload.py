"""What the benchmarks send: request shapes, random prompts of ordinary tokens, arrival times.

Every script draws its prompts here, so a workload named by (seed, count, lengths) is the same
token ids in throughput.py, serving.py and compare.py.
"""
from __future__ import annotations

import argparse
import math
import random
from typing import NamedTuple


class Request(NamedTuple):
    """A tuple, so that `for prompt, max_tokens in requests` reads it."""
    prompt: list[int]  # token ids
    max_tokens: int  # output tokens asked for (sent with ignore_eos, so exactly this many)


def parse_len(text: str) -> tuple[int, int]:
    """argparse type: 'N' -> (N, N); 'LO:HI' -> (LO, HI), inclusive."""
    lo, _, hi = text.partition(":")
    try:
        lo_i, hi_i = int(lo), int(hi or lo)
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad length {text!r}: expected N or LO:HI") from None
    if not 1 <= lo_i <= hi_i:
        raise argparse.ArgumentTypeError(f"bad length {text!r}: need 1 <= LO <= HI")
    return lo_i, hi_i


def format_len(span: tuple[int, int]) -> str:
    lo, hi = span
    return str(lo) if lo == hi else f"{lo}:{hi}"


def ordinary_token_ids(tokenizer) -> list[int]:
    """Ids of a transformers tokenizer's non-special tokens, sorted. Special tokens (BOS, EOS,
    chat markers) would change what the model does, so prompts never hold them. Added tokens
    that are not special stay in: the vocabulary's size decides how many random draws each
    token takes, so a different list would change every later request's lengths too, and
    `--baseline-commit` legs, which run the old commit's own script, would no longer run the
    same requests."""
    return sorted(set(tokenizer.get_vocab().values()) - set(tokenizer.all_special_ids))


def make_requests(vocab: list[int], n: int, input_len: tuple[int, int],
                  output_len: tuple[int, int], rng: random.Random) -> list[Request]:
    """n requests with lengths drawn uniformly from the inclusive ranges, reproducible for a
    given rng state."""
    requests = []
    for _ in range(n):
        in_len = rng.randint(*input_len)
        out_len = rng.randint(*output_len)
        requests.append(Request([rng.choice(vocab) for _ in range(in_len)], out_len))
    return requests


def text_prompts(tokenizer, vocab: list[int], n: int, input_len: int,
                 rng: random.Random) -> list[str]:
    """n prompts as text that the tokenizer encodes back to input_len tokens (for servers that
    take text only): random ordinary ids, decoded, re-encoded, trimmed or padded, decoded."""
    prompts = []
    for _ in range(n):
        ids = [rng.choice(vocab) for _ in range(input_len)]
        # Decoding and re-encoding can change the count: trim or pad back to input_len.
        ids = tokenizer.encode(tokenizer.decode(ids), add_special_tokens=False)[:input_len]
        while len(ids) < input_len:
            ids.append(rng.choice(vocab))
        prompts.append(tokenizer.decode(ids))
    return prompts


_WORDS = ("time person year way day thing man world life hand part child eye woman place work "
          "week case point number group problem fact story river mountain city garden music "
          "window paper color light water stone market winter morning letter table").split()


def word_prompts(n: int, input_len: int, rng: random.Random) -> list[str]:
    """Prompts of random common words, about one token per word, when no tokenizer is at hand."""
    return [" ".join(rng.choice(_WORDS) for _ in range(input_len)) for _ in range(n)]


def arrival_times(rate: float, rng: random.Random, num: int | None = None,
                  duration: float | None = None, burstiness: float = 1.0) -> list[float]:
    """Seconds after the start at which each request is sent: gamma-distributed gaps of mean
    1/rate (burstiness 1: a Poisson process). `num` requests, or as many as start within
    `duration` seconds; an infinite rate sends all `num` at once."""
    if (num is None) == (duration is None):
        raise ValueError("give exactly one of num and duration")
    if math.isinf(rate):
        if num is None:
            raise ValueError("an infinite rate needs a request count, not a duration")
        return [0.0] * num
    if not rate > 0 or not burstiness > 0:
        raise ValueError(f"rate and burstiness must be > 0, got {rate} and {burstiness}")
    theta = 1.0 / (rate * burstiness)
    times, t = [], 0.0
    while True:
        if num is not None and len(times) == num:
            return times
        times.append(t)
        t += rng.gammavariate(burstiness, theta)
        if duration is not None and t >= duration:
            return times
