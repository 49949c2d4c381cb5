"""Gemma 2 and Gemma 3 (text) against transformers: greedy tokens and top-5 logprobs, in both
attention backends; Gemma 3's mixed local/global layers past the window with chunked prefill;
TP=2 against one worker (slow: starts processes); config errors.

Tiny random models are built with transformers' own config and model classes (eager attention,
which applies the soft cap and the window itself) and saved as safetensors.
"""
from __future__ import annotations

import json
import os

import pytest
import torch

from pagedlm import LLM, SamplingParams
from tests.models.test_correctness import PROMPTS
from tests.distributed.test_distributed_executor import assert_no_workers_left, assert_same
from tests.models.test_sliding_window import (LONG_PROMPTS, LONG_TOKENS, WINDOW, _check_backend,
                                       assert_matches_hf, backend, make_hf_model)

__all__ = ["backend"]  # the fixture, re-used

GEMMA2 = dict(head_dim=16, query_pre_attn_scalar=24, sliding_window=WINDOW,
              attn_logit_softcapping=10.0, final_logit_softcapping=30.0,
              tie_word_embeddings=False)
GEMMA3 = dict(head_dim=16, num_hidden_layers=4, query_pre_attn_scalar=24,
              sliding_window=WINDOW, tie_word_embeddings=True, embed_std=0.05,
              layer_types=["sliding_attention", "sliding_attention", "full_attention",
                           "sliding_attention"],
              # A separate base for local layers; linear scaling on the global ones.
              rope_parameters={"sliding_attention": {"rope_type": "default",
                                                     "rope_theta": 10000.0},
                               "full_attention": {"rope_type": "linear", "factor": 2.0,
                                                  "rope_theta": 1e6}})


@pytest.fixture(scope="module")
def gemma(tmp_path_factory, default_model_dir):
    from transformers import (Gemma2Config, Gemma2ForCausalLM, Gemma3ForCausalLM,
                              Gemma3TextConfig)
    root = tmp_path_factory.mktemp("gemma")
    return {
        "gemma2": make_hf_model(root, "gemma2", Gemma2Config, Gemma2ForCausalLM,
                                default_model_dir, **GEMMA2),
        "gemma3": make_hf_model(root, "gemma3", Gemma3TextConfig, Gemma3ForCausalLM,
                                default_model_dir, **GEMMA3),
    }


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_gemma_matches_transformers(gemma, arch, backend):
    """4 prompts x 32 tokens: identical greedy tokens, top-5 logprobs within 1e-3. Prompts of
    ~10 tokens + 32 outputs pass the window of 32, so the local layers narrow too."""
    path, hf_model = gemma[arch]
    llm = LLM(path, num_gpu_blocks_override=64)
    assert llm.llm_engine.config.model_config.architecture == hf_model.config.architectures[0]
    assert_matches_hf(llm, hf_model, PROMPTS[:4], 32)
    _check_backend(llm, backend)


def test_gemma3_mixed_layers_past_the_window_with_chunked_prefill(gemma, backend):
    path, hf_model = gemma["gemma3"]
    llm = LLM(path, max_num_batched_tokens=24, max_num_seqs=4, enable_chunked_prefill=True,
              num_gpu_blocks_override=64)
    windows = [m.sliding_window for m in llm.llm_engine.executor.worker.model.modules()
               if type(m).__name__ == "Attention"]
    assert windows == [WINDOW, WINDOW, None, WINDOW]
    assert_matches_hf(llm, hf_model, LONG_PROMPTS, LONG_TOKENS)
    _check_backend(llm, backend)


def test_gemma_reference_uses_its_window_and_soft_caps(gemma):
    """The knobs the tests rely on are live in the reference: without the window, or without
    Gemma 2's soft caps, transformers' logits change."""
    ids = torch.tensor([list(range(200, 200 + 3 * WINDOW))])
    for arch, change in (("gemma3", dict(sliding_window=10**4)),
                         ("gemma2", dict(sliding_window=10**4)),
                         ("gemma2", dict(attn_logit_softcapping=None)),
                         ("gemma2", dict(final_logit_softcapping=None))):
        path, hf_model = gemma[arch]
        other = type(hf_model).from_pretrained(path, dtype=torch.float32,
                                               attn_implementation="eager", **change).eval()
        with torch.inference_mode():
            diff = (hf_model(ids).logits - other(ids).logits).abs().max().item()
        assert diff > 1e-2, (arch, change)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_gemma_tp2_and_pp2_match_one_worker(gemma, arch):
    path, _ = gemma[arch]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=5)

    def run(**kwargs):
        with LLM(path, kv_cache_memory_bytes=8 * 2**20, **kwargs) as llm:
            return [o.outputs[0] for o in llm.generate(PROMPTS[:4], params, use_tqdm=False)]

    ref = run()
    assert_same(ref, run(tensor_parallel_size=2, distributed_executor_backend="mp"))
    # Pipeline stages split the mixed local/global layers; Gemma 3's last stage re-uses the
    # embedding for its tied head.
    assert_same(ref, run(pipeline_parallel_size=2, distributed_executor_backend="mp"))
    assert_no_workers_left()


@pytest.mark.parametrize("field,value,match", [
    ("attn_logit_softcapping", -1.0, "attn_logit_softcapping"),
    ("final_logit_softcapping", "big", "final_logit_softcapping"),
    ("query_pre_attn_scalar", 0, "query_pre_attn_scalar"),
    ("hidden_activation", "relu", "hidden_activation"),
    ("sliding_window", 0, "sliding_window"),
])
def test_bad_gemma_config_is_a_value_error(gemma, tmp_path, field, value, match):
    import shutil
    path = shutil.copytree(gemma["gemma2"][0], tmp_path / "bad")
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config[field] = value
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    with pytest.raises(ValueError, match=match):
        LLM(str(path), num_gpu_blocks_override=16)
