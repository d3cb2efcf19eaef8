"""A run's modes (tim_megatron/modes.py) and attention kinds (tim_megatron/attention_kinds.py): derived once, and
the only places outside recipe/ that decode the recipe's mode strings."""

import dataclasses
import re
from pathlib import Path

import pytest

from tim_megatron.attention_kinds import GROUPED_QUERY, LATENT, attention_kind, attention_kind_of_config
from tim_megatron.modes import modes_of
from tim_megatron.recipe import load_recipe
from tim_megatron.slurm.plan import kv_cache_bytes_per_token
from tim_megatron.trainer.patching import KNOWN

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "recipes/tiny-moe/grpo.yaml"
DEEPSEEK = ROOT / "recipes/deepseek-v3/grpo.yaml"


def modes(path=TINY, *overrides):
    return modes_of(load_recipe(path, list(overrides)).recipe)


@pytest.mark.parametrize(
    "replay, capture, old_pass, rollout_routes, probe, update, from_old",
    [
        ("off", "false", "off", False, False, "off", False),
        ("off", "true", "off", False, False, "off", False),
        ("r2", "false", "record", False, False, "replay", True),
        ("r3", "false", "replay", True, True, "replay", False),  # R3 captures the engine's routing itself
    ],
)
def test_routing_per_phase(replay, capture, old_pass, rollout_routes, probe, update, from_old):
    m = modes(TINY, f"remedies.router_replay={replay}", f"rollout.capture_routed_experts={capture}")
    r = m.routing
    assert (r.old_pass, r.old_pass_uses_rollout_routes, r.free_routing_probe) == (
        old_pass,
        rollout_routes,
        probe,
    )
    assert (r.update, r.update_routes_from_old_pass, r.engine_routes) == (update, from_old, replay == "r3")
    assert ("router_replay" in m.patches) == (replay != "off")


def test_exact_mode_fields():
    plain, exact = modes(), modes(TINY, "diagnostics.vexact=exact")
    assert (plain.exact, plain.backend, plain.dispatcher) == (False, "vllm", None)
    assert (exact.exact, exact.backend, exact.dispatcher) == (True, "trainer", "allgather")
    assert "invariant_kernels" in exact.patches and "invariant_kernels" not in plain.patches
    with pytest.raises(dataclasses.FrozenInstanceError):  # decided once
        exact.exact = False


def test_attention_kind_and_its_patches():
    tiny, deepseek = load_recipe(TINY).recipe, load_recipe(DEEPSEEK).recipe
    assert attention_kind(tiny.model.dims) is GROUPED_QUERY and attention_kind(deepseek.model.dims) is LATENT
    m = modes_of(deepseek)
    assert m.attention is LATENT and "mla_without_te" in m.patches
    assert ("mla_tp_rope_grad" in m.patches) == (deepseek.parallel.tp > 1)
    assert set(m.patches) <= set(KNOWN) and set(modes_of(tiny).patches) <= set(KNOWN)
    assert attention_kind_of_config({"kv_lora_rank": 512}) is LATENT
    assert attention_kind_of_config({"kv_lora_rank": 0}) is GROUPED_QUERY


def test_kv_cache_bytes_by_kind():
    d = load_recipe(DEEPSEEK).recipe.model.dims
    assert kv_cache_bytes_per_token(d, rollout_tp=8, dtype="bfloat16") == d.num_layers * (512 + 64) * 2
    t = load_recipe(TINY).recipe.model.dims
    heads = max(-(-t.num_key_value_heads // 2), 1)
    assert (
        kv_cache_bytes_per_token(t, rollout_tp=2, dtype="float32")
        == 2 * t.num_layers * heads * t.head_dim * 4
    )


def test_cpu_engine_limits_by_kind():
    assert LATENT.check_cpu_engine({"kv_lora_rank": 512, "qk_rope_head_dim": 64}, head_sizes=list) is None
    refused = LATENT.check_cpu_engine({"kv_lora_rank": 256, "qk_rope_head_dim": 64}, head_sizes=list)
    assert "kv_lora_rank = 256" in refused and "512 and 64" in refused
    cfg = {"hidden_size": 256, "num_attention_heads": 16}  # head_dim 16
    assert "head_dim = 16" in GROUPED_QUERY.check_cpu_engine(cfg, head_sizes=lambda: [32, 64])
    assert GROUPED_QUERY.check_cpu_engine({**cfg, "head_dim": 64}, head_sizes=lambda: [32, 64]) is None


def test_modes_are_decided_in_one_place():
    """Outside recipe/ (the validators, which run before modes exist) and the modes module, nothing decodes the
    exact mode, the router-replay strings or the attention kind itself."""
    rx = re.compile(r'vexact ==|"r2"|"r3"|is_mla')
    pkg = ROOT / "tim_megatron"
    found = [
        f"{p.relative_to(ROOT)}:{i}"
        for p in sorted(pkg.rglob("*.py"))
        if p.parent != pkg / "recipe" and p.name != "modes.py"
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if rx.search(line)
    ]
    assert found == []


MODE_FIELDS = {
    "vexact": "diagnostics.vexact (RunModes.exact)",
    "router_replay": "remedies.router_replay (RunModes.routing)",
    "capture_routed_experts": "rollout.capture_routed_experts (modes.captures_routes, Routing.capture)",
}
"""The recipe fields a run's modes decide; a read of one outside modes.py and recipe/ decides a mode again."""


def mode_reads(source: str) -> list[str]:
    """Every read of a mode field in ``source`` (line: what it decides): an attribute load of one of
    :data:`MODE_FIELDS`, or of ``backend`` on a ``rollout`` section (``rollout.backend``: RunModes.backend)."""
    import ast

    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Attribute) or not isinstance(node.ctx, ast.Load):
            continue
        if node.attr in MODE_FIELDS:
            found.append(f"{node.lineno}: {MODE_FIELDS[node.attr]}")
        elif (
            node.attr == "backend" and isinstance(node.value, ast.Attribute) and node.value.attr == "rollout"
        ):
            found.append(f"{node.lineno}: rollout.backend (RunModes.backend)")
    return found


def test_the_mode_fields_are_read_only_where_the_modes_are_decided():
    """Issue 60, item 1: the backend, exact mode, router replay and route capture are decided in modes.py (and
    checked by the validators in recipe/, which run before modes exist); every other module asks the modes. The
    scanner finds planted reads of each kind, and none in the package."""
    planted = (
        "if recipe.diagnostics.vexact == 'exact': pass\n"
        "replay = r.remedies.router_replay\n"
        "capture = recipe.rollout.capture_routed_experts and n > 0\n"
        "name = recipe.rollout.backend or 'vllm'\n"
        "r.rollout.backend = 'vllm'\n"  # a store is no read
    )
    assert sorted(f.split(":")[0] for f in mode_reads(planted)) == ["1", "2", "3", "4"]
    assert mode_reads("modes.exact and modes.routing.capture and modes.backend == 'vllm'\n") == []
    pkg = ROOT / "tim_megatron"
    found = [
        f"{p.relative_to(ROOT)}:{hit}"
        for p in sorted(pkg.rglob("*.py"))
        if p.parent != pkg / "recipe" and p.name != "modes.py"
        for hit in mode_reads(p.read_text())
    ]
    assert found == []
    import tim_megatron.recipe.schema as schema

    assert not hasattr(schema.Recipe, "rollout_backend") and not hasattr(
        schema.Recipe, "capture_routed_experts"
    )


def test_the_trainer_doctor_and_plan_share_one_kernel_rule():
    """Issue 60, item 1: one resolver (trainer/kernel_choice.py) for the trainer, ``tim doctor`` and ``tim plan``:
    exact mode keeps the materialized attention and the expert loop on a GPU too, biased experts (gpt-oss) take the
    loop, ``auto`` takes SDPA, the grouped GEMM and fused Adam on a GPU in bfloat16, and the plan counts what the
    resolver picks."""
    from tim_megatron.slurm.plan import _kernels
    from tim_megatron.trainer.kernel_choice import choose_kernels, planned_grouped_problem

    def chosen(path, *overrides, on_gpu=True):
        r = load_recipe(path, list(overrides)).recipe
        return choose_kernels(r, modes_of(r), on_gpu=on_gpu, grouped_problem=planned_grouped_problem)

    qwen = ROOT / "recipes/qwen3-30b-a3b/gspo.yaml"
    assert dataclasses.astuple(chosen(qwen)) == ("sdpa", "grouped", "fused")
    assert dataclasses.astuple(chosen(qwen, on_gpu=False)) == ("materialized", "loop", "foreach")
    assert dataclasses.astuple(chosen(TINY, "diagnostics.vexact=exact")) == ("materialized", "loop", "fused")
    assert chosen(ROOT / "recipes/gpt-oss-20b/grpo.yaml").experts == "loop"  # expert biases
    assert (
        chosen(qwen, "trainer.dtype=float32", "rollout.dtype=float32").experts == "loop"
    )  # auto: the CUDA kernel takes bfloat16 only
    r = load_recipe(qwen).recipe
    assert _kernels(r, on_gpu=True) == chosen(qwen)
    grouped_fp32 = load_recipe(
        qwen, ["trainer.dtype=float32", "rollout.dtype=float32", "trainer.experts=grouped"]
    ).recipe
    with pytest.raises(ValueError, match="trainer.experts = grouped"):
        choose_kernels(
            grouped_fp32, modes_of(grouped_fp32), on_gpu=True, grouped_problem=planned_grouped_problem
        )
    assert _kernels(grouped_fp32, on_gpu=True).experts == "grouped"  # the plan counts what was asked
