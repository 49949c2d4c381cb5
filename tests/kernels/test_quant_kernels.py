"""The quantized weight formats and their native kernels against plain PyTorch, and against
gguf-py's own (llama.cpp's) quantizers and dequantizers for the GGUF block layouts."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from pagedlm.kernels import quant
from pagedlm.model_executor.layers.quantization import kernels
from tests.conftest import require_kernels
from tests.kernels.test_kquant_kernels import _kernel16

# (N, K): SmolLM2-135M's qkv, o, gate_up, down; a Llama-7B-like down projection slice; an odd
# N (a vocabulary slice); and a tiny test model's.
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (256, 11008), (4099, 576),
          (64, 32)]


def _rows(fmt: str) -> list[int]:
    """Ragged row counts: the 4-row tile and its remainders, and both sides of the switch to
    dequantize + float GEMM."""
    switch = quant.dequant_gemm_min_rows(fmt)
    return [1, 2, 3, 5, 7, 37, switch - 1, switch]


def _pack(fmt: str, w: torch.Tensor):
    if fmt == "q4_1":
        return kernels.quantize_q4_1(w), None
    if fmt == "q8_0":
        return kernels.quantize_q8_0(w), None
    return kernels.quantize_i8(w)


@pytest.fixture(scope="module", autouse=True)
def native():
    require_kernels()


@pytest.mark.parametrize("path", ["native", "disabled"])
@pytest.mark.parametrize("fmt", ["q4_1", "q8_0", "i8"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_matmul_matches_reference(fmt, shape, path, monkeypatch):
    """The kernels, and the dequantize + float GEMM path every row count takes without them
    (PAGEDLM_DISABLE_KERNELS=1, or no compiler), against a float64 reference: x times the
    dequantized weights, with x quantized to 8 bits as the q4_1 / q8_0 kernels quantize it
    where they run (below the switch to dequantize + GEMM)."""
    if path == "disabled":
        monkeypatch.setenv("PAGEDLM_DISABLE_KERNELS", "1")
    n, k = shape
    gen = torch.Generator().manual_seed(n * 7 + k)
    w = torch.randn(n, k, generator=gen) * 0.05
    qweight, scale = _pack(fmt, w)
    ref_w = kernels.dequantize_reference(fmt, qweight, scale).double()
    assert torch.equal(kernels.dequantize(fmt, qweight, scale), ref_w.float())
    bias = torch.randn(n, generator=gen)
    for m in _rows(fmt):
        x = torch.randn(m, k, generator=gen)
        if path == "native" and fmt != "i8" and m < quant.dequant_gemm_min_rows(fmt):
            ref = kernels.matmul_reference_q8(fmt, x, qweight) + bias.double()
        else:
            ref = x.double() @ ref_w.T + bias.double()
        got = kernels.quantized_matmul(fmt, x, qweight, scale, bias)
        assert got.shape == (m, n) and got.dtype == torch.float32
        # float32 accumulation over k terms against a float64 reference
        tol = 1e-5 * k ** 0.5 * ref.abs().max().item() + 1e-5
        assert (got.double() - ref).abs().max().item() < tol, (fmt, shape, m)


def test_leading_dims_and_empty_batch():
    w = torch.randn(96, 64)
    qweight = kernels.quantize_q4_1(w)
    x = torch.randn(2, 3, 64)
    got = kernels.quantized_matmul("q4_1", x, qweight)
    ref = kernels.matmul_reference_q8("q4_1", x.reshape(6, 64), qweight).float().reshape(2, 3, 96)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    assert kernels.quantized_matmul("q4_1", torch.empty(0, 64), qweight).shape == (0, 96)


@pytest.mark.parametrize("fmt", ["q4_1", "q8_0", "i8"])
def test_quantization_error_is_within_half_a_step(fmt):
    w = torch.randn(128, 256)
    qweight, scale = _pack(fmt, w)
    err = (kernels.dequantize_reference(fmt, qweight, scale) - w).abs()
    if fmt == "i8":
        step = scale[:, None]
    else:
        step = kernels._fp16_field(qweight, 0).expand(-1, -1, 32).reshape(128, 256)
    # half a quantization step, plus the fp16 rounding of the block's scale and min
    assert (err <= step * 0.5 + w.abs() * 2e-3 + 1e-6).all()


@pytest.mark.parametrize("qtype,fmt", [("Q4_1", "q4_1"), ("Q8_0", "q8_0"), ("Q4_0", "q4_1")])
def test_gguf_blocks_dequantize_as_llama_cpp_does(qtype, fmt):
    """Blocks made by gguf-py's port of llama.cpp's quantizer read back, through our format,
    to exactly gguf-py's dequantized values (Q4_0 after its conversion to q4_1)."""
    gtype = GGMLQuantizationType[qtype]
    w = np.random.default_rng(0).standard_normal((48, 192)).astype(np.float32)
    raw = gguf_quantize(w, gtype)
    expected = torch.from_numpy(gguf_dequantize(raw, gtype).reshape(48, 192))
    blocks = torch.from_numpy(raw).reshape(48, 192 // 32, -1)
    if qtype == "Q4_0":
        blocks = kernels.q4_0_to_q4_1(blocks)
    assert torch.equal(kernels.dequantize_reference(fmt, blocks), expected)
    assert torch.equal(kernels.dequantize(fmt, blocks), expected)


def test_q4_1_quantizer_matches_llama_cpp():
    w = np.random.default_rng(1).standard_normal((16, 128)).astype(np.float32)
    raw = gguf_quantize(w, GGMLQuantizationType.Q4_1).reshape(16, 4, 20)
    ours = kernels.quantize_q4_1(torch.from_numpy(w)).numpy()
    # The fp16 scale and minimum of every block: bit for bit.
    assert np.array_equal(ours[..., :4], raw[..., :4])
    # The nibbles: identical but for a rare off-by-one q where llama.cpp rounds
    # (w - min) * (1 / d) with the unrounded d and we use the stored fp16 one.
    def nibbles(blocks):
        qs = blocks[..., 4:].astype(np.int16)
        return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)
    diff = np.abs(nibbles(ours) - nibbles(raw))
    assert diff.max() <= 1, np.argwhere(diff > 1)
    assert (diff == 0).mean() > 0.98


def test_bad_inputs_raise_value_error():
    qweight = kernels.quantize_q4_1(torch.randn(8, 64))
    with pytest.raises(ValueError, match="input features"):
        kernels.quantized_matmul("q4_1", torch.randn(1, 32), qweight)
    with pytest.raises(ValueError, match="unknown quantized format 'q3'"):
        kernels.quantized_matmul("q3", torch.randn(1, 64), qweight)
    with pytest.raises(ValueError, match=r"\[N, K/32, 34\]"):
        kernels.quantized_matmul("q8_0", torch.randn(1, 64), qweight)
    with pytest.raises(ValueError, match="multiple of 32"):
        kernels.quantize_q4_1(torch.randn(8, 40))
    qi8, _ = kernels.quantize_i8(torch.randn(8, 40))
    with pytest.raises(ValueError, match="scale"):
        kernels.quantized_matmul("i8", torch.randn(1, 40), qi8, None)


@pytest.mark.parametrize("fmt,shape", [
    ("q4_1", (3072, 576)), ("q4_1", (4099, 576)), ("q4_1", (64, 32)), ("q8_0", (4099, 576)),
    ("q8_0", (64, 32)), ("i8", (4099, 576)), ("i8", (37, 100)), ("i8", (960, 1536)),
], ids=str)
def test_batch_invariant_rows_do_not_depend_on_the_batch(fmt, shape):
    """batch_invariant=True (deterministic=True): a row's output is the same bits alone on one
    thread, in a batch past the row count where the default switches to dequantize + GEMM, at
    any place in the kernels' tiles of x rows (4 with AVX-512, 2 with AVX2, and remainders),
    on 1 or 2 threads. Shapes: odd N (a partial group of weight rows, an uneven thread split),
    one too small to parallelise, and K with a scalar tail (i8)."""
    n, k = shape
    gen = torch.Generator().manual_seed(n + k)
    qweight, scale = _pack(fmt, torch.randn(n, k, generator=gen) * 0.05)
    bias = torch.randn(n, generator=gen)
    rows = max(70, quant.dequant_gemm_min_rows(fmt) + 3)
    x = torch.randn(rows, k, generator=gen)

    def matmul(x_rows):
        return kernels.quantized_matmul(fmt, x_rows, qweight, scale, bias, batch_invariant=True)

    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = torch.cat([matmul(x[i:i + 1]) for i in range(rows)])
        assert torch.equal(matmul(x), alone)
        torch.set_num_threads(2)
        assert torch.equal(matmul(x), alone)
        for start, size in [(1, 1), (1, 2), (2, 3), (3, 5), (5, 7), (6, 37)]:
            assert torch.equal(matmul(x[start:start + size]), alone[start:start + size]), \
                (start, size)
    finally:
        torch.set_num_threads(threads)
    # The same bits as the default path below its switch to dequantize + GEMM (the same
    # kernel), and the same values past it up to the sum order, on the input the kernel
    # multiplies: 8-bit x for q4_1 and q8_0 (matmul_reference_q8), float x for i8.
    below = quant.dequant_gemm_min_rows(fmt) - 1
    assert torch.equal(alone[:below],
                       kernels.quantized_matmul(fmt, x[:below], qweight, scale, bias))
    if fmt == "i8":
        expected = kernels.quantized_matmul(fmt, x, qweight, scale, bias)
    else:
        expected = (kernels.matmul_reference_q8(fmt, x, qweight) + bias.double()).float()
    torch.testing.assert_close(alone, expected, rtol=1e-4, atol=1e-4)


def test_batch_invariant_refuses_to_run_without_the_kernels(monkeypatch):
    monkeypatch.setenv("PAGEDLM_DISABLE_KERNELS", "1")
    qweight = kernels.quantize_q4_1(torch.randn(8, 64))
    assert kernels.quantized_matmul("q4_1", torch.randn(1, 64), qweight).shape == (1, 8)
    with pytest.raises(ValueError, match="needs the native kernels"):
        kernels.quantized_matmul("q4_1", torch.randn(1, 64), qweight, batch_invariant=True)


def test_deterministic_linear_methods_run_one_kernel_at_every_row_count():
    """Every linear method built with deterministic=True (as the loader builds them under
    ModelConfig.deterministic): a row's output is the same bits alone and in batches past
    gemv.GEMV_MAX_ROWS and past the default's switch to dequantize + GEMM, and the fused decode
    stack may run its kernel at any row count (NativeLinear.batch_invariant)."""
    from pagedlm.model_executor.layers.linear_method import UnquantizedLinearMethod
    from pagedlm.model_executor.layers.quantization.weight_only import (Int4LinearMethod,
                                                                        Int8LinearMethod)
    gen = torch.Generator().manual_seed(3)
    weight, bias = torch.randn(600, 576, generator=gen) * 0.05, torch.randn(600, generator=gen)
    x = torch.randn(300, 576, generator=gen)
    for cls in (UnquantizedLinearMethod, Int8LinearMethod, Int4LinearMethod):
        method = cls(deterministic=True)
        layer = torch.nn.Module()
        method.create_weights(layer, 576, [600], 576, 600, torch.float32, None)
        layer.weight.data.copy_(weight)
        method.process_weights_after_loading(layer)
        assert method.native_form(layer).batch_invariant, cls
        assert not cls().native_form(layer).every_row_count, cls
        alone = torch.cat([method.apply(layer, x[i:i + 1], bias) for i in range(300)])
        for rows in (9, 40, 300):
            assert torch.equal(method.apply(layer, x[:rows], bias), alone[:rows]), (cls, rows)


@pytest.mark.parametrize("fmt", ["q4_1", "q8_0"])
def test_two_limbs_match_the_reference_and_the_batch(fmt):
    """qmm16_q4_1 / qmm16_q8_0 (x in two 8-bit limbs, as quant_kquants.c's): against the
    float64 product of the reference's limbs and the dequantized weights within the float32
    roundings; within a step of the residual's limb of the exact product, which one limb
    misses; and each row the same bits alone, in a batch and on 1 or 2 threads."""
    for n, k in [(37, 96), (517, 576)]:
        w = torch.randn(n, k, generator=torch.Generator().manual_seed(n))
        qweight, _ = _pack(fmt, w)
        wd = kernels.dequantize_reference(fmt, qweight).double()
        x = torch.randn(9, k, generator=torch.Generator().manual_seed(k))
        ref = kernels.matmul_reference_x16(fmt, x, qweight)
        size = sum(kernels._dequantize_limb(limb).abs()
                   for limb in kernels.activation_limbs_reference(x)) @ wd.abs().T
        # q4_1's offsets are summed apart, as in the 8-bit kernel (twice the terms' sizes)
        tol = (k // 32 + 9) * 2.0 ** -23 * 2 * size + 1e-30
        alone = torch.cat([_kernel16(fmt, x[i:i + 1], qweight, 1) for i in range(9)])
        for threads in (1, 2):
            got = _kernel16(fmt, x, qweight, threads)
            assert ((got.double() - ref).abs() <= tol).all(), (n, k, threads)
            assert torch.equal(got, alone), (n, k, threads)
        exact = x.double() @ wd.T
        amax = x.double().abs().reshape(9, -1, 32).amax(-1).repeat_interleave(32, dim=1)
        bound = (amax / (2 * 127 * 254)) @ wd.abs().T + tol
        assert ((alone.double() - exact).abs() <= bound).all()
        one = kernels.quantized_matmul(fmt, x, qweight, batch_invariant=True)
        assert ((one.double() - exact).abs() > bound).any()
        assert torch.equal(kernels.quantized_matmul(fmt, x, qweight, batch_invariant=True,
                                                    precise_activations=True), alone)
