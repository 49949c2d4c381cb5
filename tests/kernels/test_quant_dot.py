"""The q4_1 / q8_0 kernels' 8-bit activations and integer dot products (csrc/quant_matmul.c):
the activation quantization bit for bit against its PyTorch reference, the integer sums exactly,
the outputs against a float64 reference that quantizes x the same way, and the scalar build
(no AVX2) against the vector one bit for bit."""
from __future__ import annotations

import ctypes
import platform
import shutil
import subprocess

import pytest
import torch

from pagedlm.kernels import loader, quant
from pagedlm.model_executor.layers.quantization import kernels
from tests.conftest import needs_kernels, require_kernels

# Every test here runs the kernels themselves: nothing to test where they are off.
pytestmark = needs_kernels
QUANTIZE = {"q4_1": kernels.quantize_q4_1, "q8_0": kernels.quantize_q8_0}


@pytest.fixture(scope="module", autouse=True)
def native():
    require_kernels()


def _kernel(fmt, x, qweight, threads):
    """The kernel itself at any row count (batch_invariant: never dequantize + GEMM)."""
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        return kernels.quantized_matmul(fmt, x, qweight, batch_invariant=True)
    finally:
        torch.set_num_threads(saved)


def test_activation_quantization_matches_the_reference_bit_for_bit():
    """Random rows and the edge cases: exact ties (amax 127 makes the scale 1, so x.5 must
    round to even), an all-zero block, huge and tiny magnitudes, one lone nonzero, a block
    below 2^-120 and one with a NaN."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(7, 192, generator=gen) * torch.logspace(-3, 3, 7)[:, None]
    x[0, :32] = torch.tensor([127.0, -127.0] + [k + 0.5 for k in range(-15, 15)])
    x[1, 32:64] = 0.0
    x[2, 64:96] *= 1e30
    x[3, 96:128] *= 1e-30
    x[4, 128:160] = 0.0
    x[4, 140] = -3.0
    x[5, 160:192] = x[5, 160:192] / x[5, 160:192].abs().max() * 1e-37  # below 2^-120: 0
    x[6, 0] = float("nan")  # d and s NaN, q 0
    q, d, s = quant.quantize_activations(x)
    rq, rd, rs = kernels.quantize_activations_reference(x)
    assert torch.equal(q, rq)
    for got, want in ((d, rd), (s, rs)):
        assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(),
                                                                      want.nan_to_num())
    assert q[5, 160:192].eq(0).all() and q[6, :32].eq(0).all() and d[6, 0].isnan()
    assert q[0, 2:8].tolist() == [-14, -14, -12, -12, -10, -10]  # -14.5 .. -9.5: ties to even
    assert q[1, 32:64].eq(0).all() and d[1, 1] == 0
    assert q[4, 140] == -127 and q.abs().max() <= 127


@pytest.mark.parametrize("fmt", ["q4_1", "q8_0"])
def test_integer_sums_are_exact(fmt):
    """Weights with d = 1 (and q4_1's m = -8, as Q4_0 converts) against integer x whose every
    block reaches 127, so d_x = 1 and q_x = x: every float step then holds an integer below
    2**24 and y must be the exact integer dot product."""
    n, k = 37, 576
    gen = torch.Generator().manual_seed(1)
    one = torch.tensor([1.0], dtype=torch.float16).view(torch.uint8)
    if fmt == "q4_1":
        qs = torch.randint(0, 256, (n, k // 32, 16), generator=gen, dtype=torch.uint8)
        m = torch.tensor([-8.0], dtype=torch.float16).view(torch.uint8)
        blocks = torch.cat([one.expand(n, k // 32, 2), m.expand(n, k // 32, 2), qs], -1)
    else:
        qs = torch.randint(-127, 128, (n, k // 32, 32), generator=gen, dtype=torch.int8)
        blocks = torch.cat([one.expand(n, k // 32, 2), qs.view(torch.uint8)], -1)
    blocks = blocks.contiguous()
    w = kernels.dequantize_reference(fmt, blocks).to(torch.int64)
    x = torch.randint(-127, 128, (13, k), generator=gen).float()
    x.view(13, k // 32, 32)[..., 5] = 127.0
    exact = x.to(torch.int64) @ w.T
    for threads in (1, 2):
        assert torch.equal(_kernel(fmt, x, blocks, threads), exact.float()), threads


@pytest.mark.parametrize("fmt", ["q4_1", "q8_0"])
@pytest.mark.parametrize("shape", [(37, 96), (1029, 576), (576, 1536), (3, 32)],
                         ids=lambda s: f"{s[0]}x{s[1]}")
def test_kernels_match_the_reference_on_quantized_x(fmt, shape):
    """Ragged N (partial groups of 4 weight rows, an uneven thread split) and M, on 1 and 2
    threads, against x quantized as the kernels quantize it, times the dequantized weights in
    float64. The integer sums are exact, so the only error is the float32 scaling and summing
    over the K/32 blocks: bounded by (K/32 + 8) roundings of the sum of the terms' sizes."""
    n, k = shape
    gen = torch.Generator().manual_seed(n + k)
    qweight = QUANTIZE[fmt](torch.randn(n, k, generator=gen) * 0.05)
    w_abs = kernels.dequantize_reference(fmt, qweight).double().abs()
    for m in (1, 3, 5, 13, 200):
        x = torch.randn(m, k, generator=gen)
        ref = kernels.matmul_reference_q8(fmt, x, qweight)
        q, d, _ = kernels.quantize_activations_reference(x)
        x_abs = (q.double().reshape(m, -1, 32) * d.double()[..., None]).reshape(m, k).abs()
        tol = (k // 32 + 8) * 2.0 ** -23 * (x_abs @ w_abs.T) + 1e-30
        for threads in (1, 2):
            got = _kernel(fmt, x, qweight, threads)
            assert ((got.double() - ref).abs() <= tol).all(), (m, threads)


@pytest.fixture(scope="module")
def scalar_library(tmp_path_factory):
    """quant_matmul.c built for plain x86-64 (no AVX2, F16C or FMA): the scalar fallback."""
    compiler = shutil.which(loader.COMPILER)
    if compiler is None:
        pytest.skip(f"{loader.COMPILER} not found")
    out = tmp_path_factory.mktemp("scalar") / "quant_scalar.so"
    source = loader.CSRC / "quant_matmul.c"
    flags = ["-O2", "-fopenmp", "-shared", "-fPIC"]
    if platform.machine() == "x86_64":
        flags.append("-march=x86-64")
    subprocess.run([compiler, *flags, str(source), "-o", str(out), "-lm"], check=True,
                   capture_output=True, timeout=120)
    return ctypes.CDLL(str(out))


@pytest.mark.parametrize("fmt", ["q4_1", "q8_0"])
def test_scalar_build_gives_the_vector_builds_bits(fmt, scalar_library):
    """The scalar fallback emulates the AVX2 kernel's 8 lanes and horizontal sum with fmaf, so
    both builds give the same bits (the kernels' order does not depend on the CPU's vector
    width either: AVX-512 builds run the AVX2 code)."""
    p = ctypes.c_void_p
    gen = torch.Generator().manual_seed(5)
    for n, k, m in [(4099, 576, 1), (37, 96, 5), (576, 1536, 3)]:
        qweight = QUANTIZE[fmt](torch.randn(n, k, generator=gen) * 0.05)
        x = torch.randn(m, k, generator=gen)
        expected = _kernel(fmt, x, qweight, 2)
        for threads in (1, 2):
            y = torch.empty(m, n)
            getattr(scalar_library, f"qmm_{fmt}")(p(y.data_ptr()), p(x.data_ptr()),
                                                  p(qweight.data_ptr()), m, n, k, threads)
            assert torch.equal(y, expected), (n, k, m, threads)
        q, d, s = (torch.empty(m, k, dtype=torch.int8), torch.empty(m, k // 32),
                   torch.empty(m, k // 32))
        scalar_library.qmm_quantize_activations(p(q.data_ptr()), p(d.data_ptr()),
                                                p(s.data_ptr()), p(x.data_ptr()), m, k)
        assert all(torch.equal(a, b) for a, b in zip((q, d, s), quant.quantize_activations(x)))


@pytest.mark.parametrize("fmt", ["q4_1", "q8_0", *kernels.GGUF_ONLY_FORMATS])
def test_non_finite_x_makes_its_row_nan_and_a_tiny_block_counts_as_zero(fmt):
    """A NaN or an infinity in x makes its row's outputs NaN on every kernel path, as the
    float product's are NaN or infinite: quantized like any block, a NaN was kept or dropped
    by its lane in the max and converted to INT_MIN, and 127 / inf made x * 0 a NaN, so finite
    garbage came out (up to 1e7 with an offset term). A block below 2^-120, whose 127 / amax
    overflowed (every q -128: the block's sign and size wrong), counts as 0."""
    from tests.kernels.test_kquant_kernels import _kernel16, random_blocks
    bw = kernels.BLOCK_WEIGHTS[fmt]
    n, k = 20, max(2 * bw, 64)
    gen = torch.Generator().manual_seed(3)
    blocks = (QUANTIZE[fmt](torch.randn(n, k, generator=gen)) if fmt in QUANTIZE
              else random_blocks(fmt, n, k, seed=3))
    x = torch.randn(24, k, generator=gen)
    for row, col, value in [(0, 0, "nan"), (1, 31, "nan"), (2, 32, "inf"), (3, 5, "-inf")]:
        x[row, col] = float(value)
    x[4, :32] = torch.randn(32, generator=gen) * 1e-38
    x[5] = x[4]
    x[5, :32] = 0.0
    paths = {"kernels": _kernel(fmt, x, blocks, 2), "two limbs": _kernel16(fmt, x, blocks, 2)}
    if quant.qgemm_min_rows(fmt):
        paths["qgemm"] = torch.empty(24, n)
        quant.qgemm(fmt, paths["qgemm"], x, blocks)
    for name, y in paths.items():
        assert y[:4].isnan().all(), (name, y[:4])
        assert y[4:].isfinite().all(), name
        assert torch.equal(y[4], y[5]), name
