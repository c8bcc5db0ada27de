"""Mean/std over runs, the exact McNemar test and the paired ratio interval, against independent
computations."""

from __future__ import annotations

import math
import random
import statistics
from fractions import Fraction
from math import comb

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vllm_h20.bench.stats import (
    change_pct,
    mcnemar_exact,
    paired_ratio_ci,
    summarize,
    t975,
    welch_ratio_ci,
)


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


_times = st.lists(st.floats(min_value=1e-3, max_value=1e3), min_size=2, max_size=16)


@given(_times, st.data())
def test_paired_ratio_ci_inverts_with_the_baseline_and_scales_with_it(num, data):
    den = data.draw(st.lists(st.floats(min_value=1e-3, max_value=1e3), min_size=len(num),
                             max_size=len(num)))  # fmt: skip
    r, inv = paired_ratio_ci(num, den), paired_ratio_ci(den, num)
    assert r.n == len(num) and r.low <= r.ratio <= r.high
    assert math.isclose(inv.ratio, 1 / r.ratio, rel_tol=1e-9)
    assert math.isclose(inv.low, 1 / r.high, rel_tol=1e-9)
    assert r.resolved == inv.resolved
    twice = paired_ratio_ci([2 * x for x in num], den)
    assert math.isclose(twice.ratio, 2 * r.ratio, rel_tol=1e-9)
    assert math.isclose(twice.high, 2 * r.high, rel_tol=1e-9)


def test_paired_ratio_ci_of_equal_arms_is_one_and_unresolved():
    r = paired_ratio_ci([7.0, 7.5, 6.9], [7.0, 7.5, 6.9])
    assert (r.ratio, r.low, r.high, r.resolved) == (1.0, 1.0, 1.0, False)
    with pytest.raises(ValueError):
        paired_ratio_ci([1.0, -0.1], [1.0, 1.0])  # a step time that noise made negative
    with pytest.raises(ValueError):
        paired_ratio_ci([1.0], [1.0])


def test_paired_ratio_ci_covers_the_true_ratio_95_percent_of_the_time():
    """Pairs sharing a drift, each arm with its own noise: the interval should hold the true
    ratio (1.1) in ~95 % of 4,000 experiments of 6 pairs (seeded: the same every run)."""
    rng = random.Random(0)
    hits = 0
    for _ in range(4000):
        drift = [rng.lognormvariate(0, 0.15) for _ in range(6)]
        a = [1.1 * d * rng.lognormvariate(0, 0.08) for d in drift]
        b = [d * rng.lognormvariate(0, 0.08) for d in drift]
        r = paired_ratio_ci(a, b)
        hits += r.low <= 1.1 <= r.high
    assert 0.935 <= hits / 4000 <= 0.965


def _t_cdf(x: float, df: int, steps: int = 4000) -> float:
    """Student's t CDF by Simpson's rule over its density (independent of the table)."""
    c = math.exp(math.lgamma((df + 1) / 2) - math.lgamma(df / 2)) / math.sqrt(df * math.pi)
    h = x / steps
    ys = [c * (1 + (i * h) ** 2 / df) ** (-(df + 1) / 2) for i in range(steps + 1)]
    return 0.5 + h / 3 * (ys[0] + ys[-1] + 4 * sum(ys[1:-1:2]) + 2 * sum(ys[2:-1:2]))


@pytest.mark.parametrize("df", [1, 2, 5, 15, 30, 31, 50, 200])
def test_t_quantiles_leave_two_and_a_half_percent_above(df):
    assert abs(_t_cdf(t975(df), df) - 0.975) < 2e-4


@given(_times, _times)
def test_welch_ratio_ci_inverts_with_the_baseline(num, den):
    r, inv = welch_ratio_ci(num, den), welch_ratio_ci(den, num)
    assert r.low <= r.ratio <= r.high
    assert math.isclose(inv.ratio, 1 / r.ratio, rel_tol=1e-9)
    assert math.isclose(inv.high, 1 / r.low, rel_tol=1e-9)
    assert r.n == min(len(num), len(den))


def test_welch_ratio_ci_covers_the_true_ratio_at_least_95_percent_of_the_time():
    """Two runs of each target, each with its own noise (unequal): the interval holds the true
    ratio in at least ~95 % of 4,000 experiments (the rounded-down df errs wide)."""
    rng = random.Random(1)
    hits = 0
    for _ in range(4000):
        a = [1.1 * rng.lognormvariate(0, 0.05) for _ in range(2)]
        b = [rng.lognormvariate(0, 0.15) for _ in range(3)]
        r = welch_ratio_ci(a, b)
        hits += r.low <= 1.1 <= r.high
    assert 0.945 <= hits / 4000 <= 0.995
    with pytest.raises(ValueError):
        welch_ratio_ci([1.0], [1.0, 2.0])  # one run: no interval
