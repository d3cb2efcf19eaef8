"""From the shrunk job's measurements to the full recipe: step time by component, and peak memory.

Each figure comes with the formula that produced it, printed with its numbers, so it can be argued with.

Step time (from the preflight's second step, the loop's own timers):

* rollout: decoding is memory-bandwidth bound, so its time follows decode iterations, ``waves x max_tokens``
  (waves: how many times an engine's KV cache is filled, from ``tim plan``'s fleet model);
* logprobs, train (forward and backward) and the rest of the step: compute on each data-parallel rank's tokens,
  ``sequences / dp x width`` (the preflight's measured batch width; the full recipe's widest possible,
  ``max_prompt_tokens + max_tokens``);
* optimizer: one step per update, ``ppo_epochs x minibatches``;
* weight sync: the same bytes (the preflight syncs the full model), so the same time.

Peak memory per device: the measured peak plus what the full recipe's longer sequences add to the activations,
``peak + A(full) - A(preflight)``, with ``A`` the activation term of ``tim plan`` (one micro-batch) at each shape.
On GPU vLLM reserves its memory share at start whatever the workload, so it is already in the measured peak.
"""

from __future__ import annotations

GIB = 2**30


def step_shape(recipe) -> dict:
    """The numbers of a recipe that set its step's amount of work."""
    from tim_megatron.slurm.fleet_plan import fleet_plan

    r = recipe
    try:
        waves = fleet_plan(r).waves
    except ValueError:  # the trainer-side sampler has no fleet
        waves = 1
    return {
        "sequences_per_step": r.sequences_per_step,
        "dp": r.parallel.dp,
        "max_tokens": r.rollout.max_tokens,
        "max_prompt_tokens": r.data.max_prompt_tokens,
        "width": r.data.max_prompt_tokens + r.rollout.max_tokens,
        "updates": r.rl.ppo_epochs * r.rl.minibatches,
        "waves": waves,
        "micro_batch_size": r.trainer.micro_batch_size,
        "max_model_len": r.rollout.max_model_len,
    }


def _at_shape(recipe, *, seq_len: int, micro_batch: int):
    from tim_megatron.slurm.plan import estimate

    r = recipe.model_copy(deep=True)
    r.rollout.max_model_len = seq_len  # the plan's sequence length
    r.trainer.micro_batch_size = micro_batch
    return estimate(r)


def memory_plan(*, full, shrunk) -> dict:
    """``tim plan`` for the full recipe and for the shrunk one at the preflight's own shape (its longest sequence
    and micro-batch), per device, in bytes; ``device_bytes`` is None off GPU."""
    from tim_megatron.slurm.plan import GIB as PLAN_GIB
    from tim_megatron.slurm.plan import estimate

    plan_full = estimate(full)
    rows = shrunk.sequences_per_step // shrunk.parallel.dp // shrunk.rl.minibatches
    seq = shrunk.data.max_prompt_tokens + shrunk.rollout.max_tokens
    plan_pf = _at_shape(shrunk, seq_len=seq, micro_batch=max(1, min(shrunk.trainer.micro_batch_size, rows)))
    return {
        "device_bytes": plan_full.gpu_gib * PLAN_GIB if plan_full.gpu_gib else None,
        "full_total_bytes": plan_full.total,
        "full_activations_bytes": plan_full.activations,
        "preflight_total_bytes": plan_pf.total,
        "preflight_activations_bytes": plan_pf.activations,
        "preflight_shape": {
            "seq_len": seq,
            "micro_batch": max(1, min(shrunk.trainer.micro_batch_size, rows)),
        },
    }


def _ratio(num: float, den: float) -> float:
    return num / den if den else float("nan")


def step_time(times: dict[str, float], *, preflight: dict, full: dict, width: float | None) -> list[dict]:
    """Each component of the preflight's step (seconds, ``times``) extrapolated to the full recipe.

    ``times`` keys: rollout, logprobs, train, optimizer, sync, other. ``width``: the preflight step's measured
    batch width (None: its widest possible)."""
    p, f = preflight, full
    w_pf = width or p["width"]
    tok_pf = p["sequences_per_step"] / p["dp"] * w_pf
    tok_f = f["sequences_per_step"] / f["dp"] * f["width"]
    tokens = (
        _ratio(tok_f, tok_pf),
        f"x ({f['sequences_per_step']}/{f['dp']} seq x {f['width']} tok) / "
        f"({p['sequences_per_step']}/{p['dp']} seq x {w_pf:g} tok) per dp rank",
    )
    rules = {
        "rollout": (
            _ratio(f["waves"] * f["max_tokens"], p["waves"] * p["max_tokens"]),
            f"x ({f['waves']} wave(s) x {f['max_tokens']} tok) / ({p['waves']} wave(s) x {p['max_tokens']} tok) "
            "decode iterations",
        ),
        "logprobs": tokens,
        "train": tokens,
        "optimizer": (
            _ratio(f["updates"], p["updates"]),
            f"x {f['updates']} / {p['updates']} updates (ppo_epochs x minibatches)",
        ),
        "sync": (1.0, "x 1 (the same bytes: the preflight syncs the full model)"),
        "other": tokens,
    }
    out = []
    for name, (ratio, why) in rules.items():
        if name not in times:
            continue
        t = times[name]
        out.append({"component": name, "preflight_s": t, "full_s": t * ratio, "formula": f"{t:.3g} s {why}"})
    if out:
        out.append(
            {
                "component": "step",
                "preflight_s": sum(x["preflight_s"] for x in out),
                "full_s": sum(x["full_s"] for x in out),
                "formula": "sum of the components",
            }
        )
    return out


def memory(peak_bytes: float, plan: dict) -> dict:
    """The measured peak against the plan at the preflight's shape, and extrapolated to the full recipe."""
    extra = plan["full_activations_bytes"] - plan["preflight_activations_bytes"]
    full = peak_bytes + extra
    out = {
        "peak_bytes": peak_bytes,
        "plan_bytes": plan["preflight_total_bytes"],
        "plan_ratio": _ratio(peak_bytes, plan["preflight_total_bytes"]),
        "full_bytes": full,
        "full_plan_bytes": plan["full_total_bytes"],
        "device_bytes": plan["device_bytes"],
        "formula": f"{peak_bytes / GIB:.3f} GiB measured + ({plan['full_activations_bytes'] / GIB:.3f} - "
        f"{plan['preflight_activations_bytes'] / GIB:.3f}) GiB activations (tim plan, full - preflight shape) = "
        f"{full / GIB:.3f} GiB",
    }
    return out
