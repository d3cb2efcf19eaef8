"""The papers' claims C1..C9, each decided by a rule stated here (a report says, from git, whether this code was
last changed before its grid's first run: :mod:`tim_megatron.lab.provenance`).

Every claim names the arms it reads (by the arm names of ``lab/*.yaml``) and an effect oriented so that a
positive value supports it, computed per seed and summarized by a 95% t interval across seeds (paired by
seed when two arms are compared: the same seed means the same initial weights, prompts and sampling seeds).
Each claim that can be tested gets a one-sided p-value (its test is named in its rule), and the p-values of the
claims tested in one report are adjusted together with Holm's method (:func:`verdicts`). The common rule
(:func:`decide`), unless a claim states its own:

* **reproduced**: the Holm-adjusted one-sided p is at most ``ALPHA`` = 0.025 (with a single claim tested: the
  95% CI lies above 0);
* **not reproduced**: the interval lies below the smallest effect that would matter (``min_effect``), i.e.
  the data rule out an effect of that size in the claim's direction;
* **inconclusive**: anything else, fewer than 2 seeds, or an arm that did not run (named in the row).

Precedence: the smallest effect of interest first. A claim whose interval lies below it is not reproduced
whatever its p-value (a significant but smaller effect is not the effect the paper claims); only then does the
Holm-adjusted p decide between reproduced and inconclusive. "Not reproduced" therefore always rests on an interval
that excludes the smallest effect of interest (:func:`decide`), never on a point estimate.

Growth is the change of log(rho_std) over the run (:mod:`.runstats`), or of log(log_ppl_abs_diff) for TIM-LR's
claims C8 and C9 (its Eq. 8); its ``min_effect`` is log(1.25), 25% more growth over the run. C1 and C2
(VeXact) compare outcomes against the matched zero-mismatch control (the ``exact`` arm): persistent collapses
of the training reward (C1), and the trained policy's reward, sampled without the injection (C2, :data:`OUTCOME`;
an injected arm's training reward is its distorted sampler's), with the training reward reported beside it. Nothing here is tuned to the results: the thresholds are the papers' (30%
collapse) or round numbers stated with the rule.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from tim_megatron.lab.grid import ArmPlan, Grid
from tim_megatron.lab.runstats import RunStats
from tim_megatron.lab.stats import (
    NAN,
    Interval,
    fisher_fewer,
    holm,
    mean_ci,
    paired_ci,
    rate_difference,
    t_test_greater,
)

REPRODUCED, NOT_REPRODUCED, INCONCLUSIVE = "reproduced", "not reproduced", "inconclusive"
GROWTH_MIN = math.log(1.25)
"""Smallest growth difference that matters: 25% more growth of the mismatch over the run."""
PCC_MIN = 0.3
"""Smallest correlation of J with step that counts as 'rises'."""
DRIFT_MIN = 0.01
"""Smallest relative drift of the low-probability buckets' rho_mean over the run (1%)."""
DEFICIT_MIN = 0.05
"""Smallest final-window reward deficit at the highest dose that counts (C2): 5 points of reward."""
COLLAPSE_RATE_MIN = 0.25
"""Smallest rise of the persistent-collapse rate with mismatch that counts (C1): 25 points."""
ALPHA = 0.025
"""Family-wise level of the one-sided tests, after Holm's adjustment across the claims tested in one report."""
OUTCOME = "policy_reward"
"""What the claims about outcomes read: the trained policy's reward, sampled without the injection."""
CONTROL = "exact"
"""The zero-mismatch control of C1 and C2: the arm that samples from the trainer's own forward."""

COMMON_RULE = (
    "one-sided t test of effect > 0 across seeds: not reproduced if the 95% CI lies below {min} (the smallest "
    "effect that would count; this comes first, whatever p); else reproduced if its Holm-adjusted p <= 0.025; "
    "otherwise inconclusive"
)


@dataclass
class ClaimVerdict:
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
    p_value: float = float("nan")
    """One-sided p of the claim's test (NaN: no test: an arm did not run, too few seeds, or no contrast)."""
    p_holm: float = float("nan")
    """``p_value`` after Holm's adjustment across the claims tested in the same report."""
    can_reproduce: bool = field(default=True, repr=False)
    """False when a condition of the rule other than the test fails (C3: the unbiased arm grows as well)."""

    def row(self) -> dict:
        d = asdict(self)
        d.pop("can_reproduce")
        return d


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
    """The common rule before the test: (not reproduced or inconclusive, why). :func:`verdicts` makes it
    reproduced when the claim's Holm-adjusted p is at most ``ALPHA``."""
    if iv.n < 2:
        return INCONCLUSIVE, f"{iv.n} seed(s) with a value: no interval"
    if iv.high < min_effect:
        return NOT_REPRODUCED, f"CI below {min_effect:.3g}"
    return INCONCLUSIVE, f"CI reaches {min_effect:.3g}"


def _verdict(
    claim: str,
    spec: dict,
    iv: Interval,
    verdict: str,
    detail: str,
    arms: list[str],
    *,
    p: float = float("nan"),
    can_reproduce: bool = True,
) -> ClaimVerdict:
    return ClaimVerdict(
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
        p_value=p,
        can_reproduce=can_reproduce,
    )


def _not_run(claim: str, spec: dict, lab: LabData, arms: list[str]) -> ClaimVerdict | None:
    miss = lab.missing(arms)
    if not miss:
        return None
    return _verdict(claim, spec, NAN, INCONCLUSIVE, "; ".join(miss), arms)


def _diffs(a: dict[int, float], b: dict[int, float]) -> dict[int, float]:
    return {s: a[s] - b[s] for s in set(a) & set(b) if math.isfinite(a[s]) and math.isfinite(b[s])}


def _growth_gap(
    claim: str, spec: dict, lab: LabData, more: str, less: str, extra: str = "", *, key: str = "growth"
) -> ClaimVerdict:
    """Effect = growth(more) - growth(less), paired by seed, common rule with GROWTH_MIN."""
    arms = [more, less]
    nr = _not_run(claim, spec, lab, arms)
    if nr:
        return nr
    diffs = list(_diffs(lab.values(more, key), lab.values(less, key)).values())
    iv = mean_ci(diffs)
    verdict, why = decide(iv, min_effect=GROWTH_MIN)
    g = {x: mean_ci(list(lab.values(x, key).values())) for x in arms}
    detail = f"{why}; growth {more} {g[more].as_text()}, {less} {g[less].as_text()}" + extra
    return _verdict(claim, spec, iv, verdict, detail, arms, p=t_test_greater(diffs))


def _growth_of(lab: LabData, arm: str, key: str = "growth") -> str:
    if not lab.runs.get(arm):
        return f"{arm}: " + ("; ".join(lab.missing([arm])) or "no runs")
    return f"{arm}: growth {mean_ci(list(lab.values(arm, key).values())).as_text()}"


def _collapses(lab: LabData, arm: str) -> tuple[int, int]:
    """(collapsed runs, judged runs) of ``arm``: a run whose lasting drop started too late to be judged
    (censored) is in neither count."""
    runs = [r for r in lab.runs.get(arm, {}).values() if not r.collapse_censored]
    return sum(r.collapse_step is not None for r in runs), len(runs)


def _censored(lab: LabData, arms: list[str]) -> str:
    n = sum(r.collapse_censored for a in arms for r in lab.runs.get(a, {}).values())
    return f"; {n} run(s) left out as censored (a lasting drop too late to judge)" if n else ""


def dose_groups(lab: LabData) -> dict[str, list[str]]:
    """Arms with a group and a dose, by group, lowest dose first (the injected arms of C1 and C2)."""
    groups: dict[str, list[tuple[float, str]]] = {}
    for name, p in lab.plans.items():
        if p.arm.group and p.arm.dose is not None:
            groups.setdefault(p.arm.group, []).append((p.arm.dose, name))
    return {g: [n for _, n in sorted(v)] for g, v in sorted(groups.items())}


def injected_arms(lab: LabData) -> list[str]:
    """The arms with a controlled mismatch put back in: every arm of a dose series."""
    return [a for names in dose_groups(lab).values() for a in names]


# ------------------------------------------------------------------------------------------- the claims


def c1(lab: LabData) -> ClaimVerdict:
    spec = CLAIMS["C1"]
    injected = injected_arms(lab)
    arms = [CONTROL, *injected]
    nr = _not_run("C1", spec, lab, [CONTROL])
    if nr:
        return nr
    if not injected:
        return _verdict(
            "C1", spec, NAN, INCONCLUSIVE, "no injected arm in this grid: nothing to contrast", arms
        )
    ran = [a for a in injected if lab.runs.get(a)]
    k_e, n_e = _collapses(lab, CONTROL)
    k_m = sum(_collapses(lab, a)[0] for a in ran)
    n_m = sum(_collapses(lab, a)[1] for a in ran)
    iv = rate_difference(k_m, n_m, k_e, n_e)

    def gap(key: str) -> str:
        per_seed: dict[int, list[float]] = {}
        for a in ran:
            for seed, v in lab.values(a, key).items():
                per_seed.setdefault(seed, []).append(v)
        return paired_ci(
            lab.values(CONTROL, key), {s: sum(v) / len(v) for s, v in per_seed.items()}
        ).as_text()

    context = (
        f"{k_e} of {n_e} exact run(s) and {k_m} of {n_m} injected run(s) collapsed persistently; exact minus "
        f"injected: policy reward {gap(OUTCOME)}, final-window training reward {gap('final_reward')}"
    )
    context += _censored(lab, [CONTROL, *ran])
    context += "".join(f"; {m}" for m in lab.missing(injected))
    nonzero = [s for s, r in lab.runs[CONTROL].items() if not r.zero_mismatch]
    if nonzero:
        why = f"exact seed(s) {sorted(nonzero)} logged a rho_std > 0 or none at all: not a zero-mismatch control"
        return _verdict("C1", spec, iv, INCONCLUSIVE, f"{why}; {context}", arms)
    if n_e < 2 or n_m < 1:
        return _verdict("C1", spec, iv, INCONCLUSIVE, f"too few completed runs; {context}", arms)
    if k_m == 0:
        why = "no contrast: no run with mismatch collapsed either, so stability without it shows nothing"
        return _verdict("C1", spec, iv, INCONCLUSIVE, f"{why}; {context}", arms)
    verdict, why = decide(iv, min_effect=COLLAPSE_RATE_MIN)
    return _verdict("C1", spec, iv, verdict, f"{why}; {context}", arms, p=fisher_fewer(k_e, n_e, k_m, n_m))


def c2(lab: LabData) -> ClaimVerdict:
    spec = CLAIMS["C2"]
    injected = injected_arms(lab)
    arms = [CONTROL, *injected]
    if not injected:
        return _verdict(
            "C2", spec, NAN, INCONCLUSIVE, "no dose series (arms with group and dose) in this grid", []
        )
    nr = _not_run("C2", spec, lab, [CONTROL])
    if nr:
        return nr
    ran = [a for a in injected if lab.runs.get(a)]
    control = lab.values(CONTROL, OUTCOME)

    def both(arm: str) -> str:
        policy = mean_ci(list(lab.values(arm, OUTCOME).values())).as_text("{:.3f}")
        training = mean_ci(list(lab.values(arm, "final_reward").values())).as_text("{:.3f}")
        return f"policy reward {policy} (training reward {training})"

    mean_dose = {a: mean_ci(list(lab.values(a, "dose").values())).mean for a in ran}
    notes = [f"{CONTROL}: {both(CONTROL)}"]
    for a in ran:
        k, n = _collapses(lab, a)
        notes.append(f"{a}: dose {mean_dose[a]:.3g}, {both(a)}, collapsed {k}/{n}")
    notes.append(_manipulation_check(lab, [CONTROL, *ran]))
    if not any(math.isfinite(v) for v in control.values()):
        why = "no policy evaluation in the control's runs (run.val_samples = 0): the outcome is not measured"
        return _verdict("C2", spec, NAN, INCONCLUSIVE, f"{why}; " + "; ".join(notes), arms)
    notes += lab.missing(injected)
    doses = [d for d in mean_dose.values() if math.isfinite(d) and d > 0]
    if not doses:
        return _verdict(
            "C2", spec, NAN, INCONCLUSIVE, "no injected run with a dose; " + "; ".join(notes), arms
        )
    d_max = max(doses)
    effects = []
    for seed, base in control.items():
        pts = []
        for a in ran:
            r = lab.runs[a].get(seed)
            if r is not None and math.isfinite(r.dose) and r.dose > 0 and math.isfinite(r.policy_reward):
                pts.append((r.dose, base - r.policy_reward))
        if pts and math.isfinite(base):
            effects.append(d_max * sum(d * y for d, y in pts) / sum(d * d for d, _ in pts))
    iv = mean_ci(effects)
    verdict, why = decide(iv, min_effect=DEFICIT_MIN)
    detail = f"{why}; highest arm-mean dose {d_max:.3g} nats per token; " + "; ".join(notes)
    return _verdict("C2", spec, iv, verdict, detail, arms, p=t_test_greater(effects))


def _manipulation_check(lab: LabData, arms: list[str]) -> str:
    """Whether the untrained policy's reward (before step 1) is the same in every arm, seed by seed: the arms of a
    seed start from the same weights, and the policy evaluation never sees the injection."""
    starts: dict[int, list[float]] = {}
    for a in arms:
        for seed, v in lab.values(a, "policy_reward_start").items():
            if math.isfinite(v):
                starts.setdefault(seed, []).append(v)
    if not starts:
        return "manipulation check: no start-of-run policy evaluation logged"
    whole = {s: v for s, v in starts.items() if len(v) == len(arms)}  # a seed logged by every arm
    same = sorted(s for s, v in whole.items() if len(set(v)) == 1)
    differ = sorted(s for s, v in whole.items() if len(set(v)) > 1)
    text = f"manipulation check: the untrained policy's reward is the same in every arm for seed(s) {same or 'none'}"
    text += f", differs for seed(s) {differ}" if differ else ""
    partial = sorted(set(starts) - set(whole))
    return text + (f"; seed(s) {partial} not logged by every arm" if partial else "")


def c3(lab: LabData) -> ClaimVerdict:
    spec = CLAIMS["C3"]
    arms = ["objective-delta", "objective-sigma", "gspo"]
    nr = _not_run("C3", spec, lab, arms)
    if nr:
        return nr
    d1 = _diffs(lab.values("objective-delta", "growth"), lab.values("gspo", "growth"))
    d2 = _diffs(lab.values("objective-sigma", "growth"), lab.values("gspo", "growth"))
    e1, e2 = mean_ci(list(d1.values())), mean_ci(list(d2.values()))
    sigma_grows = e2.n >= 2 and e2.low > 0
    # sigma growing at least as much as delta, on an interval: delta - sigma paired by seed, wholly at or below 0
    e3 = mean_ci(
        list(
            _diffs(lab.values("objective-delta", "growth"), lab.values("objective-sigma", "growth")).values()
        )
    )
    if min(e1.n, e2.n) < 2:
        verdict = INCONCLUSIVE
    elif e1.high < GROWTH_MIN or (sigma_grows and e3.n >= 2 and e3.high <= 0):
        verdict = NOT_REPRODUCED
    else:
        verdict = INCONCLUSIVE
    detail = (
        f"delta - gspo {e1.as_text()}; sigma - gspo {e2.as_text()}; delta - sigma {e3.as_text()} (growth of log "
        "rho_std over the run)"
    )
    return _verdict(
        "C3",
        spec,
        e1,
        verdict,
        detail,
        arms,
        p=t_test_greater(list(d1.values())),
        can_reproduce=not sigma_grows,
    )


def c4(lab: LabData) -> ClaimVerdict:
    spec = CLAIMS["C4"]
    arms = ["objective-delta"]
    nr = _not_run("C4", spec, lab, arms)
    if nr:
        return nr
    values = list(lab.values("objective-delta", "j_step_pcc").values())
    iv = mean_ci(values)
    verdict, why = decide(iv, min_effect=PCC_MIN)
    base = mean_ci(list(lab.values("gspo", "j_step_pcc").values()))
    detail = f"{why}; gspo (no distortion): PCC {base.as_text()}"
    return _verdict("C4", spec, iv, verdict, detail, arms, p=t_test_greater(values))


def c5(lab: LabData) -> ClaimVerdict:
    spec = CLAIMS["C5"]
    arms = ["baseline"]
    nr = _not_run("C5", spec, lab, arms)
    if nr:
        return nr
    values = [-v for v in lab.values("baseline", "bucket_drift").values()]
    iv = mean_ci(values)
    verdict, why = decide(iv, min_effect=DRIFT_MIN)
    return _verdict("C5", spec, iv, verdict, why, arms, p=t_test_greater(values))


def c6(lab: LabData) -> ClaimVerdict:
    return _growth_gap("C6", CLAIMS["C6"], lab, "clip-0.2", "clip-0.28")


def c7(lab: LabData) -> ClaimVerdict:
    return _growth_gap("C7", CLAIMS["C7"], lab, "baseline", "tis")


def c8(lab: LabData) -> ClaimVerdict:
    spec = CLAIMS["C8"]
    arms = ["baseline", "length-decay"]
    nr = _not_run("C8", spec, lab, ["baseline"])
    if nr:
        return nr
    leads, no_surge, no_onset = [], 0, 0
    for r in lab.runs["baseline"].values():
        if r.surge_step is None:
            no_surge += 1
        elif r.ppl_onset is None:
            no_onset += 1
        else:
            leads.append(float(r.ppl_onset - r.surge_step))
    a = mean_ci(leads)
    surges = sorted(r.surge_step for r in lab.runs["baseline"].values() if r.surge_step is not None)
    detail = (
        f"(a) onset of log_ppl_abs_diff growth minus length-surge step, baseline: {a.as_text('{:+.1f}')} steps "
        f"over runs with both ({no_surge} run(s) without a surge, {no_onset} with a surge but no onset; surge "
        f"steps {surges or 'none'})"
    )
    missing = lab.missing(["length-decay"])
    if missing:
        return _verdict("C8", spec, NAN, INCONCLUSIVE, f"{detail}; (b) " + "; ".join(missing), arms)
    db = _diffs(lab.values("baseline", "ppl_growth"), lab.values("length-decay", "ppl_growth"))
    b = mean_ci(list(db.values()))
    detail += f"; (b) growth of log_ppl_abs_diff_seq_sum, baseline - length-decay: {b.as_text()}"
    detail += "; " + _per_token(lab, "baseline", "length-decay")
    if a.n < 2 or b.n < 2:
        return _verdict(
            "C8", spec, b, INCONCLUSIVE, f"too few runs with both a surge and an onset; {detail}", arms
        )
    verdict = NOT_REPRODUCED if a.high < 0 or b.high < GROWTH_MIN else INCONCLUSIVE
    p = max(t_test_greater(leads), t_test_greater(list(db.values())))  # both parts must hold
    return _verdict("C8", spec, b, verdict, detail, arms, p=p)


def _per_token(lab: LabData, more: str, less: str) -> str:
    """The same gap on Eq. 8 per token (the mean over each sequence), reported beside the sequence sum."""
    d = mean_ci(
        list(_diffs(lab.values(more, "ppl_growth_token"), lab.values(less, "ppl_growth_token")).values())
    )
    return f"per token (log_ppl_abs_diff_token_mean), {more} - {less}: {d.as_text()}"


def c9(lab: LabData) -> ClaimVerdict:
    extra = "; " + _growth_of(lab, "lr-high", "ppl_growth") if "lr-high" in lab.plans else ""
    extra += "; " + _per_token(lab, "baseline", "lr-low")
    return _growth_gap("C9", CLAIMS["C9"], lab, "baseline", "lr-low", extra, key="ppl_growth")


_G = "growth of log rho_std over the run"
_P = "growth of log(log_ppl_abs_diff_seq_sum) over the run (TIM-LR Eq. 8 as written, summed over each sequence)"
CLAIMS: dict[str, dict] = {
    "C1": {
        "statement": "Zero mismatch stays stable: with rho = 1 exactly, training does not collapse where the same "
        "runs with mismatch do.",
        "source": "VeXact (arXiv 2605.14220), abstract",
        "unit": "persistent-collapse rate, injected arms pooled minus exact (Newcombe 95% CI)",
        "rule": "against the matched zero-mismatch control: Fisher's exact test, one-sided (more collapses with "
        "mismatch); inconclusive if an exact seed logs rho_std > 0 or no injected run collapsed (no contrast); "
        f"not reproduced if the 95% CI of the rate difference lies below {COLLAPSE_RATE_MIN} (this comes first, "
        "whatever p); else reproduced if the Holm-adjusted p <= 0.025; otherwise inconclusive. Collapse: the "
        "grid's trailing mean reward at or below 70% of its best so far, there to the end of the run for at least "
        "the grid's minimum number of steps",
        "fn": c1,
    },
    "C2": {
        "statement": "Injected TIM degrades or collapses training, more so at a larger dose.",
        "source": "VeXact (arXiv 2605.14220), abstract; issue 13 item 2",
        "unit": "policy reward deficit against exact (val/policy_reward, the last two evaluations), fitted through "
        "the origin against the dose (KL(pi || mu) per token) and read at the highest arm-mean dose",
        "rule": COMMON_RULE.format(min=DEFICIT_MIN) + " (a persistent collapse lasts to the final window)",
        "fn": c2,
    },
    "C3": {
        "statement": "A biased token-weight distortion (delta = 2 below pi_low = 0.1) grows the mismatch; unbiased "
        "weight noise (sigma = 0.2) does not.",
        "source": "objective-level hacking (arXiv 2602.01103), Sec. 4.4 and 5.1, Fig. 5 vs Fig. 12, Eq. 17-22",
        "unit": f"{_G}, delta arm minus GSPO",
        "rule": "one-sided t test of delta - gspo > 0: reproduced if its Holm-adjusted p <= 0.025 and CI(sigma - "
        "gspo) does not lie above 0; not reproduced if CI(delta - gspo) lies below log 1.25, or sigma grows "
        "significantly (CI(sigma - gspo) above 0) and at least as much as delta (CI(delta - sigma) at or below 0); "
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
        "unit": f"{_G}, clip 0.2 minus clip 0.28 (arms clip-0.2 and clip-0.28, off-policy minibatches so that "
        "the clip acts)",
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
        "unit": f"(b): {_P}, constant LR minus Algorithm 1",
        "rule": "surge: the mean length doubles within 10 steps (the run's own surge settings); onset: the trend "
        "rule on log_ppl_abs_diff_seq_sum. One-sided t tests of (a) onset - surge > 0 and (b) > 0, p = the "
        "larger: reproduced if its Holm-adjusted value <= 0.025; not reproduced if (a)'s CI lies below 0 or (b)'s "
        "below log 1.25; otherwise inconclusive (also with fewer than 2 runs having both a surge and an onset)",
        "fn": c8,
    },
    "C9": {
        "statement": "A lower learning rate gives less mismatch growth.",
        "source": "TIM-LR, Sec. 3.1, Fig. 4",
        "unit": f"{_P}, base LR minus the lower LR",
        "rule": COMMON_RULE.format(min="log 1.25"),
        "fn": c9,
    },
}


def verdicts(lab: LabData) -> list[ClaimVerdict]:
    """Every claim's verdict; the claims with a test are adjusted together (Holm) and reproduced when the
    adjusted p is at most ALPHA and nothing else in their rule fails."""
    fns: dict[str, Callable[[LabData], ClaimVerdict]] = {k: v["fn"] for k, v in CLAIMS.items()}
    out = [fns[k](lab) for k in CLAIMS]
    tested = sum(math.isfinite(v.p_value) for v in out)
    for v, adjusted in zip(out, holm([v.p_value for v in out]), strict=True):
        v.p_holm = adjusted
        if not math.isfinite(adjusted):
            continue
        if adjusted <= ALPHA and v.can_reproduce and v.verdict != NOT_REPRODUCED:  # the minimum effect first
            v.verdict = REPRODUCED
        v.detail = (
            f"p = {v.p_value:.3g}, Holm-adjusted over {tested} tested claim(s) {adjusted:.3g}; {v.detail}"
        )
    return out
