"""OLMoE (``OlmoeForCausalLM``): every layer MoE, softmax over all experts then top-k without renormalization
(``norm_topk_prob: false``), and qk-norm over the whole q and k projections (one weight per channel, not per head).

Not modelled: ``clip_qkv`` (null in OLMoE-1B-7B; a config that sets it is refused).
"""

from __future__ import annotations

from typing import Any

from tim_megatron.recipe.schema import ModelDims
from tim_megatron.trainer.families import base


def read_dims(cfg: dict[str, Any]) -> ModelDims:
    r = base.ConfigReader(cfg, "OlmoeForCausalLM")
    r.require_silu("experts")
    if r.cfg.get("clip_qkv") is not None:
        raise r.unsupported("clip_qkv", r.cfg["clip_qkv"], "q/k/v clipping is not implemented")
    r.refuse_attention_bias("OLMoE")
    fields = base.common_fields(r)
    if fields["head_dim"] * fields["num_attention_heads"] != fields["hidden_size"]:
        raise r.unsupported(
            "head_dim", fields["head_dim"], "OLMoE's q_norm spans hidden_size = heads x head_dim"
        )
    r.require_full_rotary(fields, "OLMoE")
    fields.update(
        base.experts_only_fields(r, "num_experts", "num_local_experts"),
        family="olmoe",
        norm_topk_prob=r.bool("norm_topk_prob", False),
        qk_norm="whole",
    )
    return base.dims_from_fields(r, base.EXPERTS_ONLY_KEYS, **fields)


def hf_config(dims: ModelDims):
    from transformers import OlmoeConfig

    common = base.hf_common(dims)
    if dims.head_dim * dims.num_attention_heads != dims.hidden_size:
        raise ValueError("OLMoE needs head_dim x num_attention_heads = hidden_size")
    del common["head_dim"]  # OLMoE derives it
    return OlmoeConfig(
        **common,
        intermediate_size=dims.moe_intermediate_size,
        num_experts=dims.num_experts,
        num_experts_per_tok=dims.num_experts_per_tok,
        norm_topk_prob=dims.norm_topk_prob,
        clip_qkv=None,
        attention_bias=False,
        output_router_logits=False,
    )


WEIGHTS = (
    *base.ENDS,
    *base.attention_rules(qk_norm="whole"),
    *base.router_rules(),
    *base.expert_rules(),
)

FAMILY = base.Family(
    name="olmoe",
    architectures=("OlmoeForCausalLM",),
    read_dims=read_dims,
    hf_config=hf_config,
    weights=WEIGHTS,
    tiny=ModelDims(
        family="olmoe", qk_norm="whole", norm_topk_prob=False, intermediate_size=64, rms_norm_eps=1e-5
    ),
    notes=("clip_qkv is refused (null in OLMoE-1B-7B)",),
)
