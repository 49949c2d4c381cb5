"""Chunked prefill: a prompt longer than the step's token budget is prefilled over several steps,
and gives the same tokens and prompt logprobs as a one-step prefill (up to a near-tie; the same
bits under deterministic=True, issue 31)."""
from __future__ import annotations

import pytest

from pagedlm import LLM, SamplingParams
from tests.compare_utils import MODES, assert_greedy_match, assert_outputs_bitwise_equal
from tests.conftest import needs_kernels

LONG = " ".join(f"Line {i}: the committee reviewed item {i * 7 % 13} and moved on."
                for i in range(30))
PROMPTS = [LONG + "\nSummary:", "The capital of France is", "def fibonacci(n):",
           LONG[:400] + "\nQuestion: which item came first?"]


@pytest.fixture(scope="module")
def unchunked():
    """unchunked(deterministic) -> an engine that prefills in one step, built on first use."""
    built = {}

    def get(deterministic: bool = False):
        if deterministic not in built:
            built[deterministic] = LLM(enable_chunked_prefill=False, enable_prefix_caching=False,
                                       kv_cache_memory_bytes=256 * 2**20,
                                       deterministic=deterministic)
        return built[deterministic]

    return get


@pytest.mark.parametrize("deterministic", MODES)
def test_greedy_tokens_and_prompt_logprobs_match_with_chunking(unchunked, deterministic):
    budget = 64
    chunked = LLM(enable_chunked_prefill=True, max_num_batched_tokens=budget, max_num_seqs=8,
                  enable_prefix_caching=False, kv_cache_memory_bytes=256 * 2**20,
                  deterministic=deterministic)
    params = SamplingParams(temperature=0, max_tokens=24, prompt_logprobs=1, logprobs=2,
                            ignore_eos=True)
    ref = unchunked(deterministic).generate(PROMPTS, params, use_tqdm=False)
    out = chunked.generate(PROMPTS, params, use_tqdm=False)
    # The long prompt is several budgets long: it can only have run in chunks.
    assert len(ref[0].prompt_token_ids) > 4 * budget
    assert chunked.llm_engine.config.scheduler_config.max_num_batched_tokens == budget
    if deterministic:
        assert_outputs_bitwise_equal([r.outputs[0] for r in ref], [o.outputs[0] for o in out])
        assert [_bits(r.prompt_logprobs) for r in ref] == [_bits(o.prompt_logprobs) for o in out]
    for r, o in zip(ref, out):
        # Chunks sum attention in another order: the same tokens up to a near-tie.
        assert_greedy_match(r.outputs[0], o.outputs[0])
        assert len(o.prompt_logprobs) == len(r.prompt_logprobs)
        for a, b in zip(r.prompt_logprobs[1:], o.prompt_logprobs[1:]):
            tid = next(iter(a))  # the prompt's own token comes first
            assert abs(b[tid].logprob - a[tid].logprob) < 2e-3
    assert chunked.llm_engine.block_manager.num_free_blocks == \
        chunked.llm_engine.block_manager.num_blocks


def _bits(prompt_logprobs) -> list:
    return [p and {t: (lp.logprob, lp.rank) for t, lp in p.items()} for p in prompt_logprobs]


def test_budget_below_max_model_len_needs_chunking():
    with pytest.raises(ValueError, match="chunked prefill"):
        LLM(enable_chunked_prefill=False, max_num_batched_tokens=512, max_model_len=2048)
    llm = LLM(enable_chunked_prefill=True, max_num_batched_tokens=32, max_model_len=2048,
              max_num_seqs=8,
              num_gpu_blocks_override=64)
    out = llm.generate([LONG[:600]], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert len(out[0].prompt_token_ids) > 32 and len(out[0].outputs[0].token_ids) == 4



@needs_kernels  # deterministic=True
def test_a_group_on_its_prompt_counts_its_sequences_to_come(tmp_path, default_model_dir):
    """max_num_seqs 4: an n=2 group still prefilling (chunked, a budget of 4) counted as one
    sequence, so an n=3 group was admitted beside it and five sequences ran; the budget then
    split the seeded group's decodes over two steps, and its draws came in another order
    (deterministic=True: tokens differed from the 3rd). It waits for room now, never more
    than 4 run, and it emits what it emits alone."""
    from tests.conftest import make_tiny_model
    path = make_tiny_model(tmp_path, "llama", default_model_dir)
    probe = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=16, ignore_eos=True,
                           logprobs=1)
    other = SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=24, ignore_eos=True)
    prompt = {"prompt_token_ids": list(range(100, 110))}
    alone_llm = LLM(path, deterministic=True, block_size=8)
    alone = alone_llm.generate(prompt, probe, use_tqdm=False)[0]
    alone_llm.shutdown()
    llm = LLM(path, deterministic=True, block_size=8, max_num_batched_tokens=4, max_num_seqs=4)
    sched = llm.llm_engine.scheduler
    most, schedule = [], sched.schedule

    def counted():
        out = schedule()
        most.append(sum(len(g.unfinished_seqs()) for g in sched.running))
        return out
    sched.schedule = counted
    outs = llm.generate([{"prompt_token_ids": list(range(5, 35))}, prompt], [other, probe],
                        use_tqdm=False)
    assert max(most) <= 4, max(most)
    assert_outputs_bitwise_equal(alone.outputs, outs[-1].outputs)
    bm = llm.llm_engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    llm.shutdown()
