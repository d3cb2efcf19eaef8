"""Qwen3-MoE (``Qwen3MoeForCausalLM``): every layer MoE, softmax top-k router, per-head qk-norm, no biases.

Not modelled: sliding-window attention (``use_sliding_window: false`` in every published Qwen3-MoE; a config that
turns it on is refused) and activations other than SwiGLU (``hidden_act: silu``).
"""

from __future__ import annotations

from typing import Any

from tim_megatron.recipe.schema import ModelDims
from tim_megatron.trainer.families import base


def read_dims(cfg: dict[str, Any]) -> ModelDims:
    r = base.ConfigReader(cfg, "Qwen3MoeForCausalLM")
    r.require_silu("experts")
    r.refuse_sliding_window()
    r.refuse_attention_bias("Qwen3")
    if r.cfg.get("mlp_only_layers"):
        raise r.unsupported(
            "mlp_only_layers",
            r.cfg["mlp_only_layers"],
            "mixed dense/MoE stacks are not implemented for Qwen3-MoE",
        )
    if r.cfg.get("decoder_sparse_step", 1) != 1:
        raise r.unsupported("decoder_sparse_step", r.cfg["decoder_sparse_step"], "only 1 (every layer MoE)")
    if r.cfg.get("shared_expert_intermediate_size"):
        raise r.unsupported(
            "shared_expert_intermediate_size",
            r.cfg["shared_expert_intermediate_size"],
            "Qwen3-MoE has no shared expert",
        )
    fields = base.common_fields(r)
    r.require_full_rotary(fields, "Qwen3")
    fields.update(
        family="qwen3_moe",
        num_experts=r.int(r.key_of("num_experts", "num_local_experts")),
        num_experts_per_tok=r.int("num_experts_per_tok"),
        moe_intermediate_size=r.int("moe_intermediate_size"),
        intermediate_size=r.int("intermediate_size", 1),
        norm_topk_prob=r.bool("norm_topk_prob", True),
    )
    return base.dims_from_fields(r, base.COMMON_KEYS, **fields)


def hf_config(dims: ModelDims):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        **base.hf_common(dims),
        intermediate_size=dims.intermediate_size,
        attention_bias=False,
        num_experts=dims.num_experts,
        num_experts_per_tok=dims.num_experts_per_tok,
        moe_intermediate_size=dims.moe_intermediate_size,
        norm_topk_prob=dims.norm_topk_prob,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        output_router_logits=False,
    )


WEIGHTS = (*base.ENDS, *base.attention_rules(), *base.router_rules(), *base.expert_rules())

FAMILY = base.Family(
    name="qwen3_moe",
    architectures=("Qwen3MoeForCausalLM",),
    read_dims=read_dims,
    hf_config=hf_config,
    weights=WEIGHTS,
    tiny=ModelDims(family="qwen3_moe"),
    notes=("sliding-window attention and activations other than silu are refused",),
)
