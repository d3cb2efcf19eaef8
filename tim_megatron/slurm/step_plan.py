"""A whole RL step on paper: rollout, old-logprob pass, update, weight sync and offload, and what offload buys.

Every number is a stated lower bound, so that a measured step can only be slower:

* tokens: every sequence at full length, ``L = data.max_prompt_tokens + rollout.max_tokens`` (the rollout model in
  :mod:`tim_megatron.slurm.fleet_plan` makes the same assumption);
* one forward pass over one sequence costs ``2 x N x L + 2 x layers x heads x head_dim x L^2`` FLOPs: ``N`` is the
  active parameters whose matmuls a token runs through (the routed experts' top-k, the LM head; not the input
  embedding, a lookup), and the second term is attention's ``Q K^T`` and ``A V`` over the causal half of the
  ``L x L`` scores;
* the old-logprob pass is one forward over the step's sequences (none with ``rl.correction.bypass``); the update is
  ``rl.ppo_epochs`` forward-and-backward passes, 3 forwards' FLOPs each, 4 with ``trainer.recompute: full``;
* those FLOPs run on every GPU of the job at ``cluster.assumed_mfu`` of the GPU's dense bf16 peak
  (``GPU_PEAK_BF16_FLOPS``; the MFU's published source is in the field's docstring);
* the weight sync: every GPU receives the whole model in the rollout dtype (the export gathers each parameter on
  every rank) at ``cluster.assumed_sync_gb_per_s``;
* offload: the parts ``trainer.offload_during_rollout`` moves go to pinned host memory and come back, each GPU at
  ``cluster.assumed_host_gb_per_s``.

The step is the sum: nothing overlaps in a colocated, on-policy step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tim_megatron.attention_kinds import attention_kind
from tim_megatron.recipe.schema import GPU_PEAK_BF16_FLOPS, ModelDims, Recipe
from tim_megatron.slurm.fleet_plan import (
    HBM_BYTES_PER_S,
    fleet_plan,
    validation_minutes,
    validation_sequences,
)
from tim_megatron.slurm.plan import GIB, Plan, estimate, largest_utilization, param_count


def step_tokens(recipe: Recipe) -> int:
    """Tokens of one step, every sequence at full length."""
    return recipe.sequences_per_step * (recipe.data.max_prompt_tokens + recipe.rollout.max_tokens)


def model_forward_flops(dims: ModelDims, *, sequences: int, length: int) -> float:
    """FLOPs of one forward pass of ``dims`` over ``sequences`` sequences of ``length`` tokens (formula in the
    module docstring)."""
    d = dims
    n = param_count(d).active - (0 if d.tie_word_embeddings else d.vocab_size * d.hidden_size)
    L = length
    width = attention_kind(d).score_width(d)
    attention = 2 * d.num_layers * d.num_attention_heads * width * L * L
    return sequences * (2 * n * L + attention)


def forward_flops(recipe: Recipe) -> float:
    """FLOPs of one forward pass over the step's sequences (formula in the module docstring)."""
    return model_forward_flops(
        recipe.model.dims,
        sequences=recipe.sequences_per_step,
        length=recipe.data.max_prompt_tokens + recipe.rollout.max_tokens,
    )


@dataclass
class StepPlan:
    """Seconds of each part of one step (lower bounds) and what they assume."""

    rollout: float
    """Decode model of :mod:`tim_megatron.slurm.fleet_plan` (NaN: no HBM bandwidth known for the GPU type)."""
    old_logprobs: float
    update: float
    sync: float
    offload: float
    forward_flops: float
    tokens: int
    cluster_flops: float
    """GPUs x peak x MFU: the FLOP/s the update and the old-logprob pass run at."""
    validation: float
    """Generation of the validations, per step: one validation's (:func:`~tim_megatron.slurm.fleet_plan.
    validation_minutes`) over ``run.val_every`` steps."""
    snapshot: float
    """The overlapped schedule's copies of the trainer's weights (taken once a step, copied in and back for the
    pi_s pass: three copies of a GPU's parameters at its HBM bandwidth; NaN without a known bandwidth)."""
    sync_bytes: float
    """Bytes every GPU receives in the weight sync."""
    offload_bytes: float
    """Bytes every GPU moves to host memory and back (counted once)."""

    def parts(self) -> list[tuple[str, float]]:
        return [
            ("rollout", self.rollout),
            ("old-logprob pass", self.old_logprobs),
            ("update", self.update),
            ("weight sync", self.sync),
            ("offload out and back", self.offload),
            ("validation, per step", self.validation),
        ]

    @property
    def total(self) -> float:
        return sum(v for _, v in self.parts())

    @property
    def sequential_offpolicy(self) -> float:
        """The step off-policy in sequence (``rollout.max_staleness`` > 0, ``schedule: sequential``): the on-policy
        step's parts with two trainer passes, pi_s on the batch just sampled and pi_t on the one trained (bypass
        or not)."""
        forward = self.forward_flops / self.cluster_flops
        return self.rollout + 2 * forward + self.update + self.sync + self.offload + self.validation

    @property
    def overlapped(self) -> float:
        """The step on the overlapped off-policy schedule (``rollout.schedule: overlapped``): generation runs beside
        the trainer's pass at the current weights and the update, then the new batch's pass at its sampling
        weights, the sync and the weight snapshot's copies follow; nothing is offloaded. A lower bound that assumes
        the engine and the trainer do not slow each other down (true of engines on GPUs of their own, not of
        engines sharing the trainer's)."""
        forward = self.forward_flops / self.cluster_flops  # pi_s is always scored, bypass or not
        return (
            max(self.rollout, forward + self.update) + forward + self.sync + self.snapshot + self.validation
        )


def step_plan(recipe: Recipe, plan: Plan | None = None) -> StepPlan | None:
    """The recipe's step (its own memory plan unless ``plan`` is given); None on a CPU recipe (no GPU peak)."""
    c, r = recipe.cluster, recipe
    if not c.gpus_per_node:
        return None
    plan = plan or estimate(recipe)
    fwd = forward_flops(recipe)
    cluster_flops = r.parallel.world_size * GPU_PEAK_BF16_FLOPS[c.gpu_type] * c.assumed_mfu
    per_pass = 4 if r.trainer.recompute == "full" else 3
    sync_bytes = param_count(r.model.dims).total * {"float32": 4}.get(r.rollout_dtype, 2)
    return StepPlan(
        rollout=fleet_plan(recipe, plan).minutes_per_step * 60,
        old_logprobs=0.0 if r.rl.correction.bypass else fwd / cluster_flops,
        update=r.rl.ppo_epochs * per_pass * fwd / cluster_flops,
        sync=sync_bytes / (c.assumed_sync_gb_per_s * 1e9),
        offload=2 * plan.offloaded_bytes / (c.assumed_host_gb_per_s * 1e9),
        validation=validation_minutes(recipe, plan) * 60 / r.run.val_every if r.run.val_every else 0.0,
        snapshot=3 * plan.params / HBM_BYTES_PER_S.get(c.gpu_type, float("nan")),
        forward_flops=fwd,
        tokens=step_tokens(recipe),
        cluster_flops=cluster_flops,
        sync_bytes=sync_bytes,
        offload_bytes=plan.offloaded_bytes,
    )


@dataclass
class RolloutOption:
    """One ``trainer.offload_during_rollout`` at the largest vLLM share it leaves room for."""

    offload: str
    kept: float
    """Trainer bytes on the GPU beside vLLM's share (the parameters stay through the sync, see plan.py)."""
    utilization: float
    kv_cache: float
    """KV cache per GPU, bytes."""
    concurrent: int
    waves: int
    minutes: float


def rollout_options(recipe: Recipe) -> list[RolloutOption]:
    """Every offload level, each at its :func:`largest_utilization` (the recipe's own layout otherwise)."""
    out = []
    from tim_megatron.trainer.offload import LEVELS

    for level in LEVELS:
        util = largest_utilization(estimate(recipe, offload=level))
        plan = estimate(recipe, offload=level, gpu_memory_utilization=util or None)
        fp = fleet_plan(recipe, plan)
        out.append(
            RolloutOption(
                level,
                plan.sync_state,
                util,
                plan.vllm_kv_cache,
                fp.concurrent_sequences,
                fp.waves,
                fp.minutes_per_step,
            )
        )
    return out


# ----------------------------------------------------------------------------------------------- output


def _s(seconds: float) -> str:
    return "unknown" if math.isnan(seconds) else f"{seconds:7.1f} s"


def format_rollout_options(recipe: Recipe, plan: Plan) -> str:
    c, r = recipe.cluster, recipe.rollout
    if not c.gpus_per_node:
        return ""
    lines = [
        "  offload during rollout, each at the largest vLLM share that fits beside what the trainer keeps:",
        f"    {'trainer.offload_during_rollout':<31} {'kept':>9} {'util':>5} {'KV cache/GPU':>13} "
        f"{'at once/engine':>15} {'waves':>6}   rollout",
    ]
    for o in rollout_options(recipe):
        mark = "  <- recipe" if o.offload == plan.offload else ""
        minutes = "unknown" if math.isnan(o.minutes) else f">= {o.minutes:.1f} min"
        lines.append(
            f"    {o.offload:<31} {o.kept / GIB:5.1f} GiB {o.utilization:5.2f} {o.kv_cache / GIB:9.1f} GiB "
            f"{o.concurrent:15d} {o.waves:6d}   {minutes}{mark}"
        )
    best = largest_utilization(plan)
    if best and abs(best - r.gpu_memory_utilization) > 1e-9:
        how = "less than" if r.gpu_memory_utilization < best else "more than"
        lines.append(
            f"    rollout.gpu_memory_utilization {r.gpu_memory_utilization:g} (the recipe's; the job uses it) is {how} "
            f"{best:g}, the largest that fits with offload {plan.offload}"
        )
    return "\n".join(lines)


def format_step(recipe: Recipe, plan: Plan) -> str:
    sp = step_plan(recipe, plan)
    if sp is None:
        return "  step estimate: none on CPU (no GPU peak to divide by)"
    c, r = recipe.cluster, recipe
    peak = GPU_PEAK_BF16_FLOPS[c.gpu_type] / 1e12
    gpus = r.parallel.world_size
    passes = f"{r.rl.ppo_epochs} epoch(s) x {4 if r.trainer.recompute == 'full' else 3} forwards"
    if r.trainer.recompute == "full":
        passes += " (recompute: full)"
    why = {
        "rollout": f"decode model above, gpu_memory_utilization {plan.gpu_memory_utilization:g}",
        "old-logprob pass": "skipped (rl.correction.bypass)"
        if r.rl.correction.bypass
        else f"1 forward, {sp.forward_flops / 1e15:.0f} PFLOP",
        "update": f"{passes} of {sp.forward_flops / 1e15:.0f} PFLOP",
        "weight sync": f"{sp.sync_bytes / GIB:.1f} GiB per GPU at {c.assumed_sync_gb_per_s:g} GB/s",
        "offload out and back": f"2 x {sp.offload_bytes / GIB:.1f} GiB per GPU at {c.assumed_host_gb_per_s:g} GB/s"
        if sp.offload_bytes
        else "nothing moves (trainer.offload_during_rollout: none)",
        "validation, per step": f"{validation_sequences(r)} sequences (data.val_prompts x (1 greedy + "
        f"run.val_samples {r.run.val_samples})) every {r.run.val_every} step(s), decode model above"
        if r.run.val_every
        else "none (run.val_every: 0)",
    }
    lines = [
        f"  step estimate (lower bound; tim_megatron/slurm/step_plan.py): {sp.tokens / 1e6:.1f}M tokens "
        f"({r.sequences_per_step} sequences at full length), {gpus} GPUs x {peak:g} TFLOP/s bf16 x MFU "
        f"{c.assumed_mfu:g} (cluster.assumed_mfu)"
        + ("" if plan.fits else "; the memory plan above does not fit, so no job takes this step")
    ]
    for label, v in sp.parts():
        lines.append(f"    {label:<30} {_s(v)}   {why[label]}")
    total = sp.total
    minutes = "" if math.isnan(total) else f" ({total / 60:.1f} min)"
    lines.append(f"    {'step total':<30} {_s(total)}{minutes}")
    lines += offpolicy_lines(recipe, sp, plan)
    if c.reference_step_seconds is not None:
        ratio = "" if math.isnan(total) else f"; the estimate is {total / c.reference_step_seconds:.2f} of it"
        lines.append(
            f"    {'published':<30} {c.reference_step_seconds:7.1f} s   {c.reference_step_source}{ratio}"
        )
    return "\n".join(lines)


def _variant(recipe: Recipe, *, rollout: dict, trainer: dict | None = None) -> tuple[Recipe | None, str]:
    """``recipe`` with these ``rollout`` (and ``trainer``) settings, or (None, the rule's sentence refusing them)."""
    from pydantic import ValidationError

    data = recipe.model_dump(mode="json")
    data["rollout"].update(rollout)
    data["trainer"].update(trainer or {})
    data["rl"]["correction"]["allow_biased"] = (
        True  # the step's time does not depend on how its loss is corrected
    )
    try:
        return Recipe.model_validate(data), ""
    except ValidationError as e:
        first = e.errors()[0]
        return None, str(first.get("ctx", {}).get("error") or first["msg"]).removeprefix("Value error, ")


def offpolicy_lines(recipe: Recipe, sp: StepPlan, plan: Plan) -> list[str]:
    """The off-policy steps ``tim plan`` prints under the step total, each only where the recipe can run it: in
    sequence (``rollout.max_staleness`` 1 if the recipe has 0) and overlapped (and no offload, the engine awake, as
    that schedule needs); a variant the rules refuse or that does not fit in memory says so instead of a time."""
    r = recipe.rollout
    k = max(r.max_staleness, 1)
    out = []
    mine = " (this recipe's schedule)"
    seq, why = _variant(recipe, rollout={"max_staleness": k, "schedule": "sequential"})
    if seq is None:
        out.append(f"    {'off-policy, sequential':<30} {'not run':>9}   {why}")
    else:
        tag = mine if r.max_staleness and r.schedule == "sequential" else ""
        out.append(
            f"    {'off-policy, sequential':<30} {_s(sp.sequential_offpolicy)}   the step with two trainer passes "
            f"(pi_s and pi_t){tag}"
        )
    over, why = _variant(
        recipe,
        rollout={"max_staleness": k, "schedule": "overlapped", "sleep_between_steps": False},
        trainer={"offload_during_rollout": "none"},
    )
    if over is None:
        out.append(f"    {'off-policy, overlapped':<30} {'not run':>9}   {why}")
        return out
    from tim_megatron.slurm.plan import GIB, estimate

    needs = estimate(over)
    if not needs.fits:
        out.append(
            f"    {'off-policy, overlapped':<30} {'no fit':>9}   nothing offloaded and the engine awake need "
            f"{needs.total / GIB:.1f} GiB per GPU of {needs.budget / GIB:.1f}: {needs.problems()[0]}"
        )
        return out
    osp = step_plan(over, needs)
    tag = mine if r.schedule == "overlapped" else ""
    out.append(
        f"    {'off-policy, overlapped':<30} {_s(osp.overlapped)}   max(rollout, pass + update) + pass + sync + "
        f"weight snapshot ({_s(osp.snapshot).strip()}), nothing offloaded, no contention assumed; against "
        f"{_s(osp.sequential_offpolicy).strip()} in sequence{tag}"
    )
    return out
