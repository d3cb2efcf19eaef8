"""Qwen3 dense (``Qwen3ForCausalLM``): SwiGLU MLP in every layer, per-head qk-norm, no biases.

Not modelled: sliding-window attention (``use_sliding_window``, or ``layer_types`` other than full attention;
refused) and activations other than SwiGLU (``hidden_act: silu``).
"""

from __future__ import annotations

from typing import Any

from tim_megatron.recipe.schema import ModelDims
from tim_megatron.trainer.families import base


def read_dims(cfg: dict[str, Any]) -> ModelDims:
    r = base.ConfigReader(cfg, "Qwen3ForCausalLM")
    r.require_silu("MLPs")
    r.refuse_sliding_window()
    r.refuse_attention_bias("Qwen3")
    fields = base.common_fields(r)
    r.require_full_rotary(fields, "Qwen3")
    fields.update(
        family="qwen3",
        num_experts=0,
        num_experts_per_tok=0,
        moe_intermediate_size=0,
        intermediate_size=r.int("intermediate_size"),
    )
    return base.dims_from_fields(r, base.COMMON_KEYS, **fields)


def hf_config(dims: ModelDims):
    from transformers import Qwen3Config

    return Qwen3Config(**base.hf_common(dims), intermediate_size=dims.intermediate_size, attention_bias=False)


WEIGHTS = (*base.ENDS, *base.attention_rules(), *base.dense_mlp_rules())

FAMILY = base.Family(
    name="qwen3",
    architectures=("Qwen3ForCausalLM",),
    read_dims=read_dims,
    hf_config=hf_config,
    weights=WEIGHTS,
    tiny=ModelDims(family="qwen3", num_experts=0, num_experts_per_tok=0, moe_intermediate_size=0),
    notes=("sliding-window attention and activations other than silu are refused",),
)
