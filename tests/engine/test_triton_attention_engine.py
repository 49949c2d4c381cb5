"""The whole engine through the Triton attention backend on the CPU (Triton's interpreter, which
tests/conftest.py selects when there is no GPU): a tiny random Llama gives the greedy tokens of
the default CPU backend, with chunked prefill over cached context and decodes in the same
steps. On a GPU, tests/gpu runs the engine through the compiled kernels. Kept small: the
interpreter runs each kernel program in Python (tens of milliseconds each)."""
from __future__ import annotations

import pytest
import torch

from pagedlm import LLM, SamplingParams
from pagedlm.attention.layer import Attention
from tests.conftest import make_tiny_model

pytestmark = pytest.mark.skipif(torch.cuda.is_available(),
                                reason="the interpreter runs only without a GPU; tests/gpu "
                                       "covers the compiled kernels")

# A 20-token prompt in three chunks (max_num_batched_tokens=8: the later ones read the earlier
# ones from the cache), and a short one that decodes beside them.
PROMPTS = ["one two three four five six seven eight nine ten eleven twelve thirteen fourteen "
           "fifteen sixteen seventeen eighteen nineteen twenty", "Hi"]


def _generate(model: str, **kw) -> tuple[list[list[int]], set[str]]:
    llm = LLM(model, max_num_batched_tokens=8, max_num_seqs=4, max_model_len=64,
              kv_cache_memory_bytes=2**20, **kw)
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    try:
        tokens = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
        model = llm.llm_engine.executor.worker.model
        backends = {m.backend.name for m in model.modules() if isinstance(m, Attention)}
    finally:
        llm.shutdown()
    return tokens, backends


def test_triton_backend_gives_the_default_backends_tokens(tmp_path, default_model_dir,
                                                         monkeypatch):
    model = make_tiny_model(tmp_path, "llama", default_model_dir, num_hidden_layers=2,
                            num_attention_heads=2, num_key_value_heads=1)
    monkeypatch.delenv("PAGEDLM_ATTENTION_BACKEND", raising=False)
    want, default_backends = _generate(model)
    monkeypatch.setenv("PAGEDLM_ATTENTION_BACKEND", "triton")
    got, backends = _generate(model)
    assert backends == {"triton"} and "triton" not in default_backends
    assert got == want
