"""Early-warning rules judged on lab runs: lead time before collapse, false alarms on runs that stay stable.

A rule is replayed over each run's logged rho_std (old vs rollout). A run that collapses (:mod:`.runstats`)
is *warned* when the rule fires at or before the collapse step (lead = collapse step - firing step), *late*
when it fires after, *missed* when it never fires. A run that never collapses counts a *false alarm* when the
rule fires at all. Only runs that can fire count: a run whose rho_std is 0 at every step (exact zero mismatch)
can neither warn nor false-alarm, so it is left out of both denominators (and counted as ``excluded``).

The trend rule's parameters are tuned on the grid's ``tune_seeds`` only (every arm), by a fixed objective:
warned fraction minus false-alarm fraction, ties broken by the longer median lead, then by the more
conservative setting (larger h, larger k). The tuned rule, the recipe default and the earlier median-ratio
rule are then compared on the held-out seeds, which played no part in the choice.
"""

from __future__ import annotations

import itertools
import math
import statistics
from dataclasses import dataclass
from pathlib import Path

from tim_megatron.lab.runstats import MISMATCH, OLD_RULE, TREND_RULE, Rule, first_fire, run_rows, series
from tim_megatron.lab.stats import wilson

TUNE_GRID = {
    "baseline_steps": (5, 10),
    "k": (0.5, 1.0, 1.5),
    "h": (4.0, 6.0, 8.0, 12.0),
    "z_cap": (3.0,),
}


@dataclass
class Trace:
    """What a rule needs from one run."""

    arm: str
    seed: int
    steps: list[int]
    values: list[float]
    collapse_step: int | None
    can_warn: bool = True
    """Some logged rho_std is positive (zero-mismatch runs cannot fire a rule on it)."""


@dataclass
class Evaluation:
    rule: str
    params: str
    seeds: str
    runs: int
    excluded: int
    """Runs left out: rho_std never positive, so no rule can fire on them."""
    collapsing: int
    warned: int
    late: int
    missed: int
    median_lead: float
    stable: int
    false_alarms: int
    false_alarm_rate: float
    fa_ci_low: float
    fa_ci_high: float

    def row(self) -> dict:
        return dict(self.__dict__)


def load_traces(runs) -> list[Trace]:
    """``runs``: RunStats of completed runs."""
    out = []
    for r in runs:
        rows = run_rows(Path(r.path))
        x, y = series(rows, MISMATCH)
        out.append(
            Trace(r.arm, r.seed, [int(s) for s in x], [float(v) for v in y], r.collapse_step, r.can_warn)
        )
    return out


def evaluate(rule: Rule, traces: list[Trace], *, seeds: str) -> Evaluation:
    warned = late = missed = fa = 0
    leads = []
    able = [t for t in traces if t.can_warn]
    collapsing = [t for t in able if t.collapse_step is not None]
    stable = [t for t in able if t.collapse_step is None]
    for t in collapsing:
        f = first_fire(rule.make(), t.steps, t.values)
        if f is None:
            missed += 1
        elif f <= t.collapse_step:
            warned += 1
            leads.append(t.collapse_step - f)
        else:
            late += 1
    for t in stable:
        fa += first_fire(rule.make(), t.steps, t.values) is not None
    ci = wilson(fa, len(stable))
    return Evaluation(
        rule=rule.name,
        params=rule.describe(),
        seeds=seeds,
        runs=len(traces),
        excluded=len(traces) - len(able),
        collapsing=len(collapsing),
        warned=warned,
        late=late,
        missed=missed,
        median_lead=float(statistics.median(leads)) if leads else float("nan"),
        stable=len(stable),
        false_alarms=fa,
        false_alarm_rate=ci.mean,
        fa_ci_low=ci.low,
        fa_ci_high=ci.high,
    )


def _score(e: Evaluation, rule: Rule) -> tuple:
    warned = e.warned / e.collapsing if e.collapsing else 0.0
    fa = e.false_alarms / e.stable if e.stable else 0.0
    lead = e.median_lead if math.isfinite(e.median_lead) else -1.0
    p = dict(rule.params)
    return (warned - fa, lead, p["h"], p["k"])


def tune(traces: list[Trace], *, seeds: str) -> tuple[Rule, list[Evaluation]]:
    """The best trend rule on ``traces`` by the module's objective, and every candidate's evaluation."""
    best, best_key, evals = None, None, []
    names = list(TUNE_GRID)
    for values in itertools.product(*(TUNE_GRID[n] for n in names)):
        rule = Rule("trend-tuned", "trend", tuple(zip(names, (float(v) for v in values), strict=True)))
        e = evaluate(rule, traces, seeds=seeds)
        evals.append(e)
        key = _score(e, rule)
        if best_key is None or key > best_key:
            best, best_key = rule, key
    return best, evals


def detector_table(traces: list[Trace], tune_seeds: list[int]) -> tuple[list[Evaluation], Rule | None]:
    """Rows: each rule on the held-out seeds and on all seeds; the tuned rule (None without tuning seeds)."""
    tune_set = [t for t in traces if t.seed in tune_seeds]
    held = [t for t in traces if t.seed not in tune_seeds]
    rules = [OLD_RULE, TREND_RULE]
    tuned = None
    rows = []
    if tune_set:
        tuned, _ = tune(tune_set, seeds="tuning")
        rules.append(tuned)
        rows += [evaluate(r, tune_set, seeds=f"tuning {sorted(tune_seeds)}") for r in rules]
    held_name = f"held out {sorted({t.seed for t in held})}" if tune_set else "all (no tuning seeds)"
    rows += [evaluate(r, held, seeds=held_name) for r in rules]
    return rows, tuned
