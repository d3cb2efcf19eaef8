"""Early-warning detectors: persistent growth of a mismatch metric, and response-length surges.

All are small state machines fed one value per step; their state is plain data for checkpoints.

* :class:`TrendDetector` (the run's default) is noise-aware: a one-sided CUSUM of log(value) against the run's
  own level and noise floor. The level is the median of the first ``baseline_steps`` values; the noise is the
  robust SD of every step-to-step difference seen so far (so it sharpens as the run goes on, and a level shift
  adds only one outlying difference). Each step adds ``min(z, z_cap) - k``, z being the step's distance above
  the baseline level in noise SDs; the sum never goes below 0, and the detector fires when it exceeds ``h``.
  Growth smaller than ``k`` noise SDs is ignored however long it lasts, one step adds at most ``z_cap - k``
  (a lone spike cannot fire it while ``h > z_cap - k``), and a series that jumps by z SDs and stays fires after
  about ``h / (z - k)`` steps. The same relative growth fires late in a noisy run and early in a quiet one.
* :class:`GrowthDetector` (the earlier rule, kept for comparison and for ``tim report``) fires when the median
  of the last ``window`` values reaches ``threshold`` x the median of the first ``baseline_steps`` values. It
  ignores the run's noise: a quiet run's 2x is a large event, a noisy run's 2x can be a fluctuation.
* :class:`SurgeDetector` fires on a rapid multiplication of the response length (TIM-LR's surge: "length can
  triple in a few steps"): the mean length of the last ``window`` steps reaches ``factor`` x its smallest value
  over the ``within`` steps before. A slow drift never fires (1% per step doubles in 70 steps), and neither the
  level the run starts at nor an early dip moves the reference, which is always the recent past.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass, field

from tim_megatron import metric_names as names
from tim_megatron.warning_defaults import MEDIAN_RATIO, SURGE, TREND

MAD_TO_SD = 1.4826
"""Scale of the median absolute deviation to a normal SD."""


@dataclass
class Event:
    step: int
    kind: str
    metric: str
    value: float
    baseline: float

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class GrowthDetector:
    metric: str
    baseline_steps: int = MEDIAN_RATIO.baseline_steps
    window: int = MEDIAN_RATIO.window
    threshold: float = MEDIAN_RATIO.threshold
    history: list[float] = field(default_factory=list)
    baseline: float | None = None
    fired_at: int | None = None

    def update(self, step: int, value: float) -> Event | None:
        if value is None or not math.isfinite(value):
            return None
        self.history.append(float(value))
        self.history = (
            self.history[-max(self.window, self.baseline_steps) :]
            if self.baseline is not None
            else self.history
        )
        if self.baseline is None:
            if len(self.history) >= self.baseline_steps:
                self.baseline = statistics.median(self.history[: self.baseline_steps])
                self.history = []
            return None
        if self.fired_at is not None or len(self.history) < self.window:
            return None
        recent = statistics.median(self.history[-self.window :])
        if recent >= self.threshold * self.baseline and recent > 0:
            self.fired_at = step
            return Event(
                step=step, kind="mismatch_growth", metric=self.metric, value=recent, baseline=self.baseline
            )
        return None

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        for k, v in state.items():
            setattr(self, k, v)


@dataclass
class TrendDetector:
    """Noise-aware persistent-growth detector (module docstring): CUSUM of log(value) in noise SDs."""

    metric: str
    baseline_steps: int = TREND.baseline_steps
    k: float = TREND.k
    h: float = TREND.h
    z_cap: float = TREND.z_cap
    min_sigma: float = 0.01
    """Floor of the noise SD in log units (1%): a perfectly flat series would make any wiggle significant."""
    max_diffs: int = 1000
    """Most recent step-to-step differences kept for the noise estimate."""
    baseline: list[float] = field(default_factory=list)
    diffs: list[float] = field(default_factory=list)
    last: float | None = None
    center: float | None = None
    cusum: float = 0.0
    fired_at: int | None = None

    def update(self, step: int, value: float) -> Event | None:
        if value is None or not math.isfinite(value) or value <= 0:  # exact zero mismatch: nothing to grow
            return None
        x = math.log(value)
        if self.last is not None:
            self.diffs = [*self.diffs[-(self.max_diffs - 1) :], x - self.last]
        self.last = x
        if self.center is None:
            self.baseline.append(x)
            if len(self.baseline) >= self.baseline_steps:
                self.center = statistics.median(self.baseline)
            return None
        if self.fired_at is not None:
            return None
        z = (x - self.center) / self.sigma
        self.cusum = max(0.0, self.cusum + min(z, self.z_cap) - self.k)
        if self.cusum > self.h:
            self.fired_at = step
            return Event(
                step=step,
                kind="mismatch_growth",
                metric=self.metric,
                value=float(value),
                baseline=math.exp(self.center),
            )
        return None

    @property
    def sigma(self) -> float:
        """Robust noise SD of one value, in log units, from every step-to-step difference seen so far."""
        return noise_sd(self.diffs, min_sigma=self.min_sigma)

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        for k, v in state.items():
            setattr(self, k, v)


def noise_sd(diffs: list[float], *, min_sigma: float) -> float:
    """SD of one value from its step-to-step differences: MAD x 1.4826 / sqrt 2, around their median.

    Differences ignore the level, so neither a slow trend nor the growth being watched (one large difference
    at a jump) inflates it much; the median absolute deviation ignores spikes."""
    if len(diffs) < 2:
        return min_sigma
    mid = statistics.median(diffs)
    sd = MAD_TO_SD * statistics.median(abs(d - mid) for d in diffs) / math.sqrt(2.0)
    return max(sd, min_sigma)


@dataclass
class SurgeDetector:
    """A rapid multiplication of the mean response length (see the module docstring); fires once."""

    window: int = SURGE.window
    """Steps averaged into the current length."""
    baseline_steps: int = SURGE.baseline_steps
    """Steps seen before the detector may fire."""
    factor: float = SURGE.factor
    """The surge: the current length reaches this multiple of its smallest value over the last ``within`` steps."""
    within: int = SURGE.within
    """How many steps the multiplication may take."""
    recent: list[float] = field(default_factory=list)
    """The last ``window`` raw lengths."""
    smoothed: list[float] = field(default_factory=list)
    """The current length at each of the last ``within`` steps (before this one)."""
    seen: int = 0
    fired_at: int | None = None
    metric: str = names.RESPONSE_LENGTH

    def update(self, step: int, mean_length: float) -> Event | None:
        if mean_length is None or not math.isfinite(mean_length):
            return None
        self.seen += 1
        self.recent = [*self.recent, float(mean_length)][-self.window :]
        if len(self.recent) < self.window:
            return None
        current = sum(self.recent) / self.window
        event = None
        if self.fired_at is None and self.seen >= self.baseline_steps and self.smoothed:
            low = min(self.smoothed)
            if low > 0 and current >= self.factor * low:
                self.fired_at = step
                event = Event(step=step, kind="length_surge", metric=self.metric, value=current, baseline=low)
        self.smoothed = [*self.smoothed, current][-self.within :]
        return event

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        """Restores what :meth:`state_dict` saved; the state of the earlier definition (a fixed baseline from the
        first steps) has no counterpart here and starts the detector afresh, keeping only ``fired_at``."""
        names = {f for f in self.__dataclass_fields__}
        for k, v in state.items():
            if k in names:
                setattr(self, k, v)


def surge_from_config(surge) -> SurgeDetector:
    """The detector of a recipe's ``remedies.lr_schedule.surge`` section."""
    return SurgeDetector(
        window=surge.window, baseline_steps=surge.baseline_steps, factor=surge.factor, within=surge.within
    )


@dataclass
class EarlyWarning:
    """A set of growth detectors plus a length-surge detector, fed the step's metrics."""

    detectors: list[TrendDetector | GrowthDetector]
    surge: SurgeDetector
    events: list[Event] = field(default_factory=list)

    @classmethod
    def create(
        cls,
        *,
        metrics: list[str],
        surge: SurgeDetector,
        rule: str = "trend",
        baseline_steps: int = TREND.baseline_steps,
        k: float = TREND.k,
        h: float = TREND.h,
        z_cap: float = TREND.z_cap,
        window: int = MEDIAN_RATIO.window,
        threshold: float = MEDIAN_RATIO.threshold,
    ) -> EarlyWarning:
        """``rule``: ``trend`` (:class:`TrendDetector`: baseline_steps, k, h, z_cap) or ``median_ratio``
        (:class:`GrowthDetector`: baseline_steps, window, threshold); the defaults are the recipe's
        (:mod:`tim_megatron.warning_defaults`)."""
        if rule == "trend":
            dets = [TrendDetector(m, baseline_steps=baseline_steps, k=k, h=h, z_cap=z_cap) for m in metrics]
        elif rule == "median_ratio":
            dets = [GrowthDetector(m, baseline_steps, window, threshold) for m in metrics]
        else:
            raise ValueError(f"early warning rule {rule!r}: allowed trend, median_ratio")
        return cls(dets, surge)

    def update(self, step: int, metrics: dict[str, float]) -> list[Event]:
        new = []
        for d in self.detectors:
            if d.metric in metrics:
                e = d.update(step, metrics[d.metric])
                if e:
                    new.append(e)
        if self.surge.metric in metrics:
            e = self.surge.update(step, metrics[self.surge.metric])
            if e:
                new.append(e)
        self.events.extend(new)
        return new

    def state_dict(self) -> dict:
        return {
            "detectors": [d.state_dict() for d in self.detectors],
            "surge": self.surge.state_dict(),
            "events": [e.as_dict() for e in self.events],
        }

    def load_state_dict(self, state: dict) -> None:
        by_metric = {d["metric"]: d for d in state["detectors"]}
        for d in self.detectors:
            if d.metric in by_metric:
                d.load_state_dict(by_metric[d.metric])
        self.surge.load_state_dict(state["surge"])
        self.events = [Event(**e) for e in state["events"]]
