"""Mean/std over runs and the exact McNemar test, against independent computations."""

from __future__ import annotations

import statistics
from fractions import Fraction
from math import comb

from hypothesis import given
from hypothesis import strategies as st

from vllm_h20.bench.stats import change_pct, mcnemar_exact, summarize


@given(st.lists(st.floats(min_value=0, max_value=1e6), min_size=2, max_size=20))
def test_summary_matches_statistics_module(xs):
    s = summarize(xs)
    assert s.n == len(xs)
    assert abs(s.mean - statistics.fmean(xs)) <= 1e-9 * max(1.0, max(xs))
    assert abs(s.std - statistics.stdev(xs)) <= 1e-6 * max(1.0, max(xs))


def test_single_run_has_no_std_and_change_pct():
    assert summarize([5.0]).std is None
    assert change_pct(259, 235) == 100 * (235 - 259) / 259
    assert change_pct(0, 1) is None


def _mcnemar_reference(b: int, c: int) -> Fraction:
    n, k = b + c, min(b, c)
    if n == 0:
        return Fraction(1)
    return min(Fraction(1), 2 * Fraction(sum(comb(n, i) for i in range(k + 1)), 2**n))


@given(st.integers(0, 400), st.integers(0, 400))
def test_mcnemar_exact_matches_the_binomial_tail(b, c):
    p = mcnemar_exact(b, c)
    assert p == mcnemar_exact(c, b)
    assert abs(p - float(_mcnemar_reference(b, c))) <= 1e-12


def test_mcnemar_known_values_and_large_n():
    assert mcnemar_exact(0, 0) == 1.0
    assert mcnemar_exact(1, 0) == 1.0
    assert mcnemar_exact(0, 6) == 2 / 64
    # the seed's GSM8K: 476 vs 475 of 494, a difference of one discordant pair at most
    assert mcnemar_exact(3, 2) == 1.0
    assert 0 < mcnemar_exact(3000, 2500) < 1e-9  # n well past float range of 2**n
