"""deterministic=True (issue 31), property-style: over several seeds, probe requests run in a
random mix of other requests, under a random engine configuration (batch size, step token
budget and so chunk size, prefix caching with a cold, warm or partly evicted cache, forced
preemption by recompute or by swap, 1 or 2 threads, block size, float32 or bfloat16 KV cache),
give bitwise the token ids and logprobs each probe gives run alone, greedy and seeded, with
float32 and with bfloat16 weights.

The promise holds for a fixed block size and KV cache dtype: a probe's reference is computed
once per (probe, weights' dtype, block_size, kv_cache_dtype), alone, with prefix caching off."""
from __future__ import annotations

import dataclasses
import math
import random

import pytest
import torch

from pagedlm import LLM, SamplingParams
from tests.conftest import needs_kernels

WORDS = ("the river town market bread green stone window quiet seven blue morning letter "
         "garden train paper silver winter road music table orange cloud bridge north "
         "candle forest simple yellow horse mirror school island coffee doctor engine "
         "village summer pocket ladder hammer circle planet button rocket castle shadow "
         "travel number kitchen basket farmer butter pencil "
         "ocean copper violin thunder").split()
SEEDS = [4, 19, 21, 28]
REFERENCE_KV_BYTES = 32 * 2**20


@dataclasses.dataclass(frozen=True)
class Request:
    words: tuple[str, ...]
    num_tokens: int  # the prompt is the words' first num_tokens tokens
    max_tokens: int
    temperature: float
    seed: int | None
    logprobs: int | None

    def params(self) -> SamplingParams:
        return SamplingParams(temperature=self.temperature, seed=self.seed,
                              max_tokens=self.max_tokens, logprobs=self.logprobs,
                              ignore_eos=True)


@dataclasses.dataclass(frozen=True)
class Scenario:
    seed: int
    probes: tuple[Request, ...]
    background: tuple[Request, ...]
    block_size: int
    kv_cache_dtype: str
    max_num_seqs: int
    max_num_batched_tokens: int
    prefix_caching: bool
    cache_state: str  # cold, warm (the probes ran once before), evicted (then others evicted)
    preemption: str | None  # None, recompute or swap (forced by a pool too small for the mix)
    threads: int
    num_gpu_blocks: int | None  # None: a roomy pool

    def engine_kwargs(self, dtype: str) -> dict:
        kw = dict(deterministic=True, dtype=dtype, block_size=self.block_size,
                  kv_cache_dtype=self.kv_cache_dtype, max_num_seqs=self.max_num_seqs,
                  max_num_batched_tokens=self.max_num_batched_tokens,
                  enable_prefix_caching=self.prefix_caching,
                  preemption_mode=self.preemption or "recompute")
        if self.num_gpu_blocks is None:
            kw["kv_cache_memory_bytes"] = REFERENCE_KV_BYTES
        else:
            kw["num_gpu_blocks_override"] = self.num_gpu_blocks
        if self.preemption == "swap":
            kw["swap_space"] = 0.05  # hundreds of host blocks: every preemption can swap
        return kw


def _words(rng: random.Random, n: int) -> tuple[str, ...]:
    return tuple(rng.choice(WORDS) for _ in range(n))


def _blocks(r: Request, block_size: int) -> int:
    return math.ceil((r.num_tokens + r.max_tokens) / block_size)


def draw(seed: int) -> Scenario:
    rng = random.Random(seed)
    probes = []
    for _ in range(3):
        n = rng.randint(5, 80)
        seeded = rng.random() < 0.5
        probes.append(Request(_words(rng, n), n, rng.randint(8, 16),
                              1.0 if seeded else 0.0, rng.randrange(2**31) if seeded else None,
                              5))
    background = []
    for _ in range(rng.randint(3, 7)):
        n = rng.randint(5, 80)
        words = _words(rng, n)
        if rng.random() < 0.4:  # shares a probe's first words: a prefix-cache neighbour
            p = rng.choice(probes)
            words = p.words[:rng.randint(1, len(p.words))] + words
        # Unseeded draws too: what others sample must not matter.
        temperature = rng.choice([0.0, 1.0])
        background.append(Request(words, n, rng.randint(4, 16), temperature,
                                  rng.choice([None, rng.randrange(2**31)]),
                                  rng.choice([None, 2])))
    block_size = rng.choice([8, 16])
    max_num_seqs = rng.choice([2, 4, 8, 32])
    max_num_batched_tokens = rng.choice([b for b in (8, 13, 24, 50, 2048) if b >= max_num_seqs])
    prefix_caching = rng.random() < 0.6
    cache_state = rng.choice(["cold", "warm", "evicted"]) if prefix_caching else "cold"
    preemption = rng.choice([None, "recompute", "swap"])
    largest = max(_blocks(r, block_size) for r in probes + background)
    num_gpu_blocks = None
    if preemption:
        max_num_seqs = max(max_num_seqs, 4)  # enough running sequences to run out of blocks
        max_num_batched_tokens = max(max_num_batched_tokens, max_num_seqs)
        num_gpu_blocks = largest + 2
    elif cache_state == "evicted":
        # Room for the probes and most of the evictors: some probe blocks stay cached.
        probe_blocks = sum(_blocks(p, block_size) for p in probes)
        num_gpu_blocks = max(largest + 2, probe_blocks + 2 * largest - probe_blocks // 2)
    return Scenario(seed, tuple(probes), tuple(background), block_size,
                    rng.choice(["float32", "bfloat16"]), max_num_seqs, max_num_batched_tokens,
                    prefix_caching, cache_state, preemption, rng.choice([1, 2]), num_gpu_blocks)


def test_the_seeds_cover_every_variation():
    """The draws are random, but the seeds were chosen so that together they cover every value
    of each dimension the promise names (change SEEDS if the draw changes)."""
    scenarios = [draw(s) for s in SEEDS]
    seen = {f: {getattr(s, f) for s in scenarios}
            for f in ("block_size", "kv_cache_dtype", "prefix_caching", "cache_state",
                      "preemption", "threads")}
    assert seen == {"block_size": {8, 16}, "kv_cache_dtype": {"float32", "bfloat16"},
                    "prefix_caching": {True, False}, "cache_state": {"cold", "warm", "evicted"},
                    "preemption": {None, "recompute", "swap"}, "threads": {1, 2}}, seen
    assert min(s.max_num_batched_tokens for s in scenarios) < 16  # small prefill chunks
    assert max(s.max_num_batched_tokens for s in scenarios) >= 80  # whole prompts in a step
    probes = [p for s in scenarios for p in s.probes]
    assert {p.seed is None for p in probes} == {True, False}  # greedy and seeded


def _prompt(tokenizer, r: Request) -> dict:
    ids = tokenizer(" ".join(r.words)).input_ids[:r.num_tokens]
    assert len(ids) == r.num_tokens  # every word is at least one token
    return {"prompt_token_ids": ids}


def _record(out) -> tuple:
    """Token ids, cumulative logprob, and every logprob entry (value and rank) per position."""
    c = out.outputs[0]
    return (list(c.token_ids), c.cumulative_logprob,
            [{t: (lp.logprob, lp.rank) for t, lp in pos.items()} for pos in c.logprobs])


def _first_difference(ref: tuple, got: tuple) -> str:
    for i, (a, b) in enumerate(zip(ref[2], got[2])):
        if a != b:
            common = a.keys() & b.keys()
            delta = max((abs(a[t][0] - b[t][0]) for t in common), default=float("nan"))
            return (f"position {i}: ids {ref[0][i]} vs {got[0][i]}, "
                    f"max |dlogprob| {delta:.3g} over {len(common)} common entries")
    return f"ids {ref[0]} vs {got[0]}"


@pytest.fixture(scope="module")
def reference():
    """reference(scenario, dtype) -> each probe's record run alone: one engine per (weights'
    dtype, block_size, kv_cache_dtype) with prefix caching off, one generate call per probe,
    so nothing of one run reaches the next (no cached blocks, each seeded request its own
    generator)."""
    engines, memo = {}, {}

    def get(s: Scenario, dtype: str) -> list[tuple]:
        layout = (dtype, s.block_size, s.kv_cache_dtype)
        if layout not in engines:
            engines[layout] = LLM(deterministic=True, dtype=dtype, block_size=s.block_size,
                                  kv_cache_dtype=s.kv_cache_dtype, enable_prefix_caching=False,
                                  kv_cache_memory_bytes=REFERENCE_KV_BYTES)
        llm = engines[layout]
        tok = llm.get_tokenizer()
        for p in s.probes:
            if (layout, p) not in memo:
                memo[layout, p] = _record(llm.generate(_prompt(tok, p), p.params(),
                                                       use_tqdm=False)[0])
        return [memo[layout, p] for p in s.probes]

    yield get
    for llm in engines.values():
        llm.shutdown()


def _assert_all_blocks_free(llm: LLM):
    engine = llm.llm_engine
    bm, sched = engine.block_manager, engine.scheduler
    assert not engine.has_unfinished_requests()
    assert not (sched.waiting or sched.running or sched.swapped)
    assert bm.num_free_blocks == bm.num_blocks and not any(bm.ref_counts)
    assert bm.cpu.num_free_blocks == bm.cpu.num_blocks and not any(bm.cpu.ref_counts)


@needs_kernels
# bfloat16 weights run the float32 path but for the panel kernel's widening load (plain or
# k-pair panels; the opt-in vdpbf16ps math too keeps one sum order at every row count, issue
# 32): the same mixes hold for them (about 6 s a seed here).
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("seed", SEEDS)
def test_probes_in_a_random_mix_are_bitwise_alone(reference, seed, dtype):
    s = draw(seed)
    ref = reference(s, dtype)
    threads = torch.get_num_threads()
    llm = LLM(**s.engine_kwargs(dtype))
    try:
        tok = llm.get_tokenizer()
        probes = [(i, _prompt(tok, p), p.params()) for i, p in enumerate(s.probes)]
        others = [(None, _prompt(tok, r), r.params()) for r in s.background]
        torch.set_num_threads(s.threads)
        runs = {}
        if s.cache_state in ("warm", "evicted"):
            outs = llm.generate([p for _, p, _ in probes], [sp for _, _, sp in probes],
                                use_tqdm=False)
            runs["first pass"] = [_record(o) for o in outs]
        if s.cache_state == "evicted":
            # Long unrelated prompts, one at a time, push the least recently used blocks out.
            rng = random.Random(seed + 1000)
            for _ in range(2):
                evictor = Request(_words(rng, 80), 80, 1, 0.0, None, None)
                llm.generate(_prompt(tok, evictor), evictor.params(), use_tqdm=False)
            assert llm.llm_engine.block_manager.device.num_evictions > 0
        mix = probes + others
        random.Random(seed).shuffle(mix)
        outs = llm.generate([p for _, p, _ in mix], [sp for _, _, sp in mix], use_tqdm=False)
        got = [None] * len(probes)
        for (i, _, _), o in zip(mix, outs):
            if i is not None:
                got[i] = _record(o)
        runs["mix"] = got
        if s.cache_state == "warm":
            assert sum(o.num_cached_tokens for (i, _, _), o in zip(mix, outs)
                       if i is not None) > 0
        stats = llm.llm_engine.stats
        if s.preemption:
            assert stats.num_preemptions > 0, s
            if s.preemption == "swap":
                assert stats.num_swapped_out > 0, s
        for name, records in runs.items():
            for i, (r, g) in enumerate(zip(ref, records)):
                assert g == r, (f"{name}, probe {i} ({s.probes[i]}): "
                                f"{_first_difference(r, g)}; scenario {s}")
        _assert_all_blocks_free(llm)
    finally:
        torch.set_num_threads(threads)
        llm.shutdown()
