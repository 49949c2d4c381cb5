"""Chi-square checks of sampled token frequencies (no scipy in the test environment)."""
from __future__ import annotations

from collections import Counter

# Upper 0.001 quantiles of the chi-square distribution by degrees of freedom (standard tables).
CHI2_P001 = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515, 6: 22.458, 7: 24.322,
             8: 26.124, 9: 27.877, 10: 29.588}


def chi_square_fit(counts: Counter, expected: dict) -> tuple[float, int]:
    """(statistic, degrees of freedom) of the counts against a distribution over their cells;
    a cell outside the distribution's support fails at once."""
    support = {c: p for c, p in expected.items() if p > 0}
    assert set(counts) <= set(support), (counts, expected)
    n = sum(counts.values())
    return sum((counts[c] - n * p) ** 2 / (n * p) for c, p in support.items()), len(support) - 1


def chi_square_homogeneity(a: Counter, b: Counter) -> tuple[float, int]:
    """(statistic, degrees of freedom): do two samples come from one distribution?"""
    na, nb = sum(a.values()), sum(b.values())
    cells = set(a) | set(b)
    stat = 0.0
    for c in cells:
        total = a[c] + b[c]
        for obs, n in ((a[c], na), (b[c], nb)):
            exp = n * total / (na + nb)
            stat += (obs - exp) ** 2 / exp
    return stat, len(cells) - 1


def assert_fits(counts: Counter, expected: dict) -> None:
    """The counts fit the distribution at p = 0.001."""
    stat, df = chi_square_fit(counts, expected)
    assert stat < CHI2_P001[df], (stat, df, counts, expected)


def assert_same_distribution(a: Counter, b: Counter) -> None:
    """Two samples are not distinguishable at p = 0.001."""
    stat, df = chi_square_homogeneity(a, b)
    assert stat < CHI2_P001[df], (stat, df, a, b)
