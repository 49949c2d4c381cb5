"""The panel kernel over bfloat16 and float16 weights (gemv.pack_panels / gemm_panels on
2-byte panels).

The weights stay 2 bytes and are widened exactly to float32 as they are read; x, the products
and the sums are float32. So the outputs must be bit for bit the float32 panel kernel's on
weight.float(), which test_fused_decode.py holds to a libm FMA chain and to batch invariance:
- ragged N (not a multiple of the panel width, and under it), K odd or tiny, M around the
  tiles (6 rows with AVX2, 12 with AVX-512) and the 192-row blocks, with a bias, 1 and 2
  threads; and against a float64 matmul on the widened weight;
- a row's bits alone and in a batch, at any position and thread count;
- float16's subnormals, extremes and signed zeros widened exactly;
- what pack_panels packs and what gemm_panels refuses.
"""
import pytest
import torch

from pagedlm.kernels import gemv
from tests.conftest import needs_kernels

pytestmark = [needs_kernels, pytest.mark.skipif(
    gemv.library() is None or gemv.library().gemm_panel_width() == 0,
    reason="the panel kernel needs AVX2 or AVX-512")]

# (N, K): ragged N against both panel widths (16, 32), N under a width, K odd or tiny, and
# SmolLM2-135M's q and down projections.
SHAPES = [(37, 100), (5, 3), (16, 1), (33, 45), (100, 7), (576, 576), (576, 1536)]
ROWS = [1, 2, 3, 5, 6, 7, 13, 130, 200]
DTYPES = [torch.bfloat16, torch.float16]


def _threads(n: int, fn):
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(n)
        return fn()
    finally:
        torch.set_num_threads(saved)


@pytest.mark.parametrize("dtype", DTYPES)
def test_panel_dtypes_and_packing(dtype):
    assert gemv.panel_dtypes() == (torch.float32, torch.bfloat16, torch.float16)
    width = gemv.panel_width()
    w = torch.randn(37, 10).to(dtype)
    panels = gemv.pack_panels(w)
    assert panels.dtype == dtype and panels.shape == (-(-37 // width), 10, width)
    assert panels.is_contiguous()
    # The same layout as the float32 panels, element for element (2 bytes -> float32 exact),
    # zeros past N included.
    assert torch.equal(panels.float(), gemv.pack_panels(w.float()))
    assert not panels.transpose(1, 2).reshape(-1, 10)[37:].any()
    # Row r of the weight is column r % width of panel r // width.
    assert torch.equal(panels.transpose(1, 2).reshape(-1, 10)[:37], w)
    for refused in (w.T, w[0], w.double(), w.to(torch.int16)):
        assert gemv.pack_panels(refused) is None
    # runs() stays the row-major float32 GEMV kernel's test.
    assert not gemv.runs(w) and gemv.runs(w.float())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,k", SHAPES)
def test_2byte_panels_are_float32_panels_on_the_widened_weight(n, k, dtype):
    g = torch.Generator().manual_seed(n * 3 + k)
    w = torch.randn(n, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g)
    panels, wide = gemv.pack_panels(w), gemv.pack_panels(w.float())
    for m in ROWS:
        x = torch.randn(m, k, generator=g)
        ref = _threads(1, lambda: gemv.gemm_panels(x, wide, n, b))
        for threads in (1, 2):
            got = _threads(threads, lambda: gemv.gemm_panels(x, panels, n, b))
            assert got.dtype == torch.float32 and got.shape == (m, n)
            assert torch.equal(got, ref), (m, threads)
        # One running float32 sum per output over K (see test_fused_decode.py's tolerance).
        torch.testing.assert_close(
            got, (x.double() @ w.double().T + b.double()).float(), rtol=1e-5, atol=3e-4)
    # A strided x is copied, not misread.
    x = torch.randn(3, k + 8, generator=g)[:, :k]
    assert torch.equal(gemv.gemm_panels(x, panels, n), gemv.gemm_panels(x, wide, n))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,k", [(1000, 131), (37, 100)])
def test_2byte_panel_row_is_batch_invariant(n, k, dtype):
    """A row's bits do not depend on the row count (inside a tile, at its edge, across tiles
    and 192-row blocks), its position, or 1 or 2 threads."""
    g = torch.Generator().manual_seed(n + k)
    w, probe = torch.randn(n, k, generator=g).to(dtype), torch.randn(1, k, generator=g)
    panels = gemv.pack_panels(w)
    alone = _threads(1, lambda: gemv.gemm_panels(probe, panels, n))
    for m in (5, 6, 7, 13, 200):
        for pos in sorted({0, m // 2, m - 1}):
            x = torch.randn(m, k, generator=g)
            x[pos] = probe[0]
            for threads in (1, 2):
                y = _threads(threads, lambda: gemv.gemm_panels(x, panels, n))
                assert torch.equal(y[pos], alone[0]), (m, pos, threads)


def test_f16_extremes_widen_exactly():
    """float16's subnormals (which vcvtph2ps widens exactly whatever MXCSR's DAZ), its largest
    and smallest normals and signed zeros, each weight alone in a row, at 1 and 7 rows."""
    specials = torch.tensor([2.0 ** -24, -(2.0 ** -24), 3 * 2.0 ** -20, 2.0 ** -14, 65504.0,
                             -65504.0, 0.0, -0.0], dtype=torch.float16)
    k = 19
    w = torch.zeros(len(specials) * 3, k, dtype=torch.float16)
    for i, v in enumerate(specials):
        w[3 * i, i] = v  # alone
        w[3 * i + 1, :] = v  # a whole row of it
        w[3 * i + 2] = torch.randn(k).half() * v.float().abs().clamp(max=1)
    panels, wide = gemv.pack_panels(w), gemv.pack_panels(w.float())
    assert torch.equal(panels.float(), wide)
    g = torch.Generator().manual_seed(5)
    for m in (1, 7):
        x = torch.randn(m, k, generator=g)
        for threads in (1, 2):
            got = _threads(threads, lambda: gemv.gemm_panels(x, panels, len(w)))
            assert torch.equal(got, gemv.gemm_panels(x, wide, len(w))), (m, threads)


def test_gemm_panels_refuses_bad_input():
    panels = gemv.pack_panels(torch.randn(20, 8).bfloat16())
    with pytest.raises(ValueError, match=r"x must be float32 \[M, 8\]"):
        gemv.gemm_panels(torch.randn(2, 8).bfloat16(), panels, 20)
    with pytest.raises(ValueError, match="panels must be contiguous float32, bfloat16 or "
                                         "float16, got torch.float64"):
        gemv.gemm_panels(torch.randn(2, 8), panels.double(), 20)
    with pytest.raises(ValueError, match="strided"):
        gemv.gemm_panels(torch.randn(2, 8), panels.transpose(1, 2).contiguous()
                         .transpose(1, 2), 20)
    with pytest.raises(ValueError, match="do not fit"):
        gemv.gemm_panels(torch.randn(2, 8), panels, panels.shape[0] * panels.shape[2] + 1)
