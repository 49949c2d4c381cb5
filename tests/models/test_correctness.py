"""pagedlm's greedy outputs and logprobs against transformers, and invariance to batching."""
from __future__ import annotations

import pytest
import torch

from pagedlm import LLM, SamplingParams
from tests.conftest import make_tiny_model

PROMPTS = [
    "The capital of France is a city that",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "1, 2, 3, 4,",
    "The three primary colors are",
    "Water boils at a temperature of",
    "import numpy as np\nx = np.",
    "My favourite recipe for pancakes starts with",
]
NUM_TOKENS = 32


def hf_greedy(model, tokenizer, prompt_ids: list[int], max_new: int, ignore_eos: bool) -> list[int]:
    kwargs = {"min_new_tokens": max_new} if ignore_eos else {}
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt_ids]),
                             attention_mask=torch.ones(1, len(prompt_ids)),
                             max_new_tokens=max_new, do_sample=False, top_k=None, top_p=None,
                             pad_token_id=tokenizer.eos_token_id, **kwargs)
    return out[0, len(prompt_ids):].tolist()


@pytest.fixture(scope="module")
def llm():
    return LLM(kv_cache_memory_bytes=512 * 2**20)


def test_default_model_greedy_matches_transformers(llm, hf_default_model):
    tok = llm.get_tokenizer()
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=NUM_TOKENS),
                        use_tqdm=False)
    assert len(outs) == len(PROMPTS)
    for prompt, out in zip(PROMPTS, outs):
        assert out.prompt == prompt
        ids = tok.encode(prompt)
        assert out.prompt_token_ids == ids
        expected = hf_greedy(hf_default_model, tok, ids, NUM_TOKENS, ignore_eos=False)
        # Completion prompts: no early EOS, so every prompt compares all NUM_TOKENS tokens.
        assert len(expected) == NUM_TOKENS
        assert out.outputs[0].token_ids == expected, prompt
        assert out.outputs[0].text == tok.decode(expected, skip_special_tokens=True)


def test_default_model_top5_logprobs_close(llm, hf_default_model):
    params = SamplingParams(temperature=0, max_tokens=16, logprobs=5, ignore_eos=True)
    for out in llm.generate(PROMPTS[:3], params, use_tqdm=False):
        seq = out.prompt_token_ids + out.outputs[0].token_ids
        with torch.inference_mode():
            ref = torch.log_softmax(hf_default_model(torch.tensor([seq])).logits[0].float(), -1)
        n = len(out.prompt_token_ids)
        for i, position in enumerate(out.outputs[0].logprobs):
            top = ref[n - 1 + i].topk(5)
            for tid, val in zip(top.indices.tolist(), top.values.tolist()):
                assert tid in position
                assert position[tid].logprob == pytest.approx(val, abs=2e-3)


@pytest.mark.parametrize("arch,overrides", [
    ("llama", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
               "rope_theta": 500000.0}),
    ("qwen2", {"tie_word_embeddings": True}),
    ("mistral", {"sliding_window": 256}),
])
def test_tiny_models_greedy_match_transformers(tmp_path, default_model_dir, arch, overrides):
    from transformers import AutoModelForCausalLM
    path = make_tiny_model(tmp_path, arch, default_model_dir, **overrides)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(path, num_gpu_blocks_override=64)
    tok = llm.get_tokenizer()
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=3)
    outs = llm.generate(PROMPTS[:4], params, use_tqdm=False)
    for prompt, out in zip(PROMPTS[:4], outs):
        ids = tok.encode(prompt)
        assert out.outputs[0].token_ids == hf_greedy(hf, tok, ids, 24, ignore_eos=True), prompt
        with torch.inference_mode():
            ref = torch.log_softmax(
                hf(torch.tensor([ids + out.outputs[0].token_ids])).logits[0], -1)
        for i, position in enumerate(out.outputs[0].logprobs):
            tid = out.outputs[0].token_ids[i]
            assert position[tid].logprob == pytest.approx(ref[len(ids) - 1 + i, tid].item(),
                                                          abs=1e-3)
    if arch == "mistral":
        # the window no longer caps the context (tests/models/test_sliding_window.py)
        assert llm.llm_engine.config.model_config.max_model_len == 512
    engine = llm.llm_engine
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_same_outputs_together_one_by_one_and_under_preemption(llm):
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)
    together = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    one_by_one = [llm.generate(p, params, use_tqdm=False)[0].outputs[0].token_ids for p in PROMPTS]
    assert together == one_by_one

    # 12 blocks of 16 tokens cannot hold 8 sequences of ~10 + 32 tokens: the scheduler must
    # preempt (recompute) and still produce the same tokens.
    small = LLM(num_gpu_blocks_override=12, max_num_seqs=8)
    squeezed = [o.outputs[0].token_ids for o in small.generate(PROMPTS, params, use_tqdm=False)]
    engine = small.llm_engine
    assert engine.stats.num_preemptions == engine.scheduler.stats.num_preemptions > 0
    assert squeezed == together
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert all(c == 0 for c in engine.block_manager.ref_counts)


def test_all_blocks_free_after_finish_and_abort(llm):
    engine = llm.llm_engine
    bm = engine.block_manager
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, params)
    for _ in range(3):
        engine.step()
    assert bm.num_free_blocks < bm.num_blocks
    engine.abort_request(["r1", "r5"])
    # A request aborted while still waiting must be freed too.
    engine.add_request("late", PROMPTS[0], params)
    engine.abort_request("late")
    finished = set()
    while engine.has_unfinished_requests():
        finished |= {o.request_id for o in engine.step() if o.finished}
    assert finished == {f"r{i}" for i in range(len(PROMPTS))} - {"r1", "r5"}
    assert bm.num_free_blocks == bm.num_blocks
    assert all(c == 0 for c in bm.ref_counts)
    assert not engine.requests


def test_request_outgrowing_the_whole_cache_finishes_instead_of_hanging():
    # Two blocks hold 32 tokens; this request wants ~10 + 100. Once it has filled the cache it
    # cannot be run or re-admitted, so it must end ("length") with what it has, not wait forever.
    small = LLM(num_gpu_blocks_override=2)
    engine = small.llm_engine
    params = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
    engine.add_request("big", "The capital of France is", params)
    engine.add_request("small", "Hi", SamplingParams(temperature=0, max_tokens=4))
    finished = {}
    for _ in range(300):  # bounded: a regression fails here instead of hanging the suite
        finished.update({o.request_id: o for o in engine.step() if o.finished})
        if not engine.has_unfinished_requests():
            break
    assert set(finished) == {"big", "small"}
    big = finished["big"].outputs[0]
    assert big.finish_reason == "length"
    assert 0 < len(big.token_ids) < 100
    assert len(finished["big"].prompt_token_ids) + len(big.token_ids) <= 2 * 16 + 1
    assert len(finished["small"].outputs[0].token_ids) == 4
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert not engine.requests


def test_n_larger_than_max_num_seqs_is_rejected():
    small = LLM(num_gpu_blocks_override=8, max_num_seqs=4)
    with pytest.raises(ValueError, match=r"\bn\b.*max_num_seqs"):
        small.generate("Hi", SamplingParams(n=5), use_tqdm=False)
    assert not small.llm_engine.has_unfinished_requests()


def test_bfloat16_is_selectable_and_tracks_float32(llm):
    prompts = ["The capital of France is", "def fibonacci(n):", "1, 2, 3, 4,"]
    params = SamplingParams(temperature=0, max_tokens=4, logprobs=1)
    bf16 = LLM(dtype="bfloat16", kv_cache_memory_bytes=256 * 2**20)
    engine = bf16.llm_engine
    assert engine.config.model_config.dtype == torch.bfloat16
    assert engine.executor.worker.cache_engine.kv_caches[0][0].dtype == torch.bfloat16
    low = bf16.generate(prompts, params, use_tqdm=False)
    full = llm.generate(prompts, params, use_tqdm=False)
    for a, b in zip(low, full):
        # bf16 rounding may flip a late near-tie, but not the first confident tokens.
        assert a.outputs[0].token_ids[:2] == b.outputs[0].token_ids[:2]
        first = a.outputs[0].token_ids[0]
        assert a.outputs[0].logprobs[0][first].logprob == pytest.approx(
            b.outputs[0].logprobs[0][first].logprob, abs=0.2)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
