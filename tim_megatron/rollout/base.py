"""What the RL loop needs from a rollout engine, whichever implementation serves it.

Two implementations: the vLLM fleet (:mod:`tim_megatron.rollout.vllm_engine`, one vLLM engine per group of
``rollout.tensor_parallel_size`` ranks, in the trainer's own processes) and the exact sampler
(:mod:`tim_megatron.rollout.exact_sampler`, the Megatron model samples from its own training forward, one engine
per data-parallel rank). Every rank holds one and
calls the same methods in the same order: there is no rank-0-only branch in the loop.

The fleet splits a step's prompts into contiguous blocks of whole prompt groups, one block per engine
(:class:`FleetLayout`). Sample seeds depend on (run seed, step, global prompt index, sample index) only, so the
samples do not depend on the number of engines.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Protocol

import numpy as np
import torch


class RolloutInputError(ValueError):
    """Input the rollout engine refuses before generating (empty or too long prompts, a bad checkpoint)."""


class EngineStartError(RuntimeError):
    """The rollout engine did not start. ``kind`` says why, for ``tim preflight``'s verdict: ``fit`` when the
    model or its KV cache does not fit in the memory the engine was given, ``load`` for anything else (weights,
    configuration, the library). The engine that raises it decides the kind; its message is the cause's."""

    def __init__(self, message: str, *, kind: Literal["fit", "load"]):
        super().__init__(message)
        self.kind = kind

    def __reduce__(self):  # a rank's error sent to another keeps its kind
        return (_engine_start_error, (str(self), self.kind))


def _engine_start_error(message: str, kind: str) -> EngineStartError:
    return EngineStartError(message, kind=kind)


def check_model_files(model_path: str | Path) -> dict:
    """Fail early for a checkpoint folder without its config.json or weights, or holding a file the engine must
    not open (a FIFO would block it; a link may lead out of the folder); return its config."""
    from tim_megatron.safe_files import UnsafePathError
    from tim_megatron.trainer.hf_config import read_hf_config
    from tim_megatron.trainer.weights.model_files import check_model_folder, model_file

    path = Path(model_path)
    if not (path / "config.json").exists():
        raise RolloutInputError(
            f"rollout: model checkpoint {path} not found (no config.json); build it or fix model.path"
        )
    if not any(path.glob("*.safetensors")):
        raise RolloutInputError(f"rollout: model checkpoint {path} has no *.safetensors weights")
    try:
        check_model_folder(path)
    except UnsafePathError as e:
        raise RolloutInputError(f"rollout: model checkpoint {path}: {e}") from None
    return read_hf_config(model_file(path, "config.json", what="config"))


@dataclass
class Sample:
    """One sampled response."""

    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]
    """Rollout logprob of each response token."""
    finish_reason: str
    routed_experts: np.ndarray | None = None
    """``[len(prompt) + len(response) - 1, layers, top_k]``: experts used at each input position."""
    prompt_index: int = 0
    """Index of the prompt in the whole step (not in the engine's block)."""
    sample_index: int = 0
    """Index of the sample in its prompt's group."""
    engine: int = 0
    """The engine that generated it."""
    policy_logprobs: list[float] | None = None
    """The trainer policy's logprob of each response token, computed when it was sampled (the exact sampler; with
    a sampling injection ``logprobs`` are the perturbed distribution's and these the unperturbed policy's)."""
    versions: list[int] | None = None
    """Partial rollouts (:mod:`tim_megatron.rl.partial`): the version (updates applied) of the weights that sampled
    each response token; None: one version for the whole response, the batch's."""

    @property
    def truncated(self) -> bool:
        return self.finish_reason == "length"


@dataclass
class GenerationStats:
    seconds: float
    prompt_tokens: int
    response_tokens: int
    extra: dict = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        return self.response_tokens / self.seconds if self.seconds > 0 else float("nan")


def sample_seed(base: int, step: int, prompt: int, sample: int) -> int:
    """The seed of one sample: a function of the run seed, the step and the GLOBAL prompt and sample index."""
    h = hashlib.blake2b(f"{base}:{step}:{prompt}:{sample}".encode(), digest_size=4).digest()
    return int.from_bytes(h, "little") & 0x7FFFFFFF


def segment_seed(base: int, step: int, segment: int, prompt: int, sample: int) -> int:
    """Partial rollouts: the seed of the part of one sample that step ``segment`` generates, for the batch that
    step ``step`` trains (global prompt and sample index): the same whatever the batching, the engines, the
    schedule or a resume."""
    h = hashlib.blake2b(f"partial:{base}:{step}:{segment}:{prompt}:{sample}".encode(), digest_size=4).digest()
    return int.from_bytes(h, "little") & 0x7FFFFFFF


@dataclass
class Segment:
    """Partial rollouts: one generation call that goes on with sequences begun earlier (or begins them). The call's
    ``prompts`` are each request's prefix, its prompt followed by the response so far; each is one request (n = 1).

    The call returns, for each request, a :class:`Sample` whose ``prompt_ids`` are the prefix, whose
    ``response_ids`` and ``logprobs`` are the tokens added, and whose ``routed_experts`` (when captured) are those of
    the positions that sampled them: from ``len(prefix) - 1`` on when the prefix holds response tokens, from 0 (the
    prompt's positions too) when it does not. ``finish_reason`` is ``length`` when the request used its budget."""

    seeds: list[int]
    """Each request's sampling seed (:func:`segment_seed`)."""
    max_tokens: list[int]
    """Each request's budget in this call (at least 1)."""
    prompt_lens: list[int]
    """Each request's own prompt length (the rest of its prefix is response)."""
    indices: list[tuple[int, int]]
    """Each request's (global prompt index, sample index) in its step."""
    longest_prompt: int
    """The longest prompt of the batch the requests belong to, on this engine (the exact sampler's width)."""


@dataclass(frozen=True)
class FleetLayout:
    """Which ranks form which rollout engine: engine k runs on ranks [k R, k R + R)."""

    world: int
    """Ranks in the job."""
    ranks_per_engine: int
    """R: the ranks of one engine (vLLM's tensor-parallel size; the trainer's TP size for the exact sampler)."""

    def __post_init__(self) -> None:
        if self.ranks_per_engine < 1 or self.world % self.ranks_per_engine:
            raise ValueError(
                f"rollout.tensor_parallel_size = {self.ranks_per_engine} must divide the job's {self.world} ranks"
            )

    @property
    def engines(self) -> int:
        return self.world // self.ranks_per_engine

    def engine_of(self, rank: int) -> int:
        return rank // self.ranks_per_engine

    def ranks_of(self, engine: int) -> range:
        return range(engine * self.ranks_per_engine, (engine + 1) * self.ranks_per_engine)

    def is_leader(self, rank: int) -> bool:
        """The first rank of its engine (the one that speaks for it in gathers)."""
        return rank % self.ranks_per_engine == 0

    def block(self, items: int, engine: int) -> range:
        """The contiguous block of ``items`` (prompts) that ``engine`` generates; blocks differ by at most one."""
        base, extra = divmod(items, self.engines)
        start = engine * base + min(engine, extra)
        return range(start, start + base + (1 if engine < extra else 0))


class RolloutEngine(Protocol):
    """The loop's view of a rollout engine. Every rank calls every method, in the same order."""

    layout: FleetLayout
    engine_index: int
    """The engine this rank belongs to."""
    shares_trainer_weights: bool
    """True when the engine samples with the trainer's own parameters (nothing to sync or verify)."""
    restartable: bool
    """True when a failed engine is restarted in place (:mod:`tim_megatron.rollout.process_engine`): the ranks then
    agree after each engine call whether one was lost for good."""

    def begin_step(self, step: int) -> None:
        """A new RL step starts (what the engine counts per step starts again)."""
        ...

    def faults(self) -> dict[str, float]:
        """This step's ``faults/*`` metrics on this rank (none for an engine that is not restarted)."""
        ...

    def generate(
        self,
        prompts: list[list[int]],
        *,
        step: int,
        first_index: int,
        n: int | None = None,
        greedy: bool = False,
        injection: bool = True,
        segment: Segment | None = None,
    ) -> tuple[list[list[Sample]], GenerationStats]:
        """``n`` samples of each prompt of this engine's block; ``first_index`` is the block's first global
        prompt index (it seeds the samples). ``injection=False`` samples the policy itself, without the recipe's
        sampling injection (greedy decoding never applies it). ``segment``: partial rollouts, each prompt a prefix
        to go on with (:class:`Segment`: one sample each, with its own seed and budget)."""
        ...

    def score(self, sequences: list[list[int]]) -> list[list[float]]:
        """The engine's logprob of every token of each sequence given its prefix (position 0: 0.0), at T = 1."""
        ...

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load ``(hf_name, tensor)`` pairs in place; the caller verifies them."""
        ...

    def sleep(self, level: int) -> None:
        """Free accelerator memory while the trainer works: level 1 keeps the weights in host memory, level 2
        discards them (a weight update follows)."""
        ...

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Take memory back: ``["weights"]``, then ``["kv_cache"]`` (None: both)."""
        ...

    def reset_prefix_cache(self) -> None:
        """Drop cached KV computed with older weights."""
        ...

    def head_dtype(self) -> str:
        """The dtype the LM head and logits are computed in."""
        ...

    def describe(self) -> dict:
        """Where this rank's engine runs: engine index, its ranks, this rank's device."""
        ...

    def close(self) -> None:
        """Release the engine in this process (before the trainer closes: it may share the trainer's groups)."""
        ...
