"""Recipe sections for rollout engines that fail: the limits of recovery, and the fire drill that plants a fault."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from tim_megatron.recipe.base import Section


class FaultsConfig(Section):
    timeout_s: float = Field(120.0, gt=0)
    """Seconds an engine in its own process (``rollout.engine_process``) may take to answer one call (a
    generation, a weight load, a score) before it counts as hung: it is killed and restarted."""
    max_restarts_per_step: int = Field(2, ge=0)
    """Restarts of one rank's engine within one step; one more lost engine stops the run (a named error naming the
    rank, the phase and the cause)."""
    max_restarts: int = Field(8, ge=0)
    """Restarts of one rank's engine over the whole run (this process's life; a resumed run counts again)."""


class FaultDrillConfig(Section):
    kind: Literal["none", "kill", "hang", "raise", "hang_in_reply", "hang_before_read", "stale"] = "none"
    """The fault to plant: ``kill`` (SIGKILL of the engine's process once it has done the work, before it answers),
    ``hang`` (SIGSTOP before the work: it stops answering; ``rollout.faults.timeout_s`` finds it), ``raise`` (the
    call raises), ``hang_in_reply`` (SIGSTOP after writing half of its answer), ``hang_before_read`` (SIGSTOP
    before it reads the request, which is made larger than the socket's buffer: the rank's write stops),
    ``stale`` (a ``kill``, and its restart skips loading the weights its predecessor held: the witness must find
    it; at step 2 the restarted engine holds the checkpoint's weights, one update behind). Needs
    ``rollout.engine_process``."""
    phase: Literal["generate", "sync", "wake"] = "generate"
    """Where: the step's generation, the weight load of its sync, or the engine's wake-up before the sync."""
    step: int = Field(2, ge=1)
    """The step it happens at."""
    rank: int = Field(0, ge=0)
    """The rank whose engine it hits."""
    every_attempt: bool = False
    """Plant it again in every restarted engine of that step (a fault that recovery cannot outlast: the run must
    stop after ``rollout.faults.max_restarts_per_step``)."""
