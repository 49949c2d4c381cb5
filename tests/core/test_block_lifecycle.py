"""A randomized run of a few hundred operations (add with shared prefixes, n > 1, best_of, beam
search; abort; step) on a cache small enough that preemption, swapping and prefix-cache eviction
all happen. After every step the block pools must agree exactly with the sequences' block tables,
and at the end every block is free with a zero reference count."""
from __future__ import annotations

import random
from collections import Counter

import pytest

from pagedlm import LLM, SamplingParams
from pagedlm.entrypoints.beam_search import BeamSearchDriver
from pagedlm.sequence import SequenceStatus
from tests.conftest import make_tiny_model


def check_pools(engine) -> None:
    bm, sched = engine.block_manager, engine.scheduler
    refs = {"device": Counter(), "cpu": Counter()}
    for group in sched.waiting + sched.running + sched.swapped:
        for seq in group.unfinished_seqs():
            if seq.status is SequenceStatus.SWAPPED:
                refs["cpu"].update(seq.block_table)
            else:
                refs["device"].update(seq.block_table)
                assert len(seq.block_table) * bm.block_size >= seq.num_computed_tokens
            if seq.status is SequenceStatus.WAITING:
                assert not seq.block_table and seq.num_computed_tokens == 0
    for name, pool in (("device", bm.device), ("cpu", bm.cpu)):
        assert pool.ref_counts == [refs[name][b] for b in range(pool.num_blocks)], name
        free = list(pool.free_plain) + list(pool.free_cached)
        assert len(free) == len(set(free)) == pool.num_free_blocks
        assert set(free) == {b for b in range(pool.num_blocks) if pool.ref_counts[b] == 0}
        assert all(pool.block_hash[b] == h for h, b in pool.cached.items())
        assert sum(h is not None for h in pool.block_hash) == len(pool.cached)


def random_params(rng: random.Random) -> SamplingParams:
    kind = rng.choice(["greedy", "greedy", "sample", "n", "best_of", "beam"])
    max_tokens = rng.randint(1, 24)
    if kind == "greedy":
        return SamplingParams(temperature=0, max_tokens=max_tokens,
                              prompt_logprobs=rng.choice([None, None, 1]))
    if kind == "sample":
        return SamplingParams(temperature=1.0, seed=rng.randint(0, 99), max_tokens=max_tokens)
    if kind == "n":
        return SamplingParams(n=rng.randint(2, 3), temperature=1.0, max_tokens=max_tokens)
    if kind == "best_of":
        return SamplingParams(n=1, best_of=3, temperature=1.0, max_tokens=max_tokens)
    return SamplingParams(use_beam_search=True, best_of=rng.randint(2, 3), n=2, temperature=0,
                          max_tokens=max_tokens)


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_random_operations_leave_every_block_free(tmp_path, default_model_dir, mode):
    path = make_tiny_model(tmp_path, "llama", default_model_dir)
    # 24 host blocks: K and V, 3 layers, 8 tokens, 2 KV heads of 16 dims, fp32.
    llm = LLM(path, block_size=8, num_gpu_blocks_override=28, max_num_seqs=6,
              max_num_batched_tokens=48, max_model_len=160, preemption_mode=mode,
              swap_space=24 * 2 * 3 * 8 * 2 * 16 * 4 / 2**30)
    engine = llm.llm_engine
    # Beam searches run above the engine: the driver adds their steps as ordinary requests.
    driver = BeamSearchDriver(engine)
    assert engine.block_manager.cpu.num_blocks == (24 if mode == "swap" else 0)
    rng = random.Random(2 if mode == "swap" else 1)
    prefixes = [[rng.randint(100, 3000) for _ in range(rng.choice([8, 16, 24]))]
                for _ in range(4)]
    live, finished, aborted, counter, aborted_swapped = set(), set(), set(), 0, 0
    for _ in range(400):
        op = rng.random()
        if op < 0.3:
            prompt = rng.choice(prefixes + [[]]) + [rng.randint(100, 3000)
                                                    for _ in range(rng.randint(1, 40))]
            rid = f"r{counter}"
            counter += 1
            driver.add_request(rid, {"prompt_token_ids": prompt}, random_params(rng))
            live.add(rid)
        elif op < 0.4 and live:
            rid = rng.choice(sorted(live))
            # Aborting a swapped-out group frees host blocks (beam steps are not users' ids).
            swapped = [g.request_id for g in engine.scheduler.swapped if g.request_id in live]
            if swapped and rng.random() < 0.5:
                rid = swapped[0]
                aborted_swapped += 1
            driver.abort_request(rid)
            live.discard(rid)
            aborted.add(rid)
        else:
            for out in driver.step():
                if out.finished:
                    assert out.request_id in live
                    assert all(c.finish_reason in ("stop", "length") for c in out.outputs)
                    live.discard(out.request_id)
                    finished.add(out.request_id)
        check_pools(engine)
    while driver.has_unfinished_requests():
        for out in driver.step():
            if out.finished:
                live.discard(out.request_id)
                finished.add(out.request_id)
        check_pools(engine)
    assert not live and not engine.requests and not driver.searches
    bm, stats = engine.block_manager, engine.stats
    assert bm.num_free_blocks == bm.num_blocks and not any(bm.ref_counts)
    assert bm.cpu.num_free_blocks == bm.cpu.num_blocks and not any(bm.cpu.ref_counts)
    # The run exercised what it claims to.
    assert len(aborted) > 10 and len(finished) > 50
    assert stats.num_preemptions > 0 and bm.device.num_evictions > 0 and bm.prefix_hits > 0
    if mode == "swap":
        assert stats.num_swapped_out > 0 and stats.num_swapped_in > 0 and aborted_swapped > 0
