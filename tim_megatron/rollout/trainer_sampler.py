"""The trainer-side sampler as a rollout engine: the Megatron model samples itself (VeXact ``trainer_sampler``).

All ranks together form one engine: each runs the whole step with the same seeds (TP/EP collectives line
up), so every rank holds every sample. Nothing is synced: the sampler uses the trainer's own parameters.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from tim_megatron.rollout.base import FleetLayout, GenerationStats, Sample


class TrainerSampler:
    shares_trainer_weights = True

    def __init__(self, trainer, *, eos_id: int):
        self.trainer = trainer
        self.eos_id = eos_id
        self.layout = FleetLayout(world=trainer.env.world_size, ranks_per_engine=trainer.env.world_size)
        self.engine_index = 0

    def generate(
        self,
        prompts: list[list[int]],
        *,
        step: int,
        first_index: int = 0,
        n: int | None = None,
        greedy: bool = False,
    ) -> tuple[list[list[Sample]], GenerationStats]:
        import time

        from tim_megatron.trainer.sampler import sample_with_trainer

        t = time.perf_counter()
        groups = sample_with_trainer(
            self.trainer,
            prompts,
            step=step,
            eos_id=self.eos_id,
            first_index=first_index,
            n=n,
            greedy=greedy,
        )
        seconds = time.perf_counter() - t
        n_resp = sum(len(s.response_ids) for g in groups for s in g)
        n_prompt = sum(len(p) * len(g) for p, g in zip(prompts, groups, strict=True))
        return groups, GenerationStats(seconds=seconds, prompt_tokens=n_prompt, response_tokens=n_resp)

    def score(self, sequences: list[list[int]]) -> list[list[float]]:
        from tim_megatron.trainer.engine import SeqBatch

        width = max(len(s) for s in sequences)
        ids = torch.zeros(len(sequences), width, dtype=torch.long)
        for i, s in enumerate(sequences):
            ids[i, : len(s)] = torch.tensor(s)
        head = self.trainer.head
        self.trainer.with_head(temperature=1.0)
        try:
            lp, _ = self.trainer.logprobs(SeqBatch(ids, torch.tensor([len(s) for s in sequences])))
        finally:
            self.trainer.head = head
        return [lp.logprobs[i, : len(s)].tolist() for i, s in enumerate(sequences)]

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Nothing to load: the sampler runs on the trainer's parameters."""

    def sleep(self, level: int) -> None:
        """Nothing to release."""

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Nothing to take back."""

    def reset_prefix_cache(self) -> None:
        """No cache: one full forward per generated token."""

    def head_dtype(self) -> str:
        from tim_megatron.trainer.logprobs import head_gemm, head_weight

        w = head_weight(self.trainer.model)
        with torch.no_grad():
            return str(head_gemm(torch.zeros(1, w.shape[1], dtype=w.dtype), w, self.trainer.head).dtype)

    def describe(self) -> dict:
        return {
            "engine": 0,
            "ranks": list(range(self.layout.world)),
            "rank": self.trainer.rank,
            "device": "trainer",
            "tensor_parallel_size": self.trainer.tp,
        }

    def close(self) -> None:
        pass
