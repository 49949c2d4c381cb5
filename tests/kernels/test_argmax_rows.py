"""The native greedy argmax (argmax_rows_f32 in csrc/fused_ops.c, through the sampler's
greedy_argmax) against torch.argmax: the same index on every row, ties (first maximum), NaNs
(first NaN), infinities and signed zeros included, on ragged shapes (vocabularies that are not a
multiple of the kernel's 64- and 16-float steps, rows that are views into a wider tensor) with
one and two threads (row counts on both sides of the threaded-path threshold)."""
import pytest
import torch

from pagedlm.kernels import fused_ops
from pagedlm.model_executor.layers.sampler import greedy_argmax
from tests.conftest import needs_kernels

pytestmark = needs_kernels

VOCABS = [1, 15, 16, 17, 63, 64, 65, 129, 1000, 49152, 49157]
ROWS = [1, 2, 7, 40]


@pytest.fixture(params=[1, 2])
def threads(request):
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def _check(x: torch.Tensor) -> None:
    ref = x.argmax(dim=-1)
    got = fused_ops.argmax_rows(x)
    assert got.dtype == torch.int64
    assert torch.equal(got, ref), (got[got != ref], ref[got != ref])


@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("rows", ROWS)
def test_random_rows(rows, vocab, threads):
    g = torch.Generator().manual_seed(rows * 100003 + vocab)
    _check(torch.randn(rows, vocab, generator=g))
    # A view into a wider tensor (the row stride is not the vocabulary).
    _check(torch.randn(rows, vocab + 24, generator=g)[:, 3:vocab + 3])


@pytest.mark.parametrize("vocab", [17, 65, 1000, 49157])
def test_ties_give_the_first_maximum(vocab, threads):
    g = torch.Generator().manual_seed(vocab)
    # Few distinct values: each row's maximum appears many times, anywhere in the row.
    _check(torch.randint(-3, 4, (40, vocab), generator=g).float())
    x = torch.zeros(8, vocab)
    x[:, -1] = 1.0  # the maximum only in the tail (past the last full 64-float step)
    x[1, 0] = 1.0
    x[2, vocab // 2] = 1.0
    x[3, :] = 1.0
    _check(x)
    # Signed zeros compare equal: the first of them wins, whatever its sign.
    z = torch.zeros(3, vocab)
    z[0, 0] = -0.0
    z[1, :] = -0.0
    z[2, 1:] = -0.0
    _check(z)


@pytest.mark.parametrize("vocab", [17, 65, 1000, 49157])
def test_nan_and_infinities(vocab, threads):
    g = torch.Generator().manual_seed(vocab + 1)
    x = torch.randn(10, vocab, generator=g)
    x[0, vocab // 3] = float("nan")
    x[1, -1] = float("nan")
    x[1, 0] = float("inf")
    x[2, 0] = float("nan")
    x[2, vocab // 2] = float("nan")
    x[3, vocab // 2] = float("inf")
    x[3, -1] = float("inf")
    x[4, :] = float("-inf")
    x[5, :] = float("-inf")
    x[5, -1] = -1e30
    x[6, :] = float("nan")
    x[7, vocab // 4] = float("-inf")
    _check(x)


def test_sampler_takes_the_kernel_only_where_it_applies():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(6, 300, generator=g)
    assert torch.equal(greedy_argmax(x), x.argmax(dim=-1))
    # Not rows-contiguous, and not float32: torch's argmax, the same answer.
    assert torch.equal(greedy_argmax(x.t()), x.t().argmax(dim=-1))
    assert torch.equal(greedy_argmax(x.bfloat16()), x.bfloat16().argmax(dim=-1))
