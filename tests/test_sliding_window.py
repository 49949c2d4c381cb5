"""Sliding-window attention and logit soft-capping: the paged-attention backends against a dense
reference, and Mistral end to end against transformers' own sliding-window attention.

Unit tests reuse test_paged_attention's random paged-cache scenarios (decodes, fresh prompts,
chunks with earlier context) and add a window and a soft cap to the dense float64 reference.
"""
from __future__ import annotations

import math
import shutil

import pytest
import torch

from pagedlm import LLM, SamplingParams
from pagedlm.attention import kernels
from pagedlm.attention.backends import paged_attention
from tests.test_paged_attention import _scenario

needs_kernel = pytest.mark.skipif(shutil.which("gcc") is None, reason="no C compiler")
TOL = 2e-5


def _dense(query, dense, scale, window=None, cap=None):
    """Per-row softmax attention in float64 over the row's last `window` keys, scores capped."""
    out = torch.empty_like(query)
    for i, (k, v) in enumerate(dense):  # k/v: the row's keys at positions 0 .. its own
        if window is not None:
            k, v = k[-window:], v[-window:]
        group = query.shape[1] // k.shape[1]
        k = k.double().repeat_interleave(group, dim=1)
        v = v.double().repeat_interleave(group, dim=1)
        s = torch.einsum("hd,lhd->hl", query[i].double(), k) * scale
        if cap is not None:
            s = cap * torch.tanh(s / cap)
        out[i] = torch.einsum("hl,lhd->hd", s.softmax(-1), v).float()
    return out


def _run(sc, disable, monkeypatch, window=None, cap=None):
    query, key, value, k_cache, v_cache, meta, _ = sc
    if disable:
        monkeypatch.setenv("PAGEDLM_DISABLE_KERNELS", "1")
    else:
        monkeypatch.delenv("PAGEDLM_DISABLE_KERNELS", raising=False)
    try:
        return paged_attention(query, key, value, k_cache.clone(), v_cache.clone(), meta,
                               1 / math.sqrt(query.shape[-1]), sliding_window=window,
                               logits_soft_cap=cap)
    finally:
        monkeypatch.delenv("PAGEDLM_DISABLE_KERNELS", raising=False)


CASES = [
    # (decode context lengths, prefill chunks (context_len, chunk_len)); windows below are
    # shorter than most contexts, equal to some, longer than others.
    ([1, 5, 32, 33, 100, 257], []),
    ([3, 200, 77], [(45, 7)]),          # decodes + a short chunk with context (kernel)
    ([9], [(0, 50), (130, 5), (0, 3)]),  # fresh prompts longer and shorter than the window
    ([4, 50], [(30, 40), (17, 16)]),   # a long chunk with context (SDPA in both backends)
    ([], [(1, 1), (63, 20), (0, 33)]),
]
SETTINGS = [(32, None), (1, None), (17, None), (None, 5.0), (32, 2.0), (300, 50.0)]


@pytest.mark.parametrize("disable", [pytest.param(False, marks=needs_kernel), True],
                         ids=["kernel", "torch"])
@pytest.mark.parametrize("window,cap", SETTINGS)
@pytest.mark.parametrize("decode_lens,chunks", CASES)
def test_window_and_soft_cap_match_dense(decode_lens, chunks, window, cap, disable, monkeypatch):
    sc = _scenario(hash((tuple(decode_lens), tuple(chunks))) % 2**31, decode_lens, chunks,
                   2, 3, 64)
    # Sharper scores, so the soft cap actually bends them.
    sc = (sc[0] * 4, *sc[1:])
    got = _run(sc, disable, monkeypatch, window, cap)
    ref = _dense(sc[0], sc[6], 1 / 8, window, cap)
    assert torch.isfinite(got).all()
    assert (got - ref).abs().max().item() < TOL
    # The window and cap change the result (the test would notice if they were ignored).
    plain = _dense(sc[0], sc[6], 1 / 8)
    if (window is not None and window < max(decode_lens + [c + n for c, n in chunks])) or cap:
        assert (got - plain).abs().max().item() > 1e-3


@needs_kernel
@pytest.mark.parametrize("decode_lens,chunks", CASES)
def test_kernel_matches_torch_path_with_window_and_cap(decode_lens, chunks, monkeypatch):
    sc = _scenario(5, decode_lens, chunks, 4, 2, 128, block_size=8)
    got = _run(sc, False, monkeypatch, 24, 30.0)
    ref = _run(sc, True, monkeypatch, 24, 30.0)
    assert (got - ref).abs().max().item() < TOL


@needs_kernel
def test_kernel_skips_keys_outside_the_window():
    """Blocks wholly before every window are never read: poisoning them (and their block-table
    entries) changes nothing."""
    g = torch.Generator().manual_seed(0)
    bs, window = 16, 20
    k_cache = torch.randn(12, bs, 2, 64, generator=g)
    v_cache = torch.randn(12, bs, 2, 64, generator=g)
    tables = torch.arange(12, dtype=torch.int32).view(2, 6).contiguous()
    query = torch.randn(3, 4, 64, generator=g)
    token_seq = torch.tensor([0, 1, 1], dtype=torch.int32)
    ctx = torch.tensor([96, 70, 71], dtype=torch.int32)  # windows start at 76, 50, 51
    ref = kernels.paged_attention(query, k_cache, v_cache, tables, token_seq, ctx, 0.125,
                                  sliding_window=window)
    poisoned_k, poisoned_v, bad_tables = k_cache.clone(), v_cache.clone(), tables.clone()
    for row, first_needed in ((0, 76 // bs), (1, 50 // bs)):
        for b in range(first_needed):
            poisoned_k[tables[row, b]] = float("nan")
            poisoned_v[tables[row, b]] = float("nan")
            bad_tables[row, b] = 10**6  # out of range: reading it would crash or be garbage
    got = kernels.paged_attention(query, poisoned_k, poisoned_v, bad_tables, token_seq, ctx,
                                  0.125, sliding_window=window)
    assert torch.equal(got, ref)


def test_bad_window_or_cap_is_a_value_error():
    from pagedlm.attention.layer import Attention
    with pytest.raises(ValueError, match="sliding_window"):
        Attention(4, 16, 0.25, 2, sliding_window=0)
    with pytest.raises(ValueError, match="logits_soft_cap"):
        Attention(4, 16, 0.25, 2, logits_soft_cap=-1.0)
