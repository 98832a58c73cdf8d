"""95% intervals for scores and for the change between two models, with a plain verdict, all from scipy.

- A proportion (exact match, accuracy: k right of n): the Wilson score interval, which keeps its coverage near 0 and
  1 and on small n, where the normal approximation's does not (Brown, Cai and DasGupta 2001).
- A mean of other per-item values: the percentile bootstrap of the mean.
- Two models on the same items: the paired difference, after - before, item by item, with the percentile bootstrap
  of its mean. Pairing takes out how hard each item is, so the interval is far narrower than two separate ones.

Every bootstrap draws from a generator seeded with `seed`, so the same values always give the same interval.
The verdict reads the interval: "better" when it lies wholly above zero, "worse" wholly below, else "no measurable
difference" (with the direction flipped for a score where lower is better, such as perplexity).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Sequence

import numpy as np

CONFIDENCE = 0.95
RESAMPLES = 10_000
BETTER, WORSE, SAME = "better", "worse", "no measurable difference"


@dataclass(frozen=True)
class Interval:
    """A score (or a difference) with its 95% interval, over `n` items; low and high are NaN where one item (or
    none) leaves nothing to resample."""
    value: float
    low: float
    high: float
    n: int

    def as_dict(self) -> dict[str, float | int]:
        return asdict(self)

    def percent(self) -> str:
        """As percentages: `27.5% [22.7, 32.8]`."""
        return f"{self.value:.1%} {bracket(self.low * 100, self.high * 100, '.1f')}"

    def number(self, digits: int = 4) -> str:
        """As plain numbers: `0.2750 [0.2270, 0.3280]`."""
        return f"{self.value:.{digits}f} {bracket(self.low, self.high, f'.{digits}f')}"


@dataclass(frozen=True)
class Comparison:
    """after - before on the same `n` items, its 95% interval and the verdict it supports."""
    difference: float
    low: float
    high: float
    n: int
    verdict: str

    def as_dict(self) -> dict[str, float | int | str]:
        return asdict(self)

    def points(self) -> str:
        """As percentage points: `+7.3 points [+2.0, +12.7]: better`."""
        return (f"{self.difference * 100:+.1f} points {bracket(self.low * 100, self.high * 100, '+.1f')}: "
                f"{self.verdict}")

    def number(self, digits: int = 4) -> str:
        return f"{self.difference:+.{digits}f} {bracket(self.low, self.high, f'+.{digits}f')}: {self.verdict}"


def bracket(low: float, high: float, spec: str) -> str:
    if math.isnan(low) or math.isnan(high):
        return "[-]"
    return f"[{low:{spec}}, {high:{spec}}]"


def proportion(successes: int, n: int) -> Interval:
    """`successes` of `n` with the Wilson score interval."""
    from scipy.stats import binomtest

    if not 0 <= successes <= n or n < 1:
        raise ValueError(f"a proportion needs 0 <= successes <= n and n >= 1, got {successes} of {n}")
    ci = binomtest(successes, n).proportion_ci(CONFIDENCE, method="wilson")
    return Interval(successes / n, float(ci.low), float(ci.high), n)


def is_binary(values: Sequence[float]) -> bool:
    return all(v in (0, 1) for v in values)


def mean(values: Sequence[float], seed: int = 0) -> Interval:
    """The mean of `values`: a proportion (Wilson) when every value is 0 or 1, else with the bootstrap interval."""
    data = np.asarray(values, dtype=np.float64)
    if len(data) and is_binary(data.tolist()):
        return proportion(int(data.sum()), len(data))
    return Interval(float(data.mean()) if len(data) else math.nan, *bootstrap(data, seed), len(data))


def paired(before: Sequence[float], after: Sequence[float], higher_is_better: bool = True,
           seed: int = 0) -> Comparison:
    """after - before, item by item (the two lists in the same item order), with the bootstrap interval of the mean
    difference and its verdict."""
    if len(before) != len(after):
        raise ValueError(f"a paired comparison needs the same items on both sides, got {len(before)} and "
                         f"{len(after)}")
    diff = np.asarray(after, dtype=np.float64) - np.asarray(before, dtype=np.float64)
    low, high = bootstrap(diff, seed)
    return Comparison(float(diff.mean()) if len(diff) else math.nan, low, high, len(diff),
                      verdict(low, high, higher_is_better))


def verdict(low: float, high: float, higher_is_better: bool = True) -> str:
    if low > 0:
        return BETTER if higher_is_better else WORSE
    if high < 0:
        return WORSE if higher_is_better else BETTER
    return SAME


def bootstrap(values: np.ndarray, seed: int) -> tuple[float, float]:
    """The percentile bootstrap interval of the mean of `values`; NaN for fewer than two."""
    from scipy.stats import bootstrap as scipy_bootstrap

    if len(values) < 2:
        return math.nan, math.nan
    result = scipy_bootstrap((values,), np.mean, n_resamples=RESAMPLES, vectorized=True,
                             confidence_level=CONFIDENCE, method="percentile", rng=np.random.default_rng(seed))
    return float(result.confidence_interval.low), float(result.confidence_interval.high)
