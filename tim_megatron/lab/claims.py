"""The papers' claims C1..C9 (tim-megatron issue 13), each decided by a rule fixed here before any run.

Every claim names the arms it reads (by the arm names of ``lab/*.yaml``) and an effect oriented so that a
positive value supports it, computed per seed and summarized by a 95% t interval across seeds (paired by
seed when two arms are compared: the same seed means the same prompts and the same sampling seeds). The
common rule (:func:`decide`), unless a claim states its own:

* **reproduced**: the interval lies above 0;
* **not reproduced**: the interval lies below the smallest effect that would matter (``min_effect``), i.e.
  the data rule out an effect of that size in the claim's direction;
* **inconclusive**: anything else, fewer than 2 seeds, or an arm that did not run (named in the row).

Growth is the change of log(rho_std) over the run (:mod:`.runstats`); its ``min_effect`` is log(1.25), 25%
more growth over the run. Nothing here is tuned to the results: the thresholds are the papers' (30%
collapse) or round numbers stated with the rule.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass

from tim_megatron.lab.grid import ArmPlan, Grid
from tim_megatron.lab.runstats import RunStats
from tim_megatron.lab.stats import NAN, Interval, mean_ci, paired_ci, wilson

REPRODUCED, NOT_REPRODUCED, INCONCLUSIVE = "reproduced", "not reproduced", "inconclusive"
GROWTH_MIN = math.log(1.25)
"""Smallest growth difference that matters: 25% more growth of rho_std over the run."""
PCC_MIN = 0.3
"""Smallest correlation of J with step that counts as 'rises'."""
DRIFT_MIN = 0.01
"""Smallest relative drift of the low-probability buckets' rho_mean over the run (1%)."""

COMMON_RULE = (
    "reproduced if the 95% CI of the effect lies above 0; not reproduced if it lies below {min} (the smallest "
    "effect that would count); otherwise inconclusive"
)


@dataclass
class Verdict:
    claim: str
    statement: str
    source: str
    verdict: str
    effect: float
    ci_low: float
    ci_high: float
    n_seeds: int
    unit: str
    arms: str
    rule: str
    detail: str

    def row(self) -> dict:
        return asdict(self)


@dataclass
class LabData:
    """Completed runs by arm and seed, and every arm's plan (runnable or why not)."""

    grid: Grid
    plans: dict[str, ArmPlan]
    runs: dict[str, dict[int, RunStats]]

    def missing(self, arms: list[str]) -> list[str]:
        """Why each of ``arms`` has no completed run: not in the grid, not run (needs ...), or no run finished."""
        out = []
        for a in arms:
            if a not in self.plans:
                out.append(f"arm {a!r} is not in this grid")
            elif not self.plans[a].runnable:
                out.append(f"arm {a!r} not run: {self.plans[a].reason}")
            elif not self.runs.get(a):
                out.append(f"arm {a!r} has no completed run")
        return out

    def values(self, arm: str, key: str) -> dict[int, float]:
        return {s: getattr(r, key) for s, r in self.runs.get(arm, {}).items()}


def decide(iv: Interval, *, min_effect: float) -> tuple[str, str]:
    """The common rule; returns (verdict, why)."""
    if iv.n < 2:
        return INCONCLUSIVE, f"{iv.n} seed(s) with a value: no interval"
    if iv.low > 0:
        return REPRODUCED, "CI above 0"
    if iv.high < min_effect:
        return NOT_REPRODUCED, f"CI below {min_effect:.3g}"
    return INCONCLUSIVE, f"CI spans 0 and {min_effect:.3g}"


def _verdict(claim: str, spec: dict, iv: Interval, verdict: str, detail: str, arms: list[str]) -> Verdict:
    return Verdict(
        claim=claim,
        statement=spec["statement"],
        source=spec["source"],
        verdict=verdict,
        effect=iv.mean,
        ci_low=iv.low,
        ci_high=iv.high,
        n_seeds=iv.n,
        unit=spec["unit"],
        arms=", ".join(arms),
        rule=spec["rule"],
        detail=detail,
    )


def _not_run(claim: str, spec: dict, lab: LabData, arms: list[str]) -> Verdict | None:
    miss = lab.missing(arms)
    if not miss:
        return None
    return _verdict(claim, spec, NAN, INCONCLUSIVE, "; ".join(miss), arms)


def _growth_gap(claim: str, spec: dict, lab: LabData, more: str, less: str, extra: str = "") -> Verdict:
    """Effect = growth(more) - growth(less), paired by seed, common rule with GROWTH_MIN."""
    arms = [more, less]
    nr = _not_run(claim, spec, lab, arms)
    if nr:
        return nr
    iv = paired_ci(lab.values(more, "growth"), lab.values(less, "growth"))
    verdict, why = decide(iv, min_effect=GROWTH_MIN)
    g = {a: mean_ci(list(lab.values(a, "growth").values())) for a in arms}
    detail = f"{why}; growth {more} {g[more].as_text()}, {less} {g[less].as_text()}" + extra
    return _verdict(claim, spec, iv, verdict, detail, arms)


def _growth_of(lab: LabData, arm: str) -> str:
    if not lab.runs.get(arm):
        return f"{arm}: " + ("; ".join(lab.missing([arm])) or "no runs")
    return f"{arm}: growth {mean_ci(list(lab.values(arm, 'growth').values())).as_text()}"


def _collapses(lab: LabData, arm: str) -> tuple[int, int]:
    runs = lab.runs.get(arm, {})
    return sum(r.collapse_step is not None for r in runs.values()), len(runs)


# ------------------------------------------------------------------------------------------- the claims


def c1(lab: LabData) -> Verdict:
    spec = CLAIMS["C1"]
    arms = ["exact"]
    nr = _not_run("C1", spec, lab, arms)
    if nr:
        return nr
    runs = lab.runs["exact"]
    nonzero = [s for s, r in runs.items() if not r.zero_mismatch]
    k, n = _collapses(lab, "exact")
    iv = wilson(k, n)
    kb, nb = _collapses(lab, "baseline")
    context = f"; baseline (real TIM) collapsed in {kb} of {nb} seed(s)" if nb else ""
    if nonzero:
        return _verdict(
            "C1",
            spec,
            iv,
            INCONCLUSIVE,
            f"rho_std > 0 logged in seed(s) {nonzero}: not zero mismatch" + context,
            arms,
        )
    if n < 2:
        return _verdict("C1", spec, iv, INCONCLUSIVE, f"{n} completed seed(s)" + context, arms)
    verdict = REPRODUCED if k == 0 else NOT_REPRODUCED
    return _verdict(
        "C1", spec, iv, verdict, f"{k} of {n} seed(s) collapsed with rho = 1 exactly" + context, arms
    )


def dose_groups(lab: LabData) -> dict[str, list[str]]:
    """Arms with a group and a dose, by group, lowest dose first (claim C2)."""
    groups: dict[str, list[tuple[float, str]]] = {}
    for name, p in lab.plans.items():
        if p.arm.group and p.arm.dose is not None:
            groups.setdefault(p.arm.group, []).append((p.arm.dose, name))
    return {g: [n for _, n in sorted(v)] for g, v in sorted(groups.items())}


def c2(lab: LabData) -> Verdict:
    spec = CLAIMS["C2"]
    groups = dose_groups(lab)
    arms = [a for g in groups.values() for a in g]
    if not groups:
        return _verdict(
            "C2", spec, NAN, INCONCLUSIVE, "no dose series (arms with group and dose) in this grid", []
        )
    per_seed: dict[int, list[float]] = {}
    notes = []
    for g, names in groups.items():
        ran = [
            a
            for a in names
            if lab.runs.get(a) and any(math.isfinite(v) for v in lab.values(a, "growth").values())
        ]
        miss = lab.missing(names)
        if miss:
            notes.append(f"{g}: " + "; ".join(miss))
        if len(ran) < 2:
            continue
        lo, hi = ran[0], ran[-1]
        for s, d in _diffs(lab.values(hi, "growth"), lab.values(lo, "growth")).items():
            per_seed.setdefault(s, []).append(d)
        cols = ", ".join(
            f"{a} {_collapses(lab, a)[0]}/{_collapses(lab, a)[1]}" for a in names if lab.runs.get(a)
        )
        notes.append(f"{g}: growth {hi} - {lo}, collapses {cols}")
    iv = mean_ci([sum(v) / len(v) for v in per_seed.values()])
    verdict, why = decide(iv, min_effect=GROWTH_MIN)
    return _verdict("C2", spec, iv, verdict, f"{why}; " + "; ".join(notes), arms)


def _diffs(a: dict[int, float], b: dict[int, float]) -> dict[int, float]:
    return {s: a[s] - b[s] for s in set(a) & set(b) if math.isfinite(a[s]) and math.isfinite(b[s])}


def c3(lab: LabData) -> Verdict:
    spec = CLAIMS["C3"]
    arms = ["objective-delta", "objective-sigma", "gspo"]
    sampling = [
        a for g, names in dose_groups(lab).items() if g in ("inject-bias", "inject-noise") for a in names
    ]
    samp_note = "; sampling-distribution part (inject-bias vs inject-noise): " + (
        "; ".join(lab.missing(sampling)) or "ran, see C2" if sampling else "not in this grid"
    )
    nr = _not_run("C3", spec, lab, arms)
    if nr:
        nr.detail += samp_note
        return nr
    e1 = paired_ci(lab.values("objective-delta", "growth"), lab.values("gspo", "growth"))
    e2 = paired_ci(lab.values("objective-sigma", "growth"), lab.values("gspo", "growth"))
    if min(e1.n, e2.n) < 2:
        verdict = INCONCLUSIVE
    elif e1.low > 0 and e2.low <= 0:
        verdict = REPRODUCED
    elif e1.high < GROWTH_MIN or (e2.low > 0 and e2.mean >= e1.mean):
        verdict = NOT_REPRODUCED
    else:
        verdict = INCONCLUSIVE
    detail = (
        f"delta - gspo {e1.as_text()}; sigma - gspo {e2.as_text()} (growth of log rho_std over the run)"
        + samp_note
    )
    return _verdict("C3", spec, e1, verdict, detail, arms)


def c4(lab: LabData) -> Verdict:
    spec = CLAIMS["C4"]
    arms = ["objective-delta"]
    nr = _not_run("C4", spec, lab, arms)
    if nr:
        return nr
    iv = mean_ci(list(lab.values("objective-delta", "j_step_pcc").values()))
    verdict, why = decide(iv, min_effect=PCC_MIN)
    base = mean_ci(list(lab.values("gspo", "j_step_pcc").values()))
    return _verdict("C4", spec, iv, verdict, f"{why}; gspo (no distortion): PCC {base.as_text()}", arms)


def c5(lab: LabData) -> Verdict:
    spec = CLAIMS["C5"]
    arms = ["baseline"]
    nr = _not_run("C5", spec, lab, arms)
    if nr:
        return nr
    iv = mean_ci([-v for v in lab.values("baseline", "bucket_drift").values()])
    verdict, why = decide(iv, min_effect=DRIFT_MIN)
    return _verdict("C5", spec, iv, verdict, why, arms)


def c6(lab: LabData) -> Verdict:
    extra = "; " + "; ".join(_growth_of(lab, a) for a in ("clip-0.24", "gspo") if a in lab.plans)
    return _growth_gap("C6", CLAIMS["C6"], lab, "baseline", "clip-0.28", extra if extra != "; " else "")


def c7(lab: LabData) -> Verdict:
    return _growth_gap("C7", CLAIMS["C7"], lab, "baseline", "tis")


def c8(lab: LabData) -> Verdict:
    spec = CLAIMS["C8"]
    arms = ["baseline", "length-decay"]
    nr = _not_run("C8", spec, lab, arms)
    if nr:
        return nr
    leads, no_surge, no_onset = [], 0, 0
    for r in lab.runs["baseline"].values():
        onset = r.warnings.get("trend")
        if r.surge_step is None:
            no_surge += 1
        elif onset is None:
            no_onset += 1
        else:
            leads.append(float(onset - r.surge_step))
    a = mean_ci(leads)
    b = paired_ci(lab.values("baseline", "growth"), lab.values("length-decay", "growth"))
    if a.n < 2 or b.n < 2:
        verdict = INCONCLUSIVE
    elif a.low > 0 and b.low > 0:
        verdict = REPRODUCED
    elif a.high < 0 or b.high < GROWTH_MIN:
        verdict = NOT_REPRODUCED
    else:
        verdict = INCONCLUSIVE
    detail = (
        f"(a) mismatch-growth onset minus length-surge step, baseline: {a.as_text('{:+.1f}')} steps over seeds "
        f"with both ({no_surge} seed(s) without a surge, {no_onset} with a surge but no growth onset); "
        f"(b) growth baseline - length-decay: {b.as_text()}"
    )
    return _verdict("C8", spec, b, verdict, detail, arms)


def c9(lab: LabData) -> Verdict:
    extra = "; " + _growth_of(lab, "lr-high") if "lr-high" in lab.plans else ""
    return _growth_gap("C9", CLAIMS["C9"], lab, "baseline", "lr-low", extra)


_G = "growth of log rho_std over the run"
CLAIMS: dict[str, dict] = {
    "C1": {
        "statement": "Zero mismatch stays stable: with rho = 1 exactly, training does not collapse.",
        "source": "VeXact (arXiv 2605.14220), abstract",
        "unit": "fraction of seeds that collapse (Wilson CI)",
        "rule": "inconclusive if any seed logs rho_std > 0 or fewer than 2 seeds completed; reproduced if no seed "
        "collapses (trailing 5-step mean reward 30% below its best); not reproduced if any does",
        "fn": c1,
    },
    "C2": {
        "statement": "Injected TIM grows or collapses with the dose.",
        "source": "VeXact (arXiv 2605.14220), abstract; issue 13 item 2",
        "unit": f"{_G}, highest minus lowest dose, averaged over perturbation kinds",
        "rule": COMMON_RULE.format(min="log 1.25"),
        "fn": c2,
    },
    "C3": {
        "statement": "A biased token-weight distortion (delta = 2 below pi_low = 0.1) grows the mismatch; unbiased "
        "weight noise (sigma = 0.2) does not.",
        "source": "objective-level hacking (arXiv 2602.01103), Sec. 4.4 and 5.1, Fig. 5 vs Fig. 12, Eq. 17-22",
        "unit": f"{_G}, delta arm minus GSPO",
        "rule": "reproduced if CI(delta - gspo) lies above 0 and CI(sigma - gspo) does not; not reproduced if "
        "CI(delta - gspo) lies below log 1.25, or sigma grows significantly and at least as much as delta; "
        "otherwise inconclusive",
        "fn": c3,
    },
    "C4": {
        "statement": "The surrogate J = sum A (phi - 1) rises over training under the delta = 2 distortion.",
        "source": "objective-level hacking, Sec. 5.2, Eq. 23, Fig. 6b",
        "unit": "Pearson correlation of J with step",
        "rule": COMMON_RULE.format(min=PCC_MIN),
        "fn": c4,
    },
    "C5": {
        "statement": "The rho of low-probability tokens drifts down relative to high-probability ones over training.",
        "source": "objective-level hacking, Sec. 5.3, Fig. 7b, App. C.2",
        "unit": "minus the change over the run of rho_mean(pi < 0.1) - rho_mean(pi >= 0.9)",
        "rule": COMMON_RULE.format(min=DRIFT_MIN),
        "fn": c5,
    },
    "C6": {
        "statement": "Stronger token clipping (eps_high 0.2) grows the mismatch faster than weaker (0.28). (The "
        "paper's direction; issue 13's one-line summary 'stronger clipping, less growth' says the opposite.)",
        "source": "objective-level hacking, Sec. 4.3, Fig. 4, Table 1",
        "unit": f"{_G}, clip 0.2 minus clip 0.28",
        "rule": COMMON_RULE.format(min="log 1.25"),
        "fn": c6,
    },
    "C7": {
        "statement": "TIS slows the growth of the mismatch.",
        "source": "objective-level hacking, Sec. 4.2, Fig. 2c",
        "unit": f"{_G}, without TIS minus with TIS",
        "rule": COMMON_RULE.format(min="log 1.25"),
        "fn": c7,
    },
    "C8": {
        "statement": "(a) A response-length surge precedes the mismatch growth, and (b) Algorithm 1's decay keeps the "
        "mismatch bounded.",
        "source": "TIM-LR (arXiv 2602.01826), Sec. 3.3-4.1, Fig. 1, 6, 7",
        "unit": f"(b): {_G}, constant LR minus Algorithm 1",
        "rule": "reproduced if (a) the onset - surge CI lies above 0 and (b) the CI lies above 0; not reproduced if "
        "(a) lies below 0 or (b) below log 1.25; otherwise inconclusive (also with fewer than 2 seeds having both "
        "a surge and an onset)",
        "fn": c8,
    },
    "C9": {
        "statement": "A lower learning rate gives less mismatch growth.",
        "source": "TIM-LR, Sec. 3.1, Fig. 4",
        "unit": f"{_G}, base LR minus LR / 10",
        "rule": COMMON_RULE.format(min="log 1.25"),
        "fn": c9,
    },
}


def verdicts(lab: LabData) -> list[Verdict]:
    fns: dict[str, Callable[[LabData], Verdict]] = {k: v["fn"] for k, v in CLAIMS.items()}
    return [fns[k](lab) for k in CLAIMS]
