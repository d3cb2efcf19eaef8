"""Checks of the recipe given: it resolves, its model checkpoint matches it, and its memory plan fits."""

from __future__ import annotations

from pathlib import Path

from tim_megatron.doctor.base import Context, Outcome, not_checked, recipe_of
from tim_megatron.doctor.services import hub_model


def check_recipe(ctx: Context) -> list[Outcome]:
    if ctx.recipe_arg is None:
        return [Outcome("recipe", "ok", "none given (tim doctor RECIPE [key=value ...] checks one)")]
    if ctx.recipe_error is not None:
        lines = ctx.recipe_error.splitlines() or [""]
        return [
            Outcome(
                "recipe",
                "fail",
                f"{ctx.recipe_arg} does not resolve: {lines[0]}",
                "fix the key named above (tim recipe show prints the resolved recipe)",
                more=tuple(lines[1:]),
            )
        ]
    loaded = ctx.recipe
    p = loaded.recipe.parallel
    return [
        Outcome(
            "recipe",
            "ok",
            f"{ctx.recipe_arg} (files: {' <- '.join(x.name for x in reversed(loaded.chain))}) -> run "
            f"{loaded.name}, tp={p.tp} ep={p.ep} pp={p.pp} dp={p.dp}",
        )
    ]


def check_model(ctx: Context) -> list[Outcome]:
    r = recipe_of(ctx)
    if r is None:
        return not_checked(ctx, "model")
    path = r.model.path
    if path == "tiny":
        return [Outcome("model", "ok", "the built-in tiny MoE (built on first use, cached under TIM_CACHE)")]
    if hub_model(ctx) is not None:
        return [Outcome("model", "ok", f"{path}: a hub name (see the hf cache line)")]
    from tim_megatron.trainer.hf_config import check_dims_match, dims_from_hf, read_hf_config

    try:
        dims = dims_from_hf(read_hf_config(path))
        check_dims_match(r.model.dims, dims, where=f"model.path = {path}")
    except (FileNotFoundError, ValueError) as e:
        lines = str(e).splitlines()
        return [
            Outcome(
                "model",
                "fail",
                lines[0],
                "fix model.path or model.dims",
                more=tuple(x.strip() for x in lines[1:]),
            )
        ]
    if not any(Path(path).glob("*.safetensors")):
        return [Outcome("model", "fail", f"{path} has no *.safetensors weights", "fix model.path")]
    return [Outcome("model", "ok", f"{path}: config.json matches model.dims")]


def check_plan(ctx: Context) -> list[Outcome]:
    r = recipe_of(ctx)
    if r is None:
        return not_checked(ctx, "plan")
    from tim_megatron.slurm.plan import GIB as PLAN_GIB
    from tim_megatron.slurm.plan import estimate, format_plan

    plan = estimate(r)
    table = tuple(format_plan(r, plan, ctx.recipe.name).splitlines())
    total = f"{plan.total / PLAN_GIB:.1f} GiB per GPU"
    if plan.layout:
        return [
            Outcome(
                "plan",
                "fail",
                plan.layout[0],
                "set cluster.nodes (or --nodes) and parallel.dp so that the tp x pp x dp ranks fill the nodes evenly",
                more=table,
            )
        ]
    if not plan.gpu_gib:
        cpu = f"{plan.total / PLAN_GIB:.2f} GiB per process (CPU: no GPU budget)"
        return [Outcome("plan", "ok", cpu, more=table)]
    if not plan.fits:
        return [
            Outcome(
                "plan",
                "fail",
                f"{total} of {plan.gpu_gib} GiB: does not fit",
                "raise parallel.tp / parallel.ep or cluster.nodes, or lower rollout.gpu_memory_utilization",
                more=table,
            )
        ]
    return [Outcome("plan", "ok", f"{total} of {plan.gpu_gib} GiB: fits", more=table)]
