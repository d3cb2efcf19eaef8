"""Who holds the accelerator's memory, and when: the one place that sleeps and wakes the rollout engine and moves
the trainer's state out and back (``trainer.offload_during_rollout``).

A step hands the memory over twice:

* :meth:`Colocation.to_trainer`, when the rollout is done: the engine sleeps (level 2: the update replaces its
  weights), then the trainer's state comes back. The old-logprob pass and the update follow.
* :meth:`Colocation.to_rollout`, after the update: the optimizer state (and the gradient buffers) leave, the
  allocator's cache goes back, the engine's weights wake, the trainer's weights are pushed in, the KV cache
  wakes, and the sync is verified (a trainer forward: the parameters are still here); then, with ``all``, the
  parameters leave too. The next rollout runs with whatever the recipe asked to move in host memory.

With a rollout engine that samples from the trainer's own weights (exact mode) nothing moves and nothing
sleeps: there is one copy of the weights, and it is the trainer's.
"""

from __future__ import annotations

from tim_megatron.observer import NO_OBSERVER, StepObserver
from tim_megatron.rollout.faults import agreed
from tim_megatron.trainer.offload import LEVELS, Transfer

MIB = 2**20


class Colocation:
    """The memory choreography of one rank: its rollout engine, its trainer and the weight sync between them."""

    def __init__(self, *, rollout, trainer, sync, offload: str):
        if offload not in LEVELS:
            raise ValueError(f"trainer.offload_during_rollout = {offload!r}: allowed {', '.join(LEVELS)}")
        self.rollout = rollout
        self.trainer = trainer
        self.sync = sync
        self.parts = LEVELS[offload]
        """What leaves the device while the engine generates."""

    @property
    def _moves(self) -> bool:
        return bool(self.parts) and not self.rollout.shares_trainer_weights

    def start(self, *, probe: list[list[int]], resumed: bool) -> dict[str, float]:
        """Before the first rollout: a resumed run's engines get the checkpoint's weights (the full handover);
        a fresh one's already hold the trainer's, so only the trainer's state leaves."""
        if resumed:
            return self.to_rollout(probe=probe)
        if not self._moves:
            return {}
        return _metrics("offload", self.trainer.offload(self.parts))

    def to_trainer(self) -> dict[str, float]:
        """The rollout is done: the engine sleeps and the trainer's state returns."""
        # the update replaces the weights: nothing to keep
        agreed(self.rollout, lambda: self.rollout.sleep(level=2), phase="sleep")
        if not self._moves:
            return {}
        return _metrics("onload", self.trainer.onload())

    def to_rollout(
        self,
        *,
        probe: list[list[int]] | None,
        last: bool = False,
        observer: StepObserver = NO_OBSERVER,
    ) -> dict[str, float]:
        """The update is done: push the weights into the engines and give them the memory. ``probe``: the
        sequences the sync's eager check scores (None: no eager check)."""
        if self.rollout.shares_trainer_weights:
            return {}
        early = tuple(p for p in self.parts if p != "params")  # the sync and its check still read the weights
        moved = []
        if self._moves:
            moved.append(self.trainer.offload(early))  # it gives the freed blocks back to the device too
        else:
            self.trainer.release_memory()  # the trainer's cached blocks go back before vLLM takes its memory
        agreed(self.rollout, lambda: self.rollout.wake_up(tags=["weights"]), phase="wake")
        out = self.sync.push(
            self.rollout,
            self.trainer,
            probe=None if probe is None else lambda: probe,
            last=last,
            after_load=lambda: agreed(
                self.rollout, lambda: self.rollout.wake_up(tags=["kv_cache"]), phase="wake"
            ),
            observer=observer,
        )
        if self._moves and "params" in self.parts:
            moved.append(self.trainer.offload(("params",)))
        if moved:
            out.update(_metrics("offload", *moved))
        return out

    def resident(self) -> _Resident:
        """``with colocation.resident():`` the trainer's whole state is on the device inside (a checkpoint), and
        what was away goes away again after."""
        return _Resident(self)


class _Resident:
    def __init__(self, colocation: Colocation):
        self.c = colocation
        self.away: tuple[str, ...] = ()

    def __enter__(self):
        self.away = self.c.trainer.host.offloaded
        if self.away:
            self.c.trainer.onload()

    def __exit__(self, *exc):
        if self.away:
            self.c.trainer.offload(self.away)
        return False


def _metrics(direction: str, *moves: Transfer) -> dict[str, float]:
    """``memory/offload_*`` or ``memory/onload_*``: MiB moved per part and in all, and seconds."""
    out: dict[str, float] = {f"memory/{direction}_seconds": sum(m.seconds for m in moves)}
    total = 0
    for m in moves:
        for part, n in m.bytes.items():
            key = f"memory/{direction}_{part}_mib"
            out[key] = out.get(key, 0.0) + n / MIB
            total += n
    out[f"memory/{direction}_mib"] = total / MIB
    return out
