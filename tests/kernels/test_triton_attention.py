"""The Triton attention kernels and backend (the GPU path) against the PyTorch backend, which
test_paged_attention.py checks against a dense reference: on a GPU when there is one (the
kernels compiled for real), else on CPU tensors in Triton's interpreter.

tests/conftest.py puts Triton in interpreter mode (TRITON_INTERPRET=1) for the whole session
when there is no GPU, before anything imports triton: the mode is fixed at triton's import, so
it cannot be switched for one file, and nothing else runs Triton on CPU tensors. Shapes are small
because the interpreter runs each program in Python.
"""
from __future__ import annotations

import math

import pytest
import torch

from pagedlm.attention.backends import TorchSDPABackend, TritonAttentionBackend
from pagedlm.attention.metadata import AttentionMetadata
from pagedlm.kernels.triton import attention as ta
from tests.kernels.test_paged_attention import _scenario

# Triton is part of the gpu extra, which setup.sh installs: missing, this fails (no skip).
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# 16-bit runs are compared with a float32 reference over the same (rounded) inputs; they differ
# by the output's rounding and the probabilities' rounding before the product with V.
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}

if DEVICE == "cuda":  # float32 parity with TF32 off (the reference runs on the CPU anyway)
    torch.backends.cuda.matmul.allow_tf32 = False


def _castable(x: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """x, made exactly representable in a bfloat16 cache under the interpreter: Triton 3.6's
    interpreter truncates float32 -> bfloat16 casts where the GPU (and PyTorch) round to nearest
    even, so K/V that need rounding would be stored one unit apart. On the GPU the rounding is
    tested as it is."""
    if DEVICE == "cpu" and cache_dtype == torch.bfloat16:
        return x.to(cache_dtype).to(x.dtype)
    return x


def _poison_unused(k_cache, v_cache, meta, num_decode_lens):
    """NaN in every cache slot that holds no token of the step's sequences (spare blocks, the
    tails of last blocks), so a kernel that reads past a length or a window shows it."""
    bs = k_cache.shape[1]
    keep = torch.zeros(k_cache.shape[0] * bs, dtype=torch.bool)
    keep[meta.slot_mapping[meta.slot_mapping >= 0]] = True
    for row, n in enumerate(num_decode_lens):
        pos = torch.arange(n)
        keep[meta.decode_block_tables[row].long()[pos // bs] * bs + pos % bs] = True
    for p in meta.prefills:
        pos = torch.arange(p.context_len)
        if p.context_len:
            keep[p.block_table.long()[pos // bs] * bs + pos % bs] = True
    for cache in (k_cache, v_cache):
        cache.view(-1, *cache.shape[2:])[~keep] = float("nan")


def _case(seed, decode_lens, chunks, num_kv_heads, group, head_dim=32, block_size=16):
    sc = _scenario(seed, decode_lens, chunks, num_kv_heads, group, head_dim,
                   block_size=block_size, with_mask=False, int32_tables=True)
    query, key, value, k_cache, v_cache, meta, _ = sc
    _poison_unused(k_cache, v_cache, meta, decode_lens)
    return query, key, value, k_cache, v_cache, meta


def _to(meta: AttentionMetadata, device) -> AttentionMetadata:
    """The same step with its tensors on `device` (a fresh object: backends cache on it)."""
    def move(t):
        return None if t is None else t.to(device)

    prefills = [type(p)(p.start, p.end, p.context_len, move(p.block_table))
                for p in meta.prefills]
    return AttentionMetadata(slot_mapping=move(meta.slot_mapping),
                             num_decode_tokens=meta.num_decode_tokens,
                             decode_block_tables=move(meta.decode_block_tables),
                             decode_mask=move(meta.decode_mask), prefills=prefills,
                             decode_seq_lens=move(meta.decode_seq_lens))


def _compare(case, dtype, cache_dtype, sliding_window=None, soft_cap=None):
    """The Triton backend's forward (on DEVICE, in dtype over a cache_dtype cache) against the
    PyTorch backend's with float32 queries on the same rounded inputs (K/V rounded to the
    cache's dtype, as both write them); also checks the cache writes."""
    query, key, value, k_cache, v_cache, meta = case
    q = query.to(dtype)
    k, v = (_castable(x.to(dtype), cache_dtype) for x in (key, value))
    # Copies: each backend writes its own caches.
    kc, vc = k_cache.to(cache_dtype, copy=True), v_cache.to(cache_dtype, copy=True)
    scale = 1 / math.sqrt(q.shape[-1])
    ref_kc, ref_vc = kc.clone(), vc.clone()
    ref = TorchSDPABackend().forward(q.float(), k.float(), v.float(), ref_kc, ref_vc, meta,
                                     scale, sliding_window, soft_cap)
    dev_kc, dev_vc = kc.to(DEVICE, copy=True), vc.to(DEVICE, copy=True)
    out = TritonAttentionBackend().forward(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), dev_kc,
                                           dev_vc, _to(meta, DEVICE), scale, sliding_window,
                                           soft_cap)
    assert out.dtype == dtype and out.shape == q.shape
    torch.testing.assert_close(out.cpu().float(), ref, atol=TOL[dtype], rtol=TOL[dtype])
    # The cache holds what the reference wrote (both cast to the cache's dtype).
    torch.testing.assert_close(dev_kc.cpu(), ref_kc, equal_nan=True, atol=0, rtol=0)
    torch.testing.assert_close(dev_vc.cpu(), ref_vc, equal_nan=True, atol=0, rtol=0)
    return out


def test_write_kv_skips_padding_slots_and_casts():
    g = torch.Generator().manual_seed(0)
    t, hk, d = 5, 3, 24  # heads and features off powers of two: masked tiles
    kv = torch.randn(t, 2 * hk * d + 8, generator=g)
    key = kv[:, :hk * d].view(t, hk, d)  # strided views, as a fused projection gives them
    value = kv[:, hk * d:2 * hk * d].view(t, hk, d)
    slots = torch.tensor([7, -1, 0, 30, -1])
    for cache_dtype in (torch.float32, torch.bfloat16, torch.float16):
        key, value = _castable(key, cache_dtype), _castable(value, cache_dtype)
        k_cache = torch.full((4, 8, hk, d), 5.0, dtype=cache_dtype)
        v_cache = torch.full((4, 8, hk, d), 5.0, dtype=cache_dtype)
        dk, dv = k_cache.to(DEVICE), v_cache.to(DEVICE)
        ta.write_kv(key.to(DEVICE), value.to(DEVICE), dk, dv, slots.to(DEVICE))
        real = slots >= 0
        k_cache.view(-1, hk, d)[slots[real]] = key[real].to(cache_dtype)
        v_cache.view(-1, hk, d)[slots[real]] = value[real].to(cache_dtype)
        assert torch.equal(dk.cpu(), k_cache) and torch.equal(dv.cpu(), v_cache)


# GQA 2:1 and 4:1, one and two KV heads, each cache dtype (float32 queries over a bfloat16 cache:
# a float32 model with kv_cache_dtype=bfloat16). Kept few: the interpreter is slow.
CONFIGS = [(2, 2, torch.float32, torch.float32), (1, 4, torch.float32, torch.bfloat16),
           (1, 2, torch.bfloat16, torch.bfloat16), (1, 4, torch.float16, torch.float16)]


@pytest.mark.parametrize("num_kv_heads,group,dtype,cache_dtype", CONFIGS)
def test_decode_matches_torch(num_kv_heads, group, dtype, cache_dtype):
    # Lengths across tiles and blocks; the tables have a spare column of garbage ids.
    case = _case(1, [1, 17, 70, 130], [], num_kv_heads, group)
    _compare(case, dtype, cache_dtype)


@pytest.mark.parametrize("sliding_window,soft_cap,dtype", [
    (8, None, torch.float32), (None, 5.0, torch.bfloat16), (40, 2.0, torch.float32)])
def test_decode_window_and_soft_cap(sliding_window, soft_cap, dtype):
    # 130 keys, window 8: the loop starts at the window's tile, past the first.
    case = _case(2, [3, 9, 70, 130], [], 1, 2)
    _compare(case, dtype, dtype, sliding_window, soft_cap)


def test_decode_padding_row_gives_zeros():
    """A CUDA-graph padding row (slot -1, length 0, a zero block table row) writes nothing and
    outputs zeros; the real rows are as without it."""
    query, key, value, k_cache, v_cache, meta = _case(3, [5, 40], [], 2, 2)
    want = _compare((query, key, value, k_cache, v_cache, meta), torch.float32, torch.float32)
    g = torch.Generator().manual_seed(3)

    def pad(x):
        return torch.cat([x, torch.randn(1, *x.shape[1:], generator=g)])

    tables = torch.cat([meta.decode_block_tables, torch.zeros_like(meta.decode_block_tables[:1])])
    padded = AttentionMetadata(slot_mapping=torch.cat([meta.slot_mapping, torch.tensor([-1])]),
                               num_decode_tokens=3, decode_block_tables=tables, decode_mask=None,
                               prefills=[], decode_seq_lens=torch.tensor([5, 40, 0],
                                                                         dtype=torch.int32))
    dk, dv = k_cache.to(DEVICE, copy=True), v_cache.to(DEVICE, copy=True)
    out = TritonAttentionBackend().forward(pad(query).to(DEVICE), pad(key).to(DEVICE),
                                           pad(value).to(DEVICE), dk, dv, _to(padded, DEVICE),
                                           1 / math.sqrt(query.shape[-1]))
    assert torch.equal(out[2].cpu(), torch.zeros_like(out[2].cpu()))
    torch.testing.assert_close(out[:2].cpu(), want.cpu(), atol=0, rtol=0)
    # The padding row's K/V went nowhere: the caches match the unpadded run's.
    dk2, dv2 = k_cache.to(DEVICE, copy=True), v_cache.to(DEVICE, copy=True)
    TritonAttentionBackend().forward(query.to(DEVICE), key.to(DEVICE), value.to(DEVICE), dk2,
                                     dv2, _to(meta, DEVICE), 1 / math.sqrt(query.shape[-1]))
    assert torch.equal(dk.isnan(), dk2.isnan()) and torch.equal(dk.nan_to_num(), dk2.nan_to_num())
    assert torch.equal(dv.nan_to_num(), dv2.nan_to_num())


def _poisoned_scratch(monkeypatch) -> list[int]:
    """Makes the split path's scratch NaN-filled (a combine reading a split that no program
    wrote shows as NaN) and records each allocation's split count."""
    calls, alloc = [], ta._split_scratch

    def scratch(rows, heads, splits, head_dim, device):
        calls.append(splits)
        return tuple(t.fill_(float("nan")) for t in alloc(rows, heads, splits, head_dim, device))

    monkeypatch.setattr(ta, "_split_scratch", scratch)
    return calls


def _decode_direct(case, dtype, cache_dtype, sliding_window=None, soft_cap=None,
                   num_splits=None, pad_at=None):
    """ta.decode_attention called directly (num_splits as given) on the case's decode rows, a
    padding row (length 0, a garbage table row, a random query) inserted at pad_at, against
    the SDPA backend on the real rows, as _compare does; the padding row must be zeros."""
    query, key, value, k_cache, v_cache, meta = case
    q = query.to(dtype)
    k, v = (_castable(x.to(dtype), cache_dtype) for x in (key, value))
    kc, vc = k_cache.to(cache_dtype, copy=True), v_cache.to(cache_dtype, copy=True)
    scale = 1 / math.sqrt(q.shape[-1])
    ref = TorchSDPABackend().forward(q.float(), k.float(), v.float(), kc.clone(), vc.clone(),
                                     meta, scale, sliding_window, soft_cap)
    kc, vc = kc.to(DEVICE), vc.to(DEVICE)
    ta.write_kv(k.to(DEVICE), v.to(DEVICE), kc, vc, meta.slot_mapping.to(DEVICE))
    tables, lens = meta.decode_block_tables, meta.decode_seq_lens
    if pad_at is not None:
        g = torch.Generator().manual_seed(99)
        q = torch.cat([q[:pad_at], torch.randn(1, *q.shape[1:], generator=g).to(dtype),
                       q[pad_at:]])
        garbage = torch.randint(0, kc.shape[0], (1, tables.shape[1]), generator=g)
        tables = torch.cat([tables[:pad_at], garbage.to(tables.dtype), tables[pad_at:]])
        lens = torch.cat([lens[:pad_at], lens.new_zeros(1), lens[pad_at:]])
    out = torch.full(q.shape, float("nan"), dtype=dtype, device=DEVICE)
    ta.decode_attention(q.to(DEVICE), kc, vc, tables.to(DEVICE), lens.to(DEVICE), scale, out,
                        sliding_window, soft_cap, num_splits=num_splits)
    out = out.cpu()
    if pad_at is not None:
        assert torch.equal(out[pad_at], torch.zeros_like(out[pad_at]))
        out = torch.cat([out[:pad_at], out[pad_at + 1:]])
    torch.testing.assert_close(out.float(), ref, atol=TOL[dtype], rtol=TOL[dtype])


# Split-KV decode, forced. Lengths 200, 0 (a padding row), 5, 70, 130 over 14-block tables
# (224 keys): 4 splits are 64 keys each, so 5 and 70 leave 3 and 2 of their splits empty;
# window 40 starts 200 in its third split and 130 mid-way through its second (200 and 130 have
# empty splits before the window). 2 splits are 128 keys (two tiles): window 70 starts 200 in
# its second split and 130 at key 60, two tiles to loop over. GQA 3:1, head_dim 64 (SmolLM2's).
@pytest.mark.parametrize("num_kv_heads,group,head_dim,dtype,cache_dtype,window,soft_cap,splits", [
    (3, 3, 64, torch.float32, torch.float32, None, None, 4),
    (3, 3, 64, torch.bfloat16, torch.bfloat16, 40, 5.0, 4),
    (1, 3, 64, torch.float32, torch.bfloat16, 70, None, 2),
    (1, 2, 32, torch.float16, torch.float16, None, 3.0, 2)])
def test_decode_split_matches_torch(monkeypatch, num_kv_heads, group, head_dim, dtype,
                                    cache_dtype, window, soft_cap, splits):
    calls = _poisoned_scratch(monkeypatch)
    case = _case(7, [200, 5, 70, 130], [], num_kv_heads, group, head_dim)
    assert case[5].decode_block_tables.shape[1] * 16 == 224
    _decode_direct(case, dtype, cache_dtype, window, soft_cap, num_splits=splits, pad_at=1)
    assert calls == [splits]  # the split path ran, with that many splits


@pytest.mark.parametrize("window", [None, 1500])
def test_decode_split_combines_many_splits(monkeypatch, window):
    """More splits hold keys than the combine merges at once (_COMBINE_BLOCK_S): 1990 keys in
    the wrapper's own plan for 2 rows (2016-key tables: 32 one-tile splits) take two steps of
    its loop, the second rescaling the first's sums; window 1500 starts at split 7."""
    calls = _poisoned_scratch(monkeypatch)
    case = _case(9, [1990, 40], [], 2, 2)
    assert ta.decode_splits(2, 2, 2016) == (32, 64) and ta._COMBINE_BLOCK_S < 32 - 7
    _decode_direct(case, torch.float32, torch.float32, window)
    assert calls == [32]


def test_decode_splits_rule():
    """The split plan: from shapes only (rows, KV heads, the tables' keys), never lengths."""
    assert ta._SPLIT_BELOW_PROGRAMS == 2 * ta._NUM_SMS == 264
    # One SmolLM2 stream (3 KV heads): 2048-key tables into 32 one-tile splits (96 programs);
    # 8192 keys into 64 two-tile splits, since 88 splits bring 3 heads to 264 programs.
    assert ta.decode_splits(1, 3, 2048) == (32, 64)
    assert ta.decode_splits(1, 3, 8192) == (64, 128)
    # 87 rows x 3 heads = 261 programs: still split in two; 88 x 3 = 264: the single pass.
    assert ta.decode_splits(87, 3, 2048) == (2, 1024)
    assert ta.decode_splits(88, 3, 2048) == (1, 2048)
    assert ta.decode_splits(128, 3, 2048) == (1, 2048)
    # Tables within 3 tiles (192 keys) keep the single pass; reaching into a 4th splits.
    assert ta.decode_splits(1, 3, 192) == (1, 192)
    assert ta.decode_splits(1, 3, 208) == (4, 64)
    for rows in (1, 2, 5, 17, 63, 100, 263):
        for kv_heads in (1, 2, 3, 8):
            for keys in (256, 304, 2048, 8192, 131072):
                splits, split_len = ta.decode_splits(rows, kv_heads, keys)
                programs = rows * kv_heads
                if programs >= ta._SPLIT_BELOW_PROGRAMS:
                    assert splits == 1
                    continue
                # Whole tiles; every split starts inside the table and together they cover it;
                # the grid stays under twice the target (the scratch with it).
                assert splits >= 2 and split_len % ta._DECODE_BLOCK_N == 0
                assert (splits - 1) * split_len < keys <= splits * split_len
                assert splits * programs < 2 * ta._SPLIT_BELOW_PROGRAMS


def test_decode_one_row_takes_split_path(monkeypatch):
    """A one-row batch of SmolLM2's attention shape (9 query heads over 3 KV heads, head_dim
    64, bfloat16) with 300 keys: the wrapper's own plan splits its 320-key table into 5, and
    the result matches the reference."""
    calls = _poisoned_scratch(monkeypatch)
    case = _case(8, [300], [], 3, 3, 64)
    assert case[5].decode_block_tables.shape == (1, 20)
    assert ta.decode_splits(1, 3, 320) == (5, 64)
    _decode_direct(case, torch.bfloat16, torch.bfloat16)
    assert calls == [5]


# (decode lengths, prefill chunks (context_len, chunk_len)): fresh prompts and chunks after
# cached context, mixed with decodes. (test_prefill_window_and_soft_cap has a chunk longer than
# one tile of query rows.)
MIXED = ([9, 70], [(0, 11), (45, 7), (0, 1), (20, 5)])


@pytest.mark.parametrize("num_kv_heads,group,dtype,cache_dtype", CONFIGS)
def test_mixed_batch_with_cached_context(num_kv_heads, group, dtype, cache_dtype):
    case = _case(4, *MIXED, num_kv_heads, group)
    _compare(case, dtype, cache_dtype)


@pytest.mark.parametrize("sliding_window,soft_cap", [(6, None), (30, 4.0)])
def test_prefill_window_and_soft_cap(sliding_window, soft_cap):
    # 40 rows: two tiles of query rows in float32 (32 each).
    case = _case(5, [], [(0, 40), (50, 9), (33, 3)], 1, 2)
    _compare(case, torch.float32, torch.float32, sliding_window, soft_cap)


def test_prefill_reads_the_runners_varlen_metadata():
    """Given the runner's varlen fields, the backend uses them as they are (they are not rebuilt
    from meta.prefills): here a block table row for a fresh chunk too, as a runner may give."""
    query, key, value, k_cache, v_cache, meta = _case(6, [], [(0, 5), (21, 4)], 2, 2)
    want = _compare((query, key, value, k_cache, v_cache, meta), torch.float32, torch.float32)
    step = _to(meta, DEVICE)
    width = meta.prefills[1].block_table.numel()
    tables = torch.zeros(2, width + 3, dtype=torch.int32)
    tables[1, :width] = meta.prefills[1].block_table
    tables[0] = 10**6  # never read: the chunk has no context
    step.prefill_query_start_loc = torch.tensor([0, 5, 9], dtype=torch.int32, device=DEVICE)
    step.prefill_context_lens = torch.tensor([0, 21], dtype=torch.int32, device=DEVICE)
    step.prefill_block_tables = tables.to(DEVICE)
    step.max_prefill_query_len = 5
    step.prefills = [type(p)(p.start, p.end, p.context_len, None) for p in meta.prefills]
    out = TritonAttentionBackend().forward(query.to(DEVICE), key.to(DEVICE), value.to(DEVICE),
                                           k_cache.to(DEVICE, copy=True),
                                           v_cache.to(DEVICE, copy=True), step,
                                           1 / math.sqrt(query.shape[-1]))
    torch.testing.assert_close(out.cpu(), want.cpu(), atol=0, rtol=0)


def test_backend_selection(monkeypatch):
    from pagedlm.attention.backends import (BACKENDS_BY_NAME, NativeKernelBackend,
                                            get_attn_backend)
    monkeypatch.delenv("PAGEDLM_ATTENTION_BACKEND", raising=False)
    monkeypatch.delenv("PAGEDLM_DISABLE_KERNELS", raising=False)
    # Automatic: Triton on a GPU; on the CPU never (the interpreter is for tests).
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert isinstance(get_attn_backend(dtype, "cuda"), TritonAttentionBackend)
        assert not isinstance(get_attn_backend(dtype, "cpu"), TritonAttentionBackend)
    monkeypatch.setenv("PAGEDLM_ATTENTION_BACKEND", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert isinstance(get_attn_backend(torch.bfloat16, "cpu"), TritonAttentionBackend)
    with pytest.raises(ValueError, match="deterministic=True needs the native"):
        get_attn_backend(torch.float32, "cpu", deterministic=True)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="PAGEDLM_ATTENTION_BACKEND='triton' cannot run"):
        get_attn_backend(torch.float32, "cpu")
    monkeypatch.setenv("PAGEDLM_ATTENTION_BACKEND", "torch_sdpa")
    assert isinstance(get_attn_backend(torch.float32, "cuda"), TorchSDPABackend)
    monkeypatch.setenv("PAGEDLM_ATTENTION_BACKEND", "native")
    with pytest.raises(ValueError, match="float32 on the CPU"):
        get_attn_backend(torch.bfloat16, "cpu")
    monkeypatch.setenv("PAGEDLM_ATTENTION_BACKEND", "flash")
    with pytest.raises(ValueError, match="native, torch_sdpa, triton"):
        get_attn_backend(torch.float32, "cpu")
    assert set(BACKENDS_BY_NAME) == {"native", "torch_sdpa", "triton"}
    assert BACKENDS_BY_NAME["native"] is NativeKernelBackend
