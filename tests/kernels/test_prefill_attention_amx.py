"""The AMX prefill attention kernel (csrc/prefill_attention_amx.c) for a bfloat16 KV cache.

It rounds the queries and the softmax weights to bfloat16 and sums in float32, so it is held to
two float64 references computed from the same bfloat16 K/V (the cache's, and the fresh rows
rounded as the cache rounds them):
  - the same arithmetic done exactly: Q rounded to bfloat16, weights exp(s - max) rounded to
    bfloat16, output = sum_j p_j v_j / sum_j p_j. The kernel's float32 scores may put a weight
    that lies next to a bfloat16 rounding boundary on the other side of it: the bound allows,
    for exactly those weights (the ones whose interval of float32 error crosses a boundary),
    the other rounding, and otherwise float32 summation error;
  - exact float attention (unrounded Q and weights), within the bound that the two bfloat16
    roundings give (relative 2^-9 on each query element and each weight).
Keys come from a paged cache through block tables with shuffled blocks; chunks are ragged.
"""
import math

import pytest
import torch

from pagedlm.kernels import attention as attn
from tests.conftest import needs_kernels

U32 = 2.0 ** -24  # float32 unit roundoff
U16 = 2.0 ** -9  # bfloat16's (round to nearest)

amx = pytest.mark.skipif(
    not attn.available() or not attn.prefill_attention_amx_runs(64),
    reason="needs AMX-BF16 (in the build and granted by Linux): the kernel's tile instructions")


def _case(seed, chunks, group, block_size, num_kv_heads=2, head_dim=64):
    """chunks: (context_len, rows). Returns the kernel's inputs and, per chunk, its keys and
    values as bfloat16-valued float64 [ctx + rows, Hkv, D]."""
    g = torch.Generator().manual_seed(seed)
    hq, hkv, d = num_kv_heads * group, num_kv_heads, head_dim
    total = sum(n for _, n in chunks)
    # As the model passes them: views of one fused QKV output, rows strided.
    qkv = torch.randn(total, (hq + 2 * hkv) * d, generator=g)
    query = qkv[:, :hq * d].view(total, hq, d)
    key = qkv[:, hq * d:(hq + hkv) * d].view(total, hkv, d)
    value = qkv[:, (hq + hkv) * d:].view(total, hkv, d)
    # Peaky scores in places (keys of very different lengths), as the float32 kernel's tests.
    key.mul_(1 + 3 * torch.rand(total, hkv, 1, generator=g))
    need = [math.ceil(c / block_size) for c, _ in chunks]
    num_blocks = sum(need) + 5  # spare blocks of garbage that must not be read
    perm = torch.randperm(num_blocks, generator=g).tolist()
    k_cache = (torch.randn(num_blocks, block_size, hkv, d, generator=g)
               * (1 + 3 * torch.rand(num_blocks, block_size, hkv, 1, generator=g))
               ).to(torch.bfloat16)
    v_cache = torch.randn(num_blocks, block_size, hkv, d, generator=g).to(torch.bfloat16)
    tables = torch.zeros(len(chunks), max(max(need), 1), dtype=torch.int32)
    rows, seqs, start, nxt = [], [], 0, 0
    for c, ((ctx, n), nb) in enumerate(zip(chunks, need)):
        tables[c, :nb] = torch.tensor(perm[nxt:nxt + nb], dtype=torch.int32)
        nxt += nb
        pos = torch.arange(ctx)
        blk = tables[c].long()[pos // block_size]
        ks = torch.cat([k_cache[blk, pos % block_size].double(),
                        key[start:start + n].to(torch.bfloat16).double()])
        vs = torch.cat([v_cache[blk, pos % block_size].double(),
                        value[start:start + n].to(torch.bfloat16).double()])
        rows.append((start, n, ctx))
        seqs.append((ks, vs))
        start += n
    chunks_t = torch.tensor(rows, dtype=torch.int32)
    return query, key, value, k_cache, v_cache, chunks_t, tables, seqs


def _check(query, chunks, seqs, out, scale, window=0, soft_cap=0.0):
    """Asserts both bounds of the module docstring, chunk by chunk; returns the largest errors
    against the two references (for the record)."""
    hq, hkv = query.shape[1], seqs[0][0].shape[1]
    group = hq // hkv
    worst = [0.0, 0.0]
    for (start, n, ctx), (ks, vs) in zip(chunks.tolist(), seqs):
        q = query[start:start + n].double()  # [n, Hq, D]
        qr = query[start:start + n].to(torch.bfloat16).double()
        keys = ctx + n
        pos = ctx + torch.arange(n).view(-1, 1)
        j = torch.arange(keys).view(1, -1)
        valid = j <= pos
        if window:
            valid &= j > pos - window
        for head in range(hq):
            h = head // group
            k, v = ks[:, h], vs[:, h]  # [keys, D]
            got = out[start:start + n, head].double()

            def scores(qq):
                s = qq[:, head] @ k.T * scale
                if soft_cap:
                    s = soft_cap * torch.tanh(s / soft_cap)
                return s.masked_fill(~valid, -math.inf)

            # Reference 1: the kernel's roundings, exact sums.
            s = scores(qr)
            p = torch.exp(s - s.max(-1, keepdim=True).values)
            pr = p.to(torch.bfloat16).double()
            ref = pr @ v / pr.sum(-1, keepdim=True)
            # float32 error of a score (a 64-term dot product, the scale, the cap) and of the
            # max it is taken from, then exp's: a relative interval around p.
            mag = (qr[:, head].abs() @ k.abs().T) * scale
            es = (k.shape[1] + 4) * U32 * mag
            es = es + es.masked_fill(~valid, 0).max(-1, keepdim=True).values + 4 * U32
            lo = (p * torch.exp(-es)).to(torch.bfloat16).double()
            hi = (p * torch.exp(es)).to(torch.bfloat16).double()
            flip = torch.maximum((lo - pr).abs(), (hi - pr).abs()) * valid  # [n, keys]
            dev = (v.view(1, keys, -1) - ref.view(n, 1, -1)).abs()  # [n, keys, D]
            bound1 = ((flip.unsqueeze(-1) * dev).sum(1) / pr.sum(-1, keepdim=True)
                      + 2 * (keys + 4) * U32 * (pr @ v.abs()) / pr.sum(-1, keepdim=True)
                      + 1e-7)
            err1 = (got - ref).abs()
            assert (err1 <= bound1).all(), (
                f"chunk {start}+{n} ctx {ctx} head {head}: {err1.max().item():.3g} against "
                f"the rounded reference (bound {bound1.min().item():.3g})")
            # Reference 2: exact float attention. Each weight's relative error: the query's
            # rounding moves its score by at most U16 * scale * sum |q_d k_d| (times the
            # cap's slope, at most 1), the weight's own rounding U16; normalised, the weights
            # move by at most a factor exp(2E) - 1 each, E the row's largest of those.
            ex = torch.softmax(scores(q), -1) @ v
            e_row = ((U16 * (q[:, head].abs() @ k.abs().T) * scale + U16) * valid).amax(-1)
            spread = (dev * valid.unsqueeze(-1)).amax(1)  # max |v_j - ref| over the row's keys
            bound2 = torch.expm1(2 * e_row + 1e-6).view(-1, 1) * spread * 1.01 + 1e-5
            err2 = (got - ex).abs()
            assert (err2 <= bound2).all(), (
                f"chunk {start}+{n} ctx {ctx} head {head}: {err2.max().item():.3g} against "
                f"exact attention (bound {bound2.min().item():.3g})")
            worst = [max(worst[0], err1.max().item()), max(worst[1], err2.max().item())]
    return worst


def _run(case, threads, use_amx=True, scale=0.125, **kw):
    query, key, value, k_cache, v_cache, chunks, tables, _ = case
    out = torch.full(query.shape, float("nan"))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        attn.prefill_attention(query, key, value, k_cache, v_cache, chunks, tables, scale, out,
                               use_amx=use_amx, **kw)
    finally:
        torch.set_num_threads(before)
    return out


# Chunk lengths 1..70 (ragged against the 32-row items and 32-key blocks) and a few hundred,
# fresh (context 0) and after context read through the block table.
CHUNKS = [[(0, n) for n in (1, 2, 5, 11, 16, 17, 31, 32, 33, 47, 64, 70)],
          [(c, n) for c, n in ((1, 1), (16, 3), (17, 31), (40, 33), (63, 70), (100, 64))],
          [(0, 300), (150, 200), (5, 257)]]


@needs_kernels
@amx
@pytest.mark.parametrize("chunks", range(len(CHUNKS)))
@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("block_size", [16, 32])
def test_amx_prefill_matches_references(chunks, group, block_size):
    case = _case(10 * chunks + group + block_size, CHUNKS[chunks], group, block_size)
    one = _run(case, 1)
    two = _run(case, 2)
    # A row's result depends only on its query and keys: the same bits on any thread count.
    assert torch.equal(one, two)
    _check(case[0], case[5], case[7], two, 0.125)


@needs_kernels
@amx
@pytest.mark.parametrize("window,soft_cap,scale", [(24, 0.0, 0.125), (0, 5.0, 0.125),
                                                   (40, 3.0, 0.125), (0, 0.0, 0.0917),
                                                   (0, 5.0, 0.0917)])
def test_amx_prefill_window_soft_cap_and_scale(window, soft_cap, scale):
    """Windows, soft caps and a scale that is not a power of two (the kernel scales the scores
    in float32 as it takes the exponent; 1/8 multiplies exactly)."""
    case = _case(7, [(0, 70), (50, 45), (9, 300)], 3, 16)
    out = _run(case, 2, scale=scale, sliding_window=window or None,
               logits_soft_cap=soft_cap or None)
    _check(case[0], case[5], case[7], out, scale, window, soft_cap)


@needs_kernels
@amx
def test_amx_prefill_is_taken_and_differs_from_float32():
    """The bfloat16 cache goes to the AMX kernel by default (its results are not the float32
    kernel's bits, which use_amx=False keeps, and which the bounds above would also pass)."""
    case = _case(3, [(0, 70), (20, 40)], 3, 16)
    amx_out, f32_out = _run(case, 2), _run(case, 2, use_amx=False)
    assert not torch.equal(amx_out, f32_out)
    assert (amx_out - f32_out).abs().max().item() < 0.05


@needs_kernels
@amx
def test_amx_prefill_rounds_fresh_rows_as_the_cache():
    """The backend hands the AMX kernel its fresh K/V unrounded (the cast of the step's whole K
    and V was a cost of its own): rounding them first, as the cache does, gives the same bits."""
    case = _case(4, [(0, 70), (33, 100)], 3, 32)
    query, key, value, k_cache, v_cache, chunks, tables, _ = case
    rk, rv = key.to(torch.bfloat16).float(), value.to(torch.bfloat16).float()
    assert not torch.equal(rk, key)
    rounded = _run((query, rk, rv, k_cache, v_cache, chunks, tables, None), 2)
    assert torch.equal(_run(case, 2), rounded)
