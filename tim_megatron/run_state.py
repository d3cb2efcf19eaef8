"""What the steps of a run share (:class:`Run`), and the per-run objects built from the recipe: the learning-rate
schedule and the early-warning detectors. Built by :mod:`tim_megatron.run_setup`, read by :mod:`tim_megatron.loop`."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from tim_megatron.algo import EarlyWarning, build_schedule
from tim_megatron.algo.early_warning import surge_from_config
from tim_megatron.recipe import LoadedRecipe
from tim_megatron.stop import StopRequest


@dataclass
class Run:
    """What the steps share: the recipe, the trainer, the rollout side (engine and weight sync), data, logging."""

    loaded: LoadedRecipe
    run_dir: Path
    trainer: object
    rollout: object
    """This rank's rollout engine (tim_megatron.rollout.base.RolloutEngine): every rank has one."""
    sync: object
    """The weight-sync state machine (tim_megatron.rollout.sync.WeightSync)."""
    colocation: object
    """Who holds the accelerator memory when (tim_megatron.rl.colocation.Colocation): sleeps, wakes, offload."""
    source: object
    tokenizer: object
    schedule: object
    warnings: EarlyWarning
    tracker: object
    stop: StopRequest
    capture_agreement: bool
    start_step: int = 1
    probe: list = field(default_factory=list)
    """Fallback probe prompts for the eager sync check (a step's own samples are used when present)."""
    info: dict = field(default_factory=dict)
    """Remedy flags and the fleet layout, logged with the first step."""

    @property
    def recipe(self):
        return self.loaded.recipe

    @property
    def is_rank0(self) -> bool:
        return self.trainer.is_rank0


def new_warnings(recipe) -> EarlyWarning:
    ew = recipe.diagnostics.early_warning
    return EarlyWarning.create(
        metrics=list(ew.metrics),
        rule=ew.rule,
        baseline_steps=ew.baseline_steps,
        k=ew.k,
        h=ew.h,
        z_cap=ew.z_cap,
        window=ew.window,
        threshold=ew.threshold,
        surge=surge_from_config(recipe.remedies.lr_schedule.surge),
    )


def new_schedule(recipe):
    return build_schedule(recipe.remedies.lr_schedule, base_lr=recipe.optim.lr, total_steps=recipe.run.steps)
