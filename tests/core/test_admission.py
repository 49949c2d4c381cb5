"""One admission rule: add_request refuses a prompt the scheduler could never admit (more blocks
than the cache less its watermark), with a clear error, and serves one that needs exactly the
allowed maximum. Before, a prompt in between was accepted and finished as `length` with no
output."""
from __future__ import annotations

import pytest

from pagedlm import LLM, SamplingParams
from tests.conftest import make_tiny_model


@pytest.fixture(scope="module")
def tiny_llm(tmp_path_factory, default_model_dir):
    path = make_tiny_model(tmp_path_factory.mktemp("admission"), "llama", default_model_dir)
    # 100 blocks of 4 tokens: the 1% watermark holds back 1, so one request may take 99.
    return LLM(path, block_size=4, num_gpu_blocks_override=100, max_model_len=512)


def test_a_prompt_needing_the_allowed_maximum_is_served(tiny_llm):
    bm = tiny_llm.llm_engine.block_manager
    assert bm.watermark_blocks == 1 and bm.max_admissible_blocks == 99
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    out = tiny_llm.generate({"prompt_token_ids": [7] * (99 * 4)}, params, use_tqdm=False)[0]
    assert out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == 4
    assert bm.num_free_blocks == bm.num_blocks and not any(bm.ref_counts)


def test_a_prompt_needing_one_block_more_is_refused_at_add_request(tiny_llm):
    engine = tiny_llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=4)
    with pytest.raises(ValueError, match=r"needs 100 blocks .* at most 99"):
        engine.add_request("big", {"prompt_token_ids": [7] * (99 * 4 + 1)}, params)
    assert not engine.has_unfinished_requests() and "big" not in engine.requests
