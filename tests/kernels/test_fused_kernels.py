"""The native fused per-layer ops and the narrow KV-cache dtypes, against plain PyTorch.

Each fused op (RMSNorm with and without the residual add, SiLU-and-mul, rotary embedding, the
KV-cache write) is compared with the PyTorch form it replaces, on random inputs of the default
model's shapes (and GQA, partial rotary, views into a wider QKV output). Paged attention over a
bfloat16 / float16 cache is compared, for both backends, with a dense float64 recomputation over
the same K/V rounded to the cache dtype.
"""
import math

import pytest
import torch
import torch.nn.functional as F

from pagedlm import kernels
from pagedlm.attention.backends import NativeKernelBackend, TorchSDPABackend, paged_attention
from pagedlm.attention.backends.native import prefill_plan
from pagedlm.model_executor.layers.activation import SiluAndMul
from pagedlm.model_executor.layers.layernorm import RMSNorm
from pagedlm.model_executor.layers.rotary_embedding import RotaryEmbedding
from tests.kernels.test_paged_attention import CASES, _dense_reference, _scenario
from tests.conftest import needs_kernels

# Not module-wide: the PyTorch paths production takes without a compiler run the same checks.


@pytest.fixture(params=[pytest.param("native", marks=needs_kernels), "disabled"])
def kernel_path(request, monkeypatch) -> str:
    """The layers' native kernels, or their PyTorch path (PAGEDLM_DISABLE_KERNELS=1)."""
    if request.param == "disabled":
        monkeypatch.setenv("PAGEDLM_DISABLE_KERNELS", "1")
    return request.param

# Token counts: a decode, a small ragged batch, and one large enough to take the threaded path.
TOKENS = [1, 7, 300]


def _torch_rms(x, w, eps, residual=None):
    if residual is not None:
        x = x + residual
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)), x


@pytest.mark.parametrize("tokens,hidden", [(1, 576), (7, 576), (300, 576), (7, 64)])
def test_rms_norm(tokens, hidden, kernel_path):
    g = torch.Generator().manual_seed(tokens * hidden)
    norm = RMSNorm(hidden, 1e-5)
    norm.weight.data = torch.randn(hidden, generator=g)
    assert norm.native == (kernel_path == "native")
    wide = torch.randn(tokens, hidden + 32, generator=g) * 3
    x = wide[:, :hidden]  # a view with a row stride, as a split of a wider output is
    residual = torch.randn(tokens, hidden, generator=g)
    ref, ref_res = _torch_rms(x, norm.weight.data, 1e-5)
    torch.testing.assert_close(norm(x), ref, rtol=1e-5, atol=1e-5)
    out, res = norm(x, residual)
    ref, ref_res = _torch_rms(x, norm.weight.data, 1e-5, residual)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(res, ref_res)  # the add is exact
    assert torch.equal(residual, residual.clone()) and x.data_ptr() == wide.data_ptr()


@pytest.mark.parametrize("tokens,inter", [(1, 1536), (7, 1536), (300, 1536), (3, 8)])
def test_silu_and_mul(tokens, inter, kernel_path):
    g = torch.Generator().manual_seed(tokens + inter)
    # Wide range: both sigmoid branches, saturation, and exact zeros.
    x = torch.randn(tokens, 2 * inter, generator=g) * 8
    x[0, :4] = torch.tensor([0.0, -0.0, 100.0, -100.0])
    act = SiluAndMul()
    assert act.native == (kernel_path == "native")
    ref = F.silu(x[:, :inter]) * x[:, inter:]
    torch.testing.assert_close(act(x), ref, rtol=2e-6, atol=1e-6)


@needs_kernels
@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("heads,kv_heads,head_dim,rotary_dim", [
    (9, 3, 64, None),    # the default model (GQA 3:1)
    (4, 4, 128, None),   # MHA, wider heads
    (8, 2, 96, 48),      # partial rotary (Phi-style)
])
def test_rotary_in_place(tokens, heads, kv_heads, head_dim, rotary_dim):
    g = torch.Generator().manual_seed(tokens * heads + head_dim)
    rot = RotaryEmbedding(head_dim, 4096, 10000.0, rotary_dim=rotary_dim)
    assert rot.native
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    qkv = torch.randn(tokens, q_size + 2 * kv_size, generator=g)
    q, k, v = qkv.split((q_size, kv_size, kv_size), dim=-1)
    q, k = q.view(tokens, heads, head_dim), k.view(tokens, kv_heads, head_dim)
    positions = torch.randint(0, 4096, (tokens,), generator=g)
    positions[0] = 4095
    v_before = v.clone()
    rot.native = False
    ref_q, ref_k = rot(positions, q.clone(), k.clone())
    rot.native = True
    out_q, out_k = rot(positions, q, k)
    assert out_q.data_ptr() == q.data_ptr()  # rotated in place
    torch.testing.assert_close(out_q, ref_q, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out_k, ref_k, rtol=1e-6, atol=1e-6)
    assert torch.equal(v, v_before)


@needs_kernels
@pytest.mark.parametrize("cache_dtype", kernels.kv_types.KERNEL_KV_DTYPES)
def test_write_kv_rounds_like_torch(cache_dtype):
    g = torch.Generator().manual_seed(3)
    num_blocks, block_size, kv_heads, head_dim, tokens = 9, 16, 3, 64, 21
    qkv = torch.randn(tokens, (3 + 2 * kv_heads) * head_dim, generator=g) * 50
    # NaN, infinities, a float32 subnormal, a value that overflows float16.
    qkv[0, 3 * head_dim:3 * head_dim + 5] = torch.tensor(
        [float("nan"), float("inf"), -float("inf"), 1e-40, 7e4])
    key = qkv[:, 3 * head_dim:][:, :kv_heads * head_dim].view(tokens, kv_heads, head_dim)
    value = qkv[:, -kv_heads * head_dim:].view(tokens, kv_heads, head_dim)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:tokens]
    caches = [torch.zeros(num_blocks, block_size, kv_heads, head_dim, dtype=cache_dtype)
              for _ in range(4)]
    kernels.fused_ops.write_kv(key, value, caches[0], caches[1], slots)
    flat = [c.view(-1, kv_heads, head_dim) for c in caches]
    flat[2][slots] = key.to(cache_dtype)
    flat[3][slots] = value.to(cache_dtype)
    torch.testing.assert_close(caches[0], caches[2], rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(caches[1], caches[3], rtol=0, atol=0, equal_nan=True)


@needs_kernels
def test_write_kv_rounds_bfloat16_ties_to_even():
    """Random values almost never sit on a bfloat16 tie. Every upper half, with the lower half
    just under, on and just over the tie: the C write and torch must round them alike, or a
    fresh prompt (rounded by torch) and its cached copy (by the C write) would differ."""
    upper = torch.arange(1 << 16, dtype=torch.int32) << 16
    bits = torch.cat([upper | 0x7fff, upper | 0x8000, upper | 0x8001, upper])
    x = bits.view(torch.float32)
    x = x[~x.isnan()]
    head_dim = 64
    x = x[:x.numel() // head_dim * head_dim].view(-1, 1, head_dim).contiguous()
    k_cache = torch.empty(x.shape[0], 1, 1, head_dim, dtype=torch.bfloat16)
    v_cache = torch.empty_like(k_cache)
    kernels.fused_ops.write_kv(x, -x, k_cache, v_cache, torch.arange(x.shape[0]))
    assert torch.equal(k_cache.view(x.shape).view(torch.int16), x.bfloat16().view(torch.int16))
    assert torch.equal(v_cache.view(x.shape).view(torch.int16),
                       (-x).bfloat16().view(torch.int16))


def _rounded_scenario(scenario, dtype):
    """The scenario with its cache in `dtype`, and the dense reference's K/V rounded the same
    way for every row: fresh prompts too attend to K/V as the cache holds them, so results do
    not depend on whether a prefix came from the cache."""
    query, key, value, k_cache, v_cache, meta, dense = scenario
    dense = [(k.to(dtype).float(), v.to(dtype).float()) for k, v in dense]
    return query, key, value, k_cache.to(dtype), v_cache.to(dtype), meta, dense


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("backend", [pytest.param(NativeKernelBackend, marks=needs_kernels),
                                     TorchSDPABackend])
# Decodes only, decodes with a context chunk, fresh prompts around one, long (SDPA) chunks.
@pytest.mark.parametrize("case", [1, 4, 5, 6, 8])
# 40: off the AVX-512 loops' multiple of 16, so the kernel widens rows into its portable copy.
@pytest.mark.parametrize("head_dim", [64, 40])
def test_attention_over_narrow_cache(cache_dtype, backend, case, head_dim):
    decode_lens, chunks = CASES[case]
    scenario = _scenario(case, decode_lens, chunks, num_kv_heads=3, group=3, head_dim=head_dim)
    query, key, value, k_cache, v_cache, meta, dense = _rounded_scenario(scenario, cache_dtype)
    scale = 1 / math.sqrt(query.shape[-1])
    out = paged_attention(query, key, value, k_cache, v_cache, meta, scale,
                          backend=backend())
    assert k_cache.dtype == cache_dtype and out.dtype == torch.float32
    ref = _dense_reference(query, dense, scale)
    exact = torch.ones(out.shape[0], dtype=torch.bool)
    if (backend is NativeKernelBackend and cache_dtype == torch.bfloat16
            and kernels.attention.prefill_attention_amx_runs(head_dim)):
        # The fresh prompt chunks go to the AMX prefill kernel here, which rounds Q and the
        # softmax weights to bfloat16 (test_prefill_attention_amx.py holds it to references
        # row by row): a bfloat16-sized bound for its rows, float32's for the rest.
        for start, length, _ in prefill_plan(meta, query, key, value, k_cache).chunks.tolist():
            exact[start:start + length] = False
        torch.testing.assert_close(out[~exact], ref[~exact], rtol=0, atol=5e-2)
    torch.testing.assert_close(out[exact], ref[exact], rtol=2e-5, atol=2e-5)
    # What this step wrote is the step's K/V rounded to the cache dtype.
    kv_heads, head_dim = k_cache.shape[-2:]
    written = k_cache.view(-1, kv_heads, head_dim)[meta.slot_mapping]
    assert torch.equal(written, key.to(cache_dtype))


@needs_kernels
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float16])
def test_narrow_cache_window_and_soft_cap(cache_dtype):
    """Sliding window and soft-capping read the narrow cache the same way in both backends."""
    scenario = _scenario(11, [40, 3, 130], [(50, 6)], num_kv_heads=2, group=4, head_dim=128)
    query, key, value, k_cache, v_cache, meta, _ = _rounded_scenario(scenario, cache_dtype)
    scale = 128 ** -0.5
    outs = [paged_attention(query, key, value, k_cache.clone(), v_cache.clone(), meta, scale,
                            backend=b(), sliding_window=32, logits_soft_cap=20.0)
            for b in (NativeKernelBackend, TorchSDPABackend)]
    torch.testing.assert_close(outs[0], outs[1], rtol=2e-5, atol=2e-5)


def test_inputs_that_disagree_raise_on_both_paths(kernel_path):
    """The layers' ops with inputs whose shapes disagree, or a position outside the rotary
    tables: a ValueError (the PyTorch path's errors) from the native path too, which read and
    wrote past the tensors' ends instead (a k with fewer tokens than q corrupted the heap, a
    shorter weight was read past, a position of -1 read 8.5e34 from before the tables) or
    dropped the odd column of SiLU-and-mul's input."""
    errors = (ValueError, RuntimeError, IndexError)
    norm = RMSNorm(64)
    with pytest.raises(errors):
        norm(torch.randn(3, 128))  # the weight is 64 long
    with pytest.raises(errors):
        norm(torch.randn(3, 64), torch.randn(3, 32))
    x, one_row = torch.randn(3, 64), torch.randn(1, 64)
    try:  # (read past its one row: off by up to 5.9)
        got = norm(x, one_row)
    except ValueError:
        pass
    else:
        assert torch.allclose(got[1], x + one_row) and torch.allclose(got[0], norm(x + one_row))
    with pytest.raises(errors):
        SiluAndMul()(torch.randn(3, 17))
    rope = RotaryEmbedding(head_dim=64, max_position=16, base=10000.0)
    q, k = torch.randn(4, 2, 64), torch.randn(4, 1, 64)
    cases = [(torch.arange(4), k[:2]), (torch.arange(3), k), (torch.tensor([0, 1, 16, 2]), k)]
    if kernel_path == "native":  # (torch's indexing takes -1 as the tables' last row)
        cases.append((torch.tensor([0, -1, 2, 3]), k))
    for positions, kk in cases:
        before = q.clone()
        with pytest.raises(errors):
            rope(positions, q, kk)
        assert torch.equal(q, before)  # nothing rotated before the error
