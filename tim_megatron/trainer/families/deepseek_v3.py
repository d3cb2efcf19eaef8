"""DeepSeek-V3 MoE (``DeepseekV3ForCausalLM``: DeepSeek-V3/R1, Kimi-K2, Moonlight-16B-A3B).

Multi-head latent attention (MLA): the query through a compressed latent with its own RMSNorm (``q_lora_rank``;
one projection when it is null, as in Moonlight), keys and values through one compressed latent
(``kv_lora_rank``, RMSNorm) expanded per head, RoPE only on ``qk_rope_head_dim`` channels with one rotated key
shared by every head, in DeepSeek's interleaved layout; YaRN RoPE scaling with its softmax correction
(``mscale_all_dim``). Leading dense layers (``first_k_dense_replace``), then MoE layers with shared experts beside
the routed ones; a sigmoid router choosing by score plus a fixed correction bias, within the ``topk_group`` best
of ``n_group`` groups (``topk_method: noaux_tc``), and weighting by the renormalized scores times
``routed_scaling_factor``.

The trainer side is megatron-core's own ``MLASelfAttention`` with :mod:`tim_megatron.trainer.mla`'s core
attention (no transformer-engine needed). Not loaded on purpose: the multi-token-prediction layers
(``num_nextn_predict_layers``, stored after the last layer), as for GLM-4.5.

Refused by key, because the engine and the trainer would not compute what HF transformers computes:
``rope_interleave: false`` (RoPE in halves: megatron-core's MLA and vLLM rotate interleaved pairs) and
``moe_layer_freq`` other than 1 (vLLM makes the layers between dense, HF transformers does not).
"""

from __future__ import annotations

from typing import Any

from tim_megatron.recipe.schema import ModelDims
from tim_megatron.trainer.families import base
from tim_megatron.trainer.weights.mapping import Rule

ARCH = "DeepseekV3ForCausalLM"


def _rope(r: base.ConfigReader) -> dict[str, Any]:
    """rope_theta and the YaRN fields from ``rope_scaling`` (or ``rope_parameters``, as newer transformers save)."""
    scaling = r.cfg.get("rope_scaling") or r.cfg.get("rope_parameters") or {}
    if not isinstance(scaling, dict):
        raise r._fail("rope_scaling", scaling, "null or an object")
    kind = scaling.get("rope_type", scaling.get("type")) or "default"
    theta = r.cfg.get("rope_theta", scaling.get("rope_theta", 10000.0))
    out: dict[str, Any] = {
        "rope_theta": base.ConfigReader({"rope_theta": theta}, r.where).float("rope_theta")
    }
    if kind == "default":
        return out
    if kind != "yarn":
        raise r.unsupported("rope_scaling.type", kind, "allowed: yarn, or no rope_scaling")
    y = base.ConfigReader(scaling, f"{r.where} rope_scaling")
    out.update(
        rope_scaling="yarn",
        yarn_factor=y.float("factor"),
        yarn_original_max_position_embeddings=y.int("original_max_position_embeddings"),
        yarn_beta_fast=y.float("beta_fast", 32.0),
        yarn_beta_slow=y.float("beta_slow", 1.0),
        yarn_mscale=y.float("mscale", 1.0, zero_allowed=True),
        yarn_mscale_all_dim=y.float("mscale_all_dim", 0.0, zero_allowed=True),
    )
    return out


def refuse_moe_layer_freq(r: base.ConfigReader) -> None:
    """``moe_layer_freq`` other than 1 describes no single model: vLLM's DeepSeek (like DeepSeek's own modeling
    code) gives experts only to the layers whose index is a multiple of it, HF transformers' DeepSeek-V2/V3 to
    every layer from ``first_k_dense_replace`` on, as the trainer and the plan do."""
    freq = r.int("moe_layer_freq", 1)
    if freq != 1:
        raise r.unsupported(
            "moe_layer_freq",
            freq,
            "vLLM (and DeepSeek's own modeling code) give experts only to the layers whose index is a multiple of "
            "it, HF transformers and the trainer to every layer from first_k_dense_replace on, so the engine and "
            "the trainer would run different models; allowed: 1 (experts in every layer from "
            "first_k_dense_replace on, as every published DeepSeek-V2/V3, Kimi-K2 and Moonlight config has)",
        )


def refuse_rope_halves(r: base.ConfigReader) -> None:
    """``rope_interleave: false`` makes HF transformers' DeepSeek-V3 rotate the rope channels in halves
    (``rotate_half``) instead of DeepSeek's interleaved pairs; megatron-core's MLA and vLLM's DeepSeek model always
    rotate interleaved pairs, so such a checkpoint would be another model on both sides."""
    if not r.bool("rope_interleave", True):
        raise r.unsupported(
            "rope_interleave",
            False,
            "HF transformers then rotates the rope channels in halves, while the trainer (megatron-core's MLA) and "
            "vLLM's DeepSeek model rotate interleaved pairs, so both would compute another model; allowed: true "
            "(the interleaved RoPE of DeepSeek's checkpoints), or no rope_interleave key (as in their published "
            "config.json)",
        )


def mla_fields(r: base.ConfigReader) -> dict[str, Any]:
    """What DeepSeek-V2 and V3 share: MLA's sizes, RoPE or YaRN, the dense and shared-expert layers, the experts
    (not the router's scoring)."""
    r.require_silu("MLPs and experts")
    refuse_moe_layer_freq(r)
    if r.bool("attention_bias", False):
        raise r.unsupported("attention_bias", True, "allowed: false (DeepSeek's projections have no bias)")
    heads = r.int("num_attention_heads")
    nope, rope, v = r.int("qk_nope_head_dim"), r.int("qk_rope_head_dim"), r.int("v_head_dim")
    moe_inter = r.int("moe_intermediate_size")
    return dict(
        hidden_size=r.int("hidden_size"),
        num_layers=r.int("num_hidden_layers"),
        num_attention_heads=heads,
        num_key_value_heads=heads,
        head_dim=nope + rope,
        vocab_size=r.int("vocab_size"),
        rms_norm_eps=r.float("rms_norm_eps", 1e-6),
        max_position_embeddings=r.int("max_position_embeddings", 4096),
        tie_word_embeddings=r.bool("tie_word_embeddings", False),
        qk_norm="none",
        num_experts=r.int("n_routed_experts"),
        num_experts_per_tok=r.int("num_experts_per_tok"),
        moe_intermediate_size=moe_inter,
        intermediate_size=r.int("intermediate_size"),
        first_k_dense_layers=r.int("first_k_dense_replace", 0, minimum=0),
        shared_expert_intermediate_size=r.int("n_shared_experts", 0, minimum=0) * moe_inter,
        routed_scaling_factor=r.float("routed_scaling_factor", 1.0),
        kv_lora_rank=r.int("kv_lora_rank"),
        q_lora_rank=r.int("q_lora_rank", 0, minimum=0),
        qk_nope_head_dim=nope,
        qk_rope_head_dim=rope,
        v_head_dim=v,
        **_rope(r),
    )


def read_dims(cfg: dict[str, Any]) -> ModelDims:
    r = base.ConfigReader(cfg, ARCH)
    scoring = r.get("scoring_func", "sigmoid")
    method = r.get("topk_method", "noaux_tc")
    if scoring != "sigmoid" or method != "noaux_tc":
        raise r.unsupported(
            "topk_method",
            f"{method} with scoring_func {scoring}",
            "allowed: noaux_tc with sigmoid scoring (DeepSeek-V3, Kimi-K2, Moonlight)",
        )
    refuse_rope_halves(r)  # HF transformers' DeepSeek-V2 has no such key: it always rotates interleaved pairs
    fields = mla_fields(r)
    fields.update(
        family="deepseek_v3",
        norm_topk_prob=r.bool("norm_topk_prob", True),
        router_score="sigmoid",
        router_expert_bias=True,
        router_groups=r.int("n_group", 1),
        router_group_topk=r.int("topk_group", 1),
    )
    keys = {**base.SHARED_EXPERT_KEYS, "router_groups": "n_group", "router_group_topk": "topk_group"}
    return base.dims_from_fields(r, keys, **fields)


def hf_config(dims: ModelDims):
    from transformers import DeepseekV3Config

    common = base.hf_common(dims)
    common.pop("head_dim")
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": dims.rope_theta}
    if dims.rope_scaling == "yarn":
        rope = {
            "rope_type": "yarn",
            "rope_theta": dims.rope_theta,
            "factor": dims.yarn_factor,
            "original_max_position_embeddings": dims.yarn_original_max_position_embeddings,
            "beta_fast": dims.yarn_beta_fast,
            "beta_slow": dims.yarn_beta_slow,
            "mscale": dims.yarn_mscale,
            "mscale_all_dim": dims.yarn_mscale_all_dim,
        }
    common["rope_parameters"] = rope
    return DeepseekV3Config(
        **common,
        **base.hf_shared_expert_moe(dims, "DeepSeek-V3"),
        q_lora_rank=dims.q_lora_rank or None,
        kv_lora_rank=dims.kv_lora_rank,
        qk_nope_head_dim=dims.qk_nope_head_dim,
        qk_rope_head_dim=dims.qk_rope_head_dim,
        v_head_dim=dims.v_head_dim,
        rope_interleave=True,
        attention_bias=False,
        # transformers' DeepSeek-V3 always routes this way and no longer writes the keys; vLLM reads them (and
        # without them builds softmax scoring with no correction bias), as the published config.json has them
        topk_method="noaux_tc",
        scoring_func="sigmoid",
    )


def transformer_config(dims: ModelDims) -> dict[str, Any]:
    """megatron-core ``MLATransformerConfig`` arguments: the MoE features every family shares, MLA's sizes, its
    RoPE or YaRN, and group-limited routing."""
    kw = base.transformer_features(dims)
    kw.update(
        q_lora_rank=dims.q_lora_rank or None,
        kv_lora_rank=dims.kv_lora_rank,
        qk_head_dim=dims.qk_nope_head_dim,
        qk_pos_emb_head_dim=dims.qk_rope_head_dim,
        v_head_dim=dims.v_head_dim,
        rotary_base=dims.rope_theta,
        rope_type="yarn" if dims.rope_scaling == "yarn" else "rope",
    )
    if dims.rope_scaling == "yarn":
        kw.update(
            rotary_scaling_factor=dims.yarn_factor,
            original_max_position_embeddings=dims.yarn_original_max_position_embeddings,
            beta_fast=dims.yarn_beta_fast,
            beta_slow=dims.yarn_beta_slow,
            mscale=dims.yarn_mscale,
            mscale_all_dim=dims.yarn_mscale_all_dim,
        )
    if dims.router_groups > 1:
        kw.update(moe_router_num_groups=dims.router_groups, moe_router_group_topk=dims.router_group_topk)
    return kw


def layer_specs(dims: ModelDims, use_te: bool, *, kernels=None) -> list:
    """One MLA layer spec per layer: a dense MLP for the leading dense layers, MoE for the rest (latent attention
    always on torch's fused attention; the expert path ``kernels`` names)."""
    from tim_megatron.trainer.mla import mla_layer_spec

    grouped = kernels is not None and kernels.experts == "grouped"
    return base.per_layer(
        dims,
        lambda num_experts: mla_layer_spec(num_experts=num_experts, use_te=use_te, grouped_experts=grouped),
    )


def _attention_rules() -> tuple[Rule, ...]:
    """MLA's projections and norms. The query has either the q-LoRA three (q_a, its norm, q_b) or one projection
    (``q_lora_rank`` null); megatron-core names them apart, so one table holds both and each model uses its own."""
    a, m = "model.layers.{L}.self_attn.", "decoder.layers.{L}.self_attention."
    return (
        Rule("decoder.layers.{L}.input_layernorm.weight", ("model.layers.{L}.input_layernorm.weight",)),
        # q_a and kv_a are column-parallel in megatron-core's local spec: row slices, gathered before their norms
        Rule(m + "linear_q_down_proj.weight", (a + "q_a_proj.weight",), split="tp0"),
        Rule(m + "q_layernorm.weight", (a + "q_a_layernorm.weight",)),
        Rule(m + "linear_q_up_proj.weight", (a + "q_b_proj.weight",), split="tp0"),
        Rule(m + "linear_q_proj.weight", (a + "q_proj.weight",), split="tp0"),
        Rule(m + "linear_kv_down_proj.weight", (a + "kv_a_proj_with_mqa.weight",), split="tp0"),
        Rule(m + "kv_layernorm.weight", (a + "kv_a_layernorm.weight",)),
        Rule(m + "linear_kv_up_proj.weight", (a + "kv_b_proj.weight",), split="tp0"),
        Rule(m + "linear_proj.weight", (a + "o_proj.weight",), split="tp1"),
        Rule(
            "decoder.layers.{L}.pre_mlp_layernorm.weight",
            ("model.layers.{L}.post_attention_layernorm.weight",),
        ),
    )


def weight_rules(*, expert_bias: bool) -> tuple[Rule, ...]:
    """DeepSeek's table: the ends, MLA, the leading dense MLPs, the router (with V3's correction bias or without,
    as V2), the routed experts and the shared experts."""
    return (
        *base.ENDS,
        *_attention_rules(),
        *base.dense_mlp_rules(),
        *base.router_rules(expert_bias=expert_bias),
        *base.expert_rules(),
        *base.dense_mlp_rules("model.layers.{L}.mlp.shared_experts", "decoder.layers.{L}.mlp.shared_experts"),
    )


WEIGHTS = weight_rules(expert_bias=True)


FAMILY = base.Family(
    name="deepseek_v3",
    architectures=(ARCH,),
    read_dims=read_dims,
    hf_config=hf_config,
    weights=WEIGHTS,
    transformer_config=transformer_config,
    layer_specs=layer_specs,
    tiny=ModelDims(
        family="deepseek_v3",
        num_key_value_heads=4,
        head_dim=96,
        first_k_dense_layers=1,
        shared_expert_intermediate_size=64,
        router_score="sigmoid",
        router_expert_bias=True,
        routed_scaling_factor=2.5,
        router_groups=2,
        router_group_topk=1,
        kv_lora_rank=512,  # + qk_rope_head_dim = 576, what vLLM's CPU MLA backend takes
        q_lora_rank=64,
        qk_nope_head_dim=32,
        qk_rope_head_dim=64,
        v_head_dim=32,
        qk_norm="none",
        rope_theta=10000.0,
    ),
    ignored_hf=base.layer_beyond(),
    tiny_init=base.random_correction_bias,
    notes=(
        "the multi-token-prediction layers (num_nextn_predict_layers) are not loaded: RL never runs them",
        "block-FP8 checkpoints (DeepSeek-V3, Kimi-K2) load dequantized to the trainer's dtype; export and sync "
        "write that dtype",
    ),
)
