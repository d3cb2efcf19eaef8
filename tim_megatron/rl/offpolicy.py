"""Off-policy rollouts by a bounded lag k (``rollout.max_staleness``), in sequence on one machine.

At step t the weights are theta_{t-1} (t - 1 updates applied). Each step samples, with those weights, the batch it
will train k steps later, B_{t+k}, and the trainer scores it at once: pi_s, its logprobs at the sampling weights
(the old-logprob pass of an on-policy step, with the same sync and exact-mode checks). The step then trains B_t,
sampled k steps earlier, after one more trainer pass at the current weights, pi_t. The first step samples B_1 ..
B_{1+k}, all with theta_0, so B_t's age (updates between its sampling and its training) is min(t - 1, k), and a batch
older than k is never trained (:meth:`Pending.take` refuses it).

The ratio a correction sees, pi_t / mu_s, then splits per token into staleness, pi_t / pi_s (the policy moved) and
TIM, pi_s / mu_s (the engine computes otherwise at the same weights): :func:`tim_megatron.algo.mismatch.
ratio_split_stats`. No old weights are kept: pi_s is computed while its weights are current.

The batches waiting to be trained are part of the loop's state: a checkpoint after step t holds B_{t+1} .. B_{t+k}
with their pi_s (:meth:`Pending.state`, written per rank beside the RNG state), so a resumed run trains the samples
an uninterrupted one would have.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch

from tim_megatron.rl.batch import StepBatch


class StalenessError(RuntimeError):
    """A batch older than ``rollout.max_staleness`` was about to be trained, or one is missing."""


@dataclass
class Generated:
    """A batch sampled ahead of the step that trains it, with what was measured when it was sampled."""

    step: int
    """The step that trains it (its prompts and sampling seeds are that step's)."""
    version: int
    """Updates applied to the weights that sampled it."""
    batch: StepBatch
    """This rank's rows of it."""
    behaviour: torch.Tensor
    """``[n, L]`` pi_s: the trainer's logprobs at the sampling weights (0 off-response)."""
    metrics: dict[str, float]
    """The sampling step's rollout and reward metrics, and its sync and exact checks."""
    probe: list[list[int]]
    """This engine's probe sequences from it, for the eager sync check of the step that trains it."""
    old_pass: object | None = field(default=None, repr=False)
    """The sampling-time trainer pass (an ``OldPass``) while it is in memory; a batch trained at its own sampling
    step (age 0) reuses it. Not checkpointed."""

    def age(self, step: int) -> int:
        """Updates between its sampling and its training at ``step``."""
        return step - 1 - self.version


@dataclass
class Pending:
    """The batches sampled ahead, by the step that trains them (at most k + 1 at a time)."""

    k: int
    """The lag bound, ``rollout.max_staleness``."""
    batches: dict[int, Generated] = field(default_factory=dict)

    def to_sample(self, step: int) -> list[int]:
        """The steps whose batches step ``step`` samples: those in [step, step + k] not sampled yet (step 1:
        all of them; later steps: step + k)."""
        return [s for s in range(step, step + self.k + 1) if s not in self.batches]

    def add(self, g: Generated) -> None:
        self.batches[g.step] = g

    def take(self, step: int) -> Generated:
        """Remove and return the batch step ``step`` trains; :class:`StalenessError` if it is missing or older
        than k."""
        g = self.batches.pop(step, None)
        if g is None:
            raise StalenessError(
                f"step {step}: no batch was sampled for it (pending: {sorted(self.batches)})"
            )
        if not 0 <= g.age(step) <= self.k:
            raise StalenessError(
                f"step {step}: its batch was sampled with the weights of update {g.version}, {g.age(step)} updates "
                f"ago; rollout.max_staleness = {self.k} allows 0 to {self.k}"
            )
        return g

    # ------------------------------------------------------------------------------------------ state

    def state(self) -> tuple[dict[str, torch.Tensor], dict]:
        """This rank's pending batches as tensors and plain data (a checkpoint writes them per rank)."""
        tensors: dict[str, torch.Tensor] = {}
        plain: dict = {"k": self.k, "batches": []}
        for s, g in sorted(self.batches.items()):
            entry = {
                "step": g.step,
                "version": g.version,
                "metrics": g.metrics,
                "probe": g.probe,
                "group_size": g.batch.group_size,
                "total_rows": g.batch.total_rows,
            }
            for f in fields(StepBatch):
                v = getattr(g.batch, f.name)
                if isinstance(v, torch.Tensor):
                    tensors[f"{s}.batch.{f.name}"] = v.detach().cpu().contiguous()
            tensors[f"{s}.behaviour"] = g.behaviour.detach().cpu().contiguous()
            plain["batches"].append(entry)
        return tensors, plain

    @classmethod
    def from_state(cls, tensors: dict[str, torch.Tensor], plain: dict, *, k: int) -> Pending:
        """What :meth:`state` wrote; ``k`` must be the run's (a checkpoint does not change its lag)."""
        if plain.get("k") != k:
            raise StalenessError(
                f"the checkpoint's pending batches were sampled with rollout.max_staleness = {plain.get('k')}; this "
                f"run has {k}: resume with the recorded value"
            )
        out = cls(k=k)
        for e in plain["batches"]:
            s = e["step"]
            kw = {
                f.name: tensors.get(f"{s}.batch.{f.name}")
                for f in fields(StepBatch)
                if f.name not in ("group_size", "total_rows")
            }
            batch = StepBatch(**kw, group_size=e["group_size"], total_rows=e["total_rows"])
            out.add(
                Generated(
                    step=s,
                    version=e["version"],
                    batch=batch,
                    behaviour=tensors[f"{s}.behaviour"],
                    metrics=e["metrics"],
                    probe=e["probe"],
                )
            )
        return out
