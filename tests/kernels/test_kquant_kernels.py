"""The K-quant, q5_0, q5_1 and iq4_nl kernels (csrc/quant_kquants.c) on random valid ggml
blocks (gguf-py dequantizes these types but cannot quantize them): dequantization bit for bit
against gguf-py, the matmul against a float64 reference on x quantized as the kernels quantize
it, batch invariance, and the scalar build against the vector one bit for bit."""
from __future__ import annotations

import ctypes
import platform
import shutil
import subprocess

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

from pagedlm.kernels import loader, quant
from pagedlm.model_executor.layers.quantization import kernels
from tests.conftest import needs_kernels, require_kernels
from tests.kernels.test_quant_dot import _kernel

pytestmark = needs_kernels
FORMATS = kernels.GGUF_ONLY_FORMATS
# Byte offsets of each block's fp16 fields: scales and mins (ggml's block structs).
FP16_FIELDS = {"q4_k": (0, 2), "q5_k": (0, 2), "q6_k": (208,), "q3_k": (108,),
               "q2_k": (80, 82), "q5_0": (0,), "q5_1": (0, 2), "iq4_nl": (0,)}


def random_blocks(fmt: str, n: int, k: int, seed: int) -> torch.Tensor:
    """[n, k / block weights, block bytes] uint8: random bytes, with every fp16 field set to a
    finite value of either sign around 1e-2 (q5_1's minimum and the mins' scales too)."""
    rng = np.random.default_rng(seed)
    nb = k // kernels.BLOCK_WEIGHTS[fmt]
    blocks = rng.integers(0, 256, (n, nb, kernels.BLOCK_BYTES[fmt]), dtype=np.uint8)
    for off in FP16_FIELDS[fmt]:
        vals = (rng.standard_normal((n, nb)) * 1e-2).astype(np.float16)
        blocks[..., off:off + 2] = vals.view(np.uint8).reshape(n, nb, 2)
    return torch.from_numpy(blocks)


# The bytes of each block holding the integer weights: zeroed, a block dequantizes to the term
# the kernels sum apart (the mins; q6_k's -32 offset).
Q_BYTES = {"q4_k": (16, 144), "q5_k": (16, 176), "q2_k": (16, 80), "q5_1": (4, 24),
           "q6_k": (0, 192)}


def _mins(fmt: str, blocks: torch.Tensor) -> torch.Tensor:
    """Float64 [N, K]: each weight's term summed apart (0 for the types without one)."""
    if fmt not in Q_BYTES:
        return torch.zeros(blocks.shape[0], blocks.shape[1] * kernels.BLOCK_WEIGHTS[fmt],
                           dtype=torch.float64)
    lo, hi = Q_BYTES[fmt]
    zeroed = blocks.clone()
    zeroed[..., lo:hi] = 0
    return kernels.dequantize_reference(fmt, zeroed).double()


def _gguf(fmt: str, blocks: torch.Tensor) -> torch.Tensor:
    raw = blocks.numpy().reshape(blocks.shape[0], -1)
    return torch.from_numpy(gguf_dequantize(raw, GGMLQuantizationType[fmt.upper()]))


@pytest.fixture(scope="module", autouse=True)
def native():
    require_kernels()


@pytest.mark.parametrize("fmt", FORMATS)
def test_dequantize_is_gguf_py_bit_for_bit(fmt):
    """Ragged N and several blocks per row, on 1 and 2 threads; and the special fp16 values
    a block may hold (zero, negative zero, subnormal, the largest)."""
    bw = kernels.BLOCK_WEIGHTS[fmt]
    for n, k in [(37, 3 * bw), (3, bw), (1029, 2 * bw)]:
        blocks = random_blocks(fmt, n, k, seed=n + k)
        if n == 37:
            specials = np.array([0.0, -0.0, 6e-8, -6e-5, 65504.0], dtype=np.float16)
            for off in FP16_FIELDS[fmt]:
                blocks[:5, 0, off:off + 2] = torch.from_numpy(specials.view(np.uint8)).view(5, 2)
        expected = _gguf(fmt, blocks)
        assert expected.shape == (n, k)
        assert torch.equal(kernels.dequantize_reference(fmt, blocks), expected)
        saved = torch.get_num_threads()
        try:
            for threads in (1, 2):
                torch.set_num_threads(threads)
                got = kernels.dequantize(fmt, blocks)
                assert torch.equal(got.view(torch.int32), expected.view(torch.int32)), threads
        finally:
            torch.set_num_threads(saved)


@pytest.mark.parametrize("fmt", FORMATS)
def test_matmul_matches_the_reference_on_quantized_x(fmt):
    """Ragged N and M on 1 and 2 threads against x quantized as the kernels quantize it, times
    the dequantized weights in float64. The integer sums are exact; the error is the float32
    scaling and summing over the blocks: bounded by (K/32 + 8) roundings of the sum of the
    terms' sizes, where the scaled weights and the mins are summed apart (as for q4_1)."""
    bw = kernels.BLOCK_WEIGHTS[fmt]
    for n, k in [(37, 3 * bw), (517, 8 * bw if bw == 32 else 2 * bw)]:
        blocks = random_blocks(fmt, n, k, seed=7 * n + k)
        w = kernels.dequantize_reference(fmt, blocks).double()
        mins = _mins(fmt, blocks)
        gen = torch.Generator().manual_seed(n)
        for m in (1, 2, 3, 7):
            x = torch.randn(m, k, generator=gen)
            ref = kernels.matmul_reference_q8(fmt, x, blocks)
            q, d, s = kernels.quantize_activations_reference(x)
            x_abs = (q.double().reshape(m, -1, 32) * d.double()[..., None]).reshape(m, k).abs()
            # |d sc q| <= |w| + |min|, and the mins' terms on their own
            size = x_abs @ (w.abs() + 2 * mins.abs()).T
            tol = (k // 32 + 8) * 2.0 ** -23 * size + 1e-30
            for threads in (1, 2):
                got = _kernel(fmt, x, blocks, threads)
                assert ((got.double() - ref).abs() <= tol).all(), (n, k, m, threads)


@pytest.mark.parametrize("fmt", FORMATS)
def test_batch_invariant_rows_do_not_depend_on_the_batch(fmt):
    """A row's output is the same bits alone on one thread, in a batch on 2 threads, and at any
    place in the kernel's tiles of x rows; and the default path runs the same kernel below its
    switch to dequantize + GEMM."""
    n, k = 131, 2 * kernels.BLOCK_WEIGHTS[fmt] if fmt.endswith("_k") else 288
    blocks = random_blocks(fmt, n, k, seed=3)
    gen = torch.Generator().manual_seed(4)
    rows = 40
    x = torch.randn(rows, k, generator=gen)
    alone = torch.cat([_kernel(fmt, x[i:i + 1], blocks, 1) for i in range(rows)])
    assert torch.equal(_kernel(fmt, x, blocks, 2), alone)
    assert torch.equal(_kernel(fmt, x, blocks, 1), alone)
    for start, size in [(1, 1), (1, 2), (2, 3), (3, 5), (5, 7)]:
        assert torch.equal(_kernel(fmt, x[start:start + size], blocks, 2),
                           alone[start:start + size]), (start, size)
    below = min(rows, quant.dequant_gemm_min_rows(fmt) - 1,
                (quant.qgemm_min_rows(fmt) or rows + 1) - 1)
    assert torch.equal(kernels.quantized_matmul(fmt, x[:below], blocks), alone[:below])


def _qgemm(fmt: str, x: torch.Tensor, blocks: torch.Tensor, threads: int) -> torch.Tensor:
    y = torch.empty(x.shape[0], blocks.shape[0])
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        quant.qgemm(fmt, y, x.contiguous(), blocks)
    finally:
        torch.set_num_threads(old)
    return y


@pytest.mark.parametrize("fmt", quant.QGEMM_FORMATS)
def test_many_row_gemm_matches_the_reference_and_its_own_rows(fmt):
    """qgemm (16 weight rows a vpdpbusd lane each, AVX512-VNNI builds): within the kernels'
    bound of the float64 reference on x quantized as they quantize it; each row the same bits
    alone and in any batch, on 1 or 2 threads; the rows past the last whole 16 the kernel's
    bits; and quantized_matmul takes it from QGEMM_MIN_ROWS rows up to its many-row switch,
    never under batch_invariant. Where it is not built, qgemm_min_rows says 0 and the layers
    never call it (checked too)."""
    if not quant.qgemm_min_rows(fmt):
        x = torch.randn(40, 256)
        blocks = random_blocks(fmt, 20, 256, seed=1)
        assert torch.equal(kernels.quantized_matmul(fmt, x[:20], blocks),
                           _kernel(fmt, x[:20], blocks, 2))
        pytest.skip("qgemm needs a build with AVX512-VNNI (and F, BW, DQ, VL): this CPU lacks "
                    "it; the layers run the kernels instead (checked)")
    bw = kernels.BLOCK_WEIGHTS[fmt]
    for n, k in [(16, bw), (37, 3 * bw), (100, 2 * bw)]:
        blocks = random_blocks(fmt, n, k, seed=11 * n + k)
        w = kernels.dequantize_reference(fmt, blocks).double()
        mins = _mins(fmt, blocks)
        gen = torch.Generator().manual_seed(n)
        x = torch.randn(40, k, generator=gen)
        x[0] = torch.tensor([1.0, -1.0]).repeat(k // 2)  # every q_x +-127
        ref = kernels.matmul_reference_q8(fmt, x, blocks)
        q, d, _ = kernels.quantize_activations_reference(x)
        x_abs = (q.double().reshape(40, -1, 32) * d.double()[..., None]).reshape(40, k).abs()
        tol = (k // 32 + 8) * 2.0 ** -23 * (x_abs @ (w.abs() + 2 * mins.abs()).T) + 1e-30
        alone = torch.cat([_qgemm(fmt, x[i:i + 1], blocks, 1) for i in range(40)])
        assert ((alone.double() - ref).abs() <= tol).all(), (n, k)
        for threads in (1, 2):
            for start, size in [(0, 40), (1, 9), (3, 17), (5, 2)]:
                assert torch.equal(_qgemm(fmt, x[start:start + size], blocks, threads),
                                   alone[start:start + size]), (n, k, threads, start, size)
        tail = n // 16 * 16
        assert torch.equal(alone[:, tail:], _kernel(fmt, x, blocks, 1)[:, tail:])
        if tail:  # another order than the kernel's: the check above tells them apart
            assert not torch.equal(alone[:, :tail], _kernel(fmt, x, blocks, 1)[:, :tail])
        switch = quant.qgemm_min_rows(fmt)
        for m in (switch - 1, switch, min(40, quant.dequant_gemm_min_rows(fmt) - 1)):
            want = alone[:m] if m >= switch else _kernel(fmt, x[:m], blocks, 2)
            assert torch.equal(kernels.quantized_matmul(fmt, x[:m], blocks), want), m
            assert torch.equal(kernels.quantized_matmul(fmt, x[:m], blocks, batch_invariant=True),
                               _kernel(fmt, x[:m], blocks, 2)), m
    # K = 8192: x's rows come in chunks of 64 (QG_X_BYTES), so 70 rows take two.
    k = 32 * bw
    blocks = random_blocks(fmt, 20, k, seed=12)
    x = torch.randn(70, k, generator=torch.Generator().manual_seed(13))
    alone = torch.cat([_qgemm(fmt, x[i:i + 1], blocks, 1) for i in (0, 63, 64, 69)])
    assert torch.equal(_qgemm(fmt, x, blocks, 2)[[0, 63, 64, 69]], alone)
    ref = kernels.matmul_reference_q8(fmt, x, blocks)
    got = _qgemm(fmt, x, blocks, 2).double()
    assert ((got - ref).abs() <= 1e-4 * ref.abs().max()).all()


@pytest.mark.parametrize("fmt", FORMATS)
def test_integer_sums_are_exact(fmt):
    """Blocks whose every fp16 scale is 1 and x whose every 32-block reaches 127 (so d_x = 1
    and q_x = x): each float step holds an integer below 2**24, so y is the exact integer
    product of x and the dequantized (integer) weights."""
    bw = kernels.BLOCK_WEIGHTS[fmt]
    n, k = 19, 2 * max(bw, 64)
    blocks = random_blocks(fmt, n, k, seed=11)
    one = torch.tensor([1.0], dtype=torch.float16).view(torch.uint8)
    for off in FP16_FIELDS[fmt]:
        blocks[..., off:off + 2] = one
    w = kernels.dequantize_reference(fmt, blocks)
    assert torch.equal(w, w.round())
    x = torch.randint(-127, 128, (5, k), generator=torch.Generator().manual_seed(2)).float()
    x.view(5, k // 32, 32)[..., 3] = 127.0
    exact = (x.to(torch.int64) @ w.to(torch.int64).T).float()
    for threads in (1, 2):
        assert torch.equal(_kernel(fmt, x, blocks, threads), exact), threads


@pytest.mark.parametrize("fmt", FORMATS)
def test_bf16_panels_are_the_rounded_weights_in_k_pairs(fmt):
    """dequantize_panels (the AMX branch's weights) against its definition: the float
    dequantization rounded to bfloat16 by torch, in k-pair panels [P, K/2, 32, 2] with zero
    rows past N. Bit for bit, a ragged last panel included. Needs no AMX."""
    k = 2 * max(kernels.BLOCK_WEIGHTS[fmt], 64)
    for n in (64, 37):
        blocks = random_blocks(fmt, n, k, seed=n)
        got = torch.empty(-(-n // 32), k // 2, 32, 2, dtype=torch.bfloat16)
        quant.dequantize_panels(fmt, got, blocks, n, k)
        w = torch.zeros(got.shape[0] * 32, k, dtype=torch.bfloat16)
        w[:n] = kernels.dequantize(fmt, blocks).bfloat16()
        expected = w.view(-1, 32, k // 2, 2).permute(0, 2, 1, 3)
        assert torch.equal(got.view(torch.int16), expected.contiguous().view(torch.int16)), n


@pytest.mark.parametrize("fmt", FORMATS)
def test_many_rows_run_on_bf16_panels_within_bfloat16_rounding(fmt, monkeypatch):
    """From the switch on, where AMX-BF16 or AVX512-BF16 runs, the matmul takes the bfloat16
    panels in chunks (here of 64 rows, so 100 weight rows take two) on AMX or vdpbf16ps: every
    output within the rounding of x and W to bfloat16 (2**-8 of the sum of |x w| terms) of the
    float64 product; the rows below the switch still get the kernel's bits. Without either the
    switch is the float32 GEMM's."""
    if quant.panel_gemm(fmt) is None:
        pytest.skip("neither AMX-BF16 nor AVX512-BF16 on this CPU: the float32 branch runs "
                    "(tested in test_quant_kernels.py)")
    n, k = 100, 512
    monkeypatch.setattr(kernels, "_PANEL_CHUNK_BYTES", 64 * 2 * k)
    # Where qgemm keeps q4_k's many-row steps the panels are reached only without it.
    monkeypatch.setattr(quant, "qgemm_min_rows", lambda fmt, limbs=1: 0)
    blocks = random_blocks(fmt, n, k, seed=5)
    w = kernels.dequantize_reference(fmt, blocks).double()
    switch = quant.dequant_gemm_min_rows(fmt)
    assert switch <= 128
    gen = torch.Generator().manual_seed(6)
    x, bias = torch.randn(switch + 3, k, generator=gen), torch.randn(n, generator=gen)
    got = kernels.quantized_matmul(fmt, x, blocks, bias=bias).double()
    terms = x.double().abs() @ w.abs().T
    err = (got - (x.double() @ w.T + bias.double())).abs()
    assert (err <= 2 ** -8 * terms + 1e-5 * terms.max()).all()
    assert err.max() > 1e-5 * terms.max()  # bfloat16's rounding, not the float32 GEMM's
    below = x[:switch - 1]
    assert torch.equal(kernels.quantized_matmul(fmt, below, blocks),
                       kernels.quantized_matmul(fmt, below, blocks, batch_invariant=True))
    no_rows = torch.empty(0, *blocks.shape[1:], dtype=torch.uint8)  # a rank's empty slice
    assert kernels.quantized_matmul(fmt, x, no_rows).shape == (switch + 3, 0)
    monkeypatch.setattr(quant, "panel_gemm", lambda fmt: None)
    assert quant.dequant_gemm_min_rows(fmt) == quant._float_dequant_gemm_min_rows(fmt)


def test_shape_errors_name_the_block_size():
    blocks = random_blocks("q4_k", 4, 256, seed=0)
    with pytest.raises(ValueError, match=r"\[N, K/256, 144\]"):
        kernels.quantized_matmul("q4_k", torch.randn(1, 256), blocks[..., :100].contiguous())
    with pytest.raises(ValueError, match="input features"):
        kernels.quantized_matmul("q4_k", torch.randn(1, 32), blocks)


@pytest.fixture(scope="module")
def scalar_library(tmp_path_factory):
    """quant_kquants.c (and quant_matmul.c's activation quantizer) built for plain x86-64:
    no AVX2, F16C or FMA."""
    compiler = shutil.which(loader.COMPILER)
    if compiler is None:
        pytest.skip(f"{loader.COMPILER} not found")
    out = tmp_path_factory.mktemp("scalar") / "kquant_scalar.so"
    sources = [str(loader.CSRC / "quant_kquants.c"), str(loader.CSRC / "quant_matmul.c")]
    flags = ["-O2", "-fopenmp", "-shared", "-fPIC"]
    if platform.machine() == "x86_64":
        flags.append("-march=x86-64")
    subprocess.run([compiler, *flags, *sources, "-o", str(out), "-lm"], check=True,
                   capture_output=True, timeout=120)
    return ctypes.CDLL(str(out))


def _with_extreme_rows(fmt: str, blocks: torch.Tensor) -> torch.Tensor:
    """Rows 0..2 with every byte outside the fp16 fields 0xff, 0x00 and 0x80: the extreme
    integers (q3_k's q 3 and -4 under scales 31 and -32, q2_k's 3 under scale and min 15, the
    largest nibbles) that random bytes reach only in a few of their lanes."""
    keep = torch.zeros(blocks.shape[-1], dtype=torch.bool)
    for off in FP16_FIELDS[fmt]:
        keep[off:off + 2] = True
    for row, byte in enumerate((0xff, 0x00, 0x80)):
        blocks[row, :, ~keep] = byte
    return blocks


@pytest.mark.parametrize("fmt", FORMATS)
def test_scalar_build_gives_the_vector_builds_bits(fmt, scalar_library):
    """Random blocks and the extreme ones, against random x and (m > 1) a row whose every q_x
    is +-127, at 8 bits and in two limbs: the scalar build's unpack() and the vector build's
    own unpacking feed the same integers to the same float steps."""
    p = ctypes.c_void_p
    bw = kernels.BLOCK_WEIGHTS[fmt]
    for n, k, m in [(37, 3 * bw, 3), (261, 2 * bw, 1)]:
        blocks = _with_extreme_rows(fmt, random_blocks(fmt, n, k, seed=n * k))
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
        if m > 1:
            x[0] = torch.tensor([1.0, -1.0]).repeat(k // 2)
        for prefix, native_kernel in (("qmm", _kernel), ("qmm16", _kernel16)):
            expected = native_kernel(fmt, x, blocks, 2)
            for threads in (1, 2):
                y = torch.empty(m, n)
                getattr(scalar_library, f"{prefix}_{fmt}")(p(y.data_ptr()), p(x.data_ptr()),
                                                           p(blocks.data_ptr()), m, n, k,
                                                           threads)
                assert torch.equal(y, expected), (prefix, n, k, m, threads)
        out = torch.empty(n, k)
        getattr(scalar_library, f"dequant_{fmt}")(p(out.data_ptr()), p(blocks.data_ptr()), n, k,
                                                  1)
        assert torch.equal(out.view(torch.int32), _gguf(fmt, blocks).view(torch.int32))


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return next((set(line.split(":", 1)[1].split()) for line in f
                         if line.startswith("flags")), set())
    except OSError:
        return set()


@pytest.fixture(scope="module")
def avx2_library(tmp_path_factory):
    """quant_kquants.c built as the loader builds it, less AVX-512: the 256-bit kernels."""
    out = tmp_path_factory.mktemp("avx2") / "kquant_avx2.so"
    sources = [str(loader.CSRC / "quant_kquants.c"), str(loader.CSRC / "quant_matmul.c")]
    subprocess.run([loader.COMPILER, *loader.CFLAGS, "-mno-avx512f", *sources, "-o", str(out),
                    "-lm"], check=True, capture_output=True, timeout=120)
    return ctypes.CDLL(str(out))


@pytest.fixture(scope="module")
def avx512_without_gfni_library(tmp_path_factory):
    """The loader's build less GFNI: the pair kernels' shifts and masks where the native build
    moves bits with vgf2p8affineqb (AVX-512 CPUs before Ice Lake have no GFNI)."""
    out = tmp_path_factory.mktemp("nogfni") / "kquant_nogfni.so"
    sources = [str(loader.CSRC / "quant_kquants.c"), str(loader.CSRC / "quant_matmul.c")]
    subprocess.run([loader.COMPILER, *loader.CFLAGS, "-mno-gfni", *sources, "-o", str(out),
                    "-lm"], check=True, capture_output=True, timeout=120)
    return ctypes.CDLL(str(out))


@pytest.mark.skipif(platform.machine() != "x86_64" or
                    not {"avx512f", "avx512bw", "avx512dq", "avx512vl"} <= _cpu_flags(),
                    reason="no AVX-512 (F, BW, DQ, VL) on this CPU: the native build is the "
                           "256-bit one")
@pytest.mark.parametrize("fmt", FORMATS)
def test_avx512_build_gives_the_256_bit_builds_bits(fmt, avx2_library,
                                                   avx512_without_gfni_library):
    """q4_k, q5_k and q6_k take two weight rows per zmm in AVX-512 builds (kq_pair_block):
    every tile shape (quads and pairs of x rows, single rows, leftover weight rows) at M 1..9
    and ragged N, 1 and 2 threads, at 8 bits and in two limbs, gives the 256-bit kernel's
    bits, with GFNI's bit moves (where the CPU has them) and without."""
    p = ctypes.c_void_p
    bw = kernels.BLOCK_WEIGHTS[fmt]
    for n, k in [(1, bw), (6, 3 * bw), (37, 2 * bw)]:
        blocks = _with_extreme_rows(fmt, random_blocks(fmt, n, k, seed=n * k)) if n >= 3 else \
            random_blocks(fmt, n, k, seed=n * k)
        for m in range(1, 10):
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
            x[0] = torch.tensor([1.0, -1.0]).repeat(k // 2)  # every q_x +-127
            for threads in (1, 2):
                for prefix, native_kernel in (("qmm", _kernel), ("qmm16", _kernel16)):
                    expected = native_kernel(fmt, x, blocks, threads)
                    for lib in (avx2_library, avx512_without_gfni_library):
                        y = torch.empty(m, n)
                        getattr(lib, f"{prefix}_{fmt}")(
                            p(y.data_ptr()), p(x.data_ptr()), p(blocks.data_ptr()), m, n, k,
                            threads)
                        assert torch.equal(expected, y), (lib, prefix, n, k, m, threads)


@pytest.mark.parametrize("fmt", FORMATS)
def test_packed_linear_method_runs_every_format(fmt):
    """PackedLinearMethod works unchanged for a format of kernels.FORMATS: it multiplies
    through quantized_matmul and describes the weight to the fused decode stack by the
    WeightFormat of the format's name (llama_decode.c's qmm_<format>)."""
    from pagedlm.model_executor.layers.native_linear import NativeLinear, WeightFormat
    from pagedlm.model_executor.layers.quantization.base import PackedLinearMethod

    rows, cols = 40, 2 * kernels.BLOCK_WEIGHTS[fmt]
    blocks = random_blocks(fmt, rows, cols, seed=5)

    class FromFile(PackedLinearMethod):
        def pack(self, layer):
            return fmt, blocks, None

    method = FromFile(deterministic=True)
    layer = torch.nn.Module()
    method.create_weights(layer, cols, [rows], cols, rows, torch.float32, None)
    method.process_weights_after_loading(layer)
    assert layer.weight is None and layer.quant_format == fmt
    x, bias = torch.randn(3, cols), torch.randn(rows)
    expected = kernels.quantized_matmul(fmt, x, blocks, None, bias, batch_invariant=True)
    assert torch.equal(method.apply(layer, x, bias), expected)
    assert method.native_form(layer) == NativeLinear(WeightFormat[fmt.upper()], blocks, None,
                                                     every_row_count=True)


@pytest.mark.parametrize("fmt", FORMATS)
def test_without_the_kernels_the_weights_are_gguf_py_s(fmt, monkeypatch):
    """PAGEDLM_DISABLE_KERNELS=1 (or no compiler): dequantize is gguf-py's and the matmul a
    float GEMM on those weights; batch_invariant refuses to run."""
    monkeypatch.setenv("PAGEDLM_DISABLE_KERNELS", "1")
    blocks = random_blocks(fmt, 9, 2 * kernels.BLOCK_WEIGHTS[fmt], seed=1)
    w = _gguf(fmt, blocks)
    assert torch.equal(kernels.dequantize(fmt, blocks), w)
    x = torch.randn(3, w.shape[1], generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(kernels.quantized_matmul(fmt, x, blocks), x @ w.T)
    with pytest.raises(ValueError, match="needs the native kernels"):
        kernels.quantized_matmul(fmt, x, blocks, batch_invariant=True)


def _kernel16(fmt: str, x: torch.Tensor, blocks: torch.Tensor, threads: int) -> torch.Tensor:
    """The two-limb kernel (qmm16_<fmt>) at any row count."""
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        y = torch.empty(x.shape[0], blocks.shape[0])
        quant.matmul(fmt, y, x.contiguous(), blocks, None, limbs=2)
        return y
    finally:
        torch.set_num_threads(saved)


@pytest.mark.parametrize("fmt", FORMATS)
def test_two_limbs_match_the_reference_on_x_in_two_limbs(fmt):
    """qmm16_<fmt> against x in the two limbs the reference makes (bit for bit the kernel's,
    or the integer sums would differ by whole steps) times the dequantized weights in float64:
    each limb's sum within the float32 scaling's roundings, plus the one adding them."""
    bw = kernels.BLOCK_WEIGHTS[fmt]
    for n, k in [(37, 3 * bw), (517, 8 * bw if bw == 32 else 2 * bw)]:
        blocks = random_blocks(fmt, n, k, seed=7 * n + k)
        w = kernels.dequantize_reference(fmt, blocks).double()
        mins = _mins(fmt, blocks)
        gen = torch.Generator().manual_seed(n + 1)
        for m in (1, 2, 5):
            x = torch.randn(m, k, generator=gen)
            ref = kernels.matmul_reference_x16(fmt, x, blocks)
            size = sum(kernels._dequantize_limb(limb).abs()
                       for limb in kernels.activation_limbs_reference(x)) @ (
                w.abs() + 2 * mins.abs()).T
            tol = (k // 32 + 9) * 2.0 ** -23 * size + 1e-30
            for threads in (1, 2):
                got = _kernel16(fmt, x, blocks, threads)
                assert ((got.double() - ref).abs() <= tol).all(), (n, k, m, threads)


@pytest.mark.parametrize("fmt", FORMATS)
def test_two_limbs_carry_x_to_about_16_bits(fmt):
    """Against the exact product of the float x: each weight meets x to within half a step
    of the residual's limb, at most amax / (2 * 127 * 254) of its 32-block's largest |x|,
    plus float32 rounding. One limb misses that bound by far (its step is amax / 127)."""
    bw = kernels.BLOCK_WEIGHTS[fmt]
    n, k = 64, 2 * max(bw, 64)
    blocks = random_blocks(fmt, n, k, seed=5)
    w = kernels.dequantize_reference(fmt, blocks).double()
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(6))
    exact = x.double() @ w.T
    amax = x.double().abs().reshape(3, -1, 32).amax(-1).repeat_interleave(32, dim=1)
    size = x.double().abs() @ (w.abs() + 2 * _mins(fmt, blocks).abs()).T
    bound = (amax / (2 * 127 * 254)) @ w.abs().T + (k // 32 + 9) * 2.0 ** -23 * size
    assert ((_kernel16(fmt, x, blocks, 2).double() - exact).abs() <= bound).all()
    assert ((_kernel(fmt, x, blocks, 2).double() - exact).abs() > bound).any()


@pytest.mark.parametrize("fmt", FORMATS)
def test_two_limb_rows_do_not_depend_on_the_batch(fmt):
    """A row's two-limb output is the same bits alone, in a batch (its limbs and the other
    rows' in the kernel's tiles) and on 1 or 2 threads."""
    n, k = 131, 2 * kernels.BLOCK_WEIGHTS[fmt] if fmt.endswith("_k") else 288
    blocks = random_blocks(fmt, n, k, seed=3)
    x = torch.randn(9, k, generator=torch.Generator().manual_seed(4))
    alone = torch.cat([_kernel16(fmt, x[i:i + 1], blocks, 1) for i in range(9)])
    for threads in (1, 2):
        assert torch.equal(_kernel16(fmt, x, blocks, threads), alone), threads
    assert torch.equal(_kernel16(fmt, x[2:7], blocks, 2), alone[2:7])


@pytest.mark.parametrize("fmt", ["q4_k", "q6_k", "q5_0"])
def test_precise_activations_take_two_limbs_and_float32(fmt, monkeypatch):
    """quantized_matmul(precise_activations=True): the kernel in two limbs at every row count
    below its switch (and under batch_invariant at every one), and past the switch float32
    dequantize + GEMM, never the bfloat16 AMX panels; without it, 8 bits."""
    bw = kernels.BLOCK_WEIGHTS[fmt]
    blocks = random_blocks(fmt, 40, 2 * max(bw, 64), seed=8)
    k = blocks.shape[1] * bw
    switch = quant.dequant_gemm_min_rows(fmt, limbs=2)
    x = torch.randn(switch + 1, k, generator=torch.Generator().manual_seed(9))
    threads = torch.get_num_threads()
    for m in (1, 2, switch - 1):
        got = kernels.quantized_matmul(fmt, x[:m], blocks, precise_activations=True)
        assert torch.equal(got, _kernel16(fmt, x[:m], blocks, threads)), m
        if m < min(quant.dequant_gemm_min_rows(fmt), quant.qgemm_min_rows(fmt) or m + 1):
            assert torch.equal(kernels.quantized_matmul(fmt, x[:m], blocks),
                               _kernel(fmt, x[:m], blocks, threads)), m
    assert torch.equal(kernels.quantized_matmul(fmt, x, blocks, batch_invariant=True,
                                                precise_activations=True),
                       _kernel16(fmt, x, blocks, threads))
    monkeypatch.setattr(kernels, "_panels_matmul", None)  # a call would fail
    many = kernels.quantized_matmul(fmt, x, blocks, precise_activations=True)
    assert torch.equal(many, torch.nn.functional.linear(x, kernels.dequantize(fmt, blocks)))


def test_the_two_limb_switch_stays_above_the_fused_decode_stacks_rows(monkeypatch):
    """The fused decode stack runs the kernels up to gemv.GEMV_MAX_ROWS rows, as the layers
    must: a build without AVX2 (its float switch at 16 rows, here imitated) halved it to 8
    for two limbs, where the layers ran dequantize + GEMM and the stack's 8-row steps differed
    from theirs (7.5e-3 in a logprob; h3's repro_scalar_switch.py)."""
    from pagedlm.kernels import gemv
    monkeypatch.setattr(quant, "_float_dequant_gemm_min_rows", lambda fmt: 16)
    for fmt in ("q4_1", "q8_0", *FORMATS):
        assert quant.dequant_gemm_min_rows(fmt, limbs=2) > gemv.GEMV_MAX_ROWS, fmt


def test_two_limbs_are_refused_where_no_kernel_takes_them():
    """i8 takes float x (no limbs to split)."""
    qweight, scale = kernels.quantize_i8(torch.randn(8, 64))
    with pytest.raises(ValueError, match="i8 kernels take x in 1 limb, not 2"):
        quant.matmul("i8", torch.empty(1, 8), torch.randn(1, 64), qweight, scale, limbs=2)
