"""DeepSeek-V2 MoE (``DeepseekV2ForCausalLM``: DeepSeek-V2-Lite, and DeepSeek-V2 without its group limit).

DeepSeek-V3's attention and layer layout (:mod:`.deepseek_v3`: multi-head latent attention with or without
q-LoRA, RoPE on the rope channels only, YaRN, leading dense layers, shared experts) with V2's router: softmax over
all experts, the top-k of those scores (``topk_method: greedy``), not renormalized, times
``routed_scaling_factor``; no correction bias. megatron-core computes that router with ``pre_softmax`` (softmax,
then top-k). Refused by key: ``topk_method: group_limited_greedy`` (DeepSeek-V2's full model scores a group by its
best expert, megatron-core by the sum of its best top-k / topk_group), and ``norm_topk_prob: true`` (the original
code renormalizes then, transformers' DeepSeek-V2 does not: the reference is ambiguous).
"""

from __future__ import annotations

from typing import Any

from tim_megatron.recipe.schema import ModelDims
from tim_megatron.trainer.families import base, deepseek_v3
from tim_megatron.trainer.weights.mapping import Rule

ARCH = "DeepseekV2ForCausalLM"


def read_dims(cfg: dict[str, Any]) -> ModelDims:
    r = base.ConfigReader(cfg, ARCH)
    method = r.get("topk_method", "greedy")
    if method != "greedy":
        raise r.unsupported(
            "topk_method",
            method,
            "allowed: greedy (DeepSeek-V2-Lite); group_limited_greedy scores a group by its best expert, which "
            "megatron-core's group-limited routing (the sum of a group's best top-k / topk_group) does not compute",
        )
    if r.get("scoring_func", "softmax") != "softmax":
        raise r.unsupported("scoring_func", r.get("scoring_func"), "allowed: softmax (DeepSeek-V2's router)")
    if r.bool("norm_topk_prob", False):
        raise r.unsupported(
            "norm_topk_prob",
            True,
            "allowed: false (DeepSeek-V2-Lite); with true DeepSeek's own code renormalizes the top-k weights and "
            "transformers' DeepSeek-V2 does not, so there is no single reference to match",
        )
    if r.int("n_group", 1) != 1 or r.int("topk_group", 1) != 1:
        raise r.unsupported(
            "n_group", r.get("n_group"), "allowed: 1 with topk_method greedy (the router ignores groups then)"
        )
    fields = deepseek_v3.mla_fields(r)  # MLA, YaRN, dense and shared-expert layers: what V2 and V3 share
    fields.update(family="deepseek_v2", router_score="softmax", norm_topk_prob=False)
    return base.dims_from_fields(r, base.SHARED_EXPERT_KEYS, **fields)


def hf_config(dims: ModelDims):
    from transformers import DeepseekV2Config

    v3 = deepseek_v3.hf_config(dims.model_copy(update=dict(family="deepseek_v3"))).to_dict()
    keep = set(DeepseekV2Config().to_dict())
    kw = {
        k: v
        for k, v in v3.items()
        if k in keep and k not in ("architectures", "model_type", "transformers_version")
    }
    kw.update(
        n_routed_experts=dims.num_experts,
        n_group=1,
        topk_group=1,
        topk_method="greedy",
        scoring_func="softmax",
        norm_topk_prob=False,
        routed_scaling_factor=dims.routed_scaling_factor,
    )
    return DeepseekV2Config(**kw)


WEIGHTS: tuple[Rule, ...] = deepseek_v3.weight_rules(expert_bias=False)


FAMILY = base.Family(
    name="deepseek_v2",
    architectures=(ARCH,),
    read_dims=read_dims,
    hf_config=hf_config,
    weights=WEIGHTS,
    transformer_config=deepseek_v3.transformer_config,
    layer_specs=deepseek_v3.layer_specs,
    tiny=deepseek_v3.FAMILY.tiny.model_copy(
        update=dict(
            family="deepseek_v2",
            router_score="softmax",
            router_expert_bias=False,
            norm_topk_prob=False,
            routed_scaling_factor=1.5,
            router_groups=1,
            router_group_topk=1,
            q_lora_rank=0,  # DeepSeek-V2-Lite's one query projection
            rms_norm_eps=1e-5,  # Moonlight's: the latent norms keep 1e-6 (tim_megatron.trainer.mla.LatentRMSNorm)
        )
    ),
    ignored_hf=base.layer_beyond(),
    notes=deepseek_v3.FAMILY.notes,
)
