"""The panel kernel over bfloat16 and float16 weights (gemv.pack_panels / gemm_panels on
2-byte panels).

float16 and bfloat16 weights stay 2 bytes and are widened exactly to float32 as they are read
(bfloat16 panels are k-pairs where the build has AVX512-BF16, gemv.bf16_pairs(), plain panels
elsewhere); x, the products and the sums are float32. So their outputs must be bit for bit the
float32 panel kernel's on weight.float(), which test_fused_decode.py holds to a libm FMA chain
and to batch invariance. That promise does not hold for the opt-in vdpbf16ps math on k-pairs
(gemv.bf16_dot(True), PAGEDLM_BF16_DPBF16=1; AVX512-BF16 builds only), which rounds x to
bfloat16 and adds each pair's odd product, then its even one, with subnormals flushed (Intel
SDM's pseudo-code): its outputs are held bit for bit to a torch emulation of that order
instead (the "bf16-dpbf16" cases, skipped without AVX512-BF16). Both:
- ragged N (not a multiple of the panel width, and under it), K odd or tiny, M around the
  tiles (6 rows with AVX2, 12 with AVX-512) and the 192-row blocks, with a bias, 1 and 2
  threads; and against a float64 matmul;
- a row's bits alone and in a batch, at any position, row count and thread count;
- float16's subnormals, extremes and signed zeros widened exactly; bfloat16 pairs' subnormals
  flushed and x's ties rounded to even, as the SDM says;
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
DPBF16 = (gemv.library() is not None and gemv.panel_width() > 0
          and gemv.bf16_dpbf16_supported())
needs_dpbf16 = pytest.mark.skipif(not DPBF16, reason="vdpbf16ps on bfloat16 k-pair panels needs "
                                  "a build with AVX512-BF16: this CPU lacks it")
# (dtype, vdpbf16ps math): each 2-byte dtype widened, and bfloat16 k-pairs on vdpbf16ps.
KINDS = [pytest.param((torch.bfloat16, False), id="bf16"),
         pytest.param((torch.float16, False), id="f16"),
         pytest.param((torch.bfloat16, True), id="bf16-dpbf16", marks=needs_dpbf16)]


@pytest.fixture
def kind(request):
    """(dtype, dpbf16), with gemm_panels_bf16 on that math for the test's length."""
    dtype, dot = request.param
    with gemv.bf16_dot(dot) as got:
        assert got == dot and gemv.bf16_dpbf16() == dot
        yield dtype, dot
# The smallest normal float32: vdpbf16ps reads subnormal inputs as zero and flushes subnormal
# sums to zero (DAZ, FTZ), whatever MXCSR says.
TINY = 2.0 ** -126


def _flush(t: torch.Tensor) -> torch.Tensor:
    return torch.where(t.abs() < TINY, torch.zeros_like(t), t)


def _vdpbf16ps(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [M, K] float32 @ w [N, K] bfloat16 ^T as the k-pair panels compute it, in torch
    float32: x rounded to bfloat16 (vcvtne2ps2bf16: subnormals read as zero, then to nearest
    even); an odd K padded with a zero pair element; per output, from +0, for each pair j:
    c += x[2j+1] w[2j+1], then c += x[2j] w[2j] (the product of two bfloat16s is exact in
    float32, so each step is one float32 rounding, as vdpbf16ps' FMA), subnormal sums flushed."""
    m, k = x.shape
    xb, wf = _flush(_flush(x).bfloat16().float()), _flush(w.float())
    if k % 2:
        xb = torch.cat([xb, torch.zeros(m, 1)], 1)
        wf = torch.cat([wf, torch.zeros(w.shape[0], 1)], 1)
    c = torch.zeros(m, w.shape[0])
    for j in range(0, xb.shape[1], 2):
        for e in (1, 0):
            c = _flush(c + _flush(xb[:, j + e, None] * wf[None, :, j + e]))
    return c


def _reference(x: torch.Tensor, w: torch.Tensor, wide: torch.Tensor, n: int,
               dot: bool) -> torch.Tensor:
    """What gemm_panels must give bit for bit on w's 2-byte panels: the float32 kernel on the
    widened weight (`wide`, its float32 panels), or on vdpbf16ps its emulation."""
    if dot:
        return _vdpbf16ps(x, w)
    return _threads(1, lambda: gemv.gemm_panels(x, wide, n))


def _threads(n: int, fn):
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(n)
        return fn()
    finally:
        torch.set_num_threads(saved)


@pytest.mark.parametrize("kind", KINDS, indirect=True)
def test_rows_put_in_pieces_land_where_pack_panels_puts_them(kind):
    """put_panel_rows, as a loader calls it shard by shard, at starts and ends inside panels
    and over K wide enough for whole 16 x 16 tiles of the native transposing copy (and ragged
    ones past them): every element where the layout says, the rest zero, and the whole the
    panels pack_panels makes."""
    dtype, _ = kind
    width = gemv.panel_width()
    for n, k in ((3 * width + 5, 96), (2 * width, 70), (9, 33)):
        w = torch.randn(n, k).to(dtype)
        panels = gemv.empty_panels(n, k, dtype)
        cuts = sorted({0, 5, width - 3, width + 16, 2 * width, n} & set(range(n + 1)))
        for a, b in zip(cuts, cuts[1:]):
            gemv.put_panel_rows(panels, a, w[a:b].contiguous())
        expected = torch.zeros_like(panels)
        for r in range(n):
            if panels.dim() == 4:  # k-pairs, an odd K's last pair padded with zero
                row = torch.cat([w[r], w.new_zeros(k % 2)])
                expected[r // width, :, r % width] = row.view(-1, 2)
            else:
                expected[r // width, :, r % width] = w[r]
        assert torch.equal(panels, expected)
        assert torch.equal(gemv.pack_panels(w), expected)


@pytest.mark.parametrize("kind", KINDS, indirect=True)
def test_panel_dtypes_and_packing(kind):
    dtype, _ = kind
    pairs = dtype == torch.bfloat16 and gemv.bf16_pairs()
    assert gemv.panel_dtypes() == (torch.float32, torch.bfloat16, torch.float16)
    width = gemv.panel_width()
    for k in (10, 9):
        w = torch.randn(37, k).to(dtype)
        panels = gemv.pack_panels(w)
        assert panels.dtype == dtype and panels.is_contiguous()
        # Row r of the weight is column r % width of panel r // width, every row read back.
        rows = torch.arange(40).view(2, 20)
        assert torch.equal(gemv.panel_rows(panels, rows, k)[rows < 37], w[rows[rows < 37]].float())
        assert not gemv.panel_rows(panels, rows, k)[rows >= 37].any()
        if pairs:
            # k-pairs: [p, j, c, e] is row p * width + c's k = 2j + e; an odd K's pad is zero.
            assert panels.shape == (2, (k + 1) // 2, width, 2)
            flat = panels.permute(0, 2, 1, 3).reshape(2 * width, -1)
            assert torch.equal(flat[:37, :k], w) and not flat[37:].any()
            assert not flat[:, k:].any()
            continue
        assert panels.shape == (-(-37 // width), k, width)
        # The same layout as the float32 panels, element for element (2 bytes -> float32
        # exact), zeros past N included.
        assert torch.equal(panels.float(), gemv.pack_panels(w.float()))
        assert not panels.transpose(1, 2).reshape(-1, k)[37:].any()
        assert torch.equal(panels.transpose(1, 2).reshape(-1, k)[:37], w)
    for refused in (w.T, w[0], w.double(), w.to(torch.int16)):
        assert gemv.pack_panels(refused) is None
    # runs() stays the row-major float32 GEMV kernel's test.
    assert not gemv.runs(w) and gemv.runs(w.float())


@pytest.mark.parametrize("kind", KINDS, indirect=True)
@pytest.mark.parametrize("n,k", SHAPES)
def test_2byte_panels_are_float32_panels_on_the_widened_weight(n, k, kind):
    """Widened (plain or k-pair panels): the float32 kernel's bits on the widened weight.
    vdpbf16ps: the emulation of its documented order, bit for bit (this Sapphire Rapids-class
    CPU follows it; 'even product first' differs on these shapes)."""
    dtype, dot = kind
    g = torch.Generator().manual_seed(n * 3 + k)
    w = torch.randn(n, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g)
    panels, wide = gemv.pack_panels(w), gemv.pack_panels(w.float())
    for m in ROWS:
        x = torch.randn(m, k, generator=g)
        ref = _reference(x, w, wide, n, dot) + b
        for threads in (1, 2):
            got = _threads(threads, lambda: gemv.gemm_panels(x, panels, n, b))
            assert got.dtype == torch.float32 and got.shape == (m, n)
            assert torch.equal(got, ref), (m, threads)
        # One running float32 sum per output over K (see test_fused_decode.py's tolerance),
        # over x rounded to bfloat16 on vdpbf16ps.
        xr = x.bfloat16() if dot else x
        torch.testing.assert_close(
            got, (xr.double() @ w.double().T + b.double()).float(), rtol=1e-5, atol=3e-4)
    # A strided x is copied, not misread.
    x = torch.randn(3, k + 8, generator=g)[:, :k]
    assert torch.equal(gemv.gemm_panels(x, panels, n), _reference(x, w, wide, n, dot))


@pytest.mark.parametrize("kind", KINDS, indirect=True)
@pytest.mark.parametrize("n,k", [(1000, 131), (37, 100)])
def test_2byte_panel_row_is_batch_invariant(n, k, kind):
    """A row's bits do not depend on the row count (every count from 1 to 130: inside a tile,
    at its edge, across tiles; and 200, across 192-row blocks), its position, or 1 or 2
    threads; N ragged, K odd (an odd K's zero pad on bfloat16 pairs)."""
    dtype, _ = kind
    g = torch.Generator().manual_seed(n + k)
    w, probe = torch.randn(n, k, generator=g).to(dtype), torch.randn(1, k, generator=g)
    panels = gemv.pack_panels(w)
    alone = _threads(1, lambda: gemv.gemm_panels(probe, panels, n))
    for m in [*range(1, 131), 200]:
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


@needs_dpbf16
@pytest.mark.parametrize("kind", [(torch.bfloat16, True)], indirect=True)
def test_bf16_dpbf16_flushes_subnormals_and_rounds_x_to_even(kind):
    """vdpbf16ps per Intel's SDM: a subnormal weight or x reads as zero (DAZ), a subnormal sum
    is flushed (FTZ), and x is rounded to bfloat16 ties-to-even; each case checked against the
    emulation and against what the other choice would give, so the test tells them apart."""
    k = 4
    w = torch.zeros(6, k)
    x = torch.zeros(1, k)
    x[0] = torch.tensor([2.0 ** 100, 1.0, 2.0 ** -63, 1.0 + 2.0 ** -8])
    w[0, 0] = 2.0 ** -130  # subnormal weight times 2^100: 2^-30 unless read as zero
    w[0, 1] = 2.0 ** -30  # so the sum is 2^-30, or 2^-29 without DAZ
    w[1, 2] = 2.0 ** -64  # 2^-63 * 2^-64 = 2^-127, subnormal: flushed
    w[2, 3] = 1.0  # x[3] halfway between two bfloat16s: rounds to the even 1.0
    w[3, 1], w[3, 3] = 1.0, -1.0  # 1 - bf16(1 + 2^-8): 0 when rounded to even
    w[4, 0], w[4, 1] = 2.0 ** -100, 1.0  # 1 + 1 (a normal product)
    w[5] = torch.tensor([0.0, 2.0 ** -20, 0.0, 3.0])
    w = w.bfloat16()
    assert w[0, 0].float() == 2.0 ** -130 and w[1, 2].float() == 2.0 ** -64  # kept exactly
    panels = gemv.pack_panels(w)
    for m in (1, 13):
        xs = x.expand(m, k).contiguous()
        got = gemv.gemm_panels(xs, panels, 6)
        assert torch.equal(got, _vdpbf16ps(xs, w)), got
        assert torch.equal(got[0], torch.tensor([2.0 ** -30, 0.0, 1.0, 0.0, 2.0,
                                                 2.0 ** -20 + 3.0]))
    # A subnormal x (float32 and bfloat16 both hold 2^-130) reads as zero; K odd.
    x = torch.tensor([[2.0 ** -130, 1.0, 1.0]])
    w = torch.tensor([[2.0 ** 100, 2.0 ** -30, 0.0]]).bfloat16()
    got = gemv.gemm_panels(x, gemv.pack_panels(w), 1)
    assert torch.equal(got, _vdpbf16ps(x, w)) and got.item() == 2.0 ** -30


@pytest.mark.parametrize("kind", KINDS, indirect=True)
def test_gemm_panels_refuses_bad_input(kind):
    dtype, _ = kind
    panels = gemv.pack_panels(torch.randn(20, 8).to(dtype))
    width = gemv.panel_width()
    plain, pairs = (-(-20 // width), 8, width), (-(-20 // width), 4, width, 2)
    # bfloat16 panels in the other layout than this build's; float16 ones in k-pairs.
    other = torch.zeros(plain if gemv.bf16_pairs() else pairs, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"bfloat16 panels here are"):
        gemv.gemm_panels(torch.randn(2, 8), other, 20)
    with pytest.raises(ValueError, match=r"float16 panels here are \[P, K, W\]"):
        gemv.gemm_panels(torch.randn(2, 8), torch.zeros(pairs, dtype=torch.float16), 20)
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


def test_bf16_layers_take_the_cpus_bfloat16_unit_from_its_switch():
    """A bfloat16 layer (UnquantizedLinearMethod) runs the widened panel kernel up to its
    switch, then AMX where the CPU has it, else vdpbf16ps where the build has AVX512-BF16 (the
    Zen 4 EPYC), else the widened kernel at every row count; deterministic, always the widened
    kernel. The expected route is this CPU's, so every CPU checks the one it takes."""
    from pagedlm.kernels import amx
    from pagedlm.model_executor.layers import linear_method
    g = torch.Generator().manual_seed(7)
    n, k = 100, 128  # a K the AMX kernel takes
    w = torch.randn(n, k, generator=g).bfloat16()
    x = torch.randn(40, k, generator=g)
    unquantized = linear_method.UnquantizedLinearMethod
    fast, det = unquantized(), unquantized(deterministic=True)
    layers = []
    for method in (fast, det):
        layer = torch.nn.Module()
        method.create_weights(layer, k, [n], k, n, torch.bfloat16, None)
        layer.weight.data.copy_(w)
        method.process_weights_after_loading(layer)
        layers.append(layer)
    layer, det_layer = layers
    panels = layer.panel_weight
    if amx.available():
        switch, many = linear_method.AMX_MIN_ROWS, amx.gemm_panels
    elif gemv.bf16_dot_available() and not gemv.bf16_dpbf16():
        switch = linear_method.DPBF16_MIN_ROWS

        def many(x, panels, n):
            return gemv.gemm_panels(x, panels, n, dot=True)
    else:
        switch, many = 0, None
    assert (layer.amx_from or layer.dot_from) == switch
    assert det_layer.amx_from == det_layer.dot_from == 0
    assert fast.native_form(layer).other_kernel_from == switch
    assert switch == 0 or switch > gemv.GEMV_MAX_ROWS  # the fused decode stack stays below
    for m in (1, gemv.GEMV_MAX_ROWS, linear_method.DPBF16_MIN_ROWS, linear_method.AMX_MIN_ROWS, 40):
        want = many(x[:m], panels, n) if switch and m >= switch else \
            gemv.gemm_panels(x[:m], panels, n)
        assert torch.equal(fast.apply(layer, x[:m]), want), m
        assert torch.equal(det.apply(det_layer, x[:m]), gemv.gemm_panels(x[:m], panels, n)), m
    if switch:  # the routes give other bits, so the checks above tell them apart
        assert not torch.equal(many(x, panels, n), gemv.gemm_panels(x, panels, n))
