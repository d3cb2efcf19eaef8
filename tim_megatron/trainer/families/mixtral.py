"""Mixtral (``MixtralForCausalLM``): every layer MoE with 8 experts, softmax top-2 renormalized, no qk-norm.

Not modelled: sliding-window attention (Mixtral-8x7B has ``sliding_window: null``; a config that sets it is
refused) and the router's training-time jitter noise (``router_jitter_noise``, off in Mixtral's config, and RL
must not add noise to the routing the rollout engine was given).
"""

from __future__ import annotations

from typing import Any

from tim_megatron.recipe.schema import ModelDims
from tim_megatron.trainer.families import base


def read_dims(cfg: dict[str, Any]) -> ModelDims:
    r = base.ConfigReader(cfg, "MixtralForCausalLM")
    r.require_silu("experts")
    if r.cfg.get("sliding_window") is not None:
        raise r.unsupported(
            "sliding_window", r.cfg["sliding_window"], "sliding-window attention is not implemented"
        )
    if r.cfg.get("router_jitter_noise"):
        raise r.unsupported(
            "router_jitter_noise", r.cfg["router_jitter_noise"], "RL keeps the routing deterministic"
        )
    fields = base.common_fields(r)
    r.require_full_rotary(fields, "Mixtral")
    fields.update(
        base.experts_only_fields(r, "num_local_experts", "num_experts"),
        family="mixtral",
        norm_topk_prob=True,
        qk_norm="none",
    )
    return base.dims_from_fields(r, {**base.EXPERTS_ONLY_KEYS, "num_experts": "num_local_experts"}, **fields)


def hf_config(dims: ModelDims):
    from transformers import MixtralConfig

    return MixtralConfig(
        **base.hf_common(dims),
        intermediate_size=dims.moe_intermediate_size,
        num_local_experts=dims.num_experts,
        num_experts_per_tok=dims.num_experts_per_tok,
        sliding_window=None,
        router_jitter_noise=0.0,
        output_router_logits=False,
    )


WEIGHTS = (
    *base.ENDS,
    *base.attention_rules(qk_norm="none"),
    *base.router_rules("model.layers.{L}.block_sparse_moe.gate"),
    *base.expert_rules("model.layers.{L}.block_sparse_moe.experts.{E}", ("w1", "w3", "w2")),
)

FAMILY = base.Family(
    name="mixtral",
    architectures=("MixtralForCausalLM",),
    read_dims=read_dims,
    hf_config=hf_config,
    weights=WEIGHTS,
    tiny=ModelDims(family="mixtral", qk_norm="none", intermediate_size=64, rms_norm_eps=1e-5),
    notes=("sliding-window attention and router jitter noise are refused (both off in Mixtral-8x7B)",),
)
