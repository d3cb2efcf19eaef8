"""How ``tim report`` replays the early warnings over logged metrics (light: ``tim``'s options read it at start)."""

from __future__ import annotations

from dataclasses import dataclass

from tim_megatron.warning_defaults import MEDIAN_RATIO, SURGE


@dataclass(frozen=True)
class WarningSettings:
    """How ``tim report`` replays the warnings over logged metrics: the median-ratio rule and the length surge, by
    default at the detectors' own settings (:mod:`tim_megatron.warning_defaults`)."""

    baseline_steps: int = MEDIAN_RATIO.baseline_steps
    """First values whose median is the mismatch's baseline."""
    window: int = MEDIAN_RATIO.window
    """Recent values whose median is compared with the baseline."""
    threshold: float = MEDIAN_RATIO.threshold
    """The warning fires at this multiple of the baseline."""
    surge_window: int = SURGE.window
    """Steps averaged into the current response length."""
    surge_baseline_steps: int = SURGE.baseline_steps
    """Steps seen before the surge may fire."""
    surge_factor: float = SURGE.factor
    """The surge: the current length reaches this multiple of its smallest over ``surge_within`` steps."""
    surge_within: int = SURGE.within
    """Steps the multiplication may take."""
    collapse_drop: float = 0.3
    """A collapse: validation accuracy (or the reward) this fraction below its best so far."""
