"""Learning-rate schedules: constant, cosine with warm-up, and the length-surge-triggered decay.

Steps count from 1. ``lr(step)`` is the rate used for the update of that step; stateful schedules learn
from ``observe(step, metrics)``, called after the step's rollouts and before its update.

Length decay (TIM-LR paper, Algorithm 1): hold eta_0; at every step t with ``t % decay_period == 0`` set
eta_t = max(eta_{t-1} / 2, eta_inf), eta_inf = min_lr_ratio x eta_0 (default 10%). The default trigger,
``step`` with ``trigger_step = 0``, is Algorithm 1 exactly: T_decay is fixed in advance (the paper takes about
1.8 x the step where an earlier run's response length surged). ``trigger = surge`` is an opt-in variant that
starts counting when the :class:`SurgeDetector` fires and derives the period from that step
(period_factor x surge step). The detector fires when the mean length multiplies by ``factor`` within
``within`` steps (TIM-LR's rapid surge), so a slow steady growth never triggers it and a curve that starts
high and dips still does when it surges back.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from tim_megatron import metric_names as names
from tim_megatron.algo.early_warning import SurgeDetector, surge_from_config


class _WarmupSchedule:
    """A schedule fixed in advance (``base_lr`` and ``warmup_steps`` are its subclass's fields): a linear warm-up
    to ``base_lr``, nothing learned from the run's metrics and no state to save."""

    base_lr: float
    warmup_steps: int

    def observe(self, step: int, metrics: dict[str, float]) -> None:
        pass

    def warmup_lr(self, step: int) -> float | None:
        """The rate during the warm-up; None after it."""
        if self.warmup_steps and step <= self.warmup_steps:
            return self.base_lr * step / self.warmup_steps
        return None

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


@dataclass
class ConstantLR(_WarmupSchedule):
    base_lr: float
    warmup_steps: int = 0

    def lr(self, step: int) -> float:
        warm = self.warmup_lr(step)
        return self.base_lr if warm is None else warm


@dataclass
class CosineLR(_WarmupSchedule):
    base_lr: float
    total_steps: int
    warmup_steps: int = 0
    min_lr_ratio: float = 0.1

    def lr(self, step: int) -> float:
        warm = self.warmup_lr(step)
        if warm is not None:
            return warm
        span = max(self.total_steps - self.warmup_steps, 1)
        progress = min(max(step - self.warmup_steps, 0) / span, 1.0)
        floor = self.min_lr_ratio * self.base_lr
        return floor + (self.base_lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


@dataclass
class LengthDecayLR:
    base_lr: float
    min_lr_ratio: float = 0.1
    trigger: str = "step"
    trigger_step: int = 0
    decay_period: int | None = None
    period_factor: float = 1.8
    surge: SurgeDetector = field(default_factory=SurgeDetector)
    triggered_at: int | None = None
    period: int | None = None
    current: float | None = None
    last_step: int = 0

    def __post_init__(self) -> None:
        if self.trigger == "step" and self.trigger_step == 0 and self.decay_period is None:
            raise ValueError("length_decay from step 0 (Algorithm 1) needs decay_period (T_decay)")
        if self.current is None:
            self.current = self.base_lr
        if self.trigger == "step" and self.triggered_at is None and self.trigger_step == 0:
            self._fire(0)

    @property
    def floor(self) -> float:
        return self.min_lr_ratio * self.base_lr

    def _fire(self, step: int) -> None:
        self.triggered_at = step
        self.period = (
            self.decay_period if self.decay_period is not None else max(1, round(self.period_factor * step))
        )

    def observe(self, step: int, metrics: dict[str, float]) -> None:
        if self.triggered_at is not None:
            return
        if self.trigger == "step":
            if step >= self.trigger_step:
                self._fire(self.trigger_step)
        elif (
            names.RESPONSE_LENGTH in metrics
            and self.surge.update(step, metrics[names.RESPONSE_LENGTH]) is not None
        ):
            self._fire(step)

    def lr(self, step: int) -> float:
        """The rate for ``step``; advances the halving state once per new step (call with increasing steps)."""
        while self.last_step < step:
            self.last_step += 1
            t = self.last_step
            if (
                self.period is not None
                and self.triggered_at is not None
                and t > self.triggered_at
                and t % self.period == 0
            ):
                self.current = max(self.current / 2.0, self.floor)
        return self.current

    def state_dict(self) -> dict:
        d = asdict(self)
        d["surge"] = self.surge.state_dict()
        return d

    def load_state_dict(self, state: dict) -> None:
        for k, v in state.items():
            if k == "surge":
                self.surge.load_state_dict(v)
            else:
                setattr(self, k, v)


def build_schedule(cfg, *, base_lr: float, total_steps: int):
    """From a ``remedies.lr_schedule`` recipe section."""
    if cfg.type == "constant":
        return ConstantLR(base_lr=base_lr, warmup_steps=cfg.warmup_steps)
    if cfg.type == "cosine":
        return CosineLR(
            base_lr=base_lr,
            total_steps=cfg.total_steps or total_steps,
            warmup_steps=cfg.warmup_steps,
            min_lr_ratio=cfg.min_lr_ratio,
        )
    if cfg.type == "length_decay":
        return LengthDecayLR(
            base_lr=base_lr,
            min_lr_ratio=cfg.min_lr_ratio,
            trigger=cfg.trigger,
            trigger_step=cfg.trigger_step,
            decay_period=cfg.decay_period,
            period_factor=cfg.period_factor,
            surge=surge_from_config(cfg.surge),
        )
    raise ValueError(f"remedies.lr_schedule.type = {cfg.type!r}: allowed constant, cosine, length_decay")
