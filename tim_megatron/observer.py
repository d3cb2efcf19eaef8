"""The loop's hook: what a watcher is told that the step's metrics do not keep apart.

``tim preflight`` watches the real loop through it (each engine's generation, each sync's load, agreements and
verdict, the update's forward/backward and optimizer seconds) instead of wrapping the loop's objects. The default
observer does nothing; the loop and the weight sync call it at fixed points, on every rank.
"""

from __future__ import annotations


class StepObserver:
    """Told what happens inside a step. Subclass and override what you watch; every method does nothing here."""

    def generated(self, *, step: int, engine: int, prompts: int, sequences: int, stats) -> None:
        """This rank's engine generated the step's block: ``prompts`` prompts, ``sequences`` responses;
        ``stats`` is its :class:`tim_megatron.rollout.base.GenerationStats`."""

    def synced(
        self,
        *,
        sync: int,
        check: str,
        metrics: dict | None = None,
        error: Exception | None = None,
        load=None,
        agreements: list | None = None,
    ) -> None:
        """Sync number ``sync`` was pushed and checked (``check = "probe"``), or checked on the next step's samples
        (``"samples"``). ``metrics``: what the loop logs; ``error``: the :class:`WeightSyncError` about to be raised;
        ``load``: this rank's :class:`tim_megatron.rollout.sync.SyncReport`; ``agreements``: every engine's
        agreement with the trainer on the probe."""

    def trained(self, *, step: int, times: dict[str, float]) -> None:
        """One optimizer update of step ``step`` ran; ``times``: its seconds by part (``fwd_bwd``, ``optimizer``)."""


NO_OBSERVER = StepObserver()
"""The observer of a loop nobody watches (stateless: safe to share)."""
