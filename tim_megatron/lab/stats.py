"""Intervals and tests across seeds: Student t for means and paired differences, Wilson for proportions, Fisher's
exact test for two proportions, Holm's correction across claims, Theil-Sen slopes.

Seeds are the unit of replication: each run gives one number per statistic (a slope, a correlation, a step)
and the interval is over those numbers. With two seeds the t interval is honest and therefore very wide
(t = 12.7); three seeds give t = 4.3, four 3.18. Tests are one-sided (the claim's direction) and their
p-values exact for the t distribution (regularized incomplete beta, no SciPy).
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


def _beta_cf(a: float, b: float, x: float) -> float:
    """Continued fraction of the incomplete beta function (modified Lentz), for x < (a + 1) / (a + b + 2)."""
    tiny, eps = 1e-300, 1e-15
    qab, qap, qam = a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 500):
        m2 = 2 * m
        for aa in (
            m * (b - m) * x / ((qam + m2) * (a + m2)),
            -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2)),
        ):
            d = 1.0 + aa * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + aa / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < eps:
            break
    return h


def betainc(a: float, b: float, x: float) -> float:
    """The regularized incomplete beta function I_x(a, b)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    front = math.exp(
        math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    )
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _beta_cf(a, b, x) / a
    return 1.0 - front * _beta_cf(b, a, 1.0 - x) / b


def t_sf(t: float, df: int) -> float:
    """P(T >= t) for Student's t with ``df`` degrees of freedom."""
    if df < 1:
        raise ValueError(f"df = {df}: need at least 1 degree of freedom")
    if math.isinf(t):
        return 0.0 if t > 0 else 1.0
    tail = 0.5 * betainc(df / 2.0, 0.5, df / (df + t * t))
    return tail if t >= 0 else 1.0 - tail


def t_test_greater(values: list[float]) -> float:
    """One-sided p-value of a one-sample t test that the mean of ``values`` (one per seed) is above 0; NaN with
    fewer than 2 finite values. Zero spread gives 0 for a positive mean, 1 otherwise."""
    x = np.array([v for v in values if _finite(v)], dtype=float)
    n = len(x)
    if n < 2:
        return float("nan")
    sd = float(x.std(ddof=1))
    m = float(x.mean())
    if sd == 0.0:
        return 0.0 if m > 0 else 1.0
    return t_sf(m / (sd / math.sqrt(n)), n - 1)


def fisher_fewer(k_a: int, n_a: int, k_b: int, n_b: int) -> float:
    """One-sided p-value of Fisher's exact test that group a has a lower rate than group b (k events of n):
    P(a gets k_a or fewer of the k_a + k_b events, all margins fixed)."""
    if not (0 <= k_a <= n_a and 0 <= k_b <= n_b) or n_a + n_b == 0:
        raise ValueError(f"counts {k_a}/{n_a} and {k_b}/{n_b}: need 0 <= k <= n")
    n, k = n_a + n_b, k_a + k_b
    total = math.comb(n, n_a)
    lo = max(0, n_a - (n - k))
    return sum(math.comb(k, x) * math.comb(n - k, n_a - x) for x in range(lo, k_a + 1)) / total


def holm(pvalues: list[float]) -> list[float]:
    """Holm's step-down adjusted p-values, in the input order; NaN entries are not tests and stay NaN."""
    idx = [i for i, p in enumerate(pvalues) if _finite(p)]
    m = len(idx)
    out = [float("nan")] * len(pvalues)
    running = 0.0
    for rank, i in enumerate(sorted(idx, key=lambda i: pvalues[i])):
        running = max(running, min(1.0, (m - rank) * pvalues[i]))
        out[i] = running
    return out


def rate_difference(k_a: int, n_a: int, k_b: int, n_b: int) -> Interval:
    """k_a / n_a - k_b / n_b with Newcombe's 95% hybrid score interval (from the two Wilson intervals)."""
    if n_a == 0 or n_b == 0:
        return NAN
    a, b = wilson(k_a, n_a), wilson(k_b, n_b)
    d = a.mean - b.mean
    low = d - math.sqrt((a.mean - a.low) ** 2 + (b.high - b.mean) ** 2)
    high = d + math.sqrt((a.high - a.mean) ** 2 + (b.mean - b.low) ** 2)
    return Interval(d, low, high, n_a + n_b)


def t_critical(alpha: float, df: int) -> float:
    """The one-sided critical value: t with ``t_sf(t, df) = alpha`` (bisection)."""
    lo, hi = 0.0, 1000.0
    for _ in range(200):
        mid = (lo + hi) / 2
        if t_sf(mid, df) > alpha:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def paired_power(
    *, n: int, effect: float, sd: float, alpha: float, reps: int = 20_000, seed: int = 0
) -> float:
    """Power of the one-sided paired t test at level ``alpha`` with ``n`` pairs whose differences are normal with
    mean ``effect`` and SD ``sd``: the share of ``reps`` simulated experiments that reject (fixed seed, so the
    same inputs give the same number)."""
    if n < 2:
        return 0.0
    rng = np.random.default_rng(seed)
    d = rng.normal(effect, sd, size=(reps, n))
    t = d.mean(1) / (d.std(1, ddof=1) / math.sqrt(n))
    return float((t > t_critical(alpha, n - 1)).mean())


def seeds_for_power(*, effect: float, sd: float, alpha: float, power: float = 0.8, most: int = 200) -> int:
    """The fewest pairs (>= 2) whose one-sided paired t test reaches ``power`` (:func:`paired_power`); ``most``
    + 1 when even ``most`` do not."""
    for n in range(2, most + 1):
        if paired_power(n=n, effect=effect, sd=sd, alpha=alpha) >= power:
            return n
    return most + 1
