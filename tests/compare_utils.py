"""Comparing the greedy outputs of two compute paths: a prefix-cache hit and a fresh prefill,
another batch size, chunked prefill, preemption and recompute or swap, tensor or pipeline
parallelism, another CPU's kernels.

Such paths add the same float32 products in other orders, so their logits differ in the last
bits, by different amounts on different CPUs (AVX2, AVX-512, AMX). Where the two best tokens are
that close, greedy decoding may pick either, and everything after that differs. Outputs of two
paths are therefore equal token for token up to the first position where they differ; there,
the two tokens must be a near-tie of the model's distribution, and the rest is not compared.
Sampled (temperature > 0) outputs have no such rule: a logit difference in the last bits can
move a draw anywhere in the sequence, so tests compare those only on one compute path.
"""
from __future__ import annotations

from collections.abc import Sequence

import pytest

from pagedlm.outputs import CompletionOutput
from tests.conftest import needs_kernels

# Logprob gap under which two tokens count as tied. Float32 reordering moves SmolLM2's logprobs
# by ~1e-5; a real difference (a wrong cache block, a wrong shard) moves them by far more.
NEAR_TIE = 1e-3


def _logprob_gap(ref: CompletionOutput, got: CompletionOutput, i: int) -> float | None:
    """|logprob(ref's token) - logprob(got's token)| at position i, in a distribution that
    lists both (each output lists its own token and its top-k), or None if neither does."""
    a, b = ref.token_ids[i], got.token_ids[i]
    for position in (ref.logprobs[i], got.logprobs[i]):
        if a in position and b in position:
            return abs(position[a].logprob - position[b].logprob)
    return None


def assert_greedy_match(ref: CompletionOutput, got: CompletionOutput,
                        tol: float = NEAR_TIE) -> bool:
    """Assert `got` has `ref`'s tokens, up to a near-tie; return whether all are identical.

    Both must come from greedy requests with `logprobs` >= 2 (a near-tie's runner-up is then
    in the top 2 of an unconstrained distribution; a grammar may need more)."""
    if ref.token_ids == got.token_ids:
        return True
    i = next((i for i, (a, b) in enumerate(zip(ref.token_ids, got.token_ids)) if a != b), None)
    assert i is not None, (f"one output is a prefix of the other without a differing token: "
                           f"{ref.token_ids} vs {got.token_ids}")
    assert ref.logprobs is not None and got.logprobs is not None, \
        "the outputs differ and have no logprobs to tell a near-tie: request logprobs=2"
    gap = _logprob_gap(ref, got, i)
    assert gap is not None, (
        f"outputs differ at token {i} ({ref.token_ids[i]} vs {got.token_ids[i]}) and neither "
        f"is in the other's top logprobs: not a near-tie")
    assert gap < tol, (f"outputs differ at token {i} ({ref.token_ids[i]} vs "
                       f"{got.token_ids[i]}) with a logprob gap of {gap:.2e}: not a near-tie")
    return False


def assert_greedy_outputs_match(refs: Sequence[CompletionOutput],
                                gots: Sequence[CompletionOutput],
                                tol: float = NEAR_TIE) -> int:
    """`assert_greedy_match` pairwise; returns how many pairs are identical (callers assert a
    floor, so that a comparison cut short at every first token cannot pass unnoticed)."""
    assert len(refs) == len(gots), f"{len(refs)} reference outputs, {len(gots)} to compare"
    return sum(assert_greedy_match(r, g, tol) for r, g in zip(refs, gots))


def assert_greedy_logprobs_match(refs: Sequence[CompletionOutput],
                                 gots: Sequence[CompletionOutput], atol: float = 1e-3) -> int:
    """`assert_greedy_outputs_match`, and the logprobs agree within `atol` up to where the tokens
    part. Top-k lists may differ in their last place (itself a near-tie with the next token):
    the tokens listed by both are compared. Returns how many pairs have identical tokens."""
    identical = assert_greedy_outputs_match(refs, gots)
    for r, g in zip(refs, gots):
        for a, b, pos_r, pos_g in zip(r.token_ids, g.token_ids, r.logprobs, g.logprobs):
            if a != b:
                break
            common = pos_r.keys() & pos_g.keys()
            assert a in common and len(common) >= len(pos_r) - 1, (pos_r, pos_g)
            for tid in common:
                assert abs(pos_r[tid].logprob - pos_g[tid].logprob) < atol, (tid, pos_r, pos_g)
    return identical


# Parametrize a cross-path test over both modes: the default, compared as above, and
# deterministic=True (issue 31), whose paths must agree bitwise (it needs the native kernels).
MODES = [pytest.param(False, id="default"),
         pytest.param(True, marks=needs_kernels, id="deterministic")]


def _bits(out: CompletionOutput) -> tuple:
    return (list(out.token_ids), out.cumulative_logprob,
            [{t: (lp.logprob, lp.rank) for t, lp in pos.items()} for pos in out.logprobs or []])


def assert_outputs_bitwise_equal(refs: Sequence[CompletionOutput],
                                 gots: Sequence[CompletionOutput]) -> None:
    """Under deterministic=True (issue 31) two compute paths give the same bits: token ids,
    cumulative logprob and every logprob entry (value and rank) are equal, not close."""
    assert len(refs) == len(gots), f"{len(refs)} reference outputs, {len(gots)} to compare"
    for n, (r, g) in enumerate(zip(refs, gots)):
        a, b = _bits(r), _bits(g)
        if a == b:
            continue
        i = next((i for i, (x, y) in enumerate(zip(a[2], b[2])) if x != y), None)
        where = "" if i is None else (
            f" first at position {i}: {a[2][i]} vs {b[2][i]}")
        raise AssertionError(f"output {n} is not bitwise the reference: tokens {a[0]} vs "
                             f"{b[0]}, cumulative logprob {a[1]!r} vs {b[1]!r}{where}")
