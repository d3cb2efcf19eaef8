"""Experiment D's primary analysis: each injected arm's policy-reward deficit against the zero-mismatch control.

Per injected arm and seed: the deficit = the control's policy reward minus the arm's (``val/policy_reward`` over
the last two evaluations, :func:`tim_megatron.lab.runstats.policy_outcome`), paired by seed (the same initial
weights, prompts and sampling seeds). Per arm: the mean deficit with a 95% t interval and a one-sided paired t
test (deficit > 0); the p-values are adjusted together with Holm's method across the arms. Verdict per arm, the
smallest effect of interest first (as :func:`tim_megatron.lab.claims.decide`): "not reproduced" when the interval
lies below ``min_effect``; else "reproduced" when the Holm-adjusted p is at most ``ALPHA``; else inconclusive.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from tim_megatron.lab.claims import (
    ALPHA,
    CONTROL,
    NOT_REPRODUCED,
    OUTCOME,
    REPRODUCED,
    LabData,
    decide,
    injected_arms,
)
from tim_megatron.lab.stats import holm, mean_ci, paired_ci, t_test_greater

D_MIN_EFFECT = 0.1
"""The deficit experiment D is sized to detect (80% power), and the smallest that counts there."""


@dataclass
class ArmDeficit:
    arm: str
    dose: float
    """The arm's mean KL(pi || mu) per token over its runs."""
    deficit: float
    ci_low: float
    ci_high: float
    n_seeds: int
    p_value: float
    p_holm: float
    verdict: str
    detail: str

    def row(self) -> dict:
        return asdict(self)


def policy_deficits(lab: LabData, *, min_effect: float = D_MIN_EFFECT) -> list[ArmDeficit]:
    """One row per injected arm with completed runs (none when the control has no policy evaluation)."""
    control = lab.values(CONTROL, OUTCOME)
    if not lab.runs.get(CONTROL) or not any(math.isfinite(v) for v in control.values()):
        return []
    rows = []
    for arm in injected_arms(lab):
        if not lab.runs.get(arm):
            continue
        mine = lab.values(arm, OUTCOME)
        iv = paired_ci(control, mine)
        diffs = [control[s] - mine[s] for s in sorted(set(control) & set(mine))]
        verdict, why = decide(iv, min_effect=min_effect)
        dose = mean_ci(list(lab.values(arm, "dose").values())).mean
        rows.append(
            ArmDeficit(
                arm, dose, iv.mean, iv.low, iv.high, iv.n, t_test_greater(diffs), math.nan, verdict, why
            )
        )
    for row, adjusted in zip(rows, holm([r.p_value for r in rows]), strict=True):
        row.p_holm = adjusted
        if math.isfinite(adjusted) and adjusted <= ALPHA and row.verdict != NOT_REPRODUCED:
            row.verdict = REPRODUCED
    return rows
