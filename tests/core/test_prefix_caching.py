"""Prefix caching: requests sharing a prefix compute it once, outputs are unchanged, and cached
blocks are reused across batches until evicted."""
from __future__ import annotations

import pytest

from pagedlm import LLM, SamplingParams
from tests.compare_utils import MODES, assert_greedy_outputs_match, assert_outputs_bitwise_equal

# About 200 tokens: 12 shared blocks of 16, enough to tell computed from cached (the 24-rule
# version took 100 s of the suite for no extra coverage).
SYSTEM = ("You are a careful assistant for a library. " + " ".join(
    f"Rule {i}: shelve books of section {i % 9} by author, then by year." for i in range(11)))
QUESTIONS = ["Where do poetry books go?", "How are atlases sorted?", "What about magazines?",
             "Can I borrow two books?", "When does the library open?", "Who sorts returns?",
             "Is there a quiet room?", "How long is a loan?"]
PROMPTS = [f"{SYSTEM}\nQuestion: {q}\nAnswer:" for q in QUESTIONS]
# A cache hit computes the prompt's last tokens against cached K/V instead of the whole prompt
# at once: the logits differ in the last bits, so outputs match up to a near-tie (logprobs=2).
# Under deterministic=True (issue 31) they are the same bits, logprobs included.
PARAMS = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2)


def greedy(llm, prompts=PROMPTS):
    return [o.outputs[0] for o in llm.generate(prompts, PARAMS, use_tqdm=False)]


def assert_same(ref, got, deterministic):
    if deterministic:
        assert_outputs_bitwise_equal(ref, got)
    else:
        assert_greedy_outputs_match(ref, got)


@pytest.fixture(scope="module")
def references():
    """references(deterministic) -> (an engine without prefix caching, its outputs), built on
    first use."""
    built = {}

    def get(deterministic: bool = False):
        if deterministic not in built:
            llm = LLM(enable_prefix_caching=False, kv_cache_memory_bytes=256 * 2**20,
                      deterministic=deterministic)
            built[deterministic] = llm, greedy(llm)
        return built[deterministic]

    return get


@pytest.fixture(scope="module")
def reference(references):
    return references()


@pytest.mark.parametrize("deterministic", MODES)
def test_shared_prefix_is_computed_once(references, deterministic):
    ref_llm, ref = references(deterministic)
    llm = LLM(enable_prefix_caching=True, kv_cache_memory_bytes=256 * 2**20,
              deterministic=deterministic)
    outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    assert_same(ref, [o.outputs[0] for o in outs], deterministic)
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


@pytest.mark.parametrize("deterministic", MODES)
def test_cache_survives_across_batches_and_eviction_keeps_outputs_right(references,
                                                                        deterministic):
    _, ref = references(deterministic)
    # 40 blocks: one batch's prefix fits, but other prompts in between force evictions.
    llm = LLM(enable_prefix_caching=True, num_gpu_blocks_override=40, max_num_seqs=4,
              deterministic=deterministic)
    stats, bm = llm.llm_engine.stats, llm.llm_engine.block_manager
    assert_same(ref[:2], greedy(llm, PROMPTS[:2]), deterministic)
    before = stats.num_prompt_tokens
    assert_same(ref[2:4], greedy(llm, PROMPTS[2:4]), deterministic)
    second = stats.num_prompt_tokens - before
    assert second < 0.3 * sum(len(llm.get_tokenizer()(p).input_ids) for p in PROMPTS[2:4])
    # Unrelated long prompts push the old prefix out, least recently used first.
    other = [f"Unrelated text number {i}. " * 40 for i in range(3)]
    greedy(llm, other)
    assert bm.device.num_evictions > 0
    before = stats.num_prompt_tokens
    assert_same(ref[4:], greedy(llm, PROMPTS[4:]), deterministic)
    assert stats.num_prompt_tokens - before > 0
    assert bm.num_free_blocks == bm.num_blocks and not any(bm.ref_counts)


# -- safe hashes and tenant isolation ----------------------------------------------------------

def test_sha256_is_the_default_block_hash_and_a_bad_algo_is_named():
    from pagedlm.core.block_hash import sha256_block_hash
    from pagedlm.engine.arg_utils import EngineArgs
    assert EngineArgs().prefix_caching_hash_algo == "sha256"
    llm = LLM(kv_cache_memory_bytes=64 * 2**20)
    bm = llm.llm_engine.block_manager
    assert bm.hash_block is sha256_block_hash
    llm.generate(PROMPTS[0], PARAMS, use_tqdm=False)
    hashes = list(bm.device.cached)
    assert hashes and all(isinstance(h, bytes) and len(h) == 32 for h in hashes)
    # The chain: each block's hash covers its parent's, its tokens and the first block's salt.
    assert sha256_block_hash(None, (1, 2), ()) != sha256_block_hash(None, (1, 2), ("salt",))
    assert sha256_block_hash(b"\1" * 32, (1, 2), ()) != sha256_block_hash(None, (1, 2), ())
    with pytest.raises(ValueError, match="prefix_caching_hash_algo"):
        LLM(prefix_caching_hash_algo="md5")


@pytest.mark.parametrize("algo", ["sha256", "builtin"])
def test_a_forged_hash_collision_never_reuses_another_prompts_blocks(reference, algo):
    """Every block hashes alike (a forged collision): lookups must compare the block's tokens,
    so no prompt is served another's KV, and outputs stay exactly those without caching."""
    _, ref = reference
    llm = LLM(kv_cache_memory_bytes=256 * 2**20, prefix_caching_hash_algo=algo)
    bm = llm.llm_engine.block_manager
    bm.hash_block = lambda parent, tokens, extra: b"collide"
    victim = "A completely different opening about rivers, mountains and the sea. " * 8
    llm.generate(victim, PARAMS, use_tqdm=False)  # its first block owns the colliding hash
    assert len(bm.device.cached) == 1
    outs = llm.generate(PROMPTS[:4], PARAMS, use_tqdm=False)
    assert_greedy_outputs_match(ref[:4], [o.outputs[0] for o in outs])  # another batch size
    assert all(o.num_cached_tokens == 0 for o in outs)
    assert bm.prefix_hits == 0


def test_cache_salt_keeps_identical_prompts_apart():
    llm = LLM(kv_cache_memory_bytes=256 * 2**20)
    prompt = PROMPTS[0]

    def cached(salt=None):
        p = {"prompt": prompt} if salt is None else {"prompt": prompt, "cache_salt": salt}
        return llm.generate(p, PARAMS, use_tqdm=False)[0].num_cached_tokens

    assert cached("tenant-a") == 0
    assert cached("tenant-b") == 0  # same prompt, other salt: nothing shared
    assert cached() == 0  # no salt is its own namespace too
    hit = cached("tenant-a")
    assert hit > 0 and hit % 16 == 0
    assert cached() == hit
    with pytest.raises(ValueError, match="cache_salt"):
        llm.generate({"prompt": prompt, "cache_salt": ""}, PARAMS, use_tqdm=False)
