"""What a lost rollout engine is, what recovering from it costs, and how the ranks agree that one was lost."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch

from tim_megatron.comm import comm_device

T = TypeVar("T")


class EngineLost(RuntimeError):
    """A rank's rollout engine failed more often than ``rollout.faults`` allows."""

    def __init__(self, message: str, *, rank: int, phase: str, cause: str):
        super().__init__(message)
        self.rank, self.phase, self.cause = rank, phase, cause
        self.before_update = False
        """Set when every rank agreed on it before the step changed the trainer (the step before can be saved)."""

    def __reduce__(self):  # sent to the other ranks whole
        return (_engine_lost, (str(self), self.rank, self.phase, self.cause))


def _engine_lost(message: str, rank: int, phase: str, cause: str) -> EngineLost:
    return EngineLost(message, rank=rank, phase=phase, cause=cause)


class WitnessMismatch(EngineLost):
    """A restarted engine does not score its witness probe as its predecessor did after the same load: it does not
    hold the weights its predecessor held (a stale or partial load)."""

    def __reduce__(self):
        return (_witness_mismatch, (str(self), self.rank, self.phase, self.cause))


def _witness_mismatch(message: str, rank: int, phase: str, cause: str) -> WitnessMismatch:
    return WitnessMismatch(message, rank=rank, phase=phase, cause=cause)


@dataclass
class FaultTally:
    """What recovery cost, this step and over the run (``faults/*`` metrics)."""

    restarts: int = 0
    seconds_lost: float = 0.0
    prompts_regenerated: int = 0
    run_restarts: int = 0
    detect_seconds: float = 0.0
    """The longest time from the start of a failed call to its failure being found (a hang: ``timeout_s``)."""
    witness_checks: int = 0
    """Restarted engines whose witness (the fixed probe scored right after a load) was compared with their
    predecessor's for the same weights."""
    witness_max_abs_prob_diff: float = 0.0
    """The largest probability difference found by those comparisons (0.0 here when there were none: the neutral
    value of the maximum over the ranks; :meth:`reduced` then drops the metric)."""

    HIGHEST = frozenset({"faults/witness_max_abs_prob_diff", "faults/detect_seconds"})
    """The metrics that are the largest over the ranks (the others are sums)."""

    def metrics(self) -> dict[str, float]:
        return {
            "faults/restarts": float(self.restarts),
            "faults/seconds_lost": self.seconds_lost,
            "faults/prompts_regenerated": float(self.prompts_regenerated),
            "faults/restarts_run": float(self.run_restarts),
            "faults/detect_seconds": self.detect_seconds,
            "faults/witness_checks": float(self.witness_checks),
            "faults/witness_max_abs_prob_diff": self.witness_max_abs_prob_diff,
        }

    @staticmethod
    def reduced(metrics: dict[str, float]) -> dict[str, float]:
        """The step's metrics over the ranks as logged: ``faults/witness_max_abs_prob_diff`` only when some
        witness was compared (``faults/witness_checks`` > 0); absent, not 0.0, when none was."""
        if not metrics.get("faults/witness_checks"):
            metrics.pop("faults/witness_max_abs_prob_diff", None)
        return metrics


def agree_on_engines(
    rollout, error: BaseException | None, *, phase: str, before_update: bool = False
) -> None:
    """Every rank calls this after an engine call that may have lost its engine for good: if any rank did (or its
    call failed otherwise), every rank raises: that rank its own error, the others :class:`EngineLost` naming the
    ranks, so that none waits in a collective the others never reach. Without a restartable engine the error, if
    any, is raised at once (nothing to agree on). ``before_update``: the step has not changed the trainer yet (the
    run may checkpoint the step before)."""
    if not rollout.restartable:
        if error is not None:
            raise error
        return
    import torch.distributed as dist

    flags = torch.zeros(rollout.layout.world, dtype=torch.float64, device=comm_device())
    if error is not None:  # this process's global rank (the engine protocol does not name one)
        flags[dist.get_rank() if dist.is_initialized() else 0] = 1.0
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    lost = [r for r in range(len(flags)) if flags[r] > 0]
    if not lost:
        return
    if error is None:
        error = EngineLost(
            f"rank(s) {', '.join(map(str, lost))} lost their rollout engine during {phase} (their logs say why)",
            rank=lost[0],
            phase=phase,
            cause="another rank's engine",
        )
    if isinstance(error, EngineLost):
        error.before_update = before_update
    raise error


def agreed(rollout, call: Callable[[], T], *, phase: str, before_update: bool = False) -> T:
    """``call()`` (an engine call), then :func:`agree_on_engines` on how it went; its result."""
    out, error = None, None
    try:
        out = call()
    except Exception as e:
        error = e
    agree_on_engines(rollout, error, phase=phase, before_update=before_update)
    return out
