"""What a deficit analysis could detect: the power at the smallest effect of interest and the smallest deficit the
design detects, at the paired spread the runs showed (not a rule: it decides nothing, it says what the verdicts
could have seen).

For each contrast of :func:`tim_megatron.lab.deficits.policy_deficits`: the pairs (seeds with both the reference
and the arm), the SD of their differences, the one-sided paired t test's power to detect the smallest effect of
interest at Holm's strictest level (``ALPHA / contrasts``: the level the first of the Holm-ordered tests must meet), and
the smallest deficit that test detects with 80% power (:func:`tim_megatron.lab.stats.paired_power`, a fixed-seed
simulation, so the same runs give the same numbers). A pre-registration that promised to say which deficit the
design could detect when the spread came out above what it was sized for is kept by this table.
"""

from __future__ import annotations

import math
import statistics

from tim_megatron.lab.claims import ALPHA, LabData
from tim_megatron.lab.deficits import D_MIN_EFFECT, contrast_pairs, outcomes
from tim_megatron.lab.stats import paired_power

POWER = 0.8
"""The power the detectable deficit is stated at."""


def detectable(*, n: int, sd: float, alpha: float, power: float = POWER) -> float:
    """The smallest mean deficit the one-sided paired t test at ``alpha`` detects with ``power`` given ``n`` pairs of
    SD ``sd`` (bisection over :func:`paired_power`, to 0.001 of ``sd``)."""
    if n < 2 or not math.isfinite(sd) or sd <= 0:
        return math.nan
    lo, hi = 0.0, 10 * sd
    while hi - lo > 1e-3 * sd:
        mid = (lo + hi) / 2
        if paired_power(n=n, effect=mid, sd=sd, alpha=alpha) >= power:
            hi = mid
        else:
            lo = mid
    return hi


def sensitivity_rows(lab: LabData, *, min_effect: float = D_MIN_EFFECT) -> list[dict]:
    """One row per contrast with paired runs (see the module docstring)."""
    pairs = [
        p
        for p in contrast_pairs(lab)
        if lab.runs.get(p.arm) and any(math.isfinite(v) for v in outcomes(lab, p)[0].values())
    ]
    if not pairs:
        return []
    alpha = ALPHA / len(pairs)
    rows = []
    for pair in pairs:
        ref, mine = outcomes(lab, pair)
        diffs = [
            ref[s] - mine[s]
            for s in sorted(set(ref) & set(mine))
            if math.isfinite(ref[s]) and math.isfinite(mine[s])
        ]
        n = len(diffs)
        sd = statistics.stdev(diffs) if n >= 2 else math.nan
        rows.append(
            {
                "arm": pair.label,
                "pairs": n,
                "paired_sd": sd,
                "alpha": alpha,
                f"power_at_{min_effect:g}": paired_power(n=n, effect=min_effect, sd=sd, alpha=alpha)
                if n >= 2 and sd > 0
                else math.nan,
                "detectable_at_80pct": detectable(n=n, sd=sd, alpha=alpha),
            }
        )
    return rows
