"""The primary analysis of D and E: policy-reward deficits, one test per contrast.

A contrast is a pair of arms (:class:`tim_megatron.lab.grid.Contrast`): the grid's ``contrasts`` when it declares
them (E: noise against exact, bias against noise, the engine against exact), else each injected arm against the
zero-mismatch control (D). Per contrast and seed: the deficit = the reference's policy reward minus the arm's (``val/policy_reward`` over
the last two evaluations, :func:`tim_megatron.lab.runstats.policy_outcome`), paired by seed (the same initial
weights, prompts and sampling seeds). Per contrast: the mean deficit with a 95% t interval and a one-sided paired t
test (deficit > 0); the p-values are adjusted together with Holm's method across the contrasts. Verdict per arm, the
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


@dataclass(frozen=True)
class Pair:
    """One deficit test: ``reference`` minus ``arm``; ``label`` names it in the tables."""

    label: str
    arm: str
    reference: str


def contrast_pairs(lab: LabData) -> list[Pair]:
    """The grid's contrasts, or each injected arm against the control (named by the arm alone)."""
    if lab.grid.contrasts:
        return [Pair(c.name, c.arm, c.reference) for c in lab.grid.contrasts]
    return [Pair(a, a, CONTROL) for a in injected_arms(lab)]


def outcomes(lab: LabData, pair: Pair) -> tuple[dict[int, float], dict[int, float]]:
    """The reference's and the arm's outcomes by seed."""
    return lab.values(pair.reference, OUTCOME), lab.values(pair.arm, OUTCOME)


@dataclass
class ArmDeficit:
    arm: str
    """The injected arm (D's layout), or the contrast's name when the grid declares contrasts."""
    dose: float
    """The tested arm's mean KL(pi || mu) per token over its runs."""
    deficit: float
    ci_low: float
    ci_high: float
    n_seeds: int
    p_value: float
    p_holm: float
    verdict: str
    detail: str
    tested: str = ""
    """A declared contrast's tested arm ("" in D's layout, where ``arm`` is that arm)."""
    reference: str = ""
    """A declared contrast's reference arm ("" in D's layout: the control)."""

    def row(self) -> dict:
        row = asdict(self)
        tested, reference = row.pop("tested"), row.pop("reference")
        if not reference:
            return row
        return {"contrast": row.pop("arm"), "arm": tested, "reference": reference, **row}


def policy_deficits(lab: LabData, *, min_effect: float = D_MIN_EFFECT) -> list[ArmDeficit]:
    """One row per contrast whose two arms have completed runs with a policy evaluation."""
    rows = []
    for pair in contrast_pairs(lab):
        ref, mine = outcomes(lab, pair)
        if not lab.runs.get(pair.reference) or not any(math.isfinite(v) for v in ref.values()):
            continue
        if not lab.runs.get(pair.arm):
            continue
        iv = paired_ci(ref, mine)
        diffs = [ref[s] - mine[s] for s in sorted(set(ref) & set(mine))]
        verdict, why = decide(iv, min_effect=min_effect)
        dose = mean_ci(list(lab.values(pair.arm, "dose").values())).mean
        declared = bool(lab.grid.contrasts)
        rows.append(
            ArmDeficit(
                pair.label,
                dose,
                iv.mean,
                iv.low,
                iv.high,
                iv.n,
                t_test_greater(diffs),
                math.nan,
                verdict,
                why,
                tested=pair.arm if declared else "",
                reference=pair.reference if declared else "",
            )
        )
    for row, adjusted in zip(rows, holm([r.p_value for r in rows]), strict=True):
        row.p_holm = adjusted
        if math.isfinite(adjusted) and adjusted <= ALPHA and row.verdict != NOT_REPRODUCED:
            row.verdict = REPRODUCED
    return rows
