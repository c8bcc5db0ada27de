"""The statistics the reports print: mean and sample standard deviation over runs, relative
change, the exact McNemar test for paired right/wrong outcomes, and 95 % confidence intervals
of a ratio: measured in pairs (step times of two arms) or in independent runs (sweeps)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Summary:
    n: int
    mean: float
    std: float | None  # sample std (n - 1); None for a single run


def summarize(values: Sequence[float]) -> Summary:
    if not values:
        raise ValueError("no values")
    n = len(values)
    mean = math.fsum(values) / n
    if n < 2:
        return Summary(n, mean, None)
    var = math.fsum((v - mean) ** 2 for v in values) / (n - 1)
    return Summary(n, mean, math.sqrt(var))


def change_pct(baseline: float, candidate: float) -> float | None:
    """(candidate - baseline) / baseline in percent; None when the baseline is zero."""
    if baseline == 0:
        return None
    return 100.0 * (candidate - baseline) / baseline


def mcnemar_exact(only_a: int, only_b: int) -> float:
    """Two-sided exact McNemar p-value from the discordant pairs.

    Under "no difference" each discordant pair is equally likely either way, so the smaller
    count is Binomial(b + c, 1/2); the two-sided p doubles its tail (capped at 1)."""
    if only_a < 0 or only_b < 0:
        raise ValueError("counts must be >= 0")
    n = only_a + only_b
    if n == 0:
        return 1.0
    k = min(only_a, only_b)
    tail = sum(math.comb(n, i) for i in range(k + 1)) / (1 << n)  # exact ints, any n
    return min(1.0, 2.0 * tail)


# Two-sided 95 % quantiles of Student's t for 1-30 degrees of freedom.
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179,
         2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064,
         2.060, 2.056, 2.052, 2.048, 2.045, 2.042)  # fmt: skip


def t975(df: int) -> float:
    """Student's t 97.5 % quantile (a two-sided 95 % interval); above 30 degrees of freedom the
    first Cornish-Fisher correction to the normal quantile (off by < 0.002)."""
    if df < 1:
        raise ValueError("need at least 1 degree of freedom")
    if df <= len(_T975):
        return _T975[df - 1]
    z = 1.959964
    return z + (z**3 + z) / (4 * df)


@dataclass(frozen=True)
class RatioCI:
    """A ratio of two arms measured in pairs, with its 95 % confidence interval."""

    n: int
    ratio: float
    low: float
    high: float

    @property
    def resolved(self) -> bool:
        """Whether the interval excludes 1: a change, not noise."""
        return self.low > 1.0 or self.high < 1.0


def paired_ratio_ci(num: Sequence[float], den: Sequence[float]) -> RatioCI:
    """Geometric mean of num[i] / den[i] with a Student-t 95 % interval on the log ratios.

    For A/B samples taken in pairs (the same repeat, arms interleaved), pairing removes the
    machine's drift between repeats, and logs make the interval of a ratio symmetric in which
    arm is the baseline. At the 6-16 pairs a GPU lease affords, a percentile bootstrap covers
    less than it claims; the t interval does not."""
    if len(num) != len(den):
        raise ValueError("num and den must pair up")
    if len(num) < 2:
        raise ValueError("need at least 2 pairs")
    if min(num) <= 0 or min(den) <= 0:
        raise ValueError("ratios need positive values")
    logs = [math.log(a / b) for a, b in zip(num, den, strict=True)]
    s = summarize(logs)
    half = t975(s.n - 1) * (s.std or 0.0) / math.sqrt(s.n)
    return RatioCI(s.n, math.exp(s.mean), math.exp(s.mean - half), math.exp(s.mean + half))


def welch_ratio_ci(num: Sequence[float], den: Sequence[float]) -> RatioCI:
    """Ratio of the geometric means of two independent samples (runs of two targets), with a
    Welch t 95 % interval on the difference of mean logs (degrees of freedom rounded down:
    the interval errs wide)."""
    if len(num) < 2 or len(den) < 2:
        raise ValueError("need at least 2 values on each side")
    if min(num) <= 0 or min(den) <= 0:
        raise ValueError("ratios need positive values")
    a, b = summarize([math.log(x) for x in num]), summarize([math.log(x) for x in den])
    va, vb = (a.std or 0.0) ** 2 / a.n, (b.std or 0.0) ** 2 / b.n
    diff = a.mean - b.mean
    if va + vb == 0:
        return RatioCI(min(a.n, b.n), math.exp(diff), math.exp(diff), math.exp(diff))
    df = (va + vb) ** 2 / (va**2 / (a.n - 1) + vb**2 / (b.n - 1))
    half = t975(max(1, math.floor(df))) * math.sqrt(va + vb)
    return RatioCI(min(a.n, b.n), math.exp(diff), math.exp(diff - half), math.exp(diff + half))
