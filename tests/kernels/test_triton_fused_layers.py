"""The GPU wiring of the fused GEMVs (layers/fused_decode.py's TritonFusedLayers): when
FusedDecode runs a stage's Llama layers through rms_norm_gemv / silu_mul_gemv instead of letting
them run layer by layer, and that it then computes what the layers compute.

Without a GPU the "GPU" is Triton's interpreter on CPU tensors: fused_decode._triton_device is
made to answer True, and the layers' own GPU path (RMSNorm's and SiluAndMul's Triton kernels,
UnquantizedLinearMethod.apply's Triton GEMV at <= TRITON_GEMV_MAX_ROWS rows, all chosen on
x.is_cuda) is routed the same way. The fused path must then give the layer path's bits (the
kernels' own tests: test_triton_fused_gemv.py). On a GPU both run for real, to the norm's
reduction order. The attention is a stand-in module: both paths call it alike, and the engine
runs (tests/gpu/test_fused_norm_act.py) use the real one."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from pagedlm.kernels.triton import fused_gemv, fused_ops
from pagedlm.kernels.triton import gemv as tg
from pagedlm.model_executor.layers import fused_decode
from pagedlm.model_executor.layers.activation import SiluAndMul
from pagedlm.model_executor.layers.fused_decode import FusedDecode, TritonFusedLayers
from pagedlm.model_executor.layers.layernorm import RMSNorm
from pagedlm.model_executor.layers.linear_method import (TRITON_GEMV_MAX_ROWS,
                                                         UnquantizedLinearMethod)
from pagedlm.model_executor.layers.rotary_embedding import RotaryEmbedding
from pagedlm.model_executor.models.llama import LlamaDecoderLayer

GPU = torch.cuda.is_available()
DEVICE = "cuda" if GPU else "cpu"
HIDDEN, INTER, HEADS, KV_HEADS = 64, 96, 4, 2


class _Cfg:
    """The ModelConfig fields LlamaDecoderLayer reads."""

    def __init__(self, bias: bool) -> None:
        self.hf_config = SimpleNamespace(hidden_size=HIDDEN, intermediate_size=INTER)
        self.head_dim, self.num_heads, self.num_kv_heads = HIDDEN // HEADS, HEADS, KV_HEADS
        self._hf = {"rms_norm_eps": 1e-5, "attention_bias": bias, "mlp_bias": bias}

    def get_hf(self, key, default=None):
        return self._hf.get(key, default)

    def get_sliding_window(self, layer):
        return None


class _Attention(nn.Module):
    """A stand-in for Attention (same call, same attributes): a function of q, k and v."""

    def __init__(self) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = HEADS, KV_HEADS, HIDDEN // HEADS

    def forward(self, q, k, v, kv_cache, meta):
        n, g = q.shape[0], HEADS // KV_HEADS
        kk = k.reshape(n, KV_HEADS, -1).repeat_interleave(g, 1).float()
        vv = v.reshape(n, KV_HEADS, -1).repeat_interleave(g, 1).float()
        w = torch.sigmoid((q.float() * kk).sum(-1, keepdim=True))
        return (w * vv + q.float()).to(q.dtype).reshape(n, -1)


def _layers(dtype, bias=False, num=3) -> nn.ModuleDict:
    gen = torch.Generator().manual_seed(0)
    rotary = RotaryEmbedding(HIDDEN // HEADS, 64, 10000.0)
    layers = nn.ModuleDict()
    for i in range(num):
        layer = LlamaDecoderLayer(_Cfg(bias), rotary, object(), i)
        layer.self_attn.attn = _Attention()
        for name, param in layer.named_parameters():
            scale = 0.3 if "layernorm" not in name else 0.2
            base = 1.0 if "layernorm" in name else 0.0
            param.data = base + scale * torch.randn(param.shape, generator=gen)
        layers[str(i)] = layer.to(DEVICE, dtype)
    return layers


@pytest.fixture
def gpu_path(monkeypatch):
    """Off a GPU: the interpreter stands in for it (see the module docstring)."""
    if GPU:
        return
    monkeypatch.setattr(fused_decode, "_triton_device", lambda t: True)
    monkeypatch.setattr(RMSNorm, "_triton_ok", lambda self, x: x.dim() == 2
                        and x.stride(1) == 1 and self.weight.dtype is x.dtype)
    monkeypatch.setattr(SiluAndMul, "forward", lambda self, x: fused_ops.silu_and_mul(x))
    real_apply = UnquantizedLinearMethod.apply

    def apply(self, layer, x, bias=None):  # the method's own test, with x.is_cuda taken as True
        if (x.dim() == 2 and x.shape[0] <= TRITON_GEMV_MAX_ROWS
                and x.dtype in (torch.bfloat16, torch.float16)
                and layer.weight.dtype == x.dtype):
            return tg.gemv(x, layer.weight, bias)
        return real_apply(self, layer, x, bias)
    monkeypatch.setattr(UnquantizedLinearMethod, "apply", apply)


@pytest.fixture
def calls(monkeypatch):
    """Every call of the fused kernels' wrappers: (name, args)."""
    seen = []
    for name in ("rms_norm_gemv", "silu_mul_gemv"):
        real = getattr(fused_gemv, name)

        def spy(*args, _name=name, _real=real, **kwargs):
            seen.append((_name, args))
            return _real(*args, **kwargs)
        monkeypatch.setattr(fused_gemv, name, spy)
    return seen


def _step(layers, m, dtype, seed=1):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, HIDDEN, generator=gen).to(DEVICE, dtype)
    positions = torch.arange(5, 5 + m, device=DEVICE)
    return x, positions, [None] * len(layers), None


def _layer_by_layer(layers, x, residual, positions, kv_caches, meta):
    for layer, kv in zip(layers.values(), kv_caches):
        x, residual = layer(positions, x, residual, kv, meta)
    return x, residual


def _same(got, want):
    if not GPU:
        assert torch.equal(got, want), (got.float() - want.float()).abs().max()
    else:  # the norm's sum of squares in another order: a unit of the last place, rarely
        torch.testing.assert_close(got, want, rtol=2 ** -6, atol=1e-2)


# The rows the layers send the Triton GEMV (1 and 2), both 16-bit dtypes, with and without the
# biases (Qwen2's QKV, mlp_bias), in few runs: the interpreter is slow, and on a GPU each
# case compiles a dozen kernels (gpu_check.sh's test_triton stage: 90 s), so there bfloat16.
CASES = [(1, torch.bfloat16, False), (2, torch.bfloat16, True)] + (
    [] if GPU else [(2, torch.float16, False), (1, torch.float16, True)])


@pytest.mark.parametrize("m,dtype,bias", CASES)
def test_fused_layers_compute_the_layer_path(gpu_path, calls, monkeypatch, m, dtype, bias):
    assert m <= TRITON_GEMV_MAX_ROWS
    monkeypatch.setenv("PAGEDLM_TRITON_FUSED_NORM_ACT", "1")
    layers = _layers(dtype, bias, num=2)
    x, positions, kv, meta = _step(layers, m, dtype)
    want = _layer_by_layer(layers, x, None, positions, kv, meta)
    assert not calls  # the layers alone never call the fused kernels
    fused = FusedDecode(layers)
    got = fused.run(x, None, positions, kv, meta)
    assert isinstance(fused.stack, TritonFusedLayers) and fused.off_reason is None
    assert got is not None and fused.stack.steps == 1
    _same(got[0], want[0])
    _same(got[1], want[1])
    # Three launches a layer, on the layer's own parameters, the residual chained from the
    # first layer's input (x itself: the first layer has none).
    assert [name for name, _ in calls] == ["rms_norm_gemv", "rms_norm_gemv",
                                           "silu_mul_gemv"] * len(layers)
    for i, layer in enumerate(layers.values()):
        (_, qkv), (_, gate_up), (_, down) = calls[3 * i:3 * i + 3]
        attn, mlp = layer.self_attn, layer.mlp
        assert qkv[2] is layer.input_layernorm.weight and qkv[3] == 1e-5
        assert qkv[4] is attn.qkv_proj.weight and qkv[5] is attn.qkv_proj.bias
        assert gate_up[2] is layer.post_attention_layernorm.weight
        assert gate_up[4] is mlp.gate_up_proj.weight and gate_up[5] is mlp.gate_up_proj.bias
        assert down[1] is mlp.down_proj.weight and down[2] is mlp.down_proj.bias
        assert (qkv[1] is None) == (i == 0)
    # A later step (a pipeline stage after the first: a residual comes in) runs too.
    res = torch.randn(m, HIDDEN, generator=torch.Generator().manual_seed(2)).to(DEVICE, dtype)
    got = fused.run(x, res, positions, kv, meta)
    want = _layer_by_layer(layers, x, res, positions, kv, meta)
    _same(got[0], want[0])
    _same(got[1], want[1])


def test_flag_off_leaves_the_layers_alone(gpu_path, calls, monkeypatch):
    """The default: the GPU path as it was (the layers, one launch per op)."""
    monkeypatch.delenv("PAGEDLM_TRITON_FUSED_NORM_ACT", raising=False)
    layers = _layers(torch.bfloat16, num=2)
    x, positions, kv, meta = _step(layers, 1, torch.bfloat16)
    fused = FusedDecode(layers)
    assert fused.run(x, None, positions, kv, meta) is None
    assert fused.stack is None
    assert fused.off_reason == "PAGEDLM_TRITON_FUSED_NORM_ACT is not set"
    assert fused.run(x, None, positions, kv, meta) is None  # decided once
    # With the Triton GEMV turned off the layers run cuBLAS: so does this.
    monkeypatch.setenv("PAGEDLM_TRITON_FUSED_NORM_ACT", "1")
    monkeypatch.setenv("PAGEDLM_TRITON_GEMV", "0")
    fused = FusedDecode(layers)
    assert fused.run(x, None, positions, kv, meta) is None
    assert fused.off_reason == "PAGEDLM_TRITON_GEMV is off: the linear layers run cuBLAS"
    # The switch that sends the CPU's decode layer by layer does the same here.
    monkeypatch.setenv("PAGEDLM_TRITON_GEMV", "1")
    monkeypatch.setenv("PAGEDLM_DISABLE_FUSED_DECODE", "1")
    fused = FusedDecode(layers)
    assert fused.run(x, None, positions, kv, meta) is None
    assert fused.off_reason == "PAGEDLM_DISABLE_FUSED_DECODE is set"
    assert not calls


def test_steps_past_the_gemv_rows_run_layer_by_layer(gpu_path, calls, monkeypatch):
    # Above TRITON_GEMV_MAX_ROWS the layers' linears run cuBLAS: no fused form of that.
    monkeypatch.setenv("PAGEDLM_TRITON_FUSED_NORM_ACT", "1")
    layers = _layers(torch.bfloat16, num=1)
    fused = FusedDecode(layers)
    x, positions, kv, meta = _step(layers, TRITON_GEMV_MAX_ROWS + 1, torch.bfloat16)
    assert fused.run(x, None, positions, kv, meta) is None
    assert isinstance(fused.stack, TritonFusedLayers)  # built, for the steps it takes
    assert fused.run(x.float(), None, positions, kv, meta) is None  # another dtype
    assert not calls and fused.stack.steps == 0


def _reason(layers) -> str | TritonFusedLayers:
    return TritonFusedLayers.build(list(layers.named_children()))


def test_layers_the_fused_kernels_cannot_run(gpu_path, monkeypatch):
    monkeypatch.setenv("PAGEDLM_TRITON_FUSED_NORM_ACT", "1")
    assert isinstance(_reason(_layers(torch.bfloat16, num=1)), TritonFusedLayers)
    assert _reason(_layers(torch.float32, num=1)) == (
        "decoder layer 0: its weights are torch.float32; the Triton GEMV takes bfloat16 and "
        "float16")
    assert _reason(nn.ModuleDict()) == "this stage has no decoder layers"

    layers = _layers(torch.bfloat16, num=2)
    layers["1"].mlp.act = nn.SiLU()
    assert _reason(layers) == "decoder layer 1: its MLP activation is SiLU, not SiluAndMul"

    class Wrapped(nn.Module):  # as LoRA wraps a linear layer
        def __init__(self, base):
            super().__init__()
            self.base = base

    layers = _layers(torch.bfloat16, num=1)
    layers["0"].mlp.down_proj = Wrapped(layers["0"].mlp.down_proj)
    assert _reason(layers) == "decoder layer 0: its down_proj is a Wrapped, not a linear layer"

    class OwnMatmul(UnquantizedLinearMethod):  # a method that multiplies another way
        def apply(self, layer, x, bias=None):
            return super().apply(layer, x, bias) * 2

    layers = _layers(torch.bfloat16, num=1)
    layers["0"].self_attn.qkv_proj.linear_method = OwnMatmul()
    assert _reason(layers) == "decoder layer 0: its qkv_proj multiplies with OwnMatmul"

    layers = _layers(torch.bfloat16, num=1)
    norm = layers["0"].post_attention_layernorm
    norm.weight.data = norm.weight.data.half()
    assert _reason(layers) == ("decoder layer 0: its norms are not torch.bfloat16 RMSNorms on "
                               "the GPU")

    class OwnForward(LlamaDecoderLayer):  # computes something else: not the standard block
        def forward(self, positions, x, residual, kv_cache, meta):
            return super().forward(positions, x, residual, kv_cache, meta)

    layers = _layers(torch.bfloat16, num=1)
    layers["0"].__class__ = OwnForward
    assert _reason(layers) == "decoder layer 0 (OwnForward) is not the standard block"
