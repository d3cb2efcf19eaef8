"""Per-run numbers the report ranks variants by.

* mismatch growth rate: the Theil-Sen slope (median of pairwise slopes, robust to spikes) of
  log(std of rho) against step, per step;
* first warning: the first step the math core's :class:`~tim_megatron.algo.early_warning.GrowthDetector`
  fires on the mismatch, replayed over the logged metrics with the given settings (so runs logged before a
  setting changed, or still running, are judged alike); the length surge likewise with ``SurgeDetector``;
* first collapse: the first step where validation accuracy (or, without validation, the reward) falls by
  ``collapse_drop`` (a fraction) below its best so far;
* best validation score, and rollout throughput (mean response tokens per second).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from tim_megatron import metric_names as names
from tim_megatron.algo.early_warning import GrowthDetector, SurgeDetector
from tim_megatron.report.runs import MISMATCH, RunData
from tim_megatron.report.settings import WarningSettings


@dataclass
class RunSummary:
    name: str
    steps: int
    growth_rate: float
    """d log(mismatch std) / d step (Theil-Sen)."""
    first_warning: int | None
    length_surge: int | None
    first_collapse: int | None
    best_val: float
    final_mismatch: float
    tokens_per_s: float
    sweep_id: str | None
    status: str

    def row(self) -> dict:
        return {
            "variant": self.name,
            "steps": self.steps,
            "mismatch_growth_per_step": self.growth_rate,
            "first_warning_step": self.first_warning,
            "length_surge_step": self.length_surge,
            "first_collapse_step": self.first_collapse,
            "best_val": self.best_val,
            "final_mismatch": self.final_mismatch,
            "tokens_per_s": self.tokens_per_s,
            "sweep_id": self.sweep_id,
            "status": self.status,
        }


def theil_sen(x: np.ndarray, y: np.ndarray, max_pairs: int = 200_000) -> float:
    """Median of pairwise slopes (NaN with fewer than two points)."""
    n = len(x)
    if n < 2:
        return float("nan")
    i, j = np.triu_indices(n, k=1)
    if len(i) > max_pairs:  # long runs: an even subsample of pairs
        keep = np.linspace(0, len(i) - 1, max_pairs).astype(int)
        i, j = i[keep], j[keep]
    dx = x[j] - x[i]
    ok = dx != 0
    return float(np.median((y[j] - y[i])[ok] / dx[ok])) if ok.any() else float("nan")


def growth_rate(run: RunData, key: str = MISMATCH) -> float:
    x, y = run.series(key)
    pos = y > 0
    return theil_sen(x[pos], np.log(y[pos]))


def first_warning(run: RunData, s: WarningSettings, key: str = MISMATCH) -> int | None:
    det = GrowthDetector(key, baseline_steps=s.baseline_steps, window=s.window, threshold=s.threshold)
    for step, v in zip(*run.series(key), strict=True):
        if det.update(int(step), v):
            return int(step)
    return None


def length_surge(run: RunData, s: WarningSettings) -> int | None:
    det = SurgeDetector(
        window=s.surge_window,
        baseline_steps=s.surge_baseline_steps,
        factor=s.surge_factor,
        within=s.surge_within,
    )
    for step, v in zip(*run.series(names.RESPONSE_LENGTH), strict=True):
        if det.update(int(step), v):
            return int(step)
    return None


def first_collapse(run: RunData, drop: float) -> int | None:
    for key in (names.VAL_ACCURACY, names.REWARD):
        x, y = run.series(key)
        if len(y) >= 2:
            best = -math.inf
            for step, v in zip(x, y, strict=True):
                if best > 0 and v <= best * (1 - drop):
                    return int(step)
                best = max(best, v)
            return None
    return None


def summarize(run: RunData, s: WarningSettings) -> RunSummary:
    _, val = run.series(names.VAL_ACCURACY)
    _, mm = run.series(MISMATCH)
    _, tps = run.series("rollout/tokens_per_s")
    return RunSummary(
        name=run.name,
        steps=int(run.rows[-1]["step"]) if run.rows else 0,
        growth_rate=growth_rate(run),
        first_warning=first_warning(run, s),
        length_surge=length_surge(run, s),
        first_collapse=first_collapse(run, s.collapse_drop),
        best_val=float(val.max()) if len(val) else float("nan"),
        final_mismatch=float(mm[-1]) if len(mm) else float("nan"),
        tokens_per_s=float(tps.mean()) if len(tps) else float("nan"),
        sweep_id=run.sweep_id,
        status=run.status,
    )


def ranked(summaries: list[RunSummary]) -> list[RunSummary]:
    """Fastest mismatch growth first; then earliest warning; NaN growth last."""

    def key(s: RunSummary):
        g = s.growth_rate
        return (0 if math.isfinite(g) else 1, -g if math.isfinite(g) else 0, s.first_warning or 10**12)

    return sorted(summaries, key=key)


def pearson(x: np.ndarray, y: np.ndarray) -> float:
    if len(x) < 2 or np.std(x) == 0 or np.std(y) == 0:
        return float("nan")
    return float(np.corrcoef(x, y)[0, 1])
