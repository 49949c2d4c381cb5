"""The float32 GEMV kernel and the fused Llama decode stack.

- gemv against a float64 matmul on the default model's decode shapes and ragged ones (N not a
  multiple of the 4-row group, K not a multiple of 8, a matrix small enough to stay on one
  thread), 1 to GEMV_MAX_ROWS rows; one and two threads give the same bits (each output is
  summed by one thread, in one order).
- The panel kernel (the float32 layers past GEMV_MAX_ROWS rows on AVX-512) the same way, at row
  counts around its 12-row tiles and 192-row blocks, and through UnquantizedLinearMethod.
- The fused decode stack against the layer-by-layer path of the same engine configuration:
  the same tokens and bit-identical logprobs for Llama (GQA), Qwen2 (biased q/k/v), Mistral
  (a sliding window shorter than the prompts), a bfloat16 KV cache, and int8 / int4 weights.
  Each run mixes steps the stack takes (decodes: 1 to 10 on the panel kernel, else 1 to 8)
  with steps it leaves to the layers (prefills, and 10 decodes off the panel kernel), and the
  test checks it took some and left the disabled run alone.
"""
import ctypes
import os
import shutil
import sys

import pytest
import torch

from pagedlm import LLM, SamplingParams
from pagedlm.model_executor.layers import gemv
from pagedlm.model_executor.models.llama import LlamaFusedDecode
from tests.conftest import make_tiny_model

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None, reason="no C compiler")

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (4099, 576), (37, 100), (8, 64)]


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("m", [1, 2, 3, 5, gemv.GEMV_MAX_ROWS])
def test_gemv_matches_float64(n, k, m):
    assert gemv.available()
    g = torch.Generator().manual_seed(n * 7 + k + m)
    w, x, b = torch.randn(n, k, generator=g), torch.randn(m, k, generator=g), torch.randn(n)
    ref = (x.double() @ w.double().T + b.double()).float()
    got = gemv.gemv(x, w, b)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-4)
    # Strided x (a view into a wider output) is copied, not misread.
    wide = torch.randn(m, k + 8, generator=g)
    torch.testing.assert_close(gemv.gemv(wide[:, :k], w), (wide[:, :k].double() @ w.double().T)
                               .float(), rtol=1e-5, atol=1e-4)
    lib, p = gemv.load_library(), ctypes.c_void_p
    one, two = torch.empty(m, n), torch.empty(m, n)
    lib.gemv_f32(one.data_ptr(), x.data_ptr(), w.data_ptr(), m, n, k, 1)
    lib.gemv_f32(two.data_ptr(), x.data_ptr(), w.data_ptr(), m, n, k, 2)
    assert torch.equal(one, two) and torch.equal(one + b, got)


def test_gemv_rejects_bad_input():
    w = torch.randn(16, 32)
    with pytest.raises(ValueError, match=r"x must be float32 \[M, 32\]"):
        gemv.gemv(torch.randn(1, 31), w)
    with pytest.raises(ValueError, match="float32"):
        gemv.gemv(torch.randn(1, 32, dtype=torch.float64), w)
    assert not gemv.runs(w.T) and not gemv.runs(w.bfloat16()) and gemv.runs(w)


def _has_avx512() -> bool:
    with open("/proc/cpuinfo") as f:
        return " avx512f" in f.read()


needs_panels = pytest.mark.skipif(not _has_avx512(), reason="the panel kernel needs AVX-512")


@needs_panels
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("m", [1, 9, 12, 13, 25, 64, 192, 200])
def test_gemm_panels_matches_float64(n, k, m):
    assert gemv.panel_width() == 32
    g = torch.Generator().manual_seed(n * 5 + k + m)
    w, x, b = torch.randn(n, k, generator=g), torch.randn(m, k, generator=g), torch.randn(n)
    panels = gemv.pack_panels(w)
    assert panels.shape == (-(-n // 32), k, 32)
    got = gemv.gemm_panels(x, panels, n, b)
    # One running float32 sum per output over K (no partial sums as in gemv): at K=1536 the
    # rounding reaches 1e-4 on outputs of magnitude ~40.
    tol = dict(rtol=1e-5, atol=3e-4)
    torch.testing.assert_close(got, (x.double() @ w.double().T + b.double()).float(), **tol)
    wide = torch.randn(m, k + 8, generator=g)
    torch.testing.assert_close(gemv.gemm_panels(wide[:, :k], panels, n),
                               (wide[:, :k].double() @ w.double().T).float(), **tol)
    lib = gemv.load_library()
    one, two = torch.empty(m, n), torch.empty(m, n)
    lib.gemm_panels_f32(one.data_ptr(), x.data_ptr(), panels.data_ptr(), m, n, k, 1)
    lib.gemm_panels_f32(two.data_ptr(), x.data_ptr(), panels.data_ptr(), m, n, k, 2)
    assert torch.equal(one, two) and torch.equal(one + b, got)


@needs_panels
def test_linear_layers_use_panels():
    from pagedlm.model_executor.layers.linear import UnquantizedLinearMethod
    layer = torch.nn.Module()
    method = UnquantizedLinearMethod()
    method.create_weights(layer, 96, [40, 60], 96, 100, torch.float32, None)
    layer.weight.data.copy_(torch.randn(100, 96))
    method.process_weights_after_loading(layer)
    # The panels replace oneDNN's copy: one packed copy of the weight, not two.
    assert layer.panel_weight is not None and layer.packed_weight is None
    for rows in (1, gemv.GEMV_MAX_ROWS + 1, 50):
        x, b = torch.randn(rows, 96), torch.randn(100)
        torch.testing.assert_close(method.apply(layer, x, b), x @ layer.weight.T + b,
                                   rtol=1e-5, atol=1e-4)
    with pytest.raises(ValueError, match=r"x must be float32 \[M, 96\]"):
        gemv.gemm_panels(torch.randn(3, 95), layer.panel_weight, 100)
    with pytest.raises(ValueError, match="do not fit 4 panels"):
        gemv.gemm_panels(torch.randn(3, 96), layer.panel_weight, 200)


def _random_biases(path: str) -> str:
    """transformers initialises biases to zero, which would hide a bias the stack dropped."""
    from safetensors.torch import load_file, save_file
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    g = torch.Generator().manual_seed(1)
    for name, t in tensors.items():
        if name.endswith(".bias"):
            tensors[name] = torch.randn(t.shape, generator=g) * 0.5
    save_file(tensors, file, metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, default_model_dir):
    root = tmp_path_factory.mktemp("fused")
    return {"llama": make_tiny_model(root, "llama", default_model_dir),
            "qwen2": _random_biases(make_tiny_model(root, "qwen2", default_model_dir)),
            "mistral": make_tiny_model(root, "mistral", default_model_dir, sliding_window=6)}


PROMPTS = ["The capital of France is", "Write a haiku about the sea and the moon.",
           "def fibonacci(n):", "1, 2, 3, 4, 5,", "Once upon a time, in a land far away,",
           "The quick brown fox", "Translate to French: good morning", "Q: 2 + 2 = ? A:",
           "import numpy as np", "Dear Sir or Madam,"]


def _run(model: str, fused: bool, monkeypatch, **engine_args):
    """Greedy tokens and their logprobs, and the fused stack's step count (None: off)."""
    if fused:
        monkeypatch.delenv("PAGEDLM_DISABLE_FUSED_DECODE", raising=False)
    else:
        monkeypatch.setenv("PAGEDLM_DISABLE_FUSED_DECODE", "1")
    llm = LLM(model=model, **engine_args)
    # Lengths 4..22: the batch shrinks from 10 decodes to one.
    outs = [llm.generate(PROMPTS, [SamplingParams(temperature=0, max_tokens=4 + 2 * i,
                                                  ignore_eos=True, logprobs=2)
                                   for i in range(len(PROMPTS))], use_tqdm=False)]
    outs.append(llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=12,
                                                         ignore_eos=True, logprobs=2),
                             use_tqdm=False))
    result = [(list(o.outputs[0].token_ids),
               [sorted((t, lp.logprob) for t, lp in step.items()) for step in o.outputs[0].logprobs])
              for batch in outs for o in batch]
    stack = llm.llm_engine.executor.worker.model.fused_decode
    return result, stack if isinstance(stack, LlamaFusedDecode) else None


@pytest.mark.parametrize("arch,engine_args", [
    ("llama", {}),
    ("qwen2", {}),
    ("mistral", {}),
    ("llama", {"kv_cache_dtype": "bfloat16"}),
    ("qwen2", {"quantization": "int8"}),
    ("llama", {"quantization": "int4"}),
])
def test_fused_stack_equals_layer_by_layer(tiny, monkeypatch, arch, engine_args):
    ref, off = _run(tiny[arch], False, monkeypatch, **engine_args)
    got, stack = _run(tiny[arch], True, monkeypatch, **engine_args)
    assert off is None and stack.steps > 20
    assert got == ref  # tokens and every logprob, bit for bit
    # On the panel kernel the stack takes decode steps of any size (here the 10-decode ones
    # too); on other kernels only those the layers run on the same kernel.
    panels = _has_avx512() and "quantization" not in engine_args
    assert stack.max_rows == (sys.maxsize if panels else gemv.GEMV_MAX_ROWS)
