"""The rollout backends: what samples a step's responses, chosen by ``rollout.backend``.

The one place a backend is added. Each entry says how to build this rank's engine (an object that meets
:class:`tim_megatron.rollout.base.RolloutEngine`) and what its model must satisfy before anything starts. The rest
of the run (the loop, the weight sync, the memory choreography) sees only the protocol.

* ``vllm``: the vLLM fleet (:mod:`tim_megatron.rollout.vllm_engine`), one in-process engine per group of
  ``rollout.tensor_parallel_size`` ranks; with ``rollout.engine_process`` each rank's engine in a process of its
  own, restarted when it fails (:mod:`tim_megatron.rollout.process_engine`).
* ``trainer``: the exact sampler (:mod:`tim_megatron.rollout.exact_sampler`), the Megatron model sampling from its
  own training forward; ``diagnostics.vexact: exact`` implies it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Backend:
    """One rollout backend."""

    name: str
    """The value of ``rollout.backend`` that selects it."""
    build: Callable[..., object]
    """``build(recipe, trainer, model_path=, tokenizer=)``: this rank's engine."""
    check_model: Callable[..., None]
    """``check_model(model_path, on_gpu=, tensor_parallel=)``: raise, naming the reason, for a checkpoint it cannot
    serve with engines of ``tensor_parallel`` ranks."""
    own_copy: bool
    """For ``tim plan``: True when the engine holds its own copy of the weights (in ``rollout.dtype``, split over
    ``rollout.tensor_parallel_size``) and its KV cache inside the ``rollout.gpu_memory_utilization`` share of each
    GPU; False when it samples with the trainer's own weights and keeps its KV cache in the trainer's memory."""


def _build_vllm(recipe, trainer, *, model_path: Path, tokenizer):
    from tim_megatron.rollout.base import FleetLayout
    from tim_megatron.rollout.vllm_engine import VLLMEngine

    layout = FleetLayout(world=trainer.env.world_size, ranks_per_engine=recipe.rollout.tensor_parallel_size)
    engine = VLLMEngine
    if recipe.rollout.engine_process:  # the same engine in a process of its own, restarted when it fails
        from tim_megatron.rollout.process_engine import ProcessEngine as engine
    return engine(
        recipe,
        model_path=model_path,
        layout=layout,
        rank=trainer.rank,
        num_moe_layers=trainer.num_moe_layers(),
    )


def _check_vllm(model_path: Path, *, on_gpu: bool, tensor_parallel: int) -> None:
    from tim_megatron.rollout.vllm_engine import check_model_for_engine

    check_model_for_engine(model_path, on_gpu=on_gpu, tensor_parallel=tensor_parallel)


def _build_trainer(recipe, trainer, *, model_path: Path, tokenizer):
    from tim_megatron.rollout.exact_sampler import ExactSampler

    return ExactSampler(trainer, recipe=recipe, eos_id=tokenizer.eos_token_id)


def _check_trainer(model_path: Path, *, on_gpu: bool, tensor_parallel: int) -> None:
    from tim_megatron.rollout.base import check_model_files

    check_model_files(model_path)  # the trainer reads the same files; no engine of its own to fit


BACKENDS: dict[str, Backend] = {
    "vllm": Backend("vllm", build=_build_vllm, check_model=_check_vllm, own_copy=True),
    "trainer": Backend("trainer", build=_build_trainer, check_model=_check_trainer, own_copy=False),
}
"""Every rollout backend, by ``rollout.backend`` name (the schema's ``Literal`` lists the same names)."""


def backend_for(name: str) -> Backend:
    """The backend of that name: a run's is its modes' (:attr:`tim_megatron.modes.RunModes.backend`, decided by
    :func:`tim_megatron.modes.rollout_backend`)."""
    if name not in BACKENDS:
        raise ValueError(f"rollout.backend = {name!r}: allowed {', '.join(BACKENDS)}")
    return BACKENDS[name]
