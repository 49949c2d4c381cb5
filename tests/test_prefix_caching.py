"""Prefix caching: requests sharing a prefix compute it once, outputs are unchanged, and cached
blocks are reused across batches until evicted."""
from __future__ import annotations

import pytest

from pagedlm import LLM, SamplingParams

SYSTEM = ("You are a careful assistant for a library. " + " ".join(
    f"Rule {i}: shelve books of section {i % 9} by author, then by year." for i in range(24)))
QUESTIONS = ["Where do poetry books go?", "How are atlases sorted?", "What about magazines?",
             "Can I borrow two books?", "When does the library open?", "Who sorts returns?",
             "Is there a quiet room?", "How long is a loan?"]
PROMPTS = [f"{SYSTEM}\nQuestion: {q}\nAnswer:" for q in QUESTIONS]
PARAMS = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def greedy(llm, prompts=PROMPTS):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, PARAMS, use_tqdm=False)]


@pytest.fixture(scope="module")
def reference():
    llm = LLM(enable_prefix_caching=False, kv_cache_memory_bytes=256 * 2**20)
    return llm, greedy(llm)


def test_shared_prefix_is_computed_once(reference):
    ref_llm, ref = reference
    llm = LLM(enable_prefix_caching=True, kv_cache_memory_bytes=256 * 2**20)
    outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == ref
    tok = llm.get_tokenizer()
    total = sum(len(o.prompt_token_ids) for o in outs)
    common = len(tok(SYSTEM + "\nQuestion:").input_ids) - 1  # margin for the joint token
    shared_blocks = common // 16
    assert shared_blocks >= 10
    # Without caching every prompt token is computed; with it, 7 of 8 prompts skip the prefix.
    assert ref_llm.llm_engine.stats.num_prompt_tokens == total
    computed = llm.llm_engine.stats.num_prompt_tokens
    assert computed <= total - 7 * shared_blocks * 16
    assert all(o.num_cached_tokens >= shared_blocks * 16 for o in outs[1:])
    assert llm.llm_engine.prefix_cache_hit_rate >= 7 * shared_blocks * 16 / total
    bm = llm.llm_engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and not any(bm.ref_counts)


def test_cache_survives_across_batches_and_eviction_keeps_outputs_right(reference):
    _, ref = reference
    # 40 blocks: one batch's prefix fits, but other prompts in between force evictions.
    llm = LLM(enable_prefix_caching=True, num_gpu_blocks_override=40, max_num_seqs=4)
    stats, bm = llm.llm_engine.stats, llm.llm_engine.block_manager
    assert greedy(llm, PROMPTS[:2]) == ref[:2]
    before = stats.num_prompt_tokens
    assert greedy(llm, PROMPTS[2:4]) == ref[2:4]
    second = stats.num_prompt_tokens - before
    assert second < 0.3 * sum(len(llm.get_tokenizer()(p).input_ids) for p in PROMPTS[2:4])
    # Unrelated long prompts push the old prefix out, least recently used first.
    other = [f"Unrelated text number {i}. " * 60 for i in range(3)]
    greedy(llm, other)
    assert bm.gpu.num_evictions > 0
    before = stats.num_prompt_tokens
    assert greedy(llm, PROMPTS[4:]) == ref[4:]
    assert stats.num_prompt_tokens - before > 0
    assert bm.num_free_blocks == bm.num_blocks and not any(bm.ref_counts)
