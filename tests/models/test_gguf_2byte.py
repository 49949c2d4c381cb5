"""quantization="gguf" keeps a GGUF file's F16 and BF16 matrices 2 bytes a weight (issue 33):
a layer all of one of them on panels of that dtype (no float32 copy, no plain copy beside the
panels), a fused layer of two of them or of one beside blocks shard by shard. The panel kernel
widens them exactly, so every layer computes the float32 path's bits on the gguf-py-dequantized
weights: with the embedding the only quantized tensor (its lookup is exact too), greedy tokens
and logprobs equal the float path's bit for bit (but under the opt-in vdpbf16ps math on BF16
layers, PAGEDLM_BF16_DPBF16=1, which rounds x to bfloat16). Tiny Llama files written with
gguf-py.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize

from pagedlm.kernels import gemv
from pagedlm.model_executor.layers.linear import QKVParallelLinear
from pagedlm.model_executor.layers.linear_method import UnquantizedLinearMethod
from pagedlm.model_executor.layers.native_linear import PANEL_FORMATS, WeightFormat
from pagedlm.model_executor.layers.quantization import gguf as gguf_method
from pagedlm.model_executor.layers.quantization import kernels
from pagedlm.model_executor.model_loader.gguf_header import read_gguf_header
from pagedlm.model_executor.model_loader.gguf_weights import GGUFBlocks, GGUFWeights
from tests.conftest import needs_kernels
from tests.models.test_gguf_mmap import PROMPTS, _run_both
from tests.models.test_model_loading import _tiny_hf_state, write_tiny_gguf

DTYPES = {T.F16: torch.float16, T.BF16: torch.bfloat16}
# Layer 0: q/k/v F16, o BF16, gate F16 beside up BF16 (one fused layer of two 2-byte types),
# down F16; layer 1 the other way round but gate/up both F16; an untied BF16 head; the
# embedding Q8_0.
LAYERS = [{"q_proj": T.F16, "k_proj": T.F16, "v_proj": T.F16, "o_proj": T.BF16,
           "gate_proj": T.F16, "up_proj": T.BF16, "down_proj": T.F16},
          {"q_proj": T.BF16, "k_proj": T.BF16, "v_proj": T.BF16, "o_proj": T.F16,
           "gate_proj": T.F16, "up_proj": T.F16, "down_proj": T.BF16}]
# Logprobs' largest gap to the float path where BF16 layers round x to bfloat16 (vdpbf16ps).
BF16_X_TOL = 1e-2
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "o_proj": ("o_proj",),
         "gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}


def _types() -> dict[str, T]:
    types = {"model.embed_tokens.weight": T.Q8_0, "lm_head.weight": T.BF16}
    for i, layer in enumerate(LAYERS):
        for name, qtype in layer.items():
            kind = "self_attn" if name[0] in "qkvo" else "mlp"
            types[f"model.layers.{i}.{kind}.{name}.weight"] = qtype
    return types


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory):
    folder = tmp_path_factory.mktemp("two_byte")
    return write_tiny_gguf(folder / "tiny-f16-bf16.gguf", _tiny_hf_state(False, True),
                           types=_types())


@pytest.fixture(scope="module")
def runs(gguf_file, tmp_path_factory):
    return _run_both(gguf_file, tmp_path_factory.mktemp("cache"))


def _layers(model):
    for i, layer in enumerate(LAYERS):
        block = model.layers[str(i)]
        for fused, names in FUSED.items():
            kind = "self_attn" if fused[0] in "qo" else "mlp"
            module = getattr(getattr(block, kind), fused)
            yield f"layers.{i}.{kind}.{fused}", module, [DTYPES[layer[n]] for n in names]


def test_file_tensors_widen_to_gguf_py_dequantize(gguf_file):
    """The 2-byte tensors the file hands over are its own pages (no copy where no rows are
    permuted) and widen bit for bit to gguf-py's dequantize."""
    header = read_gguf_header(str(gguf_file))
    raw = {t.name: t for t in header.tensors}
    weights = dict(GGUFWeights(str(gguf_file)).weights({"Q8_0", "F16", "BF16"}))
    checked = 0
    for hf_name, gguf_name in (("model.layers.0.mlp.down_proj.weight", "blk.0.ffn_down.weight"),
                               ("model.layers.0.self_attn.o_proj.weight",
                                "blk.0.attn_output.weight"),
                               ("lm_head.weight", "output.weight")):
        got, tensor = weights[hf_name], raw[gguf_name]
        assert got.dtype == DTYPES[tensor.tensor_type] and got.dim() == 2
        assert not got.untyped_storage().resizable()  # memory torch did not allocate: the map
        data = header.map[tensor.data_offset:tensor.data_offset + tensor.n_bytes]
        expected = dequantize(np.asarray(data).reshape(got.shape[0], -1), tensor.tensor_type)
        assert torch.equal(got.float(), torch.from_numpy(np.ascontiguousarray(expected)))
        checked += 1
    assert checked == 3
    assert isinstance(weights["model.embed_tokens.weight"], GGUFBlocks)
    # The norms stay float32.
    assert weights["model.norm.weight"].dtype == torch.float32


@needs_kernels
def test_layers_hold_two_bytes_a_weight(runs):
    if torch.float16 not in gemv.panel_dtypes():
        pytest.skip("2-byte matrices stay 2 bytes on the panel kernel, which needs AVX2")
    model, width = runs["gguf"]["model"], gemv.panel_width()
    # Parameters left: the norms, nothing else (no plain or float32 copy of any matrix).
    assert all("norm" in n for n, p in model.named_parameters() if not p.is_meta)
    formats = {}
    for name, layer, dtypes in _layers(model):
        if len(set(dtypes)) == 1:  # one dtype: the float method's panels of it
            assert type(layer.linear_method) is UnquantizedLinearMethod, name
            assert layer.weight.is_meta and layer.packed_weight is None
            shards = [(layer.weight.shape[0], layer.panel_weight)]
        else:
            assert type(layer.linear_method) is gguf_method.GGUFShardedLinearMethod, name
            shards = [(rows, data) for _, _, rows, data in gguf_method._shards(layer)]
        formats[name] = [data.dtype for _, data in shards]
        for rows, panels in shards:
            # 2 bytes a weight: the matrix's own elements, rows padded to whole panels.
            assert panels.element_size() == 2
            assert panels.numel() == -(-rows // width) * width * layer.input_size, name
        assert formats[name] == sorted(set(dtypes), key=dtypes.index), name
    head = model.lm_head
    assert head.panel_weight.dtype == torch.bfloat16 and head.weight.is_meta
    assert model.embed_tokens.row_lookup.fmt == "q8_0"


def test_matches_the_float_path_bit_for_bit(runs):
    """Each 2-byte layer is the float path's float32 weight widened (the panels' rows, element
    for element), and the run gives the float path's greedy tokens and logprobs, bit for bit,
    where the panel kernel widens both 2-byte types (the default). Under the opt-in vdpbf16ps
    math (gemv.bf16_dpbf16), and on AMX or vdpbf16ps (bfloat16 layers from
    linear_method.AMX_MIN_ROWS rows where the CPU has AMX, from linear_method.DPBF16_MIN_ROWS
    where it has AVX512-BF16 without: here the BF16 LM head at decode steps of that many
    sequences), the BF16 layers round x to bfloat16: there the tokens must still be the float
    path's and the logprobs within BF16_X_TOL."""
    quantized, floats = runs["gguf"]["model"], runs[None]["model"]
    float_layers = dict(floats.named_modules())
    for name, layer, _ in _layers(quantized):
        ref = float_layers[name]
        k = ref.weight.shape[1]
        if hasattr(layer, "quant_shards"):
            for _, row, rows, panels in gguf_method._shards(layer):
                want = ref.weight[row:row + rows]
                assert torch.equal(gemv.panel_rows(panels, torch.arange(rows), k), want), name
        elif layer.panel_weight is not None:
            rows = torch.arange(ref.weight.shape[0])
            assert torch.equal(gemv.panel_rows(layer.panel_weight, rows, k), ref.weight), name
        else:  # no panel kernel: widened at load, as the float path holds it
            assert torch.equal(layer.weight, ref.weight), name
    assert runs["gguf"]["tokens"] == runs[None]["tokens"]
    rounds_x = gemv.library() is not None and (
        gemv.bf16_dpbf16() or any(getattr(m, "amx_from", 0) or getattr(m, "dot_from", 0)
                                  for m in quantized.modules()))
    if rounds_x:
        torch.testing.assert_close(torch.tensor(runs["gguf"]["logprobs"]),
                                   torch.tensor(runs[None]["logprobs"]), rtol=0, atol=BF16_X_TOL)
    else:
        assert runs["gguf"]["logprobs"] == runs[None]["logprobs"]
    assert len(runs["gguf"]["tokens"]) == len(PROMPTS)


@needs_kernels
def test_fused_layer_of_2byte_and_block_shards():
    """q/k F16 beside v Q8_0: the 2-byte shards on their panels, v on its kernel, each into its
    rows, and the native form the decode stack reads says the same."""
    if torch.float16 not in gemv.panel_dtypes():
        pytest.skip("needs the panel kernel (AVX2)")
    hidden, heads, kv_heads = 64, 4, 2
    layer = QKVParallelLinear(hidden, hidden // heads, heads, kv_heads)
    method = gguf_method.GGUFLinearMethod()
    layer.linear_method, layer.quant_prefix = method, "model.layers.0.self_attn.qkv_proj"
    method.attach(layer)
    g = torch.Generator().manual_seed(3)
    kv = kv_heads * hidden // heads
    q = torch.randn(hidden, hidden, generator=g).half()
    k = torch.randn(kv, hidden, generator=g).half()
    v = kernels.quantize_q8_0(torch.randn(kv, hidden, generator=g))
    for shard, loaded in (("q", q), ("k", k), ("v", GGUFBlocks("Q8_0", v, hidden))):
        layer.weight.weight_loader(layer.weight, loaded, shard)
    method.process_weights_after_loading(layer)
    assert layer.quant_format == "f16+q8_0"
    x = torch.randn(5, hidden, generator=g)
    y = layer(x)
    assert torch.equal(y[:, :hidden], gemv.gemm_panels(x, gemv.pack_panels(q.float()), hidden))
    assert torch.equal(y[:, hidden:hidden + kv],
                       gemv.gemm_panels(x, gemv.pack_panels(k.float()), kv))
    assert torch.equal(y[:, hidden + kv:], kernels.quantized_matmul("q8_0", x, v))
    form = layer.linear_method.native_form(layer)
    assert [(rows, seg.fmt) for rows, seg in form.segments] == [
        (hidden, WeightFormat.F16_PANELS), (kv, WeightFormat.F16_PANELS), (kv, WeightFormat.Q8_0)]
    assert PANEL_FORMATS[torch.float16] == WeightFormat.F16_PANELS


@needs_kernels
def test_fused_decode_on_2byte_panels(gguf_file, tmp_path_factory, monkeypatch):
    """deterministic=True: every decode step runs in the fused stack on the F16/BF16 panels
    (gate|up of two dtypes as two row segments) and gives the layer-by-layer tokens and
    logprobs bit for bit."""
    if torch.float16 not in gemv.panel_dtypes():
        pytest.skip("needs the panel kernel (AVX2)")
    from tests.kernels.test_fused_decode import _run
    monkeypatch.setenv("PAGEDLM_CACHE_DIR", str(tmp_path_factory.mktemp("fcache")))
    args = {"quantization": "gguf", "deterministic": True}
    ref, off = _run(str(gguf_file), False, monkeypatch, **args)
    got, on = _run(str(gguf_file), True, monkeypatch, **args)
    assert on.off_reason is None and on.stack.steps > 20 and off.stack is None
    assert sorted(layer.gate_up.nseg for layer in on.stack.layers) == [1, 2]
    assert {layer.qkv.seg[0].fmt for layer in on.stack.layers} == {
        WeightFormat.F16_PANELS, WeightFormat.BF16_PANELS}
    assert got == ref
