"""PAGEDLM_TRITON_FUSED_NORM_ACT=1 on a GPU (layers/fused_decode.py's TritonFusedLayers: the
norms folded into the QKV and gate_up GEMVs, SiLU-and-mul into the down GEMV) against the same
engine without it: the same greedy tokens on a tiny random Llama in bfloat16, with CUDA graphs
(the 1- and 2-row graphs record the fused kernels, the larger ones the layers).

The two paths round alike; only the norm's float32 sum of squares may be reduced in another
order (kernels/triton/fused_gemv.py), so a token may part at a near tie: there the unfused run
must rank the fused run's token within 0.1 nats of its own, and the request is compared no
further. A wrong kernel or wiring parts at the first decode step, by far more. The kernels
themselves, and the wiring's choices, are tested under the interpreter too
(tests/kernels/test_triton_fused_gemv.py, test_triton_fused_layers.py). Skips without CUDA."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

from pagedlm import LLM, SamplingParams  # noqa: E402
from tests.conftest import make_tiny_model  # noqa: E402

# The decode batch shrinks 5 -> 1 as requests finish: steps of 3-5 rows run the layers (the
# graphs of 4 and 8), those of 1 and 2 the fused kernels.
PROMPTS = ["The capital of France is", "One, two, three,", "Hello",
           "In a hole in the ground there lived a hobbit. Not a nasty, dirty, wet hole",
           "def fibonacci(n):"]
MAX_TOKENS = [32, 28, 24, 12, 8]
NEAR_TIE = 0.1  # nats


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory, default_model_dir):
    return make_tiny_model(tmp_path_factory.mktemp("fused_norm_act"), "llama",
                           default_model_dir)


def _generate(path: str, fused: bool, monkeypatch):
    if fused:
        monkeypatch.setenv("PAGEDLM_TRITON_FUSED_NORM_ACT", "1")
    else:
        monkeypatch.delenv("PAGEDLM_TRITON_FUSED_NORM_ACT", raising=False)
    params = [SamplingParams(max_tokens=m, temperature=0, logprobs=2, ignore_eos=True)
              for m in MAX_TOKENS]
    with LLM(path, device="cuda", dtype="bfloat16", max_num_seqs=8, max_model_len=256,
             num_gpu_blocks_override=128) as llm:
        outs = [o.outputs[0] for o in llm.generate(PROMPTS, params, use_tqdm=False)]
        worker = llm.llm_engine.executor.worker
        fused_decode, graphs = worker.model.fused_decode, worker.runner.cuda_graphs
        info = {"stack": type(fused_decode.stack).__name__ if fused_decode.stack else None,
                "off_reason": fused_decode.off_reason,
                "steps": getattr(fused_decode.stack, "steps", 0),
                "sizes": graphs.sizes if graphs is not None else None,
                "replays": graphs.replays if graphs is not None else 0}
    torch.cuda.empty_cache()
    return outs, info


def test_fused_norm_act_gives_the_unfused_tokens(tiny_llama, monkeypatch):
    ref, off = _generate(tiny_llama, False, monkeypatch)
    got, on = _generate(tiny_llama, True, monkeypatch)
    assert off["stack"] is None
    assert off["off_reason"] == "PAGEDLM_TRITON_FUSED_NORM_ACT is not set"
    # Built, run (the graphs' warm-up and capture at 1 and 2 rows at least) and replayed.
    assert on["stack"] == "TritonFusedLayers" and on["steps"] >= 4, on
    assert on["sizes"] == [1, 2, 4, 8] and on["replays"] >= max(MAX_TOKENS) - 2, on
    compared = 0
    for r, g in zip(ref, got):
        assert len(g.token_ids) == len(r.token_ids)
        for i, (tr, tg) in enumerate(zip(r.token_ids, g.token_ids)):
            lp_r, lp_g = r.logprobs[i], g.logprobs[i]
            if tr != tg:  # a near tie in the unfused run, or a wrong path
                assert tg in lp_r and lp_r[tr].logprob - lp_r[tg].logprob < NEAR_TIE, (
                    i, tr, tg, lp_r, lp_g)
                break
            assert abs(lp_r[tr].logprob - lp_g[tg].logprob) < 0.05, (i, lp_r, lp_g)
            compared += 1
    # Most of the tokens, not only the ones up to an early near tie.
    assert compared >= sum(MAX_TOKENS) // 2, compared
