"""GLM-4.5 MoE (``Glm4MoeForCausalLM``: GLM-4.5, GLM-4.5-Air).

Leading dense layers (``first_k_dense_replace``), then MoE layers with a shared expert beside 128-160 routed
experts; a sigmoid router that picks experts by score plus a fixed correction bias and weights them by the
renormalized scores times ``routed_scaling_factor``; partial RoPE (half the head channels); biases on q, k, v;
per-head qk-norm on GLM-4.5 (``use_qk_norm``), none on GLM-4.5-Air.

Not loaded on purpose: the multi-token-prediction layer (``num_nextn_predict_layers``, stored as layer
``num_hidden_layers``). RL samples and scores one token at a time, so it is never run; its tensors are left out of
the trainer, the export and the sync.
"""

from __future__ import annotations

from typing import Any

from tim_megatron.recipe.schema import ModelDims
from tim_megatron.trainer.families import base


def read_dims(cfg: dict[str, Any]) -> ModelDims:
    r = base.ConfigReader(cfg, "Glm4MoeForCausalLM")
    r.require_silu("MLPs")
    n_group, topk_group = r.int("n_group", 1), r.int("topk_group", 1)
    if topk_group != n_group:
        raise r.unsupported(
            "n_group",
            n_group,
            f"group-limited routing (topk_group = {topk_group} of {n_group} groups) is not implemented",
        )
    experts_key = r.key_of("n_routed_experts", "num_local_experts")
    experts = r.int(experts_key)
    if n_group > 1 and (experts % n_group or experts // n_group < 2):
        # every group is chosen, but HF transformers and vLLM still score each by its two best experts
        raise r.unsupported(
            "n_group",
            n_group,
            f"{experts_key} = {experts} must split into n_group groups of at least 2 experts each (a group is "
            f"scored by its two best); allowed: a divisor of {experts_key} up to {experts // 2}, or 1",
        )
    moe_inter = r.int("moe_intermediate_size")
    fields = base.common_fields(r)
    fields.update(
        family="glm4_moe",
        num_experts=experts,
        num_experts_per_tok=r.int("num_experts_per_tok"),
        moe_intermediate_size=moe_inter,
        intermediate_size=r.int("intermediate_size"),
        norm_topk_prob=r.bool("norm_topk_prob", True),
        first_k_dense_layers=r.int("first_k_dense_replace", 0, minimum=0),
        shared_expert_intermediate_size=r.int("n_shared_experts", 0, minimum=0) * moe_inter,
        router_score="sigmoid",
        router_expert_bias=True,
        routed_scaling_factor=r.float("routed_scaling_factor", 1.0),
        attention_bias=r.bool("attention_bias", False),
        qk_norm="per_head" if r.bool("use_qk_norm", False) else "none",
    )
    return base.dims_from_fields(r, base.SHARED_EXPERT_KEYS, **fields)


def hf_config(dims: ModelDims):
    from transformers import Glm4MoeConfig

    common = base.hf_common(dims)
    common["rope_parameters"] = {
        **common["rope_parameters"],
        "partial_rotary_factor": dims.partial_rotary_factor,
    }
    return Glm4MoeConfig(
        **common,
        **base.hf_shared_expert_moe(dims, "GLM-4.5"),
        attention_bias=dims.attention_bias,
        use_qk_norm=dims.qk_norm == "per_head",
    )


WEIGHTS = (
    *base.ENDS,
    *base.attention_rules(bias=True, qk_norm="per_head"),
    *base.dense_mlp_rules(),
    *base.router_rules(expert_bias=True),
    *base.expert_rules(),
    *base.dense_mlp_rules("model.layers.{L}.mlp.shared_experts", "decoder.layers.{L}.mlp.shared_experts"),
)

FAMILY = base.Family(
    name="glm4_moe",
    architectures=("Glm4MoeForCausalLM",),
    read_dims=read_dims,
    hf_config=hf_config,
    weights=WEIGHTS,
    tiny=ModelDims(
        family="glm4_moe",
        first_k_dense_layers=1,
        shared_expert_intermediate_size=64,
        router_score="sigmoid",
        router_expert_bias=True,
        routed_scaling_factor=2.5,
        attention_bias=True,
        partial_rotary_factor=0.5,
        qk_norm="none",
        rms_norm_eps=1e-5,
    ),
    ignored_hf=base.layer_beyond(),
    tiny_init=base.random_correction_bias,
    notes=("the multi-token-prediction layer (num_nextn_predict_layers) is not loaded: RL never runs it",),
)
