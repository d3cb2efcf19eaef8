"""Intervals across seeds: Student t for means and paired differences, Wilson for proportions, Theil-Sen slopes.

Seeds are the unit of replication: each run gives one number per statistic (a slope, a correlation, a step)
and the interval is over those numbers. With two seeds the t interval is honest and therefore very wide
(t = 12.7); three seeds give t = 4.3.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

# Two-sided 95% Student t quantiles t_{0.975, df}, df = 1..30.
_T975 = (
    12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
    2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086,
    2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042,
)  # fmt: skip
Z975 = 1.959964


def t975(df: int) -> float:
    """t_{0.975, df}; beyond df = 30 the Cornish-Fisher expansion around the normal quantile (error < 1e-3)."""
    if df < 1:
        raise ValueError(f"df = {df}: need at least 1 degree of freedom")
    if df <= len(_T975):
        return _T975[df - 1]
    z = Z975
    return z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)


@dataclass(frozen=True)
class Interval:
    mean: float
    low: float
    high: float
    n: int

    def as_text(self, fmt: str = "{:+.3g}") -> str:
        if self.n == 0 or not math.isfinite(self.mean):
            return "n/a"
        if self.n == 1:
            return f"{fmt.format(self.mean)} (1 seed, no CI)"
        return f"{fmt.format(self.mean)} [{fmt.format(self.low)}, {fmt.format(self.high)}]"


NAN = Interval(float("nan"), float("nan"), float("nan"), 0)


def mean_ci(values: list[float]) -> Interval:
    """Mean and 95% t interval of the finite values (one per seed); one value has no interval (NaN bounds)."""
    x = np.array([v for v in values if v is not None and math.isfinite(v)], dtype=float)
    n = len(x)
    if n == 0:
        return NAN
    m = float(x.mean())
    if n == 1:
        return Interval(m, float("nan"), float("nan"), 1)
    half = t975(n - 1) * float(x.std(ddof=1)) / math.sqrt(n)
    return Interval(m, m - half, m + half, n)


def paired_ci(a: dict[int, float], b: dict[int, float]) -> Interval:
    """a - b over the seeds both have (a finite value in each): the seed pairs runs with the same data order and
    sampling seeds, so the difference removes what the seed shares."""
    common = [s for s in sorted(set(a) & set(b)) if _finite(a[s]) and _finite(b[s])]
    return mean_ci([a[s] - b[s] for s in common])


def wilson(successes: int, n: int) -> Interval:
    """Proportion with its 95% Wilson score interval."""
    if n == 0:
        return NAN
    p = successes / n
    z2 = Z975**2
    centre = (p + z2 / (2 * n)) / (1 + z2 / n)
    half = Z975 * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n)) / (1 + z2 / n)
    return Interval(p, max(0.0, centre - half), min(1.0, centre + half), n)


def theil_sen(x: np.ndarray, y: np.ndarray) -> float:
    """Median of pairwise slopes (NaN with fewer than two distinct x)."""
    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    if len(x) < 2:
        return float("nan")
    i, j = np.triu_indices(len(x), k=1)
    dx = x[j] - x[i]
    ok = dx != 0
    return float(np.median((y[j] - y[i])[ok] / dx[ok])) if ok.any() else float("nan")


def pearson(x: np.ndarray, y: np.ndarray) -> float:
    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    if len(x) < 3 or np.std(x) == 0 or np.std(y) == 0:
        return float("nan")
    return float(np.corrcoef(x, y)[0, 1])


def _finite(v) -> bool:
    return v is not None and isinstance(v, int | float) and math.isfinite(v)
