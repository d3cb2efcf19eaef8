"""One run's numbers for the claims: mismatch growth, J's trend, bucket drift, collapse, surge, warnings.

Every number comes from the run's ``metrics.jsonl`` (read with :func:`tim_megatron.logging.tracker.read_metrics`):

* growth: Theil-Sen slope of log(rho_std) against step, times (steps - 1): the change of log rho_std over the
  run (0.22 = 25% growth), robust to spikes. NaN when rho_std is not positive (zero-mismatch runs);
* J trend: Pearson correlation of the surrogate J (objective-level-hacking Eq. 23) with step (its Fig. 6);
* bucket drift: over the run (Theil-Sen x (steps - 1)), the change of rho_mean of tokens with pi_train < 0.1
  minus that of tokens with pi_train >= 0.9 (Fig. 7b: the low-probability buckets drift down);
* collapse (persistent): the score is the training reward's trailing mean over ``window`` steps (10 unless the
  grid says otherwise; defined from the window-th step on, so no 'best' rests on fewer steps), not validation
  accuracy (greedy accuracy on the 31 validation prompts has a sampling SD of about 0.07 at 20% accuracy). The
  run collapses at the first step whose score is at most 70% of the best score so far ("30% below its best")
  and stays there, every later score included, to the end of the run, for at least ``min_steps`` steps (20 unless
  the grid says otherwise): a dip that climbs back above 70% of that best is not a collapse, and neither is a
  drop in the run's last ``min_steps - 1`` steps, which has no room to be seen persisting (censored). Without
  the minimum, flat reward series at the measured noise (SD 0.05 per step, 200 steps) were flagged in 14% of
  runs at mean 0.15 and 40% at 0.10, nearly all in the last 30 steps; with 20 steps, 0-0.8% and 3.6-5.5% (two
  simulations of 2,000 and 400 series; ``tests/test_lab.py`` checks the rate at 0.15). A drop censored so is
  recorded (``collapse_censored``) and left out of the collapse counts;
* final-window reward: the mean training reward over the last 10% of the steps (at least ``window`` steps);
* policy reward: the mean of ``val/policy_reward`` (``run.val_samples``: the trained policy sampled without the
  injection) over the run's last two evaluations, the outcome the claims about outcomes read (an injected run's
  training reward is its distorted sampler's);
* dose: the run's mean KL(pi || mu) per token (``kl_old_rollout_k3``: pi the trainer, mu the sampling
  distribution), the common scale on which injected mismatches of different kinds are compared;
* mismatch growth in TIM-LR's measure: as growth, on ``log_ppl_abs_diff_seq_sum`` (its Eq. 8 as written: the
  absolute difference of the sequences' summed log-probabilities, which also grows with the response length),
  and its onset: the first step the trend rule (recipe defaults) fires on it; the same growth on the per-token
  ``log_ppl_abs_diff_token_mean`` beside it;
* length surge: :class:`~tim_megatron.algo.early_warning.SurgeDetector` on the mean response length, built from
  the run's own recipe (``remedies.lr_schedule.surge``, read from the run folder's recipe.yaml);
* warnings: the first step each early-warning rule fires on rho_std, replayed over the logged values.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from tim_megatron.algo.early_warning import GrowthDetector, SurgeDetector, TrendDetector, surge_from_config
from tim_megatron.lab.stats import pearson, theil_sen
from tim_megatron.logging.summary import series as logged_series
from tim_megatron.logging.tracker import read_metrics
from tim_megatron.logging.untrusted import UnreadableFile
from tim_megatron.recipe import RecipeError, load_recipe
from tim_megatron.report.runs import MISMATCH, read_meta  # rho_std: what growth and the warnings read
from tim_megatron.run_dir import RECIPE_FILE
from tim_megatron.warning_defaults import MEDIAN_RATIO, TREND


def run_rows(path: Path) -> list[dict]:
    """The metrics rows of run folder ``path``; none if its metrics.jsonl is missing or unreadable (a FIFO, a
    link to a device, over the size limit): such a run counts as having no steps."""
    try:
        return read_metrics(path / "metrics.jsonl") if (path / "metrics.jsonl").exists() else []
    except UnreadableFile:
        return []


def run_meta(path: Path) -> dict:
    """The run.json of run folder ``path`` (read bounded, regular files only); empty if missing or unreadable."""
    return read_meta(path, notices=[])


P = "mismatch/old_vs_rollout/"
PPL_DIFF = P + "log_ppl_abs_diff_seq_sum"
"""TIM-LR's mismatch (Eq. 8 as written, summed over each sequence), read by its claims C8 and C9."""
PPL_DIFF_TOKEN = P + "log_ppl_abs_diff_token_mean"
"""The same per token (the mean over a sequence instead of the sum), reported beside it."""
DOSE = P + "kl_old_rollout_k3"
"""KL(pi || mu) per token: the dose of an injected mismatch on a scale common to every kind."""
LOW_BUCKETS = ("0-0.01", "0.01-0.1")
HIGH_BUCKET = "0.9-1"
COLLAPSE_DROP = 0.3
COLLAPSE_WINDOW = 10
"""Steps in the reward mean the persistent-collapse rule reads (a grid may set its own: ``collapse_window``)."""
COLLAPSE_MIN_STEPS = 20
"""Steps a collapse must last, to the end of the run (a grid may set its own: ``collapse_min_steps``)."""
FINAL_FRACTION = 0.1
"""The final window: this share of the run's steps (at least the collapse window)."""


@dataclass
class RunStats:
    arm: str
    seed: int
    path: str
    status: str
    steps: int
    wall_seconds: float | None
    slope: float
    """Theil-Sen slope of log(rho_std) per step."""
    growth: float
    """slope x (last step - first step): the change of log(rho_std) over the run."""
    rho_std_start: float
    rho_std_end: float
    zero_mismatch: bool
    j_step_pcc: float
    bucket_drift: float
    collapse_step: int | None
    collapse_metric: str
    best_score: float
    final_score: float
    reward_start: float
    reward_end: float
    length_start: float
    length_end: float
    surge_step: int | None
    final_reward: float = float("nan")
    """Mean training reward over the last 10% of the steps."""
    dose: float = float("nan")
    """Mean KL(pi || mu) per token over the run (0 with zero mismatch)."""
    policy_reward: float = float("nan")
    """Mean val/policy_reward over the run's last two evaluations (NaN: fewer than two logged)."""
    collapse_censored: bool = False
    """A lasting drop started within the run's last ``min_steps - 1`` steps: neither collapsed nor stable."""
    policy_reward_start: float = float("nan")
    """val/policy_reward_start: the untrained policy's reward, before step 1 (NaN: not logged)."""
    ppl_growth: float = float("nan")
    """Change of log(log_ppl_abs_diff_seq_sum) over the run (TIM-LR's Eq. 8 as written)."""
    ppl_onset: int | None = None
    """First step the trend rule fires on log_ppl_abs_diff_seq_sum (None: never)."""
    ppl_growth_token: float = float("nan")
    """Change of log(log_ppl_abs_diff_token_mean) over the run (Eq. 8 per token, reported beside)."""
    can_warn: bool = True
    """The run logs a positive rho_std (a zero-mismatch run cannot fire a rule on it)."""
    warnings: dict[str, int | None] = field(default_factory=dict)
    """Rule name -> first step it fires on rho_std (None: never)."""

    def row(self) -> dict:
        d = asdict(self)
        d.pop("warnings")
        d.update({f"warning_{k}": v for k, v in self.warnings.items()})
        return d


def series(rows: list[dict], key: str) -> tuple[np.ndarray, np.ndarray]:
    """:func:`tim_megatron.logging.summary.series` as float arrays."""
    xs, ys = logged_series(rows, key)
    return np.array(xs, dtype=float), np.array(ys, dtype=float)


def over_run(x: np.ndarray, y: np.ndarray) -> float:
    """Theil-Sen slope times the run's span in steps: the change over the run."""
    if len(x) < 3:
        return float("nan")
    return theil_sen(x, y) * float(x.max() - x.min())


def _ends(y: np.ndarray) -> tuple[float, float]:
    if not len(y):
        return float("nan"), float("nan")
    k = max(1, len(y) // 5)
    return float(y[:k].mean()), float(y[-k:].mean())


def pooled_bucket(rows: list[dict], names: tuple[str, ...]) -> tuple[np.ndarray, np.ndarray]:
    """rho_mean of the union of buckets, per step, weighted by their token counts."""
    xs, ys = [], []
    for r in rows:
        n = sum(r.get(f"{P}bucket/{b}/count") or 0 for b in names)
        if n <= 0:
            continue
        s = sum(
            (r.get(f"{P}bucket/{b}/rho_mean") or 0.0) * (r.get(f"{P}bucket/{b}/count") or 0) for b in names
        )
        xs.append(r["step"])
        ys.append(s / n)
    return np.array(xs, dtype=float), np.array(ys, dtype=float)


def score_series(rows: list[dict], window: int = COLLAPSE_WINDOW) -> tuple[np.ndarray, np.ndarray, str]:
    """The trailing mean from the first full window on: a shorter window (one step's reward at step 1) would
    set a 'best' from a single noisy batch, and the next full means would read as a 30% collapse."""
    x, y = series(rows, "reward/mean")
    w = window
    smooth = np.array([y[i - w + 1 : i + 1].mean() for i in range(w - 1, len(y))])
    return x[w - 1 :], smooth, f"reward/mean (trailing {w}-step mean, from step {w})"


def collapse_step(
    x: np.ndarray, y: np.ndarray, drop: float = COLLAPSE_DROP, *, min_steps: int = COLLAPSE_MIN_STEPS
) -> int | None:
    """The first step whose score is at most (1 - drop) x the best score so far and stays so to the end of the
    run, at least ``min_steps`` steps from it to the last one (both counted); None when every drop recovers, when
    the only lasting one starts too late to be seen persisting, or when there is none."""
    y = np.asarray(y, dtype=float)
    if not len(y):
        return None
    best = np.maximum.accumulate(y)
    # the largest score from each step to the end: a drop persists when that stays below the threshold
    tail_max = np.maximum.accumulate(y[::-1])[::-1]
    for i in range(len(y)):
        limit = best[i] * (1 - drop)
        if x[-1] - x[i] + 1 < min_steps:
            return None  # censored: later drops have even less room
        if best[i] > 0 and tail_max[i] <= limit:
            return int(x[i])
    return None


def censored_drop(
    x: np.ndarray, y: np.ndarray, drop: float = COLLAPSE_DROP, *, min_steps: int = COLLAPSE_MIN_STEPS
) -> bool:
    """A drop that lasts to the end of the run but starts too late for ``min_steps``: the run can be judged
    neither collapsed nor stable (claims leave it out of their counts and say so)."""
    return (
        collapse_step(x, y, drop, min_steps=min_steps) is None
        and collapse_step(x, y, drop, min_steps=1) is not None
    )


def final_window(rows: list[dict], window: int = COLLAPSE_WINDOW) -> float:
    """Mean training reward over the last 10% of the logged steps (at least ``window`` steps)."""
    _, y = series(rows, "reward/mean")
    if not len(y):
        return float("nan")
    k = min(len(y), max(window, round(FINAL_FRACTION * len(y))))
    return float(y[-k:].mean())


POLICY_EVALS = 2
"""Evaluations the policy outcome averages: the run's last ones."""


def policy_outcome(rows: list[dict], evals: int = POLICY_EVALS) -> float:
    """Mean ``val/policy_reward`` over the last ``evals`` evaluations (NaN when the run logged fewer)."""
    _, y = series(rows, "val/policy_reward")
    return float(y[-evals:].mean()) if len(y) >= evals else float("nan")


def surge_detector(path: Path) -> SurgeDetector:
    """The length-surge detector of the run's own recipe (its recipe.yaml); the defaults if that cannot be read."""
    try:
        return surge_from_config(load_recipe(path / RECIPE_FILE, []).recipe.remedies.lr_schedule.surge)
    except (OSError, RecipeError):
        return SurgeDetector()


def first_fire(detector, x: np.ndarray, y: np.ndarray) -> int | None:
    for step, v in zip(x, y, strict=True):
        if detector.update(int(step), float(v)):
            return int(step)
    return None


@dataclass(frozen=True)
class Rule:
    """An early-warning rule, as replayed over a run's logged values."""

    name: str
    kind: str
    """trend or median_ratio."""
    params: tuple[tuple[str, float], ...]

    def make(self, metric: str = MISMATCH):
        p = dict(self.params)
        if self.kind == "trend":
            return TrendDetector(
                metric, baseline_steps=int(p["baseline_steps"]), k=p["k"], h=p["h"], z_cap=p["z_cap"]
            )
        return GrowthDetector(
            metric, baseline_steps=int(p["baseline_steps"]), window=int(p["window"]), threshold=p["threshold"]
        )

    def describe(self) -> str:
        return f"{self.kind}(" + ", ".join(f"{k}={v:g}" for k, v in self.params) + ")"


OLD_RULE = Rule(
    "median_ratio",
    "median_ratio",
    tuple((k, getattr(MEDIAN_RATIO, k)) for k in ("baseline_steps", "window", "threshold")),
)
"""The median-ratio rule at its detector's defaults (5-step medians, 2x): the rule runs used before the trend rule."""
TREND_RULE = Rule(
    "trend", "trend", tuple((k, getattr(TREND, k)) for k in ("baseline_steps", "k", "h", "z_cap"))
)
"""The noise-aware rule at its detector's defaults, which are the recipe's (``diagnostics.early_warning``)."""


def log_growth(x: np.ndarray, v: np.ndarray) -> tuple[float, float]:
    """(Theil-Sen slope of log v per step, its change over the run) over the positive values; NaN with < 3."""
    pos = v > 0
    if pos.sum() < 3:
        return float("nan"), float("nan")
    slope = theil_sen(x[pos], np.log(v[pos]))
    return slope, slope * float(x[pos].max() - x[pos].min())


def run_stats(
    path: Path,
    *,
    arm: str,
    seed: int,
    rules: tuple[Rule, ...] = (OLD_RULE, TREND_RULE),
    window: int = COLLAPSE_WINDOW,
    min_steps: int = COLLAPSE_MIN_STEPS,
) -> RunStats:
    rows, meta = run_rows(path), run_meta(path)
    x, rho = series(rows, MISMATCH)
    zero = bool(len(rho)) and bool((rho == 0).all())
    slope, growth = log_growth(x, rho)
    px, ppl = series(rows, PPL_DIFF)
    _, ppl_growth = log_growth(px, ppl)
    _, ppl_growth_token = log_growth(*series(rows, PPL_DIFF_TOKEN))
    _, dose = series(rows, DOSE)
    xj, j = series(rows, "objective/J")
    lx, low = pooled_bucket(rows, LOW_BUCKETS)
    hx, high = pooled_bucket(rows, (HIGH_BUCKET,))
    common = sorted(set(lx.tolist()) & set(hx.tolist()))
    lo_by, hi_by = (
        dict(zip(lx.tolist(), low.tolist(), strict=True)),
        dict(zip(hx.tolist(), high.tolist(), strict=True)),
    )
    drift = (
        over_run(np.array(common), np.array([lo_by[s] - hi_by[s] for s in common]))
        if common
        else float("nan")
    )
    sx, score, metric = score_series(rows, window)
    _, reward = series(rows, "reward/mean")
    lx2, length = series(rows, "response/length_mean")
    r0, r1 = _ends(reward)
    m0, m1 = _ends(rho)
    n0, n1 = _ends(length)
    return RunStats(
        arm=arm,
        seed=seed,
        path=str(path),
        status=str(meta.get("status", "missing")),
        steps=int(rows[-1]["step"]) if rows else 0,
        wall_seconds=meta.get("wall_seconds"),
        slope=slope,
        growth=growth,
        rho_std_start=m0,
        rho_std_end=m1,
        zero_mismatch=zero,
        j_step_pcc=pearson(xj, j),
        bucket_drift=drift,
        collapse_step=collapse_step(sx, score, min_steps=min_steps),
        collapse_censored=censored_drop(sx, score, min_steps=min_steps),
        collapse_metric=metric,
        best_score=float(score.max()) if len(score) else float("nan"),
        final_score=float(score[-1]) if len(score) else float("nan"),
        reward_start=r0,
        reward_end=r1,
        length_start=n0,
        length_end=n1,
        surge_step=first_fire(surge_detector(path), lx2, length),
        final_reward=final_window(rows, window),
        policy_reward=policy_outcome(rows),
        policy_reward_start=next(
            (float(r["val/policy_reward_start"]) for r in rows if "val/policy_reward_start" in r),
            float("nan"),
        ),
        dose=float(dose.mean()) if len(dose) else float("nan"),
        ppl_growth=ppl_growth,
        ppl_onset=first_fire(TREND_RULE.make(PPL_DIFF), px, ppl),
        ppl_growth_token=ppl_growth_token,
        can_warn=bool((rho > 0).any()),
        warnings={rule.name: first_fire(rule.make(), x, rho) for rule in rules},
    )
