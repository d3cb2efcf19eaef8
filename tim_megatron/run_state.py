"""The loop's own state: the learning-rate schedule, the early-warning detectors and the step to start from.

:class:`LoopState` saves and loads itself (``state_dict`` / ``load_state_dict``, as torchtitan's components do);
a checkpoint's ``state.json`` holds what it returns, under the same keys as before it had a class of its own.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

from tim_megatron.algo import EarlyWarning, build_schedule
from tim_megatron.algo.early_warning import surge_from_config
from tim_megatron.rl.offpolicy import Pending, StalenessError, short_repr
from tim_megatron.rl.partial import PartialRollouts


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


@dataclass
class LoopState:
    """What the loop carries from step to step besides the model: the LR schedule (it watches the metrics, for the
    length-surge decay), the early-warning detectors, the first step of this process, the batches sampled ahead
    (off-policy runs) and the run's count of rollout-engine restarts."""

    schedule: object
    """The learning-rate schedule (:func:`tim_megatron.algo.build_schedule`)."""
    warnings: EarlyWarning
    """The early-warning detectors and the events they raised."""
    start_step: int = 1
    """The first step this process runs: 1, or the step after the checkpoint it resumed from."""
    pending: Pending | PartialRollouts | None = None
    """Off-policy runs (``rollout.max_staleness`` > 0): the batches sampled ahead, waiting to be trained (with
    ``rollout.partial``: the batches in flight, :mod:`tim_megatron.rl.partial`)."""
    restarts_before: float = 0.0
    """Rollout-engine restarts of the attempts before this process, as of the checkpoint it resumed from."""
    restarts_run: float = 0.0
    """Rollout-engine restarts over the run so far, every attempt's up to the checkpoint counted
    (``faults/restarts_run``; a checkpoint keeps it, so a resumed run counts on)."""

    def count_restarts(self, this_process: float) -> float:
        """The run's restart count, given this process's (every rank's engines, summed)."""
        self.restarts_run = self.restarts_before + this_process
        return self.restarts_run

    partial_limits: dict | None = None
    """Partial rollouts: the recipe's bounds a checkpoint's batches in flight are checked against."""

    @classmethod
    def create(cls, recipe) -> LoopState:
        k, part = recipe.rollout.max_staleness, recipe.rollout.partial
        pending = None
        if k and part.enabled:
            pending = PartialRollouts(k=k, tokens_per_step=part.tokens_per_step)
        elif k:
            pending = Pending(k=k)
        limits = None
        if part.enabled:
            limits = {
                "tokens_per_step": part.tokens_per_step,
                "max_tokens": recipe.rollout.max_tokens,
                "max_prompt_tokens": recipe.data.max_prompt_tokens,
            }
        return cls(
            schedule=new_schedule(recipe),
            warnings=new_warnings(recipe),
            pending=pending,
            partial_limits=limits,
        )

    def rank_state(self):
        """This rank's part of the state (tensors, plain data) that a checkpoint writes per rank, or None."""
        return None if self.pending is None else self.pending.state()

    def checkpoint_view(self) -> LoopView:
        """What a checkpoint of the state as it is now writes, kept apart from what the next step changes: a step
        that ends in an abort checkpoints the state of the step before it (the batches it was to train
        included)."""
        return LoopView(
            state=copy.deepcopy(self.state_dict()),
            pending=None if self.pending is None else self.pending.copy(),
        )

    def state_dict(self) -> dict:
        return {
            "schedule": self.schedule.state_dict(),
            "warnings": self.warnings.state_dict(),
            "engine_restarts": self.restarts_run,
        }

    def load_state_dict(
        self,
        state: dict,
        *,
        step: int,
        rank_state=None,
        where: str = "the checkpoint",
        total_rows: int | None = None,
        group_size: int | None = None,
        first_row: int | None = None,
    ) -> None:
        """Restore from a checkpoint written after ``step``: the next step run is ``step + 1``. ``rank_state``:
        what :meth:`rank_state` returned for this rank then (None when the checkpoint holds none; ``where`` names
        its file). ``total_rows`` and ``group_size``: the run's, which every pending batch must have;
        ``first_row``: the first global row this rank trains (partial rollouts' pi_s is this rank's rows')."""
        self.schedule.load_state_dict(state["schedule"])
        self.warnings.load_state_dict(state["warnings"])
        self.start_step = step + 1
        # checkpoints written before engines could restart hold no count: none restarted then
        self.restarts_before = self.restarts_run = float(state.get("engine_restarts", 0.0))
        if self.pending is None:
            recorded = rank_state[1].get("k") if rank_state and isinstance(rank_state[1], dict) else None
            if recorded:  # an off-policy run resumed on-policy would drop the batches it sampled ahead
                raise StalenessError(
                    f"{where} holds the off-policy batches sampled ahead for the steps after {step} "
                    f"(rollout.max_staleness = {recorded}); this run has rollout.max_staleness = 0, which would "
                    "drop them: resume with the recorded value"
                )
            return
        if rank_state is None:
            raise StalenessError(
                f"the checkpoint of step {step} has no pending off-policy batches ({where} is missing), but this "
                f"run has rollout.max_staleness = {self.pending.k}: it cannot continue exactly from this "
                "checkpoint (the batches sampled ahead are lost); resume from an earlier checkpoint, or start a "
                "new run"
            )
        if isinstance(self.pending, PartialRollouts):
            self.pending = PartialRollouts.from_state(
                *rank_state,
                k=self.pending.k,
                tokens_per_step=self.partial_limits["tokens_per_step"],
                max_tokens=self.partial_limits["max_tokens"],
                max_prompt_tokens=self.partial_limits["max_prompt_tokens"],
                group_size=group_size if group_size is not None else 1,
                step=step,
                first_row=first_row,
                where=where,
            )
            return
        if isinstance(rank_state[1], dict) and rank_state[1].get("partial"):
            raise StalenessError(
                f"{where} holds partial rollouts in flight (rollout.partial.tokens_per_step = "
                f"{short_repr(rank_state[1].get('tokens_per_step'))}); this run has rollout.partial.tokens_per_step = 0: "
                "resume with the recorded value"
            )
        self.pending = Pending.from_state(
            *rank_state,
            k=self.pending.k,
            step=step,
            total_rows=total_rows,
            group_size=group_size,
            where=where,
        )


@dataclass
class LoopView:
    """The loop's state as a checkpoint writes it, taken at one moment (:meth:`LoopState.checkpoint_view`)."""

    state: dict
    """What :meth:`LoopState.state_dict` returned then."""
    pending: Pending | PartialRollouts | None
    """The batches waiting then (a copy of the mapping; the batches themselves are never changed in place)."""

    def state_dict(self) -> dict:
        return self.state

    def rank_state(self):
        return None if self.pending is None else self.pending.state()
