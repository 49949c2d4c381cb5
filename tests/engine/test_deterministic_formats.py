"""deterministic=True on quantized and bfloat16 weights (issue 31): the GGUF file's own
Q4_1/Q8_0 blocks, int8, int4, and bfloat16 (on the bfloat16 panel kernel). A request's token
ids and logprobs are the same bits run alone and in a batch with 20 other requests of varied
lengths, greedy and seeded, because every linear layer (LM head included: int8 under int4, the
file's Q8_0 blocks under gguf) runs the native kernel at every row count rather than
dequantize + GEMM past a few rows, and the fused decode stack takes any number of rows (it runs
the same kernels)."""
from __future__ import annotations

import gc
import sys

import pytest
import torch

from pagedlm import LLM, SamplingParams
from pagedlm.kernels import gemv
from pagedlm.model_executor.layers.native_linear import WeightFormat
from pagedlm.model_executor.layers.linear_method import LinearMethodBase, UnquantizedLinearMethod
from pagedlm.model_executor.layers.quantization.base import weight_formats
from tests.conftest import needs_kernels

# Two probes: their prefills are 30-60 rows alone (past the default's switch to dequantize +
# GEMM on AVX2 builds for q8_0/i8) and their decode steps 1-2 rows.
PROBES = ["Note 1: " + " ".join(f"item {3 * j} goes on shelf {j % 3}." for j in range(6)),
          "The town library opened its doors at nine every morning, and by ten the reading "
          "room was usually full of students"]
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=3)
SEEDED = SamplingParams(temperature=1.0, seed=11, max_tokens=4, ignore_eos=True, logprobs=3)
# 20 others of 2-40 words and 1-6 tokens out, greedy and seeded, so the batch's rows change
# from step to step.
OTHERS = [" ".join(["word"] * (2 + 2 * i)) + f" {i}" for i in range(20)]
OTHER_PARAMS = [SamplingParams(temperature=(i % 2) * 0.8, seed=i, max_tokens=1 + i % 6,
                               ignore_eos=True) for i in range(20)]


def _outputs(outs) -> list:
    return [(list(o.outputs[0].token_ids),
             [{t: lp.logprob for t, lp in pos.items()} for pos in o.outputs[0].logprobs])
            for o in outs]


def _linear_methods(model) -> list[LinearMethodBase]:
    return [m.linear_method for m in model.modules()
            if isinstance(getattr(m, "linear_method", None), LinearMethodBase)]


@needs_kernels
def test_the_switch_reaches_every_float_linear_method():
    model = LLM(deterministic=True).llm_engine.executor.worker.model
    methods = _linear_methods(model)
    assert methods and all(type(m) is UnquantizedLinearMethod and m.deterministic
                           for m in methods)
    default = LLM().llm_engine.executor.worker.model
    assert not any(m.deterministic for m in _linear_methods(default))


@needs_kernels
@pytest.mark.parametrize("quantization", ["gguf", "int8", "int4"])
def test_quantized_request_is_bitwise_alone_and_in_a_batch(quantization):
    llm = LLM(deterministic=True, quantization=quantization, kv_cache_memory_bytes=32 * 2**20)
    model = llm.llm_engine.executor.worker.model
    assert "float" not in weight_formats(model)  # every linear layer is quantized
    assert all(method.deterministic for method in _linear_methods(model))
    params = [GREEDY, SEEDED]
    alone = [_outputs(llm.generate([p], [sp], use_tqdm=False))[0]
             for p, sp in zip(PROBES, params)]
    prompts = OTHERS[:7] + PROBES[:1] + OTHERS[7:15] + PROBES[1:] + OTHERS[15:]
    sampling = OTHER_PARAMS[:7] + params[:1] + OTHER_PARAMS[7:15] + params[1:] + OTHER_PARAMS[15:]
    batch = llm.generate(prompts, sampling, use_tqdm=False)
    assert _outputs([batch[7], batch[16]]) == alone
    # The decode steps of more than gemv.GEMV_MAX_ROWS rows ran fused too.
    stack = model.fused_decode.stack
    assert stack is not None and stack.max_rows == sys.maxsize
    del llm, model
    gc.collect()


@needs_kernels
def test_bfloat16_request_is_bitwise_alone_in_a_batch_and_from_the_prefix_cache():
    """dtype="bfloat16" (issue 32): the weights on the bfloat16 panel kernel (one FMA chain
    per output, as float32), the KV cache bfloat16. The probes alone from a cold cache, then in
    the batch with their prefixes read from the prefix cache, then alone again from it."""
    if torch.bfloat16 not in gemv.panel_dtypes():
        pytest.skip("no bfloat16 panel kernel in this build (deterministic=True refuses it)")
    llm = LLM(dtype="bfloat16", deterministic=True, kv_cache_memory_bytes=32 * 2**20)
    model = llm.llm_engine.executor.worker.model
    forms = {m.native_form(layer).fmt for layer in model.modules()
             for m in [getattr(layer, "linear_method", None)]
             if isinstance(m, LinearMethodBase)}
    assert forms == {WeightFormat.BF16_PANELS}
    assert llm.llm_engine.executor.worker.cache_engine.kv_caches[0][0].dtype == torch.bfloat16
    params = [GREEDY, SEEDED]
    cold = [llm.generate([p], [sp], use_tqdm=False)[0] for p, sp in zip(PROBES, params)]
    prompts = OTHERS[:7] + PROBES[:1] + OTHERS[7:15] + PROBES[1:] + OTHERS[15:]
    sampling = OTHER_PARAMS[:7] + params[:1] + OTHER_PARAMS[7:15] + params[1:] + OTHER_PARAMS[15:]
    batch = llm.generate(prompts, sampling, use_tqdm=False)
    hits = [llm.generate([p], [sp], use_tqdm=False)[0] for p, sp in zip(PROBES, params)]
    assert [o.num_cached_tokens for o in cold] == [0, 0]
    assert all(o.num_cached_tokens >= 16 for o in [batch[7], batch[16], *hits])
    assert _outputs([batch[7], batch[16]]) == _outputs(cold) == _outputs(hits)
    stack = model.fused_decode.stack
    assert stack is not None and stack.max_rows == sys.maxsize
    del llm, model
    gc.collect()
