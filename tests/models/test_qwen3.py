"""Qwen3 (per-head RMSNorm on queries and keys before rope) against transformers, and TP=2
against one worker."""
from __future__ import annotations

import pytest

from pagedlm import SamplingParams
from tests.models.test_moe import assert_matches_transformers, make_tiny_moe_model


@pytest.mark.parametrize("overrides", [
    {},
    # Bias on all four projections, and the LM head tied to the embedding.
    {"attention_bias": True, "tie_word_embeddings": True},
], ids=["plain", "bias-tied"])
def test_qwen3_greedy_and_logprobs_match_transformers(tmp_path, default_model_dir, overrides):
    path = make_tiny_moe_model(tmp_path, "qwen3", default_model_dir, **overrides)
    llm = assert_matches_transformers(path)
    attn = llm.llm_engine.executor.worker.model.layers["0"].self_attn
    assert (attn.qkv_proj.bias is not None) == (attn.o_proj.bias is not None) == bool(overrides)


@pytest.mark.slow
def test_qwen3_tp2_over_mp_matches_one_worker(tmp_path, default_model_dir):
    from tests.distributed.test_distributed_executor import assert_no_workers_left, assert_same, run
    path = make_tiny_moe_model(tmp_path, "qwen3", default_model_dir)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=5)
    ref = run(path, params)
    assert_same(ref, run(path, params, tensor_parallel_size=2,
                         distributed_executor_backend="mp"))
    assert_no_workers_left()
