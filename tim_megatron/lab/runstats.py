"""One run's numbers for the claims: mismatch growth, J's trend, bucket drift, collapse, surge, warnings.

Every number comes from the run's ``metrics.jsonl`` (read with :func:`tim_megatron.logging.tracker.read_metrics`):

* growth: Theil-Sen slope of log(rho_std) against step, times (steps - 1): the change of log rho_std over the
  run (0.22 = 25% growth), robust to spikes. NaN when rho_std is not positive (zero-mismatch runs);
* J trend: Pearson correlation of the surrogate J (objective-level-hacking Eq. 23) with step (its Fig. 6);
* bucket drift: over the run (Theil-Sen x (steps - 1)), the change of rho_mean of tokens with pi_train < 0.1
  minus that of tokens with pi_train >= 0.9 (Fig. 7b: the low-probability buckets drift down);
* collapse: the first step where the score falls to 70% of its best so far or lower (issue 13's "30% below its
  best"). The score is the training reward's trailing 5-step mean (5 x 64 to 5 x 128 samples; defined from the
  5th step on, so no 'best' rests on fewer steps), not validation
  accuracy: greedy accuracy on the 31 validation prompts has a sampling SD of about 0.07 at 20% accuracy, so a
  30% drop from a low best is within its noise. Validation accuracy is still drawn and tabled;
* length surge: :class:`~tim_megatron.algo.early_warning.SurgeDetector` on the mean response length, with the
  recipe defaults the run itself used;
* warnings: the first step each early-warning rule fires on rho_std, replayed over the logged values.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from tim_megatron.algo.early_warning import GrowthDetector, SurgeDetector, TrendDetector
from tim_megatron.lab.stats import pearson, theil_sen
from tim_megatron.logging.tracker import read_metrics
from tim_megatron.logging.untrusted import UnreadableFile
from tim_megatron.report.runs import read_meta


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
MISMATCH = P + "rho_std"
LOW_BUCKETS = ("0-0.01", "0.01-0.1")
HIGH_BUCKET = "0.9-1"
COLLAPSE_DROP = 0.3
REWARD_SMOOTHING = 5


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
    warnings: dict[str, int | None] = field(default_factory=dict)
    """Rule name -> first step it fires on rho_std (None: never)."""

    def row(self) -> dict:
        d = asdict(self)
        d.pop("warnings")
        d.update({f"warning_{k}": v for k, v in self.warnings.items()})
        return d


def series(rows: list[dict], key: str) -> tuple[np.ndarray, np.ndarray]:
    xs, ys = [], []
    for r in rows:
        v = r.get(key)
        if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v):
            xs.append(r["step"])
            ys.append(float(v))
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


def score_series(rows: list[dict]) -> tuple[np.ndarray, np.ndarray, str]:
    """The trailing mean from the first full window on: a shorter window (one step's reward at step 1) would
    set a 'best' from a single noisy batch, and the next full means would read as a 30% collapse."""
    x, y = series(rows, "reward/mean")
    w = REWARD_SMOOTHING
    smooth = np.array([y[i - w + 1 : i + 1].mean() for i in range(w - 1, len(y))])
    return x[w - 1 :], smooth, f"reward/mean (trailing {w}-step mean, from step {w})"


def collapse_step(x: np.ndarray, y: np.ndarray, drop: float = COLLAPSE_DROP) -> int | None:
    best = -math.inf
    for step, v in zip(x, y, strict=True):
        if best > 0 and v <= best * (1 - drop):
            return int(step)
        best = max(best, v)
    return None


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


OLD_RULE = Rule("median_ratio", "median_ratio", (("baseline_steps", 5), ("window", 5), ("threshold", 2.0)))
"""The rule runs used before issue 13 (5-step medians, 2x)."""
TREND_RULE = Rule("trend", "trend", (("baseline_steps", 10), ("k", 1.0), ("h", 8.0), ("z_cap", 3.0)))
"""The noise-aware rule with the recipe defaults."""


def run_stats(
    path: Path, *, arm: str, seed: int, rules: tuple[Rule, ...] = (OLD_RULE, TREND_RULE)
) -> RunStats:
    rows, meta = run_rows(path), run_meta(path)
    x, rho = series(rows, MISMATCH)
    pos = rho > 0
    zero = bool(len(rho)) and bool((rho == 0).all())
    slope = theil_sen(x[pos], np.log(rho[pos])) if pos.sum() >= 3 else float("nan")
    growth = slope * float(x[pos].max() - x[pos].min()) if pos.sum() >= 3 else float("nan")
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
    sx, score, metric = score_series(rows)
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
        collapse_step=collapse_step(sx, score),
        collapse_metric=metric,
        best_score=float(score.max()) if len(score) else float("nan"),
        final_score=float(score[-1]) if len(score) else float("nan"),
        reward_start=r0,
        reward_end=r1,
        length_start=n0,
        length_end=n1,
        surge_step=first_fire(SurgeDetector(), lx2, length),
        warnings={rule.name: first_fire(rule.make(), x, rho) for rule in rules},
    )
