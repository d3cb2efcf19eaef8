"""DeepSeek config.json keys that change the model, and group-limited routing that cannot pick its experts.

What each test tries; what happened before; what happens now:

- ``rope_interleave: false`` (HF transformers' DeepSeek-V3 key: rotate the rope channels in halves instead of in
  interleaved pairs). The trainer (megatron-core's MLA) and vLLM's DeepSeek model always rotate interleaved pairs.
  Before: read as the interleaved model; `tim new-recipe` and `tim recipe check` passed, and the trainer and
  engine computed another model than HF transformers (1.66 nats apart). Now: refused by key at config reading
  (`tim new-recipe`, `tim recipe check` of a recipe whose model.path holds the config.json, the trainer's start).
- ``moe_layer_freq: 2``: vLLM (and DeepSeek's own code) give experts only to layers whose index is a multiple of
  it, HF transformers to every layer. Before: planned and trained as all-MoE while vLLM built every other layer
  dense. Now: refused by key in the same places.
- Group-limited routing with one expert per group (``n_group == n_routed_experts``), or fewer experts in the
  chosen groups than ``num_experts_per_tok``. Before: validated and "fit", then crashed at the first forward
  ("selected index k out of range"). Now: refused by the recipe schema and at config reading, naming the keys;
  every layout that validates routes in HF transformers and megatron-core alike.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import importable, require
from tests.tim_cli import new_recipe
from tim_megatron.recipe import RecipeError, load_recipe
from tim_megatron.recipe.schema import ModelDims
from tim_megatron.trainer.families import get_family
from tim_megatron.trainer.hf_config import UnsupportedModelError, dims_from_hf

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "tests" / "data" / "hf-configs"
TIM = str(Path(sys.executable).parent / "tim")
TINY_V3 = ROOT / "recipes" / "tiny-deepseek-v3" / "grpo.yaml"


def _tiny(family: str = "deepseek_v3", **change) -> dict:
    """The tiny model's config.json as transformers writes it, with ``change`` applied."""
    fam = get_family(family)
    cfg = fam.hf_config(fam.tiny).to_dict()
    cfg["architectures"] = list(fam.architectures)
    return {**cfg, **change}


def _published(model: str, **change) -> dict:
    return {**json.loads((CONFIGS / model / "config.json").read_text()), **change}


def _checkpoint(folder: Path, cfg: dict) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


ROPE = r"rope_interleave = False is not supported: .*allowed: true \(the interleaved RoPE of DeepSeek's checkpoints\)"
FREQ = r"moe_layer_freq = 2 is not supported: .*allowed: 1 \(experts in every layer from first_k_dense_replace on"

REFUSED = [
    pytest.param(_tiny(rope_interleave=False), ROPE, id="tiny-v3-rope_interleave"),
    pytest.param(_published("DeepSeek-V3", rope_interleave=False), ROPE, id="deepseek-v3-rope_interleave"),
    pytest.param(_published("Kimi-K2-Instruct", rope_interleave=False), ROPE, id="kimi-k2-rope_interleave"),
    pytest.param(_tiny(moe_layer_freq=2), FREQ, id="tiny-v3-moe_layer_freq"),
    pytest.param(_published("DeepSeek-V3", moe_layer_freq=2), FREQ, id="deepseek-v3-moe_layer_freq"),
    pytest.param(_tiny("deepseek_v2", moe_layer_freq=2), FREQ, id="tiny-v2-moe_layer_freq"),
    pytest.param(
        _tiny(rope_interleave="no"),
        r"rope_interleave = 'no': allowed: true or false",
        id="rope_interleave-str",
    ),
]
ALLOWED = {"rope_interleave": True, "moe_layer_freq": 1}


@pytest.mark.parametrize("cfg,match", REFUSED)
def test_keys_that_change_the_model_are_refused_by_name(cfg, match):
    """Refused by key; the same config.json with the allowed value, or without the key (as published), loads."""
    with pytest.raises(UnsupportedModelError, match=match):
        dims_from_hf(cfg)
    key = next(k for k in ALLOWED if k in match)
    assert dims_from_hf({**cfg, key: ALLOWED[key]}).is_mla
    assert dims_from_hf({k: v for k, v in cfg.items() if k != key}).is_mla


def test_rope_interleave_false_is_another_model_in_hf_transformers():
    """Why the refusal: with the same weights HF transformers' DeepSeek-V3 gives other logits (the key is not a
    label), and it reads moe_layer_freq not at all (every layer from first_k_dense_replace on has experts)."""
    require(importable("transformers"), "transformers")
    import torch
    from transformers import DeepseekV3ForCausalLM

    fam = get_family("deepseek_v3")
    torch.manual_seed(0)
    cfg = fam.hf_config(fam.tiny)
    cfg.initializer_range = 0.1  # weights as large as a trained model's: attention depends on position
    model = DeepseekV3ForCausalLM(cfg).eval()
    ids = torch.randint(0, 64, (1, 24))
    with torch.no_grad():
        interleaved = model(ids).logits.log_softmax(-1)
        model.config.rope_interleave = False
        halves = model(ids).logits.log_softmax(-1)
    assert (interleaved - halves).abs().max() > 0.1  # nats; the project holds every family to 1e-5
    cfg = fam.hf_config(fam.tiny.model_copy(update=dict(num_layers=3)))
    cfg.moe_layer_freq = 2
    layers = DeepseekV3ForCausalLM(cfg).model.layers
    assert [type(layer.mlp).__name__ for layer in layers] == [
        "DeepseekV3MLP",
        "DeepseekV3MoE",
        "DeepseekV3MoE",
    ]
    with pytest.raises(UnsupportedModelError, match=ROPE):
        dims_from_hf(_tiny(rope_interleave=False))


@pytest.mark.parametrize(
    "change,match",
    [({"rope_interleave": False}, ROPE), ({"moe_layer_freq": 2}, FREQ)],
    ids=["rope_interleave", "moe_layer_freq"],
)
def test_tim_new_recipe_refuses_them_in_one_line(change, match, tmp_path):
    root = tmp_path / "recipes"
    root.mkdir()
    hf = _checkpoint(tmp_path / "hf", _published("DeepSeek-V3", **change))
    res = new_recipe(ROOT / "recipes" / "qwen3-30b-a3b", "ds", hf, root, timeout=120)
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: HF="), res.stderr
    assert re.search(match, lines[0]), lines[0]
    assert list(root.iterdir()) == []


def _recipe_on(folder: Path, checkpoint: Path) -> Path:
    """A recipe that runs the tiny DeepSeek-V3 recipe on ``checkpoint`` (its dims: the tiny model's)."""
    folder.mkdir()
    f = folder / "grpo.yaml"
    f.write_text(f"base: {TINY_V3}\nmodel:\n  path: {json.dumps(str(checkpoint))}\n")
    return f


@pytest.mark.parametrize(
    "change,match",
    [({"rope_interleave": False}, ROPE), ({"moe_layer_freq": 2}, FREQ)],
    ids=["rope_interleave", "moe_layer_freq"],
)
def test_tim_recipe_check_reads_the_checkpoint_it_points_at(change, match, tmp_path):
    """The recipe itself is valid (its dims cannot say either key); the checkpoint's config.json is read as the
    trainer reads it at start. The same recipe on the unchanged config.json passes."""
    ok = _recipe_on(tmp_path / "ok", _checkpoint(tmp_path / "hf-ok", _tiny()))
    bad = _recipe_on(tmp_path / "bad", _checkpoint(tmp_path / "hf-bad", _tiny(**change)))
    load_recipe(bad)  # the recipe alone loads
    for target in (ok.parent, ok):
        res = subprocess.run([TIM, "recipe", "check", str(target)], capture_output=True, text=True, cwd=ROOT)
        assert res.returncode == 0, res.stdout + res.stderr
    for target in (bad.parent, bad):
        res = subprocess.run([TIM, "recipe", "check", str(target)], capture_output=True, text=True, cwd=ROOT)
        assert res.returncode == 1 and "Traceback" not in res.stderr, res.stdout + res.stderr
        assert re.search(rf"model.path = {re.escape(str(tmp_path / 'hf-bad'))}: .*{match}", res.stdout), (
            res.stdout
        )


def test_the_trainer_refuses_them_at_start(tmp_path):
    """MegatronTrainer reads the checkpoint's config.json before it builds anything (no process group, no
    weights: the folder holds the config.json only)."""
    require(importable("megatron.core"), "megatron-core")
    from tim_megatron.trainer.megatron_trainer import MegatronTrainer

    for change, match in (({"rope_interleave": False}, ROPE), ({"moe_layer_freq": 2}, FREQ)):
        hf = _checkpoint(tmp_path / next(iter(change)), _tiny(**change))
        recipe = load_recipe(TINY_V3, [f"model.path={hf}"]).recipe
        with pytest.raises(UnsupportedModelError, match=match):
            MegatronTrainer.of_run(recipe, model_path=hf)


# ------------------------------------------------------------------------------- group-limited routing

GROUPS = (
    r"router_groups = 8 splits num_experts = 8 into groups of 1 expert: a group is scored by the sum of its two "
    r"best experts .*so each group needs at least 2 experts; allowed: num_experts / router_groups >= 2 "
    r"\(router_groups <= 4\)"
)


@pytest.mark.parametrize(
    "cfg,match",
    [
        pytest.param(
            _tiny(n_group=8, topk_group=1),
            r"DeepseekV3ForCausalLM: n_group = 8, n_routed_experts = 8: " + GROUPS,
            id="one-expert-per-group",
        ),
        pytest.param(
            _tiny(n_group=8, topk_group=8),
            r"n_group = 8, n_routed_experts = 8: " + GROUPS,
            id="one-expert-per-group-all-groups",
        ),
        pytest.param(
            _tiny(n_routed_experts=16, n_group=8, topk_group=8, num_experts_per_tok=17),
            r"n_group = 8, topk_group = 8, n_routed_experts = 16, num_experts_per_tok = 17: the router_group_topk = "
            r"8 chosen groups hold 8 x 2 = 16 experts, fewer than num_experts_per_tok = 17",
            id="too-few-in-chosen-groups",
        ),
        pytest.param(
            _tiny(n_group=4, topk_group=1, num_experts_per_tok=4),
            r"the router_group_topk = 1 chosen groups hold 1 x 2 = 2 experts, fewer than num_experts_per_tok = 4",
            id="too-few-in-one-group",
        ),
        pytest.param(
            _tiny("glm4_moe", n_group=8, topk_group=8),
            r"Glm4MoeForCausalLM: n_group = 8 is not supported: n_routed_experts = 8 must split into n_group groups "
            r"of at least 2 experts each",
            id="glm-one-expert-per-group",
        ),
        pytest.param(
            _tiny(n_routed_experts=1, n_group=1, topk_group=1, num_experts_per_tok=1),
            r"n_group = 1, n_routed_experts = 1: router_groups = 1 splits num_experts = 1 into groups of 1 expert",
            id="one-expert-bias-router",
        ),
    ],
)
def test_group_routing_that_cannot_pick_its_experts_is_refused_at_config_reading(cfg, match):
    with pytest.raises(UnsupportedModelError, match=match):
        dims_from_hf(cfg)


def test_group_routing_that_cannot_pick_its_experts_is_refused_by_the_recipe():
    with pytest.raises(RecipeError, match=r"grpo.yaml, command line: " + GROUPS):
        load_recipe(TINY_V3, ["model.dims.router_groups=8"])


def _accepted(E: int, g: int, gk: int, k: int) -> bool:
    fields = {
        **get_family("deepseek_v3").tiny.model_dump(),
        "num_experts": E,
        "router_groups": g,
        "router_group_topk": gk,
        "num_experts_per_tok": k,
    }
    try:
        ModelDims(**fields)
    except ValueError:
        return False
    return True


def _hf_route(E, g, gk, k, logits, bias):
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    cfg = DeepseekV3Config(
        hidden_size=E,
        n_routed_experts=E,
        n_group=g,
        topk_group=gk,
        num_experts_per_tok=k,
        norm_topk_prob=True,
    )
    router = DeepseekV3TopkRouter(cfg)
    import torch

    with torch.no_grad():
        router.weight.copy_(torch.eye(E))
        router.e_score_correction_bias.copy_(bias)
    return router(logits)[2]


def _megatron_route(E, g, gk, k, logits, bias):
    from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function

    _, routing_map = topk_routing_with_score_function(
        logits,
        k,
        num_groups=g if g > 1 else None,  # the trainer passes groups only when there are several
        group_topk=gk if g > 1 else None,
        score_function="sigmoid",
        expert_bias=bias,
    )
    return routing_map


def test_every_group_layout_that_validates_routes_in_hf_and_megatron_alike():
    """Every (experts, groups, chosen groups, top-k) with up to 8 experts: the schema accepts it only where HF
    transformers' router and megatron-core's both run and choose the same k experts for every token."""
    require(importable("megatron.core", "transformers"), "megatron-core and transformers")
    import torch

    wrong = []
    for E in (1, 2, 4, 8):
        for g in (d for d in range(1, E + 1) if E % d == 0):
            for gk in range(1, g + 1):
                for k in range(1, E + 1):
                    if not _accepted(E, g, gk, k):
                        continue
                    gen = torch.Generator().manual_seed(E * 1000 + g * 100 + gk * 10 + k)
                    logits = torch.randn(32, E, generator=gen)
                    bias = torch.randn(E, generator=gen) * 0.05
                    try:
                        hf = _hf_route(E, g, gk, k, logits, bias)
                        mg = _megatron_route(E, g, gk, k, logits, bias)
                    except RuntimeError as e:
                        wrong.append((E, g, gk, k, str(e).splitlines()[0]))
                        continue
                    hf_map = torch.zeros(32, E, dtype=torch.bool).scatter_(1, hf, True)
                    if not torch.equal(hf_map, mg.bool()):
                        wrong.append((E, g, gk, k, "the two routers chose different experts"))
    assert not wrong, (
        f"accepted (num_experts, router_groups, router_group_topk, top-k) that do not route: {wrong}"
    )
