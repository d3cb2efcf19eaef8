"""The two mode decisions the recipe's validators need before a run's modes exist, stated once: what samples the
responses, and whether the rollout records its routing. :mod:`tim_megatron.modes` builds the run's modes from them
(and re-exports them); the validators in :mod:`tim_megatron.recipe.rules` check pairings with them. This module
reads a recipe's fields and imports nothing of the project (the schema imports the validators)."""

from __future__ import annotations


def rollout_backend(recipe) -> str:
    """What samples the responses: ``rollout.backend``, or what ``diagnostics.vexact`` implies when it is unset
    (exact mode: the trainer's exact sampler; otherwise vLLM)."""
    if recipe.rollout.backend is not None:
        return recipe.rollout.backend
    return "trainer" if recipe.diagnostics.vexact == "exact" else "vllm"


def captures_routes(recipe) -> bool:
    """The rollout records the experts it routed each token to: asked for (``rollout.capture_routed_experts``, for the
    agreement metric) or needed (R3 replays them in the trainer). The model must have experts as well
    (:attr:`tim_megatron.modes.Routing.capture`)."""
    return recipe.rollout.capture_routed_experts or recipe.remedies.router_replay == "r3"
