"""Early-warning detectors: persistent growth of a mismatch metric, and response-length surges.

Both are small state machines fed one value per step; their state is plain data for checkpoints.

* :class:`GrowthDetector` fires when the median of the last ``window`` values reaches ``threshold`` x the
  baseline (the median of the first ``baseline_steps`` finite values). A median needs most of the window
  above the line, so a single spike does not fire it; for a series that crosses the line and stays, it
  fires within ``window // 2 + 1`` steps of the crossing.
* :class:`SurgeDetector` fires when the mean length of the last ``window`` steps reaches ``factor`` x the
  mean of the first ``baseline_steps`` steps (the TIM-LR paper's "length can triple in a few steps").
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass, field


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
    baseline_steps: int = 5
    window: int = 5
    threshold: float = 2.0
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
class SurgeDetector:
    window: int = 3
    baseline_steps: int = 5
    factor: float = 2.0
    history: list[float] = field(default_factory=list)
    baseline: float | None = None
    fired_at: int | None = None
    metric: str = "response/length_mean"

    def update(self, step: int, mean_length: float) -> Event | None:
        if mean_length is None or not math.isfinite(mean_length):
            return None
        self.history.append(float(mean_length))
        if self.baseline is None:
            if len(self.history) >= self.baseline_steps:
                self.baseline = sum(self.history[: self.baseline_steps]) / self.baseline_steps
                self.history = []
            return None
        self.history = self.history[-self.window :]
        if self.fired_at is not None or len(self.history) < self.window:
            return None
        recent = sum(self.history) / self.window
        if self.baseline > 0 and recent >= self.factor * self.baseline:
            self.fired_at = step
            return Event(
                step=step, kind="length_surge", metric=self.metric, value=recent, baseline=self.baseline
            )
        return None

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        for k, v in state.items():
            setattr(self, k, v)


@dataclass
class EarlyWarning:
    """A set of growth detectors plus a length-surge detector, fed the step's metrics."""

    detectors: list[GrowthDetector]
    surge: SurgeDetector
    events: list[Event] = field(default_factory=list)

    @classmethod
    def create(
        cls, *, metrics: list[str], baseline_steps: int, window: int, threshold: float, surge: SurgeDetector
    ) -> EarlyWarning:
        return cls([GrowthDetector(m, baseline_steps, window, threshold) for m in metrics], surge)

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
