"""The rollout fleet a recipe builds, and what a step's generation and weight sync cost on paper.

The layout is :class:`tim_megatron.rollout.base.FleetLayout`, the same object the fleet is built from, so the
plan and the job cannot disagree: world / R engines of R = ``rollout.tensor_parallel_size`` GPUs each.

Decode model (a stated lower bound, not a measurement):

* decoding is memory-bandwidth bound: every decode iteration of an engine reads its weights once (large batches
  touch every expert) plus the KV cache of the sequences in flight, spread over its R GPUs, at the GPU's nominal
  HBM bandwidth (real kernels reach less, so real times are longer);
* every response is ``rollout.max_tokens`` long (the batch lasts as long as its longest response), and a sequence
  in flight holds ``max_prompt_tokens + max_tokens / 2`` tokens of KV cache on average;
* an engine runs as many sequences at once as its KV cache holds at full length
  (``prompt + max_tokens`` tokens each); the rest wait for the next wave (the last wave holds what is left).

time per step = max_tokens x (waves x weights / R + sequences x mean KV per sequence / R) / bandwidth: every
iteration of every wave reads the weights, and every sequence's KV cache is read at each of its iterations.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tim_megatron.recipe.schema import Recipe
from tim_megatron.rollout.base import FleetLayout

if TYPE_CHECKING:
    from tim_megatron.slurm.plan import Plan

HBM_BYTES_PER_S = {
    "a100-80gb": 2.039e12,
    "a100-40gb": 1.555e12,
    "h100-80gb": 3.35e12,
    "h100-94gb": 3.9e12,
    "h200-141gb": 4.8e12,
    "b200-180gb": 8.0e12,
}
"""Nominal HBM bandwidth (vendor data sheets, SXM parts)."""
GIB = 2**30


@dataclass
class FleetPlan:
    engines: int
    ranks_per_engine: int
    kv_cache_gib_per_engine: float
    sync_gib_per_engine: float
    """Bytes every engine loads per sync: the whole model in the rollout dtype."""
    sequences_per_engine: int
    concurrent_sequences: int
    waves: int
    minutes_per_step: float
    """Rollout minutes per step (lower bound), the fleet."""
    single_engine_minutes: float
    """The same model for one engine of R GPUs serving the whole step (the pre-fleet design)."""


def _rollout_minutes(
    recipe: Recipe, *, engines: int, kv_bytes_per_engine: float, sequences: int | None = None
) -> tuple[float, int, int, int]:
    from tim_megatron.slurm.plan import kv_cache_bytes_per_token, split_params

    d, r = recipe.model.dims, recipe.rollout
    R = r.tensor_parallel_size
    bw = HBM_BYTES_PER_S.get(recipe.cluster.gpu_type)
    weights = sum(split_params(d)) * 2  # bf16/fp16 rollout weights
    kv_per_token = R * kv_cache_bytes_per_token(d, rollout_tp=R, dtype="bfloat16")  # over the engine's GPUs
    full = recipe.data.max_prompt_tokens + r.max_tokens
    seqs = math.ceil((recipe.sequences_per_step if sequences is None else sequences) / engines)
    if kv_bytes_per_engine:
        concurrent = int(kv_bytes_per_engine // (kv_per_token * full))
    else:  # a GPU engine with no KV cache generates nothing; a CPU engine's cache is rollout.cpu_kvcache_gib
        concurrent = 0 if recipe.cluster.gpus_per_node else seqs
    if concurrent < 1:  # not one sequence at full length fits: no wave can run
        return float("nan"), seqs, 0, 0
    in_flight = min(concurrent, seqs)
    waves = math.ceil(seqs / in_flight)
    if bw is None:
        return float("nan"), seqs, in_flight, waves
    mean_ctx = recipe.data.max_prompt_tokens + r.max_tokens / 2
    read = waves * weights / R + seqs * mean_ctx * kv_per_token / R
    return r.max_tokens * read / bw / 60, seqs, in_flight, waves


def fleet_plan(recipe: Recipe, plan: Plan | None = None) -> FleetPlan:
    """The recipe's fleet, with the KV cache of ``plan`` (unset: the recipe's own memory plan; pass another to see
    the fleet at another ``gpu_memory_utilization`` or ``trainer.offload_during_rollout``)."""
    from tim_megatron.slurm.plan import estimate

    R = recipe.rollout.tensor_parallel_size
    layout = FleetLayout(world=recipe.parallel.world_size, ranks_per_engine=R)
    kv_gpu = (plan or estimate(recipe)).vllm_kv_cache
    kv_engine = kv_gpu * R
    minutes, seqs, conc, waves = _rollout_minutes(
        recipe, engines=layout.engines, kv_bytes_per_engine=kv_engine
    )
    single, *_ = _rollout_minutes(recipe, engines=1, kv_bytes_per_engine=kv_engine)
    from tim_megatron.slurm.plan import split_params

    total = sum(split_params(recipe.model.dims))
    rollout_bytes = {"float32": 4}.get(recipe.rollout_dtype, 2)
    return FleetPlan(
        engines=layout.engines,
        ranks_per_engine=R,
        kv_cache_gib_per_engine=kv_engine / GIB,
        sync_gib_per_engine=total * rollout_bytes / GIB,
        sequences_per_engine=seqs,
        concurrent_sequences=conc,
        waves=waves,
        minutes_per_step=minutes,
        single_engine_minutes=single,
    )


def validation_sequences(recipe: Recipe) -> int:
    """Sequences one validation generates: one greedy answer per validation prompt, and ``run.val_samples`` sampled
    ones per prompt for the policy's reward (0 without ``run.val_every``)."""
    if not recipe.run.val_every:
        return 0
    return recipe.data.val_prompts * (1 + recipe.run.val_samples)


def validation_minutes(recipe: Recipe, plan: Plan | None = None) -> float:
    """Minutes of generation one validation costs the fleet (the decode model above, its sequences instead of the
    step's); 0 without validation."""
    from tim_megatron.slurm.plan import estimate

    n = validation_sequences(recipe)
    if not n:
        return 0.0
    R = recipe.rollout.tensor_parallel_size
    layout = FleetLayout(world=recipe.parallel.world_size, ranks_per_engine=R)
    kv_engine = (plan or estimate(recipe)).vllm_kv_cache * R
    minutes, *_ = _rollout_minutes(recipe, engines=layout.engines, kv_bytes_per_engine=kv_engine, sequences=n)
    return minutes


def format_fleet(recipe: Recipe, fp: FleetPlan) -> str:
    c = recipe.cluster
    gpus = f"{fp.ranks_per_engine} GPU(s)" if c.gpus_per_node else f"{fp.ranks_per_engine} rank(s)"
    lines = [
        f"  rollout fleet: {fp.engines} vLLM engine(s) x {gpus} (rollout.tensor_parallel_size), "
        f"{fp.sequences_per_engine} sequences each per step",
        f"    KV cache per engine {fp.kv_cache_gib_per_engine:8.2f} GiB: {fp.concurrent_sequences} sequences at full "
        f"length at once, {fp.waves} wave(s)",
        f"    weight sync: {fp.sync_gib_per_engine:.2f} GiB into each engine per step, "
        f"{fp.sync_gib_per_engine * fp.engines:.2f} GiB over the fleet (in place, by reference)",
    ]
    if not fp.concurrent_sequences:
        lines.append(
            "    rollout time: none; the KV cache holds not one sequence at full length (raise "
            "rollout.gpu_memory_utilization or rollout.tensor_parallel_size, or lower rollout.max_model_len)"
        )
    elif math.isnan(fp.minutes_per_step):
        lines.append("    rollout time: no decode estimate (no GPU type with a known HBM bandwidth)")
    else:
        lines.append(
            f"    rollout time per step >= {fp.minutes_per_step:.1f} min with the fleet, "
            f">= {fp.single_engine_minutes:.1f} min with one engine (decode model in tim_megatron/slurm/fleet_plan.py)"
        )
    return "\n".join(lines)
