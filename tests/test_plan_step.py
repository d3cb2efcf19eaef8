"""`tim plan` with the trainer's state offloaded during the rollout, and the whole step on paper (issue 25, items
2 and 3): what stays on the GPU beside vLLM, the vLLM share that leaves room for, and the step's breakdown. No
engine starts: these are the plan's formulas, read through the same functions `tim plan` prints."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tim_megatron.cli import app
from tim_megatron.recipe import load_recipe
from tim_megatron.slurm.plan import MAX_GPU_MEMORY_UTILIZATION, estimate, largest_utilization
from tim_megatron.slurm.step_plan import forward_flops, rollout_options, step_plan

ROOT = Path(__file__).resolve().parent.parent
H100 = ROOT / "recipes" / "qwen3-30b-a3b" / "grpo-h100.yaml"
NEMO_RL = ROOT / "recipes" / "qwen3-30b-a3b" / "published" / "nemo-rl-grpo-h100.yaml"


def _recipe(path: Path = H100, *overrides: str):
    return load_recipe(path, list(overrides)).recipe


def _cli(*args: str):
    return CliRunner().invoke(app, [str(a) for a in args])


@pytest.mark.parametrize(
    "level, moved",
    [
        ("optimizer", ("optimizer",)),
        ("optimizer+grads", ("optimizer", "grads")),
        ("all", ("optimizer", "grads")),
    ],
)
def test_the_trainer_state_beside_vllm_shrinks_by_exactly_the_offloaded_parts(level, moved):
    """Beside vLLM's share the trainer keeps its state less the moved parts; with ``all`` the parameters leave only
    after the sync's check, when the KV cache is already back, so they still count at the peak (not while
    generating)."""
    r = _recipe()
    none, off = estimate(r, offload="none"), estimate(r, offload=level)
    assert none.sync_state == none.trainer_state == none.generating_state
    assert none.sync_state - off.sync_state == pytest.approx(sum(getattr(none, p) for p in moved), rel=1e-12)
    gone = (*moved, "params") if level == "all" else moved
    assert none.generating_state - off.generating_state == pytest.approx(
        sum(getattr(none, p) for p in gone), rel=1e-12
    )
    assert off.offloaded_bytes == pytest.approx(sum(getattr(none, p) for p in gone), rel=1e-12)
    assert off.rollout_phase == pytest.approx(off.sync_state + off.vllm_resident, rel=1e-12)
    assert off.update_phase == none.update_phase  # everything is back for the update


def test_the_chosen_utilization_fits_and_is_larger_with_offload():
    r = _recipe()
    chosen = {}
    for level in ("none", "optimizer", "optimizer+grads"):
        util = largest_utilization(estimate(r, offload=level))
        plan = estimate(r, offload=level, gpu_memory_utilization=util)
        assert plan.fits, (level, plan.problems())
        # the largest: one more percent would not fit (or would pass the cap)
        more = estimate(r, offload=level, gpu_memory_utilization=util + 0.01)
        assert util + 0.01 > MAX_GPU_MEMORY_UTILIZATION or not more.fits, level
        chosen[level] = (util, plan.vllm_kv_cache)
    assert chosen["none"][0] < chosen["optimizer"][0] < chosen["optimizer+grads"][0]
    assert (
        chosen["optimizer+grads"][1]
        > 3 * estimate(r, offload="none", gpu_memory_utilization=0.35).vllm_kv_cache
    )
    options = {o.offload: o for o in rollout_options(r)}
    assert options["optimizer+grads"].waves < options["none"].waves
    assert options["optimizer+grads"].minutes < options["none"].minutes


def test_tim_plan_prints_the_rollout_with_and_without_offload_and_the_recipes_own_share():
    """Without offload the shipped share (0.84) does not fit, and the plan says so, with the share that would."""
    res = _cli("plan", H100, "trainer.offload_during_rollout=none")
    assert res.exit_code == 1, res.output
    assert "generation: trainer state 35.2 GiB + vLLM 67.2 GiB = 102.4 GiB > 76.0 GiB" in res.output
    rows = {
        line.split()[0]: line for line in res.output.splitlines() if line.startswith("    ") and "GiB" in line
    }
    assert "<- recipe" in rows["none"] and "<- recipe" not in rows["optimizer+grads"]
    assert "0.84" in rows["optimizer+grads"] and "0.50" in rows["none"]
    assert (
        "rollout.gpu_memory_utilization 0.84 (the recipe's; the job uses it) is more than 0.5" in res.output
    )
    shipped = _cli("plan", H100)
    assert shipped.exit_code == 0 and "offload during rollout           optimizer+grads" in shipped.output
    assert "(the recipe's; the job uses it)" not in shipped.output  # the shipped value is the chosen one


def test_the_step_breakdown_sums_and_scales_as_its_formulas_say():
    r = _recipe()
    sp = step_plan(r)
    assert sp.total == pytest.approx(sum(v for _, v in sp.parts()), rel=1e-12)
    assert all(v > 0 for _, v in sp.parts())
    # update = 4 forwards (recompute: full) and old logprobs = 1 forward, at GPUs x peak x MFU
    assert sp.cluster_flops == 32 * 989e12 * 0.2
    assert sp.update == pytest.approx(4 * sp.old_logprobs, rel=1e-12)
    assert _recipe(H100, "trainer.recompute=none").trainer.recompute == "none"
    assert step_plan(_recipe(H100, "trainer.recompute=none")).update == pytest.approx(3 * sp.old_logprobs)
    assert step_plan(_recipe(H100, "rl.correction.bypass=true")).old_logprobs == 0
    # twice the sequences: twice the FLOPs and update time; half the MFU: twice the time
    double = step_plan(_recipe(H100, "data.prompts_per_step=256"))
    assert forward_flops(_recipe(H100, "data.prompts_per_step=256")) == pytest.approx(2 * sp.forward_flops)
    assert double.update == pytest.approx(2 * sp.update, rel=1e-12)
    assert step_plan(_recipe(H100, "cluster.assumed_mfu=0.1")).update == pytest.approx(
        2 * sp.update, rel=1e-12
    )
    # forward FLOPs per sequence: 2 N L + 2 layers heads head_dim L^2, N without the input embedding
    d, L = r.model.dims, r.data.max_prompt_tokens + r.rollout.max_tokens
    n = 3_353_032_704 - d.vocab_size * d.hidden_size
    assert sp.forward_flops == pytest.approx(2048 * (2 * n * L + 2 * 48 * 32 * 128 * L * L), rel=1e-12)
    # sync: the whole model in bf16 per GPU at the stated rate; offload: the moved bytes out and back
    assert sp.sync == pytest.approx(30_532_122_624 * 2 / 100e9, rel=1e-12)
    assert step_plan(_recipe(H100, "cluster.assumed_sync_gb_per_s=50")).sync == pytest.approx(2 * sp.sync)
    plan = estimate(r)
    assert sp.offload == pytest.approx(2 * (plan.grads + plan.optimizer) / 25e9, rel=1e-12)
    assert step_plan(_recipe(H100, "trainer.offload_during_rollout=none")).offload == 0
    assert sp.rollout == pytest.approx(60 * rollout_options(r)[2].minutes, rel=1e-12)


def test_the_nemo_rl_matched_recipe_prints_its_estimate_beside_the_published_192_s():
    r = _recipe(NEMO_RL)
    assert (r.data.prompts_per_step * r.rollout.n, r.sequences_per_step // r.rl.minibatches) == (2048, 512)
    assert (r.rollout.max_model_len, r.parallel.world_size, r.parallel.tp, r.parallel.ep) == (4096, 32, 1, 8)
    res = _cli("plan", NEMO_RL)
    assert res.exit_code == 0, res.output
    total = next(line for line in res.output.splitlines() if "step total" in line)
    published = next(line for line in res.output.splitlines() if line.strip().startswith("published"))
    assert "192.0 s" in published and "NeMo-RL v0.6 performance summary" in published
    assert f"{step_plan(r).total:7.1f} s" in total
    assert not math.isnan(step_plan(r).total)
    assert "published" not in _cli("plan", H100).output  # only a recipe that carries a reference prints one


@pytest.mark.parametrize(
    "override, wanted",
    [
        ("cluster.assumed_mfu=0", "cluster.assumed_mfu = 0: Input should be greater than 0"),
        ("cluster.assumed_mfu=1.5", "cluster.assumed_mfu = 1.5: Input should be less than or equal to 1"),
        (
            "cluster.assumed_sync_gb_per_s=0",
            "cluster.assumed_sync_gb_per_s = 0: Input should be greater than 0",
        ),
        (
            "cluster.assumed_host_gb_per_s=-1",
            "cluster.assumed_host_gb_per_s = -1: Input should be greater than 0",
        ),
        (
            "cluster.reference_step_seconds=10",
            "cluster.reference_step_seconds = 10 needs cluster.reference_step_source",
        ),
    ],
)
def test_a_bad_planning_value_is_a_named_error(override, wanted):
    res = _cli("plan", H100, override)
    assert res.exit_code == 2, res.output
    assert "error:" in res.output and wanted in res.output and "Traceback" not in res.output


def test_the_plan_counts_the_rollout_backend_it_has():
    """The vLLM backend holds its own weights and KV cache in its GPU share; the exact sampler (the trainer
    backend) holds no copy, and its cache: every row of its data-parallel rank at the training width, in the
    trainer's dtype and TP (exact_cache)."""
    from tim_megatron.slurm.plan import exact_cache, kv_cache_bytes_per_token

    vllm = estimate(load_recipe("recipes/qwen3-30b-a3b/gspo.yaml", ["parallel.ep=2"]).recipe)
    exact = load_recipe(
        "recipes/qwen3-30b-a3b/gspo.yaml", ["diagnostics.vexact=exact", "parallel.ep=2"]
    ).recipe
    plan = estimate(exact)
    per_token = kv_cache_bytes_per_token(
        exact.model.dims, rollout_tp=exact.parallel.tp, dtype=exact.trainer_dtype
    )
    assert vllm.vllm_weights > 0 and vllm.vllm_share > vllm.vllm_weights
    assert plan.vllm_weights == 0 and plan.gpu_memory_utilization == 0
    rows = exact.data.prompts_per_step * exact.rollout.n // exact.parallel.dp
    width = exact.data.max_prompt_tokens + exact.rollout.max_tokens
    assert plan.vllm_kv_cache == plan.kv_needed == exact_cache(exact).cache == per_token * rows * width
    assert plan.trainer_state == vllm.trainer_state
    assert (
        plan.rollout_phase == plan.sync_state + exact_cache(exact).cache
    )  # the whole cache beside the trainer


def test_the_off_policy_steps_are_printed_only_where_the_recipe_can_run_them():
    """The off-policy lines under the step total (issue 58, item 6). Before: the overlapped step (638 s) was set
    beside the on-policy one (994 s) instead of the sequential off-policy one (1,100 s), left out the weight
    snapshot, and was printed for a recipe whose schedule is refused and which does not fit. Now: the sequential
    off-policy step is the on-policy one with two trainer passes; the overlapped one adds the snapshot's copies and
    the validations and is printed next to it only where the rules accept the schedule and the memory fits (else
    the rule's sentence, or what does not fit)."""
    sp = step_plan(_recipe(H100, "trainer.offload_during_rollout=none"))
    fwd = sp.forward_flops / sp.cluster_flops
    assert sp.sequential_offpolicy == pytest.approx(sp.total + fwd, rel=1e-12)
    assert sp.snapshot == pytest.approx(3 * estimate(_recipe(H100)).params / 3.35e12)
    assert sp.overlapped == pytest.approx(
        max(sp.rollout, fwd + sp.update) + fwd + sp.sync + sp.snapshot + sp.validation, rel=1e-12
    )
    bypass = step_plan(_recipe(H100, "trainer.offload_during_rollout=none", "rl.correction.bypass=true"))
    assert bypass.sequential_offpolicy == pytest.approx(sp.sequential_offpolicy, rel=1e-12)  # pi_s and pi_t
    out = _cli("plan", H100, "trainer.offload_during_rollout=none").output
    assert f"{'off-policy, sequential':<30} {sp.sequential_offpolicy:7.1f} s" in out
    assert "off-policy, overlapped" in out and "not run   rollout.schedule = overlapped with" in out
    assert "tensor_parallel_size = 4" in out  # the H100 recipe's engines span 4 GPUs: the rule's own sentence
    big = _cli("plan", H100, "rollout.tensor_parallel_size=1").output
    assert "no fit   nothing offloaded and the engine awake need" in big  # its memory, not a time
    small = ROOT / "recipes" / "olmoe-1b-7b" / "base.yaml"
    one = [
        "rollout.tensor_parallel_size=1",
        "rollout.max_staleness=1",
        "rollout.schedule=overlapped",
        "rl.correction.mode=tis",
    ]
    fits = _cli(
        "plan", small, *one, "trainer.offload_during_rollout=none", "rollout.sleep_between_steps=false"
    )
    osp = step_plan(
        _recipe(small, *one, "trainer.offload_during_rollout=none", "rollout.sleep_between_steps=false")
    )
    assert f"{'off-policy, overlapped':<30} {osp.overlapped:7.1f} s" in fits.output
    assert f"against {osp.sequential_offpolicy:.1f} s in sequence (this recipe's schedule)" in fits.output


def test_an_engine_with_no_kv_cache_is_not_said_to_run_a_wave():
    """Issue 58: with a 0 GiB KV cache the fleet claimed 64 sequences at once in one wave."""
    from tim_megatron.slurm.fleet_plan import fleet_plan

    r = _recipe(H100, "rollout.tensor_parallel_size=1", "rollout.gpu_memory_utilization=0.5")
    fp = fleet_plan(r)
    assert (fp.concurrent_sequences, fp.waves) == (0, 0) and math.isnan(fp.minutes_per_step)
    out = _cli("plan", H100, "rollout.tensor_parallel_size=1", "rollout.gpu_memory_utilization=0.5").output
    assert (
        "0 sequences at full length at once, 0 wave(s)" in out
        and "the KV cache holds not one sequence" in out
    )


def test_the_step_counts_the_validations_it_runs():
    """Issue 56: ``run.val_samples`` sizes the evaluation at each validation, which ``tim plan`` did not count. The
    plan's step now has a validation part: one validation's generation (val_prompts x (1 greedy + val_samples)
    sequences, the same decode model as the rollout) spread over ``run.val_every`` steps; none without it."""
    from tim_megatron.slurm.fleet_plan import validation_minutes, validation_sequences

    off = step_plan(_recipe(H100, "run.val_every=0"))
    assert off.validation == 0.0 and off.total == pytest.approx(sum(v for _, v in off.parts()))
    greedy = _recipe(H100, "run.val_every=10", "run.val_samples=0")
    sampled = _recipe(H100, "run.val_every=10", "run.val_samples=8")
    assert validation_sequences(greedy) == greedy.data.val_prompts
    assert validation_sequences(sampled) == 9 * sampled.data.val_prompts
    one, many = step_plan(greedy), step_plan(sampled)
    assert 0 < one.validation < many.validation
    assert many.validation == pytest.approx(validation_minutes(sampled) * 60 / 10)
    assert many.total - off.total == pytest.approx(many.validation)
    every_5 = step_plan(_recipe(H100, "run.val_every=5", "run.val_samples=8"))
    assert every_5.validation == pytest.approx(2 * many.validation)
    printed = _cli("plan", H100, "run.val_every=10", "run.val_samples=8").output
    assert "validation, per step" in printed and "every 10 step(s)" in printed


def test_the_memory_plan_counts_the_optimizer_steps_transient_and_the_heads_buffers():
    """Issue 57, item 7: the measured peaks of the 30B layer shape on an H200 were 1.09-1.12x the plan because torch's
    foreach AdamW (what megatron-core falls back to without apex or transformer-engine) allocates 4 bytes per
    parameter at the step. The plan counts it for the foreach kernel (none for the fused one, the GPU default),
    after the backward's activations are gone; and the head's chunk at 8 bytes per logit plus one chunk's
    head-weight gradient."""
    from tim_megatron.slurm.plan import split_params

    fused = estimate(_recipe(H100, "trainer.optimizer_kernel=auto"))
    foreach = estimate(_recipe(H100, "trainer.optimizer_kernel=foreach"))
    r = _recipe(H100)
    p, d = r.parallel, r.model.dims
    dense, experts = split_params(d)
    dp, edp = p.world_size // p.tp, p.world_size // (p.ep * p.etp)
    stepped = dense / p.tp / dp + experts / (p.ep * p.etp) / edp
    assert fused.step_transient == 0.0 and foreach.step_transient == pytest.approx(4 * stepped)
    assert foreach.trainer == pytest.approx(foreach.trainer_state + max(foreach.activations, 4 * stepped))
    assert fused.trainer == pytest.approx(fused.trainer_state + fused.activations)
    chunk = estimate(_recipe(H100, "trainer.logprob_chunk=2048")).activations - fused.activations
    assert chunk == pytest.approx(1024 * r.trainer.micro_batch_size * d.vocab_size / p.tp * 8)
    printed = _cli("plan", H100, "trainer.optimizer_kernel=foreach").output
    assert "optimizer step transient" in printed
