"""Speculative decoding's verification: the Sampler with drafts (meta.draft) on hand-built logits.

Greedy spans must emit exactly the tokens plain greedy decoding would, one row at a time; random
spans must emit tokens distributed exactly as plain sampling's (chi-square over many seeded
draws, at p = 0.001 against the exact processed distribution), whether the proposal is
deterministic (one-hot q) or a distribution (drafts drawn from q).
"""
from __future__ import annotations

from collections import Counter

import torch

from pagedlm import SamplingParams
from pagedlm.model_executor.layers.sampler import DraftSpan, Sampler
from tests.sampling_utils import make_meta
from tests.stats_utils import assert_fits


def assert_chi_square(counts: Counter, probs: torch.Tensor) -> None:
    """The token counts fit the distribution over token ids (p = 0.001)."""
    assert_fits(counts, {t: float(p) for t, p in enumerate(probs)})


def emitted(out, spans):
    return [out.sampled_token_ids[s.first_row:s.first_row + e]
            for s, e in zip(spans, out.num_emitted)]


def one_hot_rows(tokens, vocab=8):
    logits = torch.zeros(len(tokens), vocab)
    logits[torch.arange(len(tokens)), torch.tensor(tokens)] = 5.0
    return logits


# -- greedy ---------------------------------------------------------------------------------

def test_greedy_accepts_while_drafts_match_then_corrects_or_adds_a_bonus():
    greedy = SamplingParams(temperature=0.0)
    # Three spans of 3 drafts (4 rows each): all accepted, mismatch at the 2nd, at the 1st.
    argmax = [1, 2, 3, 4] + [1, 5, 3, 4] + [6, 2, 3, 4]
    spans = [DraftSpan(0, [1, 2, 3]), DraftSpan(4, [1, 2, 3]), DraftSpan(8, [1, 2, 3])]
    out = Sampler(torch.Generator().manual_seed(0))(one_hot_rows(argmax),
                                                    make_meta([greedy] * 12, spans=spans))
    assert out.num_emitted == [4, 2, 1]
    assert emitted(out, spans) == [[1, 2, 3, 4], [1, 5], [6]]


def test_greedy_spans_are_plain_argmax_with_penalties_and_constraints_seeing_the_drafts():
    # Row j of a span scores after d_1..d_j: its output-so-far includes them, so a presence
    # penalty turns the argmax away from a drafted 3, and the bad word (3, 4) bans 4 after it.
    banned = SamplingParams(temperature=0.0, bad_words=["x"])
    banned.bad_words_token_ids = [[3, 4]]
    rows = [SamplingParams(temperature=0.0, presence_penalty=2.0)] * 3 + [banned] * 3
    logits = torch.zeros(6, 8)
    logits[:, 3], logits[:, 4] = 1.0, 0.5
    logits[4, 4], logits[4, 2] = 2.0, 1.5
    history = [7]
    spans = [DraftSpan(0, [3, 3]), DraftSpan(3, [3, 4])]
    outputs = [history, history + [3], history + [3, 3]] * 2
    meta = make_meta(rows, outputs=outputs, spans=spans)
    plain = Sampler(torch.Generator().manual_seed(0))(logits, make_meta(rows, outputs=outputs))
    out = Sampler(torch.Generator().manual_seed(0))(logits, meta)
    assert plain.sampled_token_ids[:2] == [3, 4]  # the penalty sees the drafted 3
    assert plain.sampled_token_ids[3:5] == [3, 2]  # so does the bad word
    assert out.num_emitted == [2, 2]
    assert emitted(out, spans) == [plain.sampled_token_ids[:2], plain.sampled_token_ids[3:5]]


def test_rows_outside_spans_sample_exactly_as_without_drafts():
    vocab = 16
    logits = torch.randn(7, vocab, generator=torch.Generator().manual_seed(3))
    rand = SamplingParams(temperature=0.8, top_k=6, seed=1)
    params = [rand, SamplingParams(temperature=0.0)] + [rand] * 3 + [SamplingParams(), rand]

    def run(spans):
        gens = [torch.Generator().manual_seed(10 + i) for i in range(7)]
        meta = make_meta(params, generators=gens, spans=spans)
        return Sampler(torch.Generator().manual_seed(0))(logits, meta).sampled_token_ids

    plain, spec = run(None), run([DraftSpan(2, [4, 5])])
    # Rows 2..4 are the span; the others keep their tokens (the unseeded row 5 too: the
    # sampler's own generator gives it the same first draw).
    assert [spec[i] for i in (0, 1, 5, 6)] == [plain[i] for i in (0, 1, 5, 6)]


def test_logprobs_of_emitted_tokens_are_those_of_their_rows():
    vocab = 10
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(5))
    raw = logits.log_softmax(dim=-1)
    params = [SamplingParams(temperature=1.0, seed=3, logprobs=3)] * 4
    spans = [DraftSpan(0, [int(logits[0].argmax()), int(logits[1].argmax()), 0])]
    gens = [torch.Generator().manual_seed(3)] * 4
    out = Sampler(torch.Generator())(logits, make_meta(params, generators=gens, spans=spans))
    e = out.num_emitted[0]
    assert 1 <= e <= 4
    for row in range(e):
        token = out.sampled_token_ids[row]
        assert out.sampled_logprobs[row] == float(raw[row, token])
        assert out.ranks[row] == int((raw[row] > raw[row, token]).sum()) + 1
        assert out.top_token_ids[row] == raw[row].topk(3).indices.tolist()


# -- random: the distribution ----------------------------------------------------------------

P0 = torch.tensor([0.05, 0.6, 0.2, 0.1, 0.05, 0.0])
P1 = torch.tensor([0.3, 0.0, 0.1, 0.4, 0.15, 0.05])
P2 = torch.tensor([0.1, 0.1, 0.2, 0.2, 0.2, 0.2])


def _draw_spans(drafts, params=None, q=None, spans_n=12000, seed=0, logits=None):
    """spans_n spans of 2 drafts over rows with fixed distributions P0, P1, P2 (or logits);
    their emitted tokens."""
    params = params or SamplingParams(temperature=1.0)
    rows = (logits if logits is not None else torch.stack([P0, P1, P2]).log())
    logits = rows.repeat(spans_n, 1)
    if q is None:
        spans = [DraftSpan(3 * i, list(drafts)) for i in range(spans_n)]
    else:  # a proposer's drafts are drawn from its distribution
        gen = torch.Generator().manual_seed(seed + 1)
        d = torch.multinomial(q, spans_n, replacement=True, generator=gen).T.tolist()
        spans = [DraftSpan(3 * i, d[i], probs=q) for i in range(spans_n)]
    meta = make_meta([params] * 3 * spans_n, spans=spans)
    out = Sampler(torch.Generator().manual_seed(seed))(logits, meta)
    return emitted(out, spans)


def _check(tokens, first, second):
    assert_chi_square(Counter(t[0] for t in tokens), first)
    assert_chi_square(Counter(t[1] for t in tokens if len(t) > 1), second)


def test_one_hot_drafts_likely_accepted_keep_the_target_distribution():
    tokens = _draw_spans([1, 3])  # p0(1) = 0.6, p1(3) = 0.4
    _check(tokens, P0, P1)
    accepted = sum(len(t) > 1 for t in tokens) / len(tokens)
    assert abs(accepted - 0.6) < 0.02  # a draft is accepted with its target probability
    assert any(len(t) == 3 for t in tokens)  # bonus tokens, drawn from P2
    assert_chi_square(Counter(t[2] for t in tokens if len(t) > 2), P2)


def test_one_hot_drafts_likely_rejected_keep_the_target_distribution():
    tokens = _draw_spans([0, 5])  # p0(0) = 0.05, p1(5) = 0.05
    _check(tokens, P0, P1)
    accepted = sum(len(t) > 1 for t in tokens) / len(tokens)
    assert abs(accepted - 0.05) < 0.01


def test_a_draft_the_target_never_samples_is_always_rejected():
    tokens = _draw_spans([5, 3], spans_n=2000)  # p0(5) = 0
    assert all(len(t) == 1 and t[0] != 5 for t in tokens)
    assert_chi_square(Counter(t[0] for t in tokens), P0)


def test_general_q_drafts_keep_the_target_distribution():
    # One proposer close to the target, one far from it (mass where the target has none).
    near = torch.stack([torch.tensor([0.1, 0.5, 0.2, 0.1, 0.1, 0.0]),
                        torch.tensor([0.25, 0.0, 0.15, 0.4, 0.1, 0.1])])
    far = torch.stack([torch.tensor([0.0, 0.05, 0.05, 0.1, 0.2, 0.6]),
                       torch.tensor([0.0, 0.6, 0.1, 0.1, 0.1, 0.1])])
    for q in (near, far):
        _check(_draw_spans(None, q=q, spans_n=8000), P0, P1)


def test_temperature_and_top_k_are_applied_before_verification():
    logits = torch.tensor([[0.0, 1.0, 0.5, -0.5, 2.0, -1.0]] * 3)
    params = SamplingParams(temperature=0.7, top_k=3)
    expected = logits[0] / 0.7
    expected[expected < expected.topk(3).values[-1]] = float("-inf")
    expected = expected.softmax(dim=-1)
    tokens = _draw_spans([2, 4], params=params, logits=logits, spans_n=8000)
    _check(tokens, expected, expected)


def test_seeded_spans_use_their_generator_and_do_not_depend_on_the_batch():
    vocab = 12
    logits = torch.randn(8, vocab, generator=torch.Generator().manual_seed(9))
    seeded = SamplingParams(temperature=1.0, seed=4)

    def run(first_row, rows):
        gens = [None] * rows
        params = [SamplingParams(temperature=1.0)] * rows
        block = logits[:4]
        full = torch.randn(rows, vocab)
        full[first_row:first_row + 4] = block
        for r in range(first_row, first_row + 4):
            gens[r], params[r] = gen, seeded
        spans = [DraftSpan(first_row, [1, 2, 3])]
        out = Sampler(torch.Generator().manual_seed(rows))(full, make_meta(params, generators=gens,
                                                                            spans=spans))
        return emitted(out, spans)[0]

    results = []
    for first_row, rows in ((0, 4), (3, 9), (1, 5)):
        gen = torch.Generator().manual_seed(4)
        results.append(run(first_row, rows))
    assert results[0] == results[1] == results[2]


def test_greedy_and_random_spans_in_one_batch_in_any_order():
    vocab = 12
    logits = torch.randn(7, vocab, generator=torch.Generator().manual_seed(2))
    argmax = logits.argmax(dim=-1).tolist()
    greedy, seeded = SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=5)
    params = [greedy] + [seeded] * 3 + [greedy] * 3
    greedy_span = DraftSpan(4, [argmax[4], (argmax[5] + 1) % vocab])  # accepts one
    random_span = DraftSpan(1, [3, 4])

    def run(rows, spans):
        gens = [torch.Generator().manual_seed(5) if p is seeded else None for p in params]
        gens[1:4] = [gens[1]] * 3  # one request, one generator
        meta = make_meta([params[r] for r in rows],
                         generators=[gens[r] for r in rows], spans=spans)
        return Sampler(torch.Generator().manual_seed(0))(logits[rows], meta)

    out = run(list(range(7)), [greedy_span, random_span])
    assert out.sampled_token_ids[0] == argmax[0]
    both = emitted(out, [greedy_span, random_span])
    assert out.num_emitted[0] == 2 and both[0] == argmax[4:6]
    alone = run([1, 2, 3], [DraftSpan(0, random_span.token_ids)])
    assert both[1] == emitted(alone, [DraftSpan(0, [3, 4])])[0]
