"""The near-tie rule other tests compare greedy outputs of two compute paths with
(tests/compare_utils.py): identical tokens pass, a difference passes only at a near-tie of the
distribution, and what follows it is not compared."""
from __future__ import annotations

import pytest

from pagedlm.outputs import CompletionOutput, Logprob
from tests.compare_utils import assert_greedy_logprobs_match, assert_greedy_match


def output(tokens: list[int], logprobs: list[dict[int, float]]) -> CompletionOutput:
    return CompletionOutput(index=0, text="", token_ids=tokens, cumulative_logprob=None,
                            logprobs=[{t: Logprob(lp) for t, lp in p.items()} for p in logprobs])


TIED = {5: -0.6931, 6: -0.6932}  # two tokens 1e-4 apart
CLEAR = {5: -0.1, 6: -2.4}


def test_identical_outputs_match():
    ref = output([1, 5, 9], [{1: -0.1}, CLEAR, {9: -0.2}])
    assert assert_greedy_match(ref, output([1, 5, 9], [{1: -0.1}, CLEAR, {9: -0.2}])) is True


def test_a_difference_at_a_near_tie_ends_the_comparison():
    ref = output([1, 5, 9, 9], [{1: -0.1}, TIED, {9: -0.2}, {9: -0.1}])
    got = output([1, 6, 3, 3], [{1: -0.1}, {6: -0.6931, 5: -0.6932}, {3: -0.3}, {3: -0.1}])
    assert assert_greedy_match(ref, got) is False


def test_a_difference_without_a_near_tie_fails():
    ref = output([1, 5, 9], [{1: -0.1}, CLEAR, {9: -0.2}])
    got = output([1, 6, 9], [{1: -0.1}, {6: -0.1, 5: -2.4}, {9: -0.2}])
    with pytest.raises(AssertionError, match="logprob gap"):
        assert_greedy_match(ref, got)


def test_a_token_outside_both_top_lists_fails():
    ref = output([1, 5], [{1: -0.1}, {5: -0.1}])
    got = output([1, 7], [{1: -0.1}, {7: -0.1}])
    with pytest.raises(AssertionError, match="not a near-tie"):
        assert_greedy_match(ref, got)


def test_a_shorter_output_fails():
    ref = output([1, 5, 9], [{1: -0.1}, CLEAR, {9: -0.2}])
    got = output([1, 5], [{1: -0.1}, CLEAR])
    with pytest.raises(AssertionError, match="prefix"):
        assert_greedy_match(ref, got)


def test_logprobs_are_compared_up_to_the_difference():
    ref = output([1, 5, 9], [{1: -0.1, 2: -3.0}, TIED, {9: -0.2}])
    got = output([1, 6, 4], [{1: -0.1002, 2: -3.0}, {6: -0.6931, 5: -0.6932}, {4: -9.0}])
    assert assert_greedy_logprobs_match([ref], [got]) == 0
    off = output([1, 5, 9], [{1: -0.2, 2: -3.0}, TIED, {9: -0.2}])
    with pytest.raises(AssertionError):
        assert_greedy_logprobs_match([ref], [off])
