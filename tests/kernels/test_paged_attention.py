"""Native paged-attention kernel vs the PyTorch reference path.

The reference is the same `paged_attention` run with PAGEDLM_DISABLE_KERNELS=1 (gather + SDPA),
plus an independent dense re-computation that does not touch block tables at all, so a bug
shared by both paged paths (e.g. in the block-table convention) is caught too.
"""
import math
import shutil

import pytest
import torch
import torch.nn.functional as F

from pagedlm import kernels
from pagedlm.attention.backends import NativeKernelBackend, TorchSDPABackend, paged_attention
from pagedlm.attention.metadata import AttentionMetadata, PrefillChunk
from pagedlm.kernels import attention as attn
from pagedlm.kernels import loader
from tests.conftest import needs_kernels

# The kernel is optional only where there is no C compiler; with one, a failed build must fail.
TOL = 2e-5


def _scenario(seed, decode_lens, chunks, num_kv_heads, group, head_dim, block_size=16,
              with_mask=True, with_seq_lens=True, int32_tables=False):
    """A random paged cache holding every sequence's K/V in shuffled blocks.

    decode_lens: context length of each decode sequence (including the token being decoded).
    chunks: (context_len, chunk_len) of each prefill chunk; context_len 0 = fresh prompt.
    Returns (query, key, value, k_cache, v_cache, meta, dense) where dense[i] holds the
    full-sequence K and V ([len, Hkv, D]) of the sequence that flat-batch row i belongs to,
    plus the row's position, for the dense reference.
    """
    g = torch.Generator().manual_seed(seed)
    num_q_heads = num_kv_heads * group
    seq_totals = list(decode_lens) + [c + n for c, n in chunks]
    blocks_needed = [math.ceil(t / block_size) for t in seq_totals]
    num_blocks = sum(blocks_needed) + 7  # spare blocks hold garbage that must not be read
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables, nxt = [], 0
    for nb in blocks_needed:
        tables.append(perm[nxt:nxt + nb])
        nxt += nb
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g)
    # Make the softmax peaky in places so the online max/rescale logic is exercised.
    k_cache *= 1 + 3 * torch.rand(num_blocks, block_size, num_kv_heads, 1, generator=g)

    # Full K/V of every sequence (what is in the cache plus what this step writes).
    seq_k = [torch.randn(t, num_kv_heads, head_dim, generator=g) for t in seq_totals]
    seq_v = [torch.randn(t, num_kv_heads, head_dim, generator=g) for t in seq_totals]

    def slot(s, pos):
        return tables[s][pos // block_size] * block_size + pos % block_size

    # Earlier context goes into the cache now; the step's tokens are written by paged_attention.
    rows = []  # (sequence, position) of each flat-batch row
    for s, t in enumerate(decode_lens):
        rows.append((s, t - 1))
    for i, (c, n) in enumerate(chunks):
        rows += [(len(decode_lens) + i, c + j) for j in range(n)]
    step = set(rows)
    earlier = [(s, p) for s, t in enumerate(seq_totals) for p in range(t) if (s, p) not in step]
    if earlier:
        slots = torch.tensor([slot(s, p) for s, p in earlier])
        k_cache.view(-1, num_kv_heads, head_dim)[slots] = torch.stack(
            [seq_k[s][p] for s, p in earlier])
        v_cache.view(-1, num_kv_heads, head_dim)[slots] = torch.stack(
            [seq_v[s][p] for s, p in earlier])

    T = len(rows)
    query = torch.randn(T, num_q_heads, head_dim, generator=g)
    key = torch.stack([seq_k[s][p] for s, p in rows]) if T else torch.zeros(0)
    value = torch.stack([seq_v[s][p] for s, p in rows]) if T else torch.zeros(0)
    slot_mapping = torch.tensor([slot(s, p) for s, p in rows], dtype=torch.int64)

    nd = len(decode_lens)
    idx_dtype = torch.int32 if int32_tables else torch.int64
    decode_bt = decode_mask = seq_lens = None
    if nd:
        max_blocks = max(blocks_needed[:nd]) + 1  # one extra padding column
        pad = torch.randint(0, num_blocks, (nd, max_blocks), generator=g)  # garbage padding
        for s in range(nd):
            pad[s, :len(tables[s])] = torch.tensor(tables[s])
        decode_bt = pad.to(idx_dtype)
        lens = torch.tensor(decode_lens)
        if with_mask:
            decode_mask = (torch.arange(max_blocks * block_size) < lens[:, None]).view(
                nd, 1, 1, -1)
        if with_seq_lens:
            seq_lens = lens.to(torch.int32)
    prefills, start = [], nd
    for i, (c, n) in enumerate(chunks):
        bt = torch.tensor(tables[nd + i], dtype=idx_dtype) if c else None
        prefills.append(PrefillChunk(start, start + n, c, bt))
        start += n
    meta = AttentionMetadata(slot_mapping=slot_mapping, num_decode_tokens=nd,
                             decode_block_tables=decode_bt, decode_mask=decode_mask,
                             prefills=prefills, decode_seq_lens=seq_lens)
    dense = [(seq_k[s][:p + 1], seq_v[s][:p + 1]) for s, p in rows]
    return query, key, value, k_cache, v_cache, meta, dense


def _dense_reference(query, dense, scale):
    """Plain per-row softmax attention in float64, no paging involved."""
    out = torch.empty_like(query)
    num_q_heads = query.shape[1]
    for i, (k, v) in enumerate(dense):
        group = num_q_heads // k.shape[1]
        k = k.double().repeat_interleave(group, dim=1)  # [L, Hq, D]
        v = v.double().repeat_interleave(group, dim=1)
        s = torch.einsum("hd,lhd->hl", query[i].double(), k) * scale
        out[i] = torch.einsum("hl,lhd->hd", s.softmax(-1), v).float()
    return out


def _run(scenario, disable, monkeypatch):
    query, key, value, k_cache, v_cache, meta, _ = scenario
    if disable:
        monkeypatch.setenv("PAGEDLM_DISABLE_KERNELS", "1")
    else:
        monkeypatch.delenv("PAGEDLM_DISABLE_KERNELS", raising=False)
    out = paged_attention(query, key, value, k_cache.clone(), v_cache.clone(), meta,
                          1 / math.sqrt(query.shape[-1]))
    monkeypatch.delenv("PAGEDLM_DISABLE_KERNELS", raising=False)
    return out


CASES = [
    # (decode context lengths, prefill chunks (context_len, chunk_len))
    ([1], []),
    ([5, 1, 17, 33], []),
    ([16, 32, 15, 47, 100, 2, 64, 65], []),
    ([int(x) for x in torch.randint(1, 300, (37,), generator=torch.Generator().manual_seed(1))],
     []),
    ([3, 200, 77], [(45, 7)]),          # decodes + a chunk with earlier context
    ([9], [(0, 11), (130, 5), (0, 3)]),  # fresh prompts around a context chunk
    ([], [(1, 1), (63, 20)]),          # only context chunks
    ([], [(0, 9)]),                    # only a fresh prompt (kernel not used)
    ([4, 50], [(30, 40), (17, 16)]),   # a long chunk (SDPA) between kernel rows
]


@needs_kernels
@pytest.mark.parametrize("decode_lens,chunks", CASES)
@pytest.mark.parametrize("num_kv_heads,group,head_dim", [
    # 40: a head size off the AVX-512 scoring path's multiple of 16 (the portable loop).
    (3, 3, 64), (2, 1, 64), (2, 4, 128), (1, 3, 128), (4, 4, 64), (2, 2, 40)])
def test_kernel_matches_torch(decode_lens, chunks, num_kv_heads, group, head_dim, monkeypatch):
    sc = _scenario(hash((tuple(decode_lens), tuple(chunks), group, head_dim)) % 2**31,
                   decode_lens, chunks, num_kv_heads, group, head_dim)
    got = _run(sc, disable=False, monkeypatch=monkeypatch)
    ref = _run(sc, disable=True, monkeypatch=monkeypatch)
    dense = _dense_reference(sc[0], sc[6], 1 / math.sqrt(head_dim))
    assert torch.isfinite(got).all()
    assert (got - ref).abs().max().item() < TOL
    assert (got - dense).abs().max().item() < TOL


@needs_kernels
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("group", range(1, 9))
# 128: two 64-column passes; 80: one and a 16-column tail; 48: the tail alone; 40: portable.
@pytest.mark.parametrize("head_dim", [64, 128, 80, 48, 40])
def test_kernel_query_head_groups(group, cache_dtype, head_dim):
    """Every group size G = 1..8: the AVX-512 loops take a kv head's query heads in groups of
    up to 4 (one code path per size), each K/V row widened once per group. Decodes of 1 to 257
    keys (partial 4-key steps and tiles) against the dense float64 reference over the K/V as
    the cache holds them, and with a window and soft cap against the PyTorch backend."""
    decode_lens = [1, 2, 3, 5, 16, 33, 70, 257]
    sc = _scenario(group * 1000 + head_dim, decode_lens, [], 2, group, head_dim)
    query, key, value, k_cache, v_cache, meta, dense = sc
    k_cache, v_cache = k_cache.to(cache_dtype), v_cache.to(cache_dtype)
    dense = [(k.to(cache_dtype).float(), v.to(cache_dtype).float()) for k, v in dense]
    scale = head_dim ** -0.5
    got = paged_attention(query, key, value, k_cache.clone(), v_cache.clone(), meta, scale,
                          backend=NativeKernelBackend())
    torch.testing.assert_close(got, _dense_reference(query, dense, scale), rtol=TOL, atol=TOL)
    outs = [paged_attention(query, key, value, k_cache.clone(), v_cache.clone(), meta, scale,
                            backend=b(), sliding_window=32, logits_soft_cap=5.0)
            for b in (NativeKernelBackend, TorchSDPABackend)]
    torch.testing.assert_close(outs[0], outs[1], rtol=TOL, atol=TOL)


@pytest.mark.parametrize("decode_lens,chunks", CASES)
def test_torch_fallback_matches_dense(decode_lens, chunks, monkeypatch):
    """The PyTorch path (what PAGEDLM_DISABLE_KERNELS=1 runs) against the dense reference."""
    sc = _scenario(7, decode_lens, chunks, 3, 3, 64)
    ref = _run(sc, disable=True, monkeypatch=monkeypatch)
    dense = _dense_reference(sc[0], sc[6], 1 / 8)
    assert (ref - dense).abs().max().item() < TOL


@pytest.mark.parametrize("disable", [False, True])
@pytest.mark.parametrize("with_mask,with_seq_lens,int32_tables", [
    (True, False, False), (False, True, True), (True, True, True)])
def test_metadata_variants(disable, with_mask, with_seq_lens, int32_tables, monkeypatch):
    """decode_mask / decode_seq_lens are each optional, block tables may be int32."""
    if not disable and shutil.which("gcc") is None:
        pytest.skip("no C compiler")
    sc = _scenario(3, [7, 70, 16, 1], [(20, 4)], 2, 4, 64, with_mask=with_mask,
                   with_seq_lens=with_seq_lens, int32_tables=int32_tables)
    out = _run(sc, disable=disable, monkeypatch=monkeypatch)
    dense = _dense_reference(sc[0], sc[6], 1 / 8)
    assert (out - dense).abs().max().item() < TOL


@needs_kernels
@pytest.mark.parametrize("block_size", [1, 8, 16, 32, 128])
def test_kernel_block_sizes(block_size, monkeypatch):
    sc = _scenario(11, [1, 9, 130, 257], [(33, 6)], 3, 3, 64, block_size=block_size)
    got = _run(sc, disable=False, monkeypatch=monkeypatch)
    dense = _dense_reference(sc[0], sc[6], 1 / 8)
    assert (got - dense).abs().max().item() < TOL


@needs_kernels
def test_kernel_direct_api_and_threads():
    """The decode kernel on hand-built inputs; results independent of the thread count."""
    g = torch.Generator().manual_seed(0)
    k_cache = torch.randn(40, 16, 2, 64, generator=g)
    v_cache = torch.randn(40, 16, 2, 64, generator=g)
    tables = torch.randperm(40, generator=g)[:36].view(4, 9).to(torch.int32).contiguous()
    query = torch.randn(6, 8, 64, generator=g)
    token_seq = torch.tensor([3, 0, 2, 2, 1, 3], dtype=torch.int32)
    ctx = torch.tensor([144, 1, 17, 18, 100, 5], dtype=torch.int32)
    out = attn.paged_attention(query, k_cache, v_cache, tables, token_seq, ctx, 0.125)
    for t in range(6):
        pos = torch.arange(int(ctx[t]))
        blocks = tables[token_seq[t].item()].long()[pos // 16]
        k = k_cache[blocks, pos % 16].repeat_interleave(4, dim=1)  # [L, 8, 64]
        v = v_cache[blocks, pos % 16].repeat_interleave(4, dim=1)
        ref = F.scaled_dot_product_attention(query[t][:, None], k.transpose(0, 1),
                                             v.transpose(0, 1), scale=0.125)[:, 0]
        assert (out[t] - ref).abs().max().item() < TOL
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = attn.paged_attention(query, k_cache, v_cache, tables, token_seq, ctx, 0.125)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(single, out)
    # Bad inputs are rejected instead of being read as garbage.
    with pytest.raises(ValueError):
        attn.paged_attention(query, k_cache, v_cache, tables.long(), token_seq, ctx, 0.125)
    with pytest.raises(ValueError):
        attn.paged_attention(query.transpose(0, 1), k_cache, v_cache, tables, token_seq,
                             ctx, 0.125)


@needs_kernels
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_prefill_kernel_plan_and_tiles(cache_dtype):
    """Prompts of many row tiles (and one row) through the prefill kernel, against the dense
    reference; which chunks it takes; its result does not depend on the thread count."""
    from pagedlm.attention.backends.native import NativeKernelBackend, prefill_plan
    runs = attn.prefill_attention_runs(64)  # False only in a build without AVX-512
    # A fresh 300-token prompt (900 query rows), a long chunk after context, a 1-token prompt,
    # and a short context chunk (the decode kernel's).
    chunks = [(0, 300), (70, 45), (0, 1), (40, 9)]
    sc = _scenario(5, [12], chunks, 3, 3, 64)
    query, key, value, k_cache, v_cache, meta, dense = sc
    # As the model passes them: views of one fused QKV projection's output, rows strided.
    t = query.shape[0]
    qkv = torch.cat([query.flatten(1), key.flatten(1), value.flatten(1)], dim=1)
    query, key, value = (qkv[:, :576].view(t, 9, 64), qkv[:, 576:768].view(t, 3, 64),
                         qkv[:, 768:].view(t, 3, 64))
    assert not query.is_contiguous()
    k_cache, v_cache = k_cache.to(cache_dtype), v_cache.to(cache_dtype)
    plan = prefill_plan(meta, query, key, value, k_cache)
    taken = [tuple(r) for r in plan.chunks.tolist()]
    if runs:
        assert taken == [(1, 300, 0), (301, 45, 70), (346, 1, 0)] and plan.sdpa == []
    else:  # SDPA takes them all, with the same results below
        assert taken == [] and [p.start for p in plan.sdpa] == [1, 301, 346]
    meta._prefill_plan = None
    backend = NativeKernelBackend()
    out = backend.forward(query, key, value, k_cache.clone(), v_cache.clone(), meta, 0.125)
    if cache_dtype == torch.float32:
        assert (out - _dense_reference(query, dense, 0.125)).abs().max().item() < TOL
    else:  # the reference on the K/V the cache holds (fresh ones rounded as it rounds them)
        rounded = [(k.to(cache_dtype).float(), v.to(cache_dtype).float()) for k, v in dense]
        ref = _dense_reference(query, rounded, 0.125)
        err = (out - ref).abs().max().item()
        # Where AMX runs, the bfloat16 cache's prefill rows round Q and the softmax weights to
        # bfloat16 (test_prefill_attention_amx.py bounds that kernel row by row); the decode
        # kernel's rows and the float32 kernel's are exact to float32.
        amx_rows = runs and attn.prefill_attention_amx_runs(64)
        assert err < (5e-2 if amx_rows else TOL)
        if amx_rows:
            exact_rows = torch.cat([torch.arange(0, 1), torch.arange(347, 356)])  # decode kernel
            assert (out[exact_rows] - ref[exact_rows]).abs().max().item() < TOL
    if not runs:
        return
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = backend.forward(query, key, value, k_cache.clone(), v_cache.clone(), meta,
                                 0.125)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(single, out)
    with pytest.raises(ValueError, match="key/value"):
        attn.prefill_attention(query, key.transpose(0, 1), value, k_cache, v_cache,
                               plan.chunks, plan.block_tables, 0.125, out)


def test_disable_env_and_build_failure(monkeypatch, tmp_path):
    monkeypatch.setenv("PAGEDLM_DISABLE_KERNELS", "1")
    assert not kernels.available()
    # A compiler that fails means "no kernel" (one warning), never an exception.
    monkeypatch.delenv("PAGEDLM_DISABLE_KERNELS")
    monkeypatch.setenv("PAGEDLM_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(loader, "COMPILER", "definitely-not-a-compiler")
    loader.load_library.cache_clear()
    try:
        assert loader.load_library() is None
        assert not kernels.available()
    finally:
        loader.load_library.cache_clear()


@needs_kernels
def test_bad_metadata_rejected(monkeypatch):
    sc = _scenario(5, [10, 20], [], 2, 2, 64)
    query, key, value, k_cache, v_cache, meta, _ = sc
    meta.decode_seq_lens = torch.tensor([10, 20 * 100], dtype=torch.int32)  # beyond its table
    with pytest.raises(ValueError):
        paged_attention(query, key, value, k_cache, v_cache, meta, 0.125)


def test_backend_selection(monkeypatch):
    """The backend is picked from dtype and device (and the disable flag) by get_attn_backend."""
    from pagedlm.attention.backends import (NativeKernelBackend, TorchSDPABackend,
                                            get_attn_backend)
    monkeypatch.delenv("PAGEDLM_DISABLE_KERNELS", raising=False)
    if shutil.which("gcc") is not None:
        assert isinstance(get_attn_backend(torch.float32, "cpu"), NativeKernelBackend)
    assert isinstance(get_attn_backend(torch.bfloat16, "cpu"), TorchSDPABackend)
    assert not NativeKernelBackend.supports(torch.float32, "meta")
    monkeypatch.setenv("PAGEDLM_DISABLE_KERNELS", "1")
    assert isinstance(get_attn_backend(torch.float32, "cpu"), TorchSDPABackend)


@pytest.mark.parametrize("backend_name", ["native_kernel", "torch_sdpa"])
def test_attention_layer_keeps_its_backend(backend_name, monkeypatch):
    """The Attention layer runs the backend it was built with (flat [T, H*D] in and out),
    whatever the environment says afterwards: the choice is made once, not per call."""
    from pagedlm.attention.backends import NativeKernelBackend, TorchSDPABackend
    from pagedlm.attention.layer import Attention
    if backend_name == "native_kernel" and shutil.which("gcc") is None:
        pytest.skip("no C compiler")
    backend = {"native_kernel": NativeKernelBackend,
               "torch_sdpa": TorchSDPABackend}[backend_name]()
    query, key, value, k_cache, v_cache, meta, dense = _scenario(
        13, [7, 70, 1], [(20, 4), (0, 9)], 2, 3, 64)
    layer = Attention(num_heads=6, head_dim=64, scale=1 / 8, num_kv_heads=2, backend=backend)
    monkeypatch.setenv("PAGEDLM_DISABLE_KERNELS", "1")  # too late to matter
    t = query.shape[0]
    out = layer(query.reshape(t, -1), key.reshape(t, -1), value.reshape(t, -1),
                (k_cache, v_cache), meta)
    assert layer.backend is backend and out.shape == (t, 6 * 64)
    ref = _dense_reference(query, dense, 1 / 8)
    assert (out.view(t, 6, 64) - ref).abs().max().item() < TOL
