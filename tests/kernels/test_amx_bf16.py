"""The AMX (tdpbf16ps) kernel over bfloat16 panels (csrc/amx_bf16.c, kernels/amx.py) and the
layers that take it from AMX_MIN_ROWS rows.

It rounds x to bfloat16 (to nearest even) once and sums exact products of bfloat16s in float32,
in an order the SDM does not pin down bit for bit, so it is held to:
- small integers (exact in bfloat16, sums under 2^24 exact in float32): the exact matmul, bit for
  bit, over ragged M (1..70, padded rows), ragged N (37, 1000, 40: a padded last panel), K 32,
  576 and 1536 (row chunks of 448 and 160 rows) and 2144 (K blocks of 2048 and 96, summed
  through a float32 scratch), k-pair panels, 1 and 2 threads: any
  indexing, padding or layout error shows; and a y of 4 MiB or more (csrc NT_MIN_BYTES), whose
  full blocks go out with non-temporal stores where its rows are 64-byte aligned;
- random values: a float64 matmul of bfloat16-rounded x and the weight, within the bound of a
  float32 sum of K exact products in any order, gamma_K * sum |x_k w_k| (gamma_K = K u / (1 -
  K u), u = 2^-24), plus K times the smallest normal for flushed subnormals;
- x rounded to bfloat16 to nearest even (ties included) against an identity weight;
- a row's bits alone and inside a batch, at any position (each C tile row is its own A row
  against the panel) and thread count;
- the layer: AMX from AMX_MIN_ROWS rows outside the deterministic mode, the panel kernel below
  and in it; and a tiny random Llama in bfloat16 whose prefills run on AMX gives transformers'
  bfloat16 greedy tokens.
Skipped where amx.available() is False: a CPU or build without AMX-BF16 (the AVX2 EPYC), or a
kernel that refuses the tile data permission (Linux before 5.16).
"""
import pytest
import torch

from pagedlm.kernels import amx, gemv
from tests.conftest import needs_kernels

pytestmark = [needs_kernels, pytest.mark.skipif(
    gemv.library() is None or not amx.available(),
    reason="needs AMX-BF16 in the build (-march=native on a CPU with it) and Linux's tile data "
           "permission (arch_prctl XTILEDATA, Linux 5.16+): not here")]

U = 2.0 ** -24
TINY = 2.0 ** -126
# K = 2144 and 4160: blocks of 2048 (csrc KBLOCK) and a short last one.
SHAPES = [(37, 32), (1000, 576), (576, 1536), (64, 64), (40, 2144)]
ROWS = [1, 2, 15, 16, 17, 31, 32, 33, 48, 70]


def _pairs(w: torch.Tensor) -> torch.Tensor:
    """w [N, K] (K even) as k-pair panels [ceil(N / 32), K / 2, 32, 2]: [p, j, c, e] is
    w[p * 32 + c, 2j + e], AMX's B-tile layout."""
    n, k = w.shape
    p = (n + 31) // 32
    padded = torch.zeros(p * 32, k, dtype=torch.bfloat16)
    padded[:n] = w
    return padded.view(p, 32, k // 2, 2).permute(0, 2, 1, 3).contiguous()


LAYOUTS = {"pairs": _pairs}


@pytest.fixture
def threads(request):
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.mark.parametrize("threads", [1, 2], indirect=True)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("n,k", SHAPES)
def test_small_integers_give_the_exact_matmul(n, k, layout, threads):
    g = torch.Generator().manual_seed(n * k)
    w = torch.randint(-8, 9, (n, k), generator=g).bfloat16()
    panels = LAYOUTS[layout](w)
    for m in ROWS:
        x = torch.randint(-8, 9, (m, k), generator=g).float()
        expected = (x.double() @ w.double().T).float()  # |sum| <= 64 K < 2^24: exact
        assert torch.equal(amx.gemm_panels(x, panels, n), expected), (m, n, k)


@pytest.mark.parametrize("threads", [1, 2], indirect=True)
@pytest.mark.parametrize("n,k,m", [(100, 1536, 497), (70, 576, 1000), (37, 1536, 161),
                                   (2080, 576, 520)])
def test_rows_rounded_a_chunk_ahead_give_the_exact_matmul(n, k, m, threads):
    """One thread rounds each row chunk of x (448 rows at K = 576, 160 at 1536) while the chunk
    before it runs: chunks of 160 + 160 + 160 + 32 rows (the last 15 padding), 448 + 448 + 112
    (a 16-row block at the end), 160 + 16 (one row, 15 padding), and 448 + 80 (8 padding) into a
    y of 4.1 MiB, streamed; any row rounded late, twice or into the wrong place shows in small
    integers' exact results. At 2 threads (more than one chunk of rows) each thread takes a run
    of rows as a call of its own: 256 + 256, 512 + 496, 96 + 80 (65 in x) and 288 + 240."""
    g = torch.Generator().manual_seed(n + k + m)
    w = torch.randint(-8, 9, (n, k), generator=g).bfloat16()
    x = torch.randint(-8, 9, (m, k), generator=g).float()
    expected = (x.double() @ w.double().T).float()
    assert torch.equal(amx.gemm_panels(x, _pairs(w), n), expected)


@pytest.mark.parametrize("threads", [1, 2], indirect=True)
@pytest.mark.parametrize("n,k,m", [(3072, 64, 350), (1000, 32, 1100), (2080, 96, 531)])
def test_a_large_y_streamed_gives_the_exact_matmul(n, k, m, threads):
    """y of 4.3, 4.4 and 4.4 MB: full blocks streamed (3072 and 2080 columns: rows 64-byte
    aligned), the ragged ones (531 rows, 1000 columns: rows 4000 bytes apart, unaligned) stored
    as below the threshold; small integers, so the result is exact."""
    g = torch.Generator().manual_seed(n + k + m)
    w = torch.randint(-8, 9, (n, k), generator=g).bfloat16()
    x = torch.randint(-8, 9, (m, k), generator=g).float()
    assert m * n * 4 >= 4 << 20
    expected = (x.double() @ w.double().T).float()
    assert torch.equal(amx.gemm_panels(x, _pairs(w), n), expected)


@pytest.mark.parametrize("threads", [1, 2], indirect=True)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("n,k", SHAPES)
def test_random_values_within_the_float32_sum_bound(n, k, layout, threads):
    g = torch.Generator().manual_seed(1 + n * k)
    w = torch.randn(n, k, generator=g).bfloat16()
    panels = LAYOUTS[layout](w)
    gamma = k * U / (1 - k * U)
    bias = torch.randn(n, generator=g)
    for m in ROWS + [300]:
        x = torch.randn(m, k, generator=g) * 3
        xb = x.bfloat16().double()
        exact = xb @ w.double().T
        bound = gamma * (xb.abs() @ w.double().abs().T) + k * TINY
        got = amx.gemm_panels(x, panels, n)
        assert ((got.double() - exact).abs() <= bound).all(), (m, n, k)
        # The bias is added after, in float32.
        assert torch.equal(amx.gemm_panels(x, panels, n, bias), got + bias)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_x_is_rounded_to_bfloat16_to_nearest_even(layout):
    """Against an identity weight each output is one x value rounded to bfloat16: ties (1 +
    2^-8 sits halfway between 1 and 1 + 2^-7) go to the even mantissa, others to the nearest."""
    k = 64
    panels = LAYOUTS[layout](torch.eye(k).bfloat16())
    base = torch.tensor([1.0, 1 + 2 ** -8, 1 + 3 * 2 ** -8, 1 + 2 ** -9, 1 + 3 * 2 ** -9,
                         -(1 + 2 ** -8), 3.14159, -2.71828, 1e-3, 65504.0, 0.0, -0.0])
    x = base.repeat(k // len(base) + 1)[:k].reshape(1, k).repeat(20, 1)
    x *= 2.0 ** (torch.arange(20.0) - 5).reshape(20, 1)  # powers of two keep ties ties
    got = amx.gemm_panels(x, panels, k)
    assert torch.equal(got, x.bfloat16().float())
    assert got[5, 1] == 1.0 and got[5, 2] == 1 + 2 ** -6  # row 5 is x * 1: to even, both ways


@pytest.mark.parametrize("threads", [1, 2], indirect=True)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("n,k", [(1000, 576), (576, 1536), (100, 4160)])
def test_a_row_is_the_same_alone_and_in_any_batch(n, k, layout, threads):
    """Each C row is its own A row against the panel in one K order: the same bits whatever
    the tile, block, row chunk (160 rows at K = 1536, 128 in K blocks of 2048) or thread split
    it falls in."""
    g = torch.Generator().manual_seed(7)
    w = torch.randn(n, k, generator=g).bfloat16()
    panels = LAYOUTS[layout](w)
    x = torch.randn(300, k, generator=g)
    batch = amx.gemm_panels(x, panels, n)
    for i in (0, 15, 16, 31, 33, 159, 160, 177, 299):
        alone = amx.gemm_panels(x[i:i + 1], panels, n)
        assert torch.equal(alone[0], batch[i]), i
    for m in (17, 48, 170):
        assert torch.equal(amx.gemm_panels(x[:m], panels, n), batch[:m]), m


def test_other_k_and_shapes():
    """K not a multiple of 32 goes to the panel kernel (amx.runs says so); shapes that do not
    fit are refused."""
    assert amx.runs(576) and amx.runs(32) and not amx.runs(48) and not amx.runs(100)
    g = torch.Generator().manual_seed(3)
    w = torch.randn(40, 48, generator=g).bfloat16()
    panels = gemv.pack_panels(w)
    x = torch.randn(20, 48, generator=g)
    assert torch.equal(amx.gemm_panels(x, panels, 40), gemv.gemm_panels(x, panels, 40))
    panels = _pairs(torch.randn(40, 64).bfloat16())
    with pytest.raises(ValueError, match="columns do not fit"):
        amx.gemm_panels(torch.randn(2, 64), panels, 65)
    with pytest.raises(ValueError, match="x must be float32"):
        amx.gemm_panels(torch.randn(2, 32), panels, 40)
    with pytest.raises(ValueError, match="panels must be"):
        amx.gemm_panels(torch.randn(2, 64), panels.float(), 40)


def _layer(method, w: torch.Tensor) -> torch.nn.Module:
    n, k = w.shape
    layer = torch.nn.Module()
    method.create_weights(layer, k, [n], k, n, torch.bfloat16, None)
    layer.weight.data.copy_(w)
    method.process_weights_after_loading(layer)
    return layer


def test_layers_take_amx_from_amx_min_rows_outside_the_deterministic_mode():
    from pagedlm.model_executor.layers.linear_method import AMX_MIN_ROWS, UnquantizedLinearMethod
    g = torch.Generator().manual_seed(5)
    w = torch.randn(100, 128, generator=g).bfloat16()
    x = torch.randn(40, 128, generator=g)
    fast, det = UnquantizedLinearMethod(), UnquantizedLinearMethod(deterministic=True)
    layer, det_layer = _layer(fast, w), _layer(det, w)
    panels = layer.panel_weight
    for m in (1, AMX_MIN_ROWS - 1, AMX_MIN_ROWS, 40):
        y = fast.apply(layer, x[:m])
        kernel = amx.gemm_panels if m >= AMX_MIN_ROWS else gemv.gemm_panels
        assert torch.equal(y, kernel(x[:m], panels, 100)), m
        # Deterministic: the panel kernel at every row count.
        assert torch.equal(det.apply(det_layer, x[:m]), gemv.gemm_panels(x[:m], panels, 100))
    # The fused decode stack may run the panels at any row count only where apply does.
    assert not fast.native_form(layer).batch_invariant
    assert fast.native_form(layer).other_kernel_from == AMX_MIN_ROWS
    assert det.native_form(det_layer).batch_invariant
    # A K the AMX kernel does not take stays on the panels.
    odd = _layer(fast, torch.randn(100, 48, generator=g).bfloat16())
    assert odd.amx_from == 0 and fast.native_form(odd).batch_invariant


def test_tiny_llama_in_bfloat16_matches_transformers(tmp_path, default_model_dir, monkeypatch):
    """Greedy tokens of a random tiny Llama (hidden 64, MLP 128: K multiples of 32) with
    dtype="bfloat16", whose prefills (every prompt is 16 tokens or more, one prefill each) run
    on AMX, against transformers on the same bfloat16 weights fed the same tokens: each of our
    tokens is its argmax at that position, or a near-tie of its logits (AMX rounds x to
    bfloat16 in the matmuls, transformers' float32 run does not).

    transformers computing in bfloat16 is no reference on this model: it rounds every
    activation to bfloat16, and at width 64 that moves its greedy token at one of the first 3
    steps in 3 of these 4 prompts, with AMX on or off (the panel kernel everywhere gives the
    same tokens here); its float32 run on the bfloat16-rounded weights is what pagedlm
    computes (bfloat16 weights, float32 activations). The default model against transformers
    in bfloat16, whose batched prefill takes AMX too, is tests/models/test_bfloat16.py."""
    from transformers import AutoModelForCausalLM

    from pagedlm import LLM, SamplingParams
    from pagedlm.model_executor.layers import linear_method
    from tests.conftest import make_tiny_model
    path = make_tiny_model(tmp_path, "llama", default_model_dir)
    calls = []
    real = amx.gemm_panels

    def counted(x, *args, **kwargs):  # the real kernel, counted
        calls.append(x.shape[0])
        return real(x, *args, **kwargs)

    monkeypatch.setattr(linear_method.amx, "gemm_panels", counted)
    llm = LLM(model=path, dtype="bfloat16")
    prompts = ["The quick brown fox jumps over the lazy dog while the cat sleeps on the warm mat",
               "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1)",
               "Once upon a time, in a land far away, there lived a king who had three daughters",
               "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21"]
    tok = llm.get_tokenizer()
    assert all(len(tok.encode(p)) >= linear_method.AMX_MIN_ROWS for p in prompts)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outs = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]  # one prefill each
    model = llm.llm_engine.executor.worker.model
    layers = [m for m in model.modules() if getattr(m, "panel_weight", None) is not None
              and m.panel_weight.dtype == torch.bfloat16]
    assert layers and all(m.amx_from == linear_method.AMX_MIN_ROWS for m in layers)
    # Every prompt's prefill ran its layers on AMX (4 matmuls a layer, 3 layers).
    assert sum(m >= linear_method.AMX_MIN_ROWS for m in calls) >= len(prompts) * 4 * 3
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).float().eval()
    identical = 0
    for prompt, out in zip(prompts, outs):
        ids, got = tok.encode(prompt), list(out.outputs[0].token_ids)
        with torch.inference_mode():
            logits = hf(torch.tensor([ids + got])).logits[0, len(ids) - 1:-1]
        gaps = logits.max(-1).values - logits[torch.arange(len(got)), got]
        identical += bool((gaps == 0).all())
        assert (gaps < 5e-2).all(), (prompt, got, gaps)
    assert identical >= len(prompts) - 1
