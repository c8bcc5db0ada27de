"""The statistics the reports print: mean and sample standard deviation over runs, relative
change, and the exact McNemar test for paired right/wrong outcomes."""

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
