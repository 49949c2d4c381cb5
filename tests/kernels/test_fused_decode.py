"""The float32 GEMV kernel and the fused Llama decode stack.

- gemv against a float64 matmul on the default model's decode shapes and ragged ones (N not a
  multiple of the 4-row group, K not a multiple of 8, a matrix small enough to stay on one
  thread), 1 to GEMV_MAX_ROWS rows; one and two threads give the same bits (each output is
  summed by one thread, in one order).
- The panel kernel (the float32 layers at every row count with AVX2 or AVX-512) the same way,
  at row counts around its tiles (6 rows with AVX2, 12 with AVX-512) and 192-row blocks, and
  through UnquantizedLinearMethod; bit for bit against a sequential float32 FMA chain over K
  (libm's fmaf), and a row's output bit for bit the same whatever the row count, the row's
  position and the thread count. The layer tests run on every CPU, with the kernels on and
  disabled: they check the layer took the kernel production takes there (without the panel
  kernel: GEMV, then oneDNN) and hold it to the panel kernel's assertions.
- The fused decode stack against the layer-by-layer path of the same engine configuration:
  the same tokens and bit-identical logprobs for Llama (GQA), Qwen2 (biased q/k/v), Mistral
  (a sliding window shorter than the prompts), bfloat16 weights (on their own panels, float32
  activations) with a bfloat16 KV cache, and int8 / int4 weights.
  Each run mixes steps the stack takes (decodes: 1 to 10 on the panel kernel, else 1 to 8)
  with steps it leaves to the layers (prefills, and 10 decodes off the panel kernel), and the
  test checks it took some and left the disabled run alone.
- Which layers it takes: each LinearMethod's native form (float on the GEMV or panel kernel,
  int8, int4; none for a method with its own matmul), and the decoder layers that declare the
  standard structure (not Qwen3's q/k-norm attention, which says why it runs layer by layer).
"""
import ctypes
import ctypes.util
import os
import sys

import pytest
import torch

from pagedlm import LLM, SamplingParams
from pagedlm.kernels import amx, gemv
from pagedlm.model_executor.layers import fused_decode
from pagedlm.model_executor.layers.fused_decode import FusedDecode
from pagedlm.model_executor.layers.linear_method import UnquantizedLinearMethod
from pagedlm.model_executor.layers.native_linear import NativeLinear, WeightFormat
from tests.conftest import make_tiny_model, needs_kernels

# Not module-wide: the float32 layer tests' fallback variants run without a compiler too.
NATIVE_AND_DISABLED = [pytest.param("native", marks=needs_kernels), "disabled"]

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (4099, 576), (37, 100), (8, 64)]


@needs_kernels
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
    lib = gemv.library()
    one, two = torch.empty(m, n), torch.empty(m, n)
    lib.gemv_f32(one.data_ptr(), x.data_ptr(), w.data_ptr(), m, n, k, 1)
    lib.gemv_f32(two.data_ptr(), x.data_ptr(), w.data_ptr(), m, n, k, 2)
    assert torch.equal(one, two) and torch.equal(one + b, got)


@needs_kernels
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


def _has_panels() -> bool:
    """Whether this build has the panel kernel (AVX2 or AVX-512), whatever the environment."""
    lib = gemv.library()
    return lib is not None and lib.gemm_panel_width() > 0


needs_panels = pytest.mark.skipif(not _has_panels(),
                                  reason="the panel kernel needs AVX2 or AVX-512")
# Around the panel kernel's 6-row (AVX2) and 12-row (AVX-512) tiles and 192-row blocks.
PANEL_ROWS = [1, 5, 6, 7, 9, 12, 13, 25, 64, 192, 200]


@needs_kernels
@needs_panels
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("m", PANEL_ROWS)
def test_gemm_panels_matches_float64(n, k, m):
    """The panel kernel itself (AVX2 or AVX-512: test_float32_linear_matches_float64 runs the
    same checks on whichever kernel a CPU without it uses)."""
    width = gemv.panel_width()
    assert width == 32 or (width == 16 and not _has_avx512())
    g = torch.Generator().manual_seed(n * 5 + k + m)
    w, x, b = torch.randn(n, k, generator=g), torch.randn(m, k, generator=g), torch.randn(n)
    panels = gemv.pack_panels(w)
    assert panels.shape == (-(-n // width), k, width)
    got = gemv.gemm_panels(x, panels, n, b)
    # One running float32 sum per output over K (no partial sums as in gemv): at K=1536 the
    # rounding reaches 1e-4 on outputs of magnitude ~40.
    tol = dict(rtol=1e-5, atol=3e-4)
    torch.testing.assert_close(got, (x.double() @ w.double().T + b.double()).float(), **tol)
    wide = torch.randn(m, k + 8, generator=g)
    torch.testing.assert_close(gemv.gemm_panels(wide[:, :k], panels, n),
                               (wide[:, :k].double() @ w.double().T).float(), **tol)
    lib = gemv.library()
    one, two = torch.empty(m, n), torch.empty(m, n)
    lib.gemm_panels_f32(one.data_ptr(), x.data_ptr(), panels.data_ptr(), m, n, k, 1)
    lib.gemm_panels_f32(two.data_ptr(), x.data_ptr(), panels.data_ptr(), m, n, k, 2)
    assert torch.equal(one, two) and torch.equal(one + b, got)


def _fma_chain(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x @ w.T with each output one float32 FMA chain over k ascending from 0.0 (libm's fmaf,
    correctly rounded): the order the panel kernel promises, computed without it."""
    libm = ctypes.CDLL(ctypes.util.find_library("m"))
    fmaf = libm.fmaf
    fmaf.argtypes, fmaf.restype = [ctypes.c_float] * 3, ctypes.c_float
    xs, ws = x.tolist(), w.tolist()
    out = []
    for xr in xs:
        row = []
        for wr in ws:
            c = 0.0
            for a, b in zip(xr, wr):
                c = fmaf(a, b, c)
            row.append(c)
        out.append(row)
    return torch.tensor(out, dtype=torch.float32)


@needs_kernels
@needs_panels
@pytest.mark.parametrize("m,n,k", [(7, 37, 45), (13, 16, 3), (1, 50, 100), (6, 33, 1),
                                   (2, 17, 64)])
def test_gemm_panels_is_one_fma_chain_per_output(m, n, k):
    """Bit for bit the sequential FMA order, so the same bits with AVX2 and AVX-512 builds."""
    g = torch.Generator().manual_seed(m * 31 + n + k)
    w, x = torch.randn(n, k, generator=g), torch.randn(m, k, generator=g)
    assert torch.equal(gemv.gemm_panels(x, gemv.pack_panels(w), n), _fma_chain(x, w))


@needs_kernels
@needs_panels
@pytest.mark.parametrize("n,k", [(1000, 131), (37, 100), (576, 576)])
def test_gemm_panels_row_is_batch_invariant(n, k):
    """A row's output has the same bits whatever batch it is in: the row count (inside one
    tile, at a tile's edge, across tiles and 192-row blocks), its position, and 1 or 2
    threads; N ragged against both panel widths, K odd."""
    g = torch.Generator().manual_seed(n + k)
    w, probe = torch.randn(n, k, generator=g), torch.randn(1, k, generator=g)
    panels, lib = gemv.pack_panels(w), gemv.library()
    alone = torch.empty(1, n)
    lib.gemm_panels_f32(alone.data_ptr(), probe.data_ptr(), panels.data_ptr(), 1, n, k, 1)
    for m in (1, 5, 6, 7, 37, 200):
        for pos in sorted({0, m // 2, m - 1}):
            x = torch.randn(m, k, generator=g)
            x[pos] = probe[0]
            for threads in (1, 2):
                y = torch.full((m, n), float("nan"))
                lib.gemm_panels_f32(y.data_ptr(), x.data_ptr(), panels.data_ptr(), m, n, k,
                                    threads)
                assert torch.equal(y[pos], alone[0]), (m, pos, threads)
                assert not y.isnan().any()  # every output written


def _float_layer(out_features: int, in_features: int, weight: torch.Tensor | None = None):
    """A loaded float32 layer of UnquantizedLinearMethod: its kernel picked as in production."""
    from pagedlm.model_executor.layers.linear_method import UnquantizedLinearMethod
    layer, method = torch.nn.Module(), UnquantizedLinearMethod()
    method.create_weights(layer, in_features, [out_features], in_features, out_features,
                          torch.float32, None)
    layer.weight.data.copy_(torch.randn(out_features, in_features) if weight is None
                            else weight)
    method.process_weights_after_loading(layer)
    return layer, method


def _expected_path(rows: int) -> str:
    """The kernel a float32 layer runs `rows` rows on, on this CPU (gemv.py's dispatch)."""
    if gemv.available() and _has_panels():
        return "panels"
    if gemv.available() and rows <= gemv.GEMV_MAX_ROWS:
        return "gemv"
    return "onednn" if torch.backends.mkldnn.is_available() else "F.linear"


def _path_taken(layer, rows: int) -> str:
    if layer.panel_weight is not None:
        return "panels"
    if layer.use_gemv and rows <= gemv.GEMV_MAX_ROWS:
        return "gemv"
    return "onednn" if layer.packed_weight is not None else "F.linear"


@pytest.mark.parametrize("kernels", NATIVE_AND_DISABLED)
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("m", PANEL_ROWS)
def test_float32_linear_matches_float64(n, k, m, kernels, monkeypatch):
    """test_gemm_panels_matches_float64's shapes and assertions through the float32 layer, on
    whichever kernel production runs them on this CPU (the panel kernel with AVX-512, else the
    GEMV kernel up to GEMV_MAX_ROWS rows and oneDNN past them) and with the kernels disabled:
    the panel kernel's test skips without AVX-512, this one never does."""
    if kernels == "disabled":
        monkeypatch.setenv("PAGEDLM_DISABLE_KERNELS", "1")
    else:
        assert gemv.available()  # a compiler is there: the kernels must build
    g = torch.Generator().manual_seed(n * 5 + k + m)
    w, x, b = torch.randn(n, k, generator=g), torch.randn(m, k, generator=g), torch.randn(n)
    layer, method = _float_layer(n, k, w)
    path = _path_taken(layer, m)
    assert path == _expected_path(m)
    got = method.apply(layer, x, b)
    tol = dict(rtol=1e-5, atol=3e-4)
    torch.testing.assert_close(got, (x.double() @ w.double().T + b.double()).float(), **tol)
    wide = torch.randn(m, k + 8, generator=g)
    torch.testing.assert_close(method.apply(layer, wide[:, :k]),
                               (wide[:, :k].double() @ w.double().T).float(), **tol)
    if path in ("panels", "gemv"):  # our kernels: each output summed by one thread
        threads = torch.get_num_threads()
        try:
            torch.set_num_threads(1)
            one = method.apply(layer, x, b)
            torch.set_num_threads(2)
            two = method.apply(layer, x, b)
        finally:
            torch.set_num_threads(threads)
        assert torch.equal(one, two) and torch.equal(one, got)


@pytest.mark.parametrize("kernels", NATIVE_AND_DISABLED)
def test_linear_layers_pick_their_kernel(kernels, monkeypatch):
    if kernels == "disabled":
        monkeypatch.setenv("PAGEDLM_DISABLE_KERNELS", "1")
    else:
        assert gemv.available()  # a compiler is there: the kernels must build
    layer, method = _float_layer(100, 96)
    if _expected_path(1) == "panels":
        # The panels replace oneDNN's copy: one packed copy of the weight, not two.
        assert layer.panel_weight is not None and layer.packed_weight is None
    else:
        assert layer.panel_weight is None
        assert layer.use_gemv == (kernels == "native")
        assert (layer.packed_weight is not None) == torch.backends.mkldnn.is_available()
    for rows in (1, gemv.GEMV_MAX_ROWS, gemv.GEMV_MAX_ROWS + 1, 50):
        assert _path_taken(layer, rows) == _expected_path(rows)
        x, b = torch.randn(rows, 96), torch.randn(100)
        torch.testing.assert_close(method.apply(layer, x, b), x @ layer.weight.T + b,
                                   rtol=1e-5, atol=1e-4)
    # gemm_panels checks its input before the kernel runs, so on every CPU that builds it.
    panels = (layer.panel_weight if layer.panel_weight is not None
              else torch.zeros(4, 96, 32))
    num_panels, _, width = panels.shape
    with pytest.raises(ValueError, match=f"do not fit {num_panels} panels of {width}"):
        gemv.gemm_panels(torch.randn(3, 96), panels, num_panels * width + 1)
    if gemv.library() is not None:
        with pytest.raises(ValueError, match=r"x must be float32 \[M, 96\]"):
            gemv.gemm_panels(torch.randn(3, 95), panels, 100)


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
    """Greedy tokens and their logprobs, and the model's FusedDecode after the runs."""
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
               [sorted((t, lp.logprob) for t, lp in step.items())
                for step in o.outputs[0].logprobs])
              for batch in outs for o in batch]
    fused_decode = llm.llm_engine.executor.worker.model.fused_decode
    assert isinstance(fused_decode, FusedDecode)
    # Decided at the first step: exactly one of the stack and the reason it is off.
    assert (fused_decode.stack is None) != (fused_decode.off_reason is None)
    return result, fused_decode


@needs_kernels
@pytest.mark.parametrize("arch,engine_args", [
    ("llama", {}),
    ("qwen2", {}),
    ("mistral", {}),
    # bfloat16 weights (their own panels) and cache in one run: the suite's time is tight.
    ("llama", {"dtype": "bfloat16", "kv_cache_dtype": "bfloat16"}),
    # float16 weights on their own panels, which deterministic=True takes (exact widening).
    ("llama", {"dtype": "float16", "deterministic": True}),
    ("qwen2", {"quantization": "int8"}),
    ("llama", {"quantization": "int4"}),
])
def test_fused_stack_equals_layer_by_layer(tiny, monkeypatch, arch, engine_args):
    if engine_args.get("dtype") in ("bfloat16", "float16") and not _has_panels():
        pytest.skip("2-byte weights run on a native kernel (the panel kernel) only with AVX2")
    ref, off = _run(tiny[arch], False, monkeypatch, **engine_args)
    got, on = _run(tiny[arch], True, monkeypatch, **engine_args)
    assert off.stack is None and off.off_reason == "PAGEDLM_DISABLE_FUSED_DECODE is set"
    stack = on.stack
    assert stack.steps > 20
    assert got == ref  # tokens and every logprob, bit for bit
    # On the panel kernel the stack takes decode steps of any size (here the 10-decode ones
    # too); on other kernels only those the layers run on the same kernel.
    panels = _has_panels() and "quantization" not in engine_args
    # Except bfloat16 panels where the layers take AMX from linear_method.AMX_MIN_ROWS rows,
    # or vdpbf16ps from linear_method.DPBF16_MIN_ROWS (not in the deterministic mode): the
    # stack stops at GEMV_MAX_ROWS (NativeLinear.other_kernel_from).
    amx_rows = (engine_args.get("dtype") == "bfloat16" and not engine_args.get("deterministic")
                and (amx.available() or (gemv.bf16_dot_available() and not gemv.bf16_dpbf16())))
    assert stack.max_rows == (sys.maxsize if panels and not amx_rows else gemv.GEMV_MAX_ROWS)
    two_byte = {"bfloat16": WeightFormat.BF16_PANELS, "float16": WeightFormat.F16_PANELS}
    if engine_args.get("dtype") in two_byte:  # 2-byte weights: on their own panels
        assert {layer.qkv.seg[0].fmt for layer in stack.layers} == {
            two_byte[engine_args["dtype"]]}


@needs_kernels
@pytest.mark.parametrize("precise", [False, True])
def test_fused_stack_runs_the_gguf_block_formats(tiny, monkeypatch, precise):
    """csrc/quant_kquants.c's formats in the stack (llama_decode.c's qmm_<format>): int4's
    layers packed as q5_0 blocks instead (gguf-py's quantizer; the tiny model's widths are not
    multiples of the K-quants' 256) give the layer-by-layer tokens and logprobs bit for bit, at
    8 bits and in two limbs (PAGEDLM_PRECISE_ACTIVATIONS) alike."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize as gguf_quantize

    from pagedlm.model_executor.layers.quantization.weight_only import Int4LinearMethod

    def pack(self, layer):
        w = layer.weight.detach().float().numpy()
        raw = gguf_quantize(w, GGMLQuantizationType.Q5_0).reshape(w.shape[0], -1, 22)
        return "q5_0", torch.from_numpy(raw).contiguous(), None

    monkeypatch.setattr(Int4LinearMethod, "pack", pack)
    if precise:
        monkeypatch.setenv("PAGEDLM_PRECISE_ACTIVATIONS", "1")
    ref, _ = _run(tiny["llama"], False, monkeypatch, quantization="int4")
    got, on = _run(tiny["llama"], True, monkeypatch, quantization="int4")
    assert on.stack is not None and on.stack.steps > 20
    assert {layer.qkv.seg[0].fmt for layer in on.stack.layers} == {WeightFormat.Q5_0}
    assert on.stack.dims.x16_rows == (fused_decode._ALL_ROWS if precise else 0)
    assert got == ref


@needs_kernels
def test_linear_methods_describe_their_native_form():
    from pagedlm.model_executor.layers.quantization.weight_only import (Int4LinearMethod,
                                                                        Int8LinearMethod)

    def loaded(method, rows=64, cols=96):
        layer = torch.nn.Module()
        method.create_weights(layer, cols, [rows], cols, rows, torch.float32, None)
        layer.weight.data.copy_(torch.randn(rows, cols))
        method.process_weights_after_loading(layer)
        return layer

    layer = loaded(UnquantizedLinearMethod())
    form = UnquantizedLinearMethod().native_form(layer)
    if _has_panels():
        assert form == NativeLinear(WeightFormat.FLOAT_PANELS, layer.panel_weight)
    else:
        assert form.fmt == WeightFormat.FLOAT and form.weight is layer.weight
        assert form.scale is None
    layer = loaded(Int8LinearMethod())
    form = Int8LinearMethod().native_form(layer)
    assert form.fmt == WeightFormat.I8 and form.weight is layer.qweight_data
    assert form.scale is layer.qscale and form.scale.shape == (64,)
    layer = loaded(Int4LinearMethod())
    form = Int4LinearMethod().native_form(layer)
    assert form == NativeLinear(WeightFormat.Q4_1, layer.qweight_data, None)
    # Where the layer runs no kernel of ours (oneDNN, F.linear), there is no native form.
    layer.panel_weight, layer.use_gemv = None, False
    assert UnquantizedLinearMethod().native_form(layer) is None

    class OwnMatmul(Int8LinearMethod):
        def apply(self, layer, x, bias=None):
            return super().apply(layer, x, bias) * 2

    # A method that multiplies another way does not inherit its parent's form.
    assert OwnMatmul().native_form(loaded(OwnMatmul())) is None


@needs_kernels
def test_qwen3_layers_are_not_the_standard_block(tmp_path, default_model_dir):
    """Qwen3's q/k norms are work llama_decode.c does not do: its layers run one by one."""
    from tests.models.test_moe import make_tiny_moe_model
    llm = LLM(model=make_tiny_moe_model(tmp_path, "qwen3", default_model_dir))
    llm.generate(PROMPTS[:2], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    model = llm.llm_engine.executor.worker.model
    assert model.layers["0"].decoder_parts() is None
    fused_decode = model.fused_decode
    assert fused_decode.stack is None
    assert fused_decode.off_reason == ("decoder layer 0 (LlamaDecoderLayer) is not the "
                                       "standard block")
