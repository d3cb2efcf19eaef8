"""gpt-oss (issue 59), the unit-level parts: config.json reading and what is refused by name, the megatron-core
patches (each checked against what megatron-core does without it), the trainer's sink attention on FlexAttention
against megatron-core's materialized one, the vLLM reload patch's stream, the MXFP4 format and ``tim dequantize``,
and that the tiny model exercises every feature. The whole-model checks (trainer and vLLM against HF in fp32, TP2 and
EP2, the verified syncs with and without the vLLM patch, three trained steps, tim align) run with every other family
in tests/test_families.py."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest
import torch

from tests.conftest import importable, require
from tests.tim_cli import run_tim

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "tiny-gpt-oss" / "grpo.yaml"
PUBLISHED = ROOT / "tests" / "data" / "hf-configs"


def _published(model: str = "gpt-oss-20b", **change) -> dict:
    cfg = json.loads((PUBLISHED / model / "config.json").read_text())
    for k, v in change.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    return cfg


# ------------------------------------------------------------------------------------------- config.json


def test_the_published_configs_read_with_every_feature():
    from tim_megatron.attention_kinds import SINKS_AND_WINDOWS, attention_kind, attention_kind_of_config
    from tim_megatron.trainer.hf_config import dims_from_hf

    d = dims_from_hf(_published())
    assert (d.family, d.num_layers, d.num_experts, d.num_experts_per_tok, d.moe_intermediate_size) == (
        "gpt_oss",
        24,
        32,
        4,
        2880,
    )
    assert (d.attention_sinks, d.sliding_window, d.linear_biases, d.attention_bias, d.swiglu_limit) == (
        True,
        128,
        True,
        True,
        7.0,
    )
    assert (d.rope_scaling, d.yarn_factor, d.yarn_original_max_position_embeddings, d.yarn_truncate) == (
        "yarn",
        32.0,
        4096,
        False,
    )
    assert (d.rope_theta, d.rms_norm_eps, d.qk_norm, d.norm_topk_prob) == (150000.0, 1e-5, "none", True)
    assert attention_kind(d) is SINKS_AND_WINDOWS is attention_kind_of_config(_published())
    assert dims_from_hf(_published("gpt-oss-120b")).num_experts == 128


@pytest.mark.parametrize(
    "change,match",
    [
        (
            {"layer_types": ["full_attention"] * 24},
            r"layer_types\[0\] = 'full_attention' is not supported: vLLM's gpt-oss windows the even layers",
        ),
        (
            {"layer_types": ["sliding_attention", "full_attention"]},
            r"layer_types = \['sliding_attention', 'full_attention'\] is not supported: one entry per layer \(24\)",
        ),
        (
            {"rms_norm_eps": 1e-6},
            r"rms_norm_eps = 1e-06 is not supported: vLLM's gpt-oss builds every RMSNorm",
        ),
        (
            {"swiglu_limit": 8.0},
            r"swiglu_limit = 8.0 is not supported: vLLM's swigluoai activation hard-codes 7",
        ),
        ({"swiglu_alpha": 1.5}, r"swiglu_alpha = 1.5 is not supported: .*hard-codes 1.702"),
        (
            {"rope_scaling": {"rope_type": "linear", "factor": 2.0}},
            r"rope_scaling.rope_type = 'linear' is not supported: vLLM's gpt-oss always builds YaRN",
        ),
        (
            {
                "rope_scaling": {
                    "rope_type": "yarn",
                    "factor": 32.0,
                    "original_max_position_embeddings": 4096,
                    "attention_factor": 1.2,
                }
            },
            r"rope_scaling: attention_factor = 1.2 is not supported",
        ),
        ({"tie_word_embeddings": True}, r"tie_word_embeddings = True is not supported"),
        ({"attention_bias": False}, r"attention_bias = False is not supported"),
        ({"sliding_window": None}, r"key 'sliding_window' is missing"),
        ({"quantization_config": {"quant_method": "awq"}}, r"quant_method = 'awq' is not supported"),
    ],
)
def test_what_vllm_would_compute_otherwise_is_refused_by_key(change, match):
    from tim_megatron.trainer.hf_config import UnsupportedModelError, dims_from_hf

    with pytest.raises(UnsupportedModelError, match=match):
        dims_from_hf(_published(**change))


@pytest.mark.parametrize(
    ("recipe", "override", "match"),
    [
        (RECIPE, "parallel.tp=2", r"parallel.expert_tp = 2 with expert biases \(model.dims.linear_biases\)"),
        (
            RECIPE,
            "trainer.experts=grouped",
            r"trainer.experts = grouped with expert biases .* the grouped experts .* have no biases",
        ),
        (
            RECIPE,
            "diagnostics.vexact=exact",
            r"diagnostics.vexact = exact with attention sinks or sliding windows",
        ),
        (RECIPE, "model.dims.attention_bias=false", r"linear_biases = true needs attention_bias = true"),
        (
            ROOT / "recipes/tiny-moe/grpo.yaml",
            "model.dims.attention_sinks=true",
            r"model.dims.attention_sinks = True is attention sinks, which model.dims.family = qwen3_moe does not have "
            r"\(families with it: gpt_oss\)",
        ),
        (
            ROOT / "recipes/tiny-moe/grpo.yaml",
            "model.dims.sliding_window=8",
            r"sliding_window = 8 is alternating sliding-window attention",
        ),
    ],
)
def test_the_trainer_settings_that_cannot_compute_it_are_refused(recipe, override, match):
    from tim_megatron.recipe import RecipeError, load_recipe

    with pytest.raises(RecipeError, match=match):
        load_recipe(recipe, [override])


def test_tp2_with_the_experts_on_ep2_loads_and_auto_takes_the_loop():
    from tim_megatron.recipe import load_recipe
    from tim_megatron.trainer.experts import resolve_experts

    r = load_recipe(RECIPE, ["parallel.tp=2", "parallel.ep=2", "parallel.expert_tp=1"]).recipe
    assert (r.parallel.tp, r.parallel.ep, r.parallel.etp) == (2, 2, 1)
    assert resolve_experts("auto", exact=False, dtype=torch.bfloat16, on_gpu=True, biases=True) == "loop"
    with pytest.raises(ValueError, match="the grouped experts have no biases"):
        resolve_experts("grouped", exact=False, dtype=torch.bfloat16, on_gpu=True, biases=True)


# ------------------------------------------------------------------------------------- megatron patches


def test_the_sliding_window_mask_is_built_on_the_cpu_with_the_patch(one_rank):
    """megatron-core 0.16.1 allocates the window mask on "cuda" (a windowed layer fails without CUDA); with
    patches/megatron/sliding_window_mask.py it is the window: a query sees itself and the 3 keys before it."""
    from megatron.core.fusions.fused_softmax import FusedScaleMaskSoftmax
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.utils import attention_mask_func

    from patches.megatron import sliding_window_mask

    softmax = FusedScaleMaskSoftmax(
        False, False, AttnMaskType.causal, False, attention_mask_func, True, None, (3, 0)
    )
    scores = torch.randn(1, 2, 9, 9, generator=torch.Generator().manual_seed(0))
    with pytest.raises((RuntimeError, AssertionError), match="CUDA|cuda"):
        softmax(scores.clone(), None)
    h = sliding_window_mask.apply()
    try:
        probs = softmax(scores.clone(), None)
    finally:
        h.revert()
    i = torch.arange(9)
    allowed = (i[None] <= i[:, None]) & (i[:, None] - i[None] < 4)
    want = torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1)
    assert (probs - want).abs().max() <= 1e-6


def _expert_mlp(hidden: int = 16, width: int = 8):
    """One megatron-core expert MLP with biases and gpt-oss's clamped SwiGLU, as the trainer builds it (one rank)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.mlp import MLP

    from tim_megatron.trainer.families.gpt_oss import swiglu_gate

    cfg = TransformerConfig(
        num_layers=1,
        hidden_size=hidden,
        num_attention_heads=2,
        ffn_hidden_size=width,
        moe_ffn_hidden_size=width,
        num_moe_experts=2,
        gated_linear_unit=True,
        add_bias_linear=True,
        activation_func=swiglu_gate,
        activation_func_clamp_value=7.0,
        glu_linear_offset=1.0,
        bias_activation_fusion=False,
        use_cpu_initialization=True,
        gradient_accumulation_fusion=False,
    )
    spec = get_gpt_layer_local_spec(num_experts=2, moe_grouped_gemm=False).submodules.mlp.submodules.experts
    mlp = MLP(cfg, spec.submodules, is_expert=True, ffn_hidden_size=width)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for p in mlp.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 2)
    return mlp


def test_the_expert_bias_is_added_out_of_place_with_the_patch(one_rank):
    """megatron-core 0.16.1 adds an expert's fc2 bias in place to an autograd view (``output += output_bias *
    probs``): a RuntimeError with gradients on. With patches/megatron/expert_bias_grad.py the output and every
    gradient equal ``(fc2(glu(fc1 x + b1)) + b2) * p`` (HF transformers' order)."""
    from patches.megatron import expert_bias_grad

    mlp = _expert_mlp()
    g = torch.Generator().manual_seed(3)
    x = torch.randn(6, 16, generator=g, requires_grad=True)
    probs = torch.rand(6, generator=g)
    with pytest.raises(RuntimeError, match="view|inplace"):
        mlp(x, probs)
    h = expert_bias_grad.apply()
    try:
        out, bias = mlp(x, probs)
    finally:
        h.revert()
    w1, b1 = mlp.linear_fc1.weight, mlp.linear_fc1.bias
    w2, b2 = mlp.linear_fc2.weight, mlp.linear_fc2.bias
    gate, up = (x @ w1.t() + b1).chunk(2, -1)
    gate, up = gate.clamp(max=7.0), up.clamp(-7.0, 7.0)
    want = ((gate * torch.sigmoid(1.702 * gate) * (up + 1)) @ w2.t() + b2) * probs[:, None]
    assert bias is None and (out - want).abs().max() <= 1e-5 * want.abs().max()
    grad = torch.randn(out.shape, generator=g)
    got = torch.autograd.grad(out, (x, w1, b1, w2, b2), grad)
    ref = torch.autograd.grad(want, (x, w1, b1, w2, b2), grad)
    for a, b in zip(got, ref, strict=True):
        assert (a - b).abs().max() <= 1e-5 * b.abs().max().clamp(min=1)
    assert float(got[-1].abs().sum()) > 0


# ----------------------------------------------------------------------------- the sink attention kernel


def _sink_attention_pair(heads: int, groups: int, channels: int, layer: int):
    """megatron-core's DotProductAttention (learnable softmax offset, window of 4 in odd layer numbers) and
    SinkFlexCoreAttention on one config and the same sinks."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from tim_megatron.trainer.attention import SinkFlexCoreAttention

    cfg = TransformerConfig(
        num_layers=2,
        hidden_size=heads * channels,
        num_attention_heads=heads,
        num_query_groups=groups,
        kv_channels=channels,
        attention_softmax_in_fp32=True,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        masked_softmax_fusion=False,
        use_cpu_initialization=True,
        softmax_type="learnable",
        window_size=(3, 0),
        window_attn_skip_freq=2,
    )
    pgs = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "cp"])
    materialized = DotProductAttention(cfg, layer, AttnMaskType.causal, "self", pg_collection=pgs)
    flex = SinkFlexCoreAttention(cfg, layer, AttnMaskType.causal, "self", pg_collection=pgs)
    sinks = torch.randn(heads, generator=torch.Generator().manual_seed(layer)) + 1.0
    with torch.no_grad():
        materialized.softmax_offset.copy_(sinks)
        flex.softmax_offset.copy_(sinks)
    return materialized, flex


@pytest.mark.parametrize("pad_to", [1, 8], ids=["unpadded", "padded"])
@pytest.mark.parametrize("layer", [1, 2], ids=["windowed", "full"])
@pytest.mark.parametrize(("heads", "groups"), [(4, 2), (4, 4), (4, 1)])
def test_the_sink_flex_attention_equals_megatrons_materialized_one(one_rank, layer, heads, groups, pad_to):
    """The trainer's CUDA kernel for sinks and windows (FlexAttention, the sink through its log-sum-exp) against
    megatron-core's materialized attention with ``softmax_type = learnable`` and ``window_size``, on the CPU where
    FlexAttention runs its reference forward: a windowed layer (1) and a full one (2), grouped-query, multi-head and
    multi-query, float32, and with the sequence padded to a whole number of blocks as on CUDA (to 8 here, 128 there).
    Its backward is FlexAttention's on CUDA only (torch 2.13 has none on the CPU); the sink correction's gradient is
    checked below."""
    from patches.megatron import sliding_window_mask
    from tim_megatron.trainer.model import causal_mask

    materialized, flex = _sink_attention_pair(heads, groups, 32, layer)
    assert flex.window == (4 if layer == 1 else None)
    flex.pad_to = pad_to
    g = torch.Generator().manual_seed(5)
    s, b = 13, 2
    q = torch.randn(s, b, heads, 32, generator=g) * 2
    k = torch.randn(s, b, groups, 32, generator=g) * 2
    v = torch.randn(s, b, groups, 32, generator=g)
    h = sliding_window_mask.apply()
    try:
        with torch.no_grad():
            want = materialized(q, k, v, causal_mask(s, q.device))
            got = flex(q, k, v, None)
    finally:
        h.revert()
    assert got.shape == want.shape == (s, b, heads * 32)
    assert (got - want).abs().max() <= 1e-6 * max(1.0, float(want.abs().max()))


def test_the_sink_correction_has_the_gradients_of_the_softmax_with_a_sink():
    """``out * sigmoid(lse - sink)`` against the softmax over [scores, sink] (megatron-core's ``SoftmaxOne``): the
    same output and the same gradients in the query, key, value and sink (float64), a window of 4 included. This is
    the math the CUDA kernel's backward runs through FlexAttention's log-sum-exp gradient."""
    from megatron.core.fusions.fused_softmax import SoftmaxOne

    from tim_megatron.trainer.attention import materialized_lse_attention, sink_correction

    g = torch.Generator().manual_seed(7)
    b, heads, s, d = 2, 4, 11, 16
    q, k, v = (
        torch.randn(b, heads, s, d, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3)
    )
    sinks = (torch.randn(heads, generator=g, dtype=torch.float64) + 1).requires_grad_()
    i = torch.arange(s)
    allowed = (i[None] <= i[:, None]) & (i[:, None] - i[None] < 4)
    out, lse = materialized_lse_attention(q, k, v, allowed=allowed, scale=d**-0.5)
    got = sink_correction(out, lse, sinks)
    scores = (q @ k.transpose(-1, -2) * d**-0.5).masked_fill(~allowed, -10000.0)
    want = SoftmaxOne(-1, sinks)(scores) @ v
    assert (got - want).abs().max() <= 1e-12
    grad = torch.randn(got.shape, generator=g, dtype=torch.float64)
    for a, w in zip(
        torch.autograd.grad(got, (q, k, v, sinks), grad),
        torch.autograd.grad(want, (q, k, v, sinks), grad),
        strict=True,
    ):
        assert (a - w).abs().max() <= 1e-10 and float(w.abs().sum()) > 0


def test_the_sink_flex_attention_refuses_what_it_does_not_compute(one_rank):
    from tim_megatron.trainer.attention import LayerKernels
    from tim_megatron.trainer.families import get_family

    _, flex = _sink_attention_pair(4, 2, 32, 1)
    q = torch.zeros(5, 1, 4, 32)
    with pytest.raises(ValueError, match="no packed sequences, attention bias or explicit mask"):
        flex(q, q[:, :, :2], q[:, :, :2], torch.zeros(5, 5, dtype=torch.bool))
    fam = get_family("gpt_oss")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="FlexAttention \\(torch 2.13\\) has no backward on the CPU"):
            fam.layer_specs(fam.tiny, False, kernels=LayerKernels(attention="sdpa"))


# ------------------------------------------------------------------------------------- the vLLM reload patch


def test_the_reload_patch_sends_experts_one_by_one_and_sinks_through_their_loader():
    """patches/vllm/gpt_oss_reload.py's stream: each fused expert tensor (vLLM's names after its mapping) becomes
    one view per expert under vLLM's per-expert names, which its experts' weight loader takes; the sinks go to their
    parameter's weight loader as this rank's heads, and nothing else changes. (What vLLM's reload does without the
    patch, and with it, is measured on the tiny gpt-oss in tests/test_families.py: 6.0 nats, then 1.9e-6.)"""
    from patches.vllm.gpt_oss_reload import split_stream

    sinks = torch.nn.Parameter(torch.zeros(2), requires_grad=False)
    calls = []

    def loader(param, w):
        calls.append(w.clone())
        param.data.copy_(w)

    sinks.weight_loader = loader
    fused = torch.arange(3 * 4 * 6, dtype=torch.float32).view(3, 4, 6)
    bias = torch.arange(3 * 6, dtype=torch.float32).view(3, 6)
    weights = [
        ("layers.0.attn.sinks", torch.tensor([1.0, 2.0, 3.0, 4.0])),
        ("layers.0.mlp.experts.w13_weight", fused),
        ("layers.0.mlp.experts.w13_bias", bias),
        ("layers.0.attn.qkv_proj.weight", torch.ones(2)),
    ]
    loaded: set[str] = set()
    out = list(
        split_stream(weights, {"layers.0.attn.sinks": sinks}, head_start=2, heads_per_rank=2, loaded=loaded)
    )
    assert [n for n, _ in out] == [
        *(f"layers.0.mlp.experts.{e}.w13_weight" for e in range(3)),
        *(f"layers.0.mlp.experts.{e}.w13_bias" for e in range(3)),
        "layers.0.attn.qkv_proj.weight",
    ]
    assert all(
        torch.equal(t, fused[e]) and t.data_ptr() == fused[e].data_ptr() for e, (_, t) in enumerate(out[:3])
    )
    assert (
        loaded == {"layers.0.attn.sinks"}
        and torch.equal(sinks.data, torch.tensor([3.0, 4.0]))
        and len(calls) == 1
    )


# ------------------------------------------------------------------------------------------------- MXFP4


def _decode_independently(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """e2m1 and E8M0 from their definitions, byte by byte in Python integers and floats: code = sign bit, two
    exponent bits, one mantissa bit (exponent 0: subnormal, m x 0.5; else 2^(e-1) x (1 + m/2)); scale 2^(s - 127);
    the low nibble is the earlier value; the result ``[..., in, out]``."""

    def e2m1(code: int) -> float:
        e, m = (code >> 1) & 3, code & 1
        v = m * 0.5 if e == 0 else 2.0 ** (e - 1) * (1 + m / 2)
        return -v if code & 8 else v

    codes = blocks.flatten().tolist()
    exps = scales.flatten().tolist()
    values = []
    for j, byte in enumerate(codes):
        scale = math.ldexp(1.0, exps[j // 16] - 127)
        values += [e2m1(byte & 15) * scale, e2m1(byte >> 4) * scale]
    *lead, out_rows, groups, _ = blocks.shape
    w = torch.tensor(values, dtype=torch.float64).view(*lead, out_rows, groups * 32)
    return w.transpose(-1, -2).to(torch.bfloat16)


@pytest.fixture(scope="module")
def mxfp4_tiny(tmp_path_factory) -> tuple[Path, Path]:
    """The tiny gpt-oss (no warm-up) and its MXFP4 copy, made locally in the published format."""
    from tim_megatron.models.tiny import ensure_tiny_checkpoint
    from tim_megatron.trainer.families import get_family
    from tim_megatron.trainer.weights import mxfp4_checkpoint

    tmp = tmp_path_factory.mktemp("mxfp4")
    src = ensure_tiny_checkpoint(get_family("gpt_oss").tiny, warmup_steps=0, root=tmp / "cache")
    mxfp4_checkpoint.convert_checkpoint(src, tmp / "q", to="mxfp4")
    return src, tmp / "q"


def test_tim_dequantize_of_mxfp4_equals_an_independent_decoder_bit_for_bit(mxfp4_tiny, tmp_path):
    """``tim dequantize`` of the MXFP4 copy: every expert weight equals an independent e2m1 / E8M0 decoder of its
    stored blocks and scales, and HF transformers' own dequantization (``Mxfp4Config(dequantize=True)``), bit for bit
    in bfloat16; every other tensor is copied as it is; the config loses its quantization_config. The trainer's
    reader gives one expert's slice alone as the whole tensor's, and the rollout engine refuses the MXFP4 folder,
    naming the fix."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, Mxfp4Config

    from tim_megatron.rollout.base import RolloutInputError
    from tim_megatron.rollout.vllm_engine import check_model_for_engine
    from tim_megatron.trainer.weights import HFCheckpoint

    src, q = mxfp4_tiny
    stored, source = load_file(str(q / "model.safetensors")), load_file(str(src / "model.safetensors"))
    assert sorted(k for k in stored if k.endswith("_blocks")) == sorted(
        f"model.layers.{i}.mlp.experts.{p}_blocks" for i in range(2) for p in ("gate_up_proj", "down_proj")
    )
    assert all(stored[k].dtype == torch.uint8 for k in stored if k.endswith(("_blocks", "_scales")))
    out = tmp_path / "bf16"
    res = run_tim("dequantize", str(q), str(out), timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    got = load_file(str(out / "model.safetensors"))
    assert set(got) == set(source)
    hf = AutoModelForCausalLM.from_pretrained(
        q, quantization_config=Mxfp4Config(dequantize=True), dtype=torch.bfloat16
    )
    theirs = hf.state_dict()
    experts = [k for k in got if k + "_blocks" in stored]
    assert len(experts) == 4
    for name in experts:
        want = _decode_independently(stored[name + "_blocks"], stored[name + "_scales"])
        assert got[name].dtype == torch.bfloat16 and torch.equal(got[name], want), name
        assert torch.equal(theirs[name], want), name
        # the format's rounding is what moved it: within a quarter of each block's largest value of the source
        assert (want.float() - source[name]).abs().max() <= 0.25 * source[name].abs().max()
    for name in set(got) - set(experts):
        assert torch.equal(got[name], source[name]), name
    cfg = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in cfg and cfg["torch_dtype"] == "bfloat16"
    reader = HFCheckpoint(q)
    assert reader.keys() == set(source)
    assert torch.equal(reader.get_expert(experts[0], 5), reader.get(experts[0])[5])
    with pytest.raises(RolloutInputError, match=r"quant_method = 'mxfp4'.*tim dequantize"):
        check_model_for_engine(q, on_gpu=False, tensor_parallel=1)


@pytest.mark.parametrize(
    "damage,match",
    [
        ("nan_scale", r"down_proj_scales holds 1 E8M0 NaN scale\(s\) \(255\), the first at \[1, 2, 0\]"),
        ("short_blocks", r"down_proj: MXFP4 blocks of shape \(8, 128, 2, 8\) need the shape"),
        ("float_blocks", r"down_proj: MXFP4 .*_blocks and .*_scales must be uint8, got torch.float32"),
        (
            "no_scales",
            r"MXFP4 tensor 'model.layers.0.mlp.experts.down_proj' has no "
            r"'model.layers.0.mlp.experts.down_proj_scales'",
        ),
        ("huge_scale", r"down_proj \(dequantized\) holds .* non-finite value\(s\) in torch.float32"),
    ],
)
def test_damaged_mxfp4_blocks_or_scales_are_named_errors(mxfp4_tiny, tmp_path, damage, match):
    """A NaN scale, blocks of the wrong shape or type, missing scales, a scale that overflows: each stops the
    conversion naming the tensor, and nothing is written."""
    import shutil

    from safetensors.torch import load_file, save_file

    from tim_megatron.trainer.weights import WeightLoadError, mxfp4_checkpoint

    _, q = mxfp4_tiny
    bad = tmp_path / "bad"
    shutil.copytree(q, bad)
    t = load_file(str(bad / "model.safetensors"))
    name = "model.layers.0.mlp.experts.down_proj"
    if damage == "nan_scale":
        t[name + "_scales"][1, 2, 0] = 255
    elif damage == "short_blocks":
        t[name + "_blocks"] = t[name + "_blocks"][..., :8].contiguous()
    elif damage == "float_blocks":
        t[name + "_blocks"] = t[name + "_blocks"].float()
    elif damage == "no_scales":
        del t[name + "_scales"]
    elif damage == "huge_scale":
        t[name + "_scales"][0, 0, 0] = 254
        t[name + "_blocks"][0, 0, 0, 0] = 7  # 6 x 2^127 overflows
    save_file(t, str(bad / "model.safetensors"))
    with pytest.raises((WeightLoadError, ValueError), match=match):
        mxfp4_checkpoint.convert_checkpoint(bad, tmp_path / "out", to="bfloat16")
    assert not (tmp_path / "out").exists() and [p.name for p in tmp_path.iterdir()] == ["bad"]


# ---------------------------------------------------------------------------------------- the tiny model


def test_the_tiny_model_exercises_sinks_the_window_the_clamp_and_yarn():
    """On the family tests' fixed batch, HF transformers' logprobs of the tiny gpt-oss (the recipe's, as
    tests/test_families.py builds it) move by more than 0.1 nats when any one feature is dropped: the sinks (set to
    -10^4), the window (every layer full), the clamp (no limit), YaRN (plain RoPE, no attention factor)."""
    require(importable("transformers"), "transformers")
    from transformers import AutoModelForCausalLM

    from tests.workers.megatron_worker import fixed_batch
    from tim_megatron.models.tiny import ensure_tiny_checkpoint
    from tim_megatron.recipe import load_recipe

    r = load_recipe(RECIPE).recipe
    ck = ensure_tiny_checkpoint(
        r.model.dims, seed=r.model.tiny_seed, warmup_steps=r.model.tiny_warmup_steps, task=r.data.task
    )
    hf = AutoModelForCausalLM.from_pretrained(ck, dtype=torch.float32)
    batch, _, _ = fixed_batch(0)
    ids = batch.input_ids
    valid = (torch.arange(ids.shape[1])[None] < batch.lengths[:, None])[:, 1:]

    def logprobs(model) -> torch.Tensor:
        with torch.no_grad():
            lp = torch.log_softmax(model(input_ids=ids).logits.float(), -1)
        return lp[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)[valid]

    def drop(feature: str):
        m = copy.deepcopy(hf)
        for mod in m.modules():
            kind = type(mod).__name__
            if feature == "sinks" and kind == "GptOssAttention":
                mod.sinks.data.fill_(-1e4)
            elif feature == "window" and kind == "GptOssAttention":
                mod.sliding_window = None
            elif feature == "clamp" and kind == "GptOssExperts":
                mod.limit = float("inf")
        if feature == "window":
            m.config.layer_types = ["full_attention"] * m.config.num_hidden_layers
        if feature == "yarn":
            rot, dim = m.model.rotary_emb, m.config.head_dim
            rot.inv_freq = 1.0 / (
                m.config.rope_parameters["rope_theta"] ** (torch.arange(0, dim, 2).float() / dim)
            )
            rot.attention_scaling = 1.0
        return m

    base = logprobs(hf)
    moved = {f: float((logprobs(drop(f)) - base).abs().max()) for f in ("sinks", "window", "clamp", "yarn")}
    assert all(v > 0.1 for v in moved.values()), moved
