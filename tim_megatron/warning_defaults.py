"""The early-warning and length-surge detectors' default settings, stated once (torch-free, like
:mod:`tim_megatron.metric_names`): the detectors (:mod:`tim_megatron.algo.early_warning`), the recipe's
``diagnostics.early_warning`` and ``remedies.lr_schedule.surge``, ``tim report``'s options and the lab's replayed
rules all read them here."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TrendDefaults:
    """The noise-aware CUSUM rule (``TrendDetector``), the recipe's default rule."""

    baseline_steps: int = 10
    """First values whose median is the baseline level."""
    k: float = 1.0
    """Allowance per step, in noise SDs."""
    h: float = 8.0
    """Fires when the cumulative excess (in noise SDs) exceeds this."""
    z_cap: float = 3.0
    """One step counts at most this many noise SDs."""


@dataclass(frozen=True)
class MedianRatioDefaults:
    """The median-ratio rule (``GrowthDetector``), ``tim report``'s replayed warning."""

    baseline_steps: int = 5
    """First values whose median is the baseline."""
    window: int = 5
    """Recent values whose median is compared with the baseline."""
    threshold: float = 2.0
    """Fires at this multiple of the baseline."""


@dataclass(frozen=True)
class SurgeDefaults:
    """TIM-LR's response-length surge (``SurgeDetector``)."""

    window: int = 3
    """Steps averaged into the current length."""
    baseline_steps: int = 5
    """Steps seen before the detector may fire."""
    factor: float = 2.0
    """The current length reaches this multiple of its smallest over ``within`` steps."""
    within: int = 10
    """Steps the multiplication may take."""


TREND = TrendDefaults()
MEDIAN_RATIO = MedianRatioDefaults()
SURGE = SurgeDefaults()
