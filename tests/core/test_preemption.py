"""Preemption under a KV cache too small for the batch: by recompute and by swap, greedy outputs
equal those of a roomy cache (up to a near-tie), sampled ones run to completion, the counters
show it happened, and every block comes back. Under deterministic=True (issue 31) greedy and
sampled outputs are bitwise those of the roomy cache."""
from __future__ import annotations

import threading

import pytest

from pagedlm import LLM, SamplingParams
from tests.compare_utils import MODES, assert_greedy_outputs_match, assert_outputs_bitwise_equal
from tests.conftest import needs_kernels

PROMPTS = ["The history of the printing press", "List three prime numbers:",
           "A short poem about rain:", "def add(a, b):", "Translate 'good morning' to French:",
           "The largest planet is", "Steps to boil an egg:", "Once upon a time"]
# A recomputed K/V (prefill) differs from the original one (decode kernel) in the last bits:
# greedy outputs match up to a near-tie (tests/compare_utils.py), with logprobs=2 to tell one.
GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=2)
# Forked groups (n=3) preempted and resumed. The same last-bit noise can move a draw anywhere
# (measured: flips between neighbouring token ids, inverse-CDF sampling's boundaries), so these
# are not compared with the roomy run in the default mode; each must run to max_tokens.
SAMPLED = SamplingParams(n=3, temperature=1.0, top_k=20, seed=7, max_tokens=24, ignore_eos=True)


def run(llm):
    """(greedy outputs, the sampled groups' outputs in order)."""
    greedy = [o.outputs[0] for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    sampled = llm.generate(PROMPTS[:4], SAMPLED, use_tqdm=False)
    for o in sampled:
        assert [c.index for c in o.outputs] == [0, 1, 2]
        assert all(len(c.token_ids) == 24 and c.finish_reason == "length" for c in o.outputs)
    return greedy, [c for o in sampled for c in o.outputs]


@pytest.fixture(scope="module")
def references():
    """references(deterministic) -> the roomy cache's (greedy, sampled) outputs, built on first
    use; sampled is None in the default mode, which does not compare them."""
    built = {}

    def get(deterministic: bool = False):
        if deterministic not in built:
            llm = LLM(kv_cache_memory_bytes=256 * 2**20, deterministic=deterministic)
            built[deterministic] = (run(llm) if deterministic else
                                    ([o.outputs[0] for o in llm.generate(PROMPTS, GREEDY,
                                                                         use_tqdm=False)],
                                     None))
            llm.shutdown()
        return built[deterministic]

    return get


@pytest.fixture(scope="module")
def reference(references):
    return references()


def assert_keeps_outputs(ref, got):
    (ref_greedy, ref_sampled), (greedy, sampled) = ref, got
    if ref_sampled is None:
        assert_greedy_outputs_match(ref_greedy, greedy)
    else:
        assert_outputs_bitwise_equal(ref_greedy + ref_sampled, greedy + sampled)


def assert_all_blocks_free(llm):
    bm = llm.llm_engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and not any(bm.ref_counts)
    assert bm.cpu.num_free_blocks == bm.cpu.num_blocks and not any(bm.cpu.ref_counts)
    sched = llm.llm_engine.scheduler
    assert not (sched.waiting or sched.running or sched.swapped)


@pytest.mark.parametrize("deterministic", MODES)
@pytest.mark.parametrize("caching", [True, False])
def test_recompute_preemption_keeps_outputs(references, caching, deterministic):
    # 14 blocks of 16 tokens for 8 sequences growing to ~50 tokens (4 blocks each).
    llm = LLM(num_gpu_blocks_override=14, preemption_mode="recompute",
              enable_prefix_caching=caching, deterministic=deterministic)
    assert_keeps_outputs(references(deterministic), run(llm))
    stats = llm.llm_engine.stats
    assert stats.num_preemptions > 0 and stats.num_swapped_out == 0
    assert_all_blocks_free(llm)


@pytest.mark.parametrize("deterministic", MODES)
def test_swap_preemption_keeps_outputs(references, deterministic):
    llm = LLM(num_gpu_blocks_override=14, preemption_mode="swap", swap_space=0.25,
              deterministic=deterministic)
    assert llm.llm_engine.block_manager.cpu.num_blocks > 0
    assert_keeps_outputs(references(deterministic), run(llm))
    stats = llm.llm_engine.stats
    assert stats.num_swapped_out > 0 and stats.num_swapped_in == stats.num_swapped_out
    # Every preemption was a swap: the host pool had room.
    assert stats.num_preemptions == stats.num_swapped_out
    assert_all_blocks_free(llm)


def test_swap_falls_back_to_recompute_when_host_pool_is_too_small(reference):
    # Two host blocks: not enough for any group, so every preemption recomputes.
    per_block = 2 * 30 * 16 * 3 * 64 * 4  # layers, block size, kv heads, head dim, fp32
    llm = LLM(num_gpu_blocks_override=14, preemption_mode="swap",
              swap_space=2 * per_block / 2**30)
    assert llm.llm_engine.block_manager.cpu.num_blocks == 2
    assert_greedy_outputs_match(reference[0], run(llm)[0])
    stats = llm.llm_engine.stats
    assert stats.num_preemptions > 0
    assert stats.num_swapped_out < stats.num_preemptions
    assert_all_blocks_free(llm)


def test_a_swapped_group_that_outgrew_the_cache_finishes(caplog):
    """Six sequences swapped out at 33 tokens need 18 blocks to come back, in a cache of 12:
    the group finishes with what it has, as a waiting group that cannot fit does. The engine
    stepped on empty forever (an LLM.generate that never returned, a core kept busy)."""
    llm = LLM(num_gpu_blocks_override=12, preemption_mode="swap", swap_space=0.25,
              max_model_len=256)
    done = []
    params = SamplingParams(n=4, best_of=6, max_tokens=60, ignore_eos=True)
    worker = threading.Thread(target=lambda: done.append(
        llm.generate(["abc " * 20], params, use_tqdm=False)), daemon=True)
    worker.start()
    worker.join(120)
    assert done, "generate never returned"
    outs = done[0][0].outputs
    assert len(outs) == 4
    assert all(c.finish_reason == "length" and 0 < len(c.token_ids) < 60 for c in outs)
    assert llm.llm_engine.stats.num_ignored == 1
    assert "no longer fit in the KV cache" in caplog.text  # 'length' as at max_tokens: said
    assert llm.llm_engine.stats.num_swapped_out > 0
    assert_all_blocks_free(llm)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory, default_model_dir):
    from tests.conftest import make_tiny_model
    return make_tiny_model(tmp_path_factory.mktemp("preempt"), "llama", default_model_dir)


def alone_and_youngest(path, probe, prompt_len, filler_len, filler_tokens, **engine):
    """Under deterministic=True (unless engine says otherwise) the probe (a prompt_len-token
    prompt) alone, then as the youngest of a batch with two fillers that preempt it: (alone,
    in the batch, (computed tokens, output tokens) at each of its preemptions); every block
    free afterwards."""
    llm = LLM(path, **{"deterministic": True, "block_size": 8, "max_num_seqs": 8, **engine})
    try:
        prompt = {"prompt_token_ids": list(range(100, 100 + prompt_len))}
        alone = llm.generate(prompt, probe, use_tqdm=False)[0]
        sched = llm.llm_engine.scheduler
        preempted, preempt = [], sched._preempt

        def recorded(group, sched_out):
            seq = group.seqs[0]
            preempted.append((group.request_id, seq.num_computed_tokens, seq.num_output_tokens))
            return preempt(group, sched_out)
        sched._preempt = recorded
        filler = SamplingParams(temperature=0, max_tokens=filler_tokens, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": list(range(5, 5 + filler_len))}] * 2 + [prompt],
                            [filler, filler, probe], use_tqdm=False)
        assert_all_blocks_free(llm)
    finally:
        llm.shutdown()
    return alone, outs[-1], [p[1:] for p in preempted if p[0] == outs[-1].request_id]


@needs_kernels  # deterministic=True
def test_prompt_logprobs_survive_a_recompute_preemption_mid_prompt(tiny_llama):
    """A prompt preempted by recompute while it is prefilled in chunks scores its positions
    again from the start: those replace the ones it had. The list outgrew the prompt instead
    and never completed: the request's prompt_logprobs came back None."""
    probe = SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=2, ignore_eos=True)
    alone, busy, preempted = alone_and_youngest(tiny_llama, probe, 120, 40, 40,
                                                max_num_batched_tokens=12,
                                                num_gpu_blocks_override=20)
    mid_prompt = [p for p in preempted if p[1] == 0]
    assert mid_prompt and all(0 < p[0] < 120 for p in mid_prompt), preempted
    assert len(alone.prompt_logprobs) == 120
    assert busy.prompt_logprobs == alone.prompt_logprobs
    assert_outputs_bitwise_equal([alone.outputs[0]], [busy.outputs[0]])


@needs_kernels  # deterministic=True
def test_a_seeded_group_resumes_its_draws_in_order(tiny_llama):
    """Under deterministic=True a seeded n=3 group preempted by recompute, whose prefill
    then takes several steps (a budget of 40 tokens for 3 x 50), emits what it emits alone:
    its sequences draw from one generator, and those prefilled first sampled a step before
    the others, so the draws went to other sequences (tokens differed from there)."""
    probe = SamplingParams(temperature=1.0, seed=3, n=3, max_tokens=24, ignore_eos=True,
                           logprobs=1)
    alone, busy, preempted = alone_and_youngest(tiny_llama, probe, 30, 20, 60,
                                                max_num_batched_tokens=40,
                                                num_gpu_blocks_override=24)
    assert any(p[1] > 0 for p in preempted), preempted
    assert_outputs_bitwise_equal(alone.outputs, busy.outputs)


@pytest.mark.parametrize("engine", [{"enable_prefix_caching": False},
                                    {"enable_prefix_caching": True},
                                    {"enable_prefix_caching": False,
                                     "enable_chunked_prefill": False,
                                     "max_num_batched_tokens": 512}], ids=str)
@pytest.mark.parametrize("deterministic", MODES)
def test_a_group_recomputed_shares_its_prompt_again(tiny_llama, deterministic, engine):
    """A seeded n=4 group with a 100-token prompt, preempted by recompute: it comes back
    computing its prompt's full blocks once, which its sequences share again (12 blocks of 8
    tokens and 2-3 of their own each, about 24 of the cache's 40). Prefilled as four copies
    (about 56 blocks) it could never fit again and ended 'length' with what it had. With
    prefix caching its prompt's blocks are still cached when it comes back: its sequences
    start from them."""
    probe = SamplingParams(temperature=1.0, seed=3, n=4, max_tokens=16, ignore_eos=True,
                           logprobs=1)
    alone, busy, preempted = alone_and_youngest(tiny_llama, probe, 100, 100, 30,
                                                deterministic=deterministic,
                                                num_gpu_blocks_override=40, **engine)
    assert any(p[1] > 0 for p in preempted), preempted  # preempted with tokens out
    assert [len(c.token_ids) for c in busy.outputs] == [16] * 4
    if deterministic:
        assert_outputs_bitwise_equal(alone.outputs, busy.outputs)


@needs_kernels  # deterministic=True
def test_a_speculating_group_with_a_long_prompt_keeps_its_drafts(tiny_llama):
    """Under deterministic=True a seeded n=3 group speculating with a draft model (the
    target itself), its 100-token prompt shared: where its decode found no room, the check
    whether the cache (33 blocks) could ever hold it counted the prompt three times (said
    never), so it decoded plainly instead of being preempted with its drafts, and its tokens
    followed the load. It emits what it emits alone."""
    probe = SamplingParams(temperature=1.0, seed=3, n=3, max_tokens=40, ignore_eos=True,
                           logprobs=1)
    alone, busy, preempted = alone_and_youngest(
        tiny_llama, probe, 100, 60, 80, num_gpu_blocks_override=33,
        enable_prefix_caching=False,
        speculative_config={"model": tiny_llama, "num_speculative_tokens": 3})
    assert preempted, preempted
    assert_outputs_bitwise_equal(alone.outputs, busy.outputs)
