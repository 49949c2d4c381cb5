"""Multi-LoRA and swap preemption on a GPU: the adapters' weights and the punica-style batched
LoRA matmuls live on the device, the swap pool in pinned host memory. The same behaviour is
tested on the CPU in tests/engine/test_lora.py and tests/core/test_preemption.py; here it runs
with device="cuda" (CUDA graphs on), float32 with TF32 off, against peft on the CPU."""
from __future__ import annotations

import os

import pytest
import torch

# GPU_TESTS_DEVICE=cpu runs this file's logic on the CPU (a check of the test itself, where no
# GPU is at hand); on a GPU machine it runs on CUDA.
DEVICE = os.environ.get("GPU_TESTS_DEVICE", "cuda")
pytestmark = pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(),
                                reason="needs a CUDA GPU")

from pagedlm import LLM, LoRARequest, SamplingParams  # noqa: E402
from tests.compare_utils import assert_greedy_outputs_match  # noqa: E402
from tests.conftest import make_tiny_model  # noqa: E402
from tests.engine.test_lora import (ALL_PROJ, check_against_peft, make_adapter,  # noqa: E402
                                    peft_model)
from tests.models.test_correctness import PROMPTS  # noqa: E402

GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=2)


def _empty_cache():
    if DEVICE == "cuda":
        torch.cuda.empty_cache()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, default_model_dir):
    root = tmp_path_factory.mktemp("gpu_lora")
    base = make_tiny_model(root, "llama", default_model_dir)
    loras = [LoRARequest("all", 1, make_adapter(base, str(root / "all"), ALL_PROJ, seed=1)),
             LoRARequest("qv", 2, make_adapter(base, str(root / "qv"), ["q_proj", "v_proj"],
                                                r=4, alpha=8, seed=2))]
    return base, loras


def test_adapters_match_peft_and_mix_in_one_batch(tiny):
    base, loras = tiny
    with LLM(base, device=DEVICE, dtype="float32", enable_lora=True, max_loras=2,
             max_lora_rank=8, max_num_seqs=8, max_model_len=256,
             num_gpu_blocks_override=128) as llm:
        for lora in loras:
            check_against_peft(llm, peft_model(base, lora.lora_path), lora)
        choice = [None, loras[0], loras[1], None, loras[1], loras[0], None, loras[0]]
        mixed = llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=choice)
        alone = [llm.generate([p], GREEDY, use_tqdm=False, lora_request=c)[0]
                 for p, c in zip(PROMPTS, choice)]
        assert_greedy_outputs_match([o.outputs[0] for o in alone],
                                    [o.outputs[0] for o in mixed])
        # The adapters do change the output (else the comparisons prove little).
        assert len({tuple(o.outputs[0].token_ids) for o in alone[:3]}) == 3
        engine = llm.llm_engine
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    _empty_cache()


SWAP_PROMPTS = ["The history of the printing press", "List three prime numbers:",
                "A short poem about rain:", "def add(a, b):",
                "Translate 'good morning' to French:", "The largest planet is",
                "Steps to boil an egg:", "Once upon a time"]
SWAP_GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=2)


def _swap_run(path: str, **kwargs):
    with LLM(path, device=DEVICE, dtype="float32", max_num_seqs=8, max_model_len=256,
             **kwargs) as llm:
        outs = [o.outputs[0] for o in llm.generate(SWAP_PROMPTS, SWAP_GREEDY, use_tqdm=False)]
        engine = llm.llm_engine
        stats = engine.stats
        bm = engine.block_manager
        host = engine.executor.worker.cache_engine.host_kv_caches
        assert bm.num_free_blocks == bm.num_blocks and not any(bm.ref_counts)
        assert bm.cpu.num_free_blocks == bm.cpu.num_blocks
        sched = engine.scheduler
        assert not (sched.waiting or sched.running or sched.swapped)
        result = (outs, stats.num_preemptions, stats.num_swapped_out, stats.num_swapped_in,
                  host)
    _empty_cache()
    return result


def test_swap_preemption_keeps_outputs(tiny):
    base, _ = tiny
    roomy, preempted, _, _, _ = _swap_run(base, num_gpu_blocks_override=128)
    assert preempted == 0
    # 14 blocks of 16 tokens for 8 sequences growing to ~50 tokens (4 blocks each).
    got, preempted, out, back, host = _swap_run(base, num_gpu_blocks_override=14,
                                                preemption_mode="swap", swap_space=0.25)
    assert out > 0 and back == out and preempted == out
    if DEVICE == "cuda":
        # Blocks move between the device and page-locked host memory.
        assert host[0][0].is_pinned() and host[0][0].device.type == "cpu"
    assert_greedy_outputs_match(roomy, got)
