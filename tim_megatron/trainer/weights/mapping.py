"""HF <-> megatron-core parameter mapping, as data: one small table per model family.

A rule names a megatron-core parameter (with ``{L}`` for the layer and ``{E}`` for the *global* expert
index), the HF tensor(s) it is made of, how they combine, and how the result is split across ranks.
The machinery in :mod:`tim_megatron.trainer.weights.convert` is generic.

Combinations:

* ``copy``: one HF tensor, same layout.
* ``qkv``: HF q, k, v projections interleaved per query group, megatron's fused ``linear_qkv`` layout
  ``[group][q heads of the group, k, v]``.
* ``gate_up``: HF gate and up projections stacked, megatron's gated ``linear_fc1``. Under tensor
  parallelism each rank holds its slice of gate followed by its slice of up.

Splits: ``rep`` (replicated), ``tp0`` / ``tp1`` (tensor-parallel on dim 0 / 1), ``etp0`` / ``etp1``
(expert-tensor-parallel), ``qkv`` and ``gate_up`` (per-part splits described above). Experts are placed by
expert parallelism: rank ``r`` of the EP group holds global experts ``[r * E / ep, (r + 1) * E / ep)``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Rule:
    megatron: str
    hf: tuple[str, ...]
    combine: str = "copy"
    split: str = "rep"

    def pattern(self) -> re.Pattern:
        rx = re.escape(self.megatron).replace(r"\{L\}", r"(?P<L>\d+)").replace(r"\{E\}", r"(?P<E>\d+)")
        return re.compile(f"^{rx}$")


_ATTN = [
    Rule("decoder.layers.{L}.input_layernorm.weight", ("model.layers.{L}.input_layernorm.weight",)),
    Rule(
        "decoder.layers.{L}.self_attention.linear_qkv.weight",
        (
            "model.layers.{L}.self_attn.q_proj.weight",
            "model.layers.{L}.self_attn.k_proj.weight",
            "model.layers.{L}.self_attn.v_proj.weight",
        ),
        combine="qkv",
        split="qkv",
    ),
    Rule(
        "decoder.layers.{L}.self_attention.linear_proj.weight",
        ("model.layers.{L}.self_attn.o_proj.weight",),
        split="tp1",
    ),
    Rule(
        "decoder.layers.{L}.self_attention.q_layernorm.weight", ("model.layers.{L}.self_attn.q_norm.weight",)
    ),
    Rule(
        "decoder.layers.{L}.self_attention.k_layernorm.weight", ("model.layers.{L}.self_attn.k_norm.weight",)
    ),
    Rule(
        "decoder.layers.{L}.pre_mlp_layernorm.weight", ("model.layers.{L}.post_attention_layernorm.weight",)
    ),
]

_ENDS = [
    Rule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), split="tp0"),
    Rule("decoder.final_layernorm.weight", ("model.norm.weight",)),
    Rule("output_layer.weight", ("lm_head.weight",), split="tp0"),
]

QWEN3_MOE = (
    *_ENDS,
    *_ATTN,
    Rule("decoder.layers.{L}.mlp.router.weight", ("model.layers.{L}.mlp.gate.weight",)),
    Rule(
        "decoder.layers.{L}.mlp.experts.local_experts.{E}.linear_fc1.weight",
        (
            "model.layers.{L}.mlp.experts.{E}.gate_proj.weight",
            "model.layers.{L}.mlp.experts.{E}.up_proj.weight",
        ),
        combine="gate_up",
        split="egate_up",
    ),
    Rule(
        "decoder.layers.{L}.mlp.experts.local_experts.{E}.linear_fc2.weight",
        ("model.layers.{L}.mlp.experts.{E}.down_proj.weight",),
        split="etp1",
    ),
)

QWEN3 = (
    *_ENDS,
    *_ATTN,
    Rule(
        "decoder.layers.{L}.mlp.linear_fc1.weight",
        ("model.layers.{L}.mlp.gate_proj.weight", "model.layers.{L}.mlp.up_proj.weight"),
        combine="gate_up",
        split="gate_up",
    ),
    Rule("decoder.layers.{L}.mlp.linear_fc2.weight", ("model.layers.{L}.mlp.down_proj.weight",), split="tp1"),
)

TABLES = {"qwen3_moe": QWEN3_MOE, "qwen3": QWEN3}

# transformer-engine layer specs fuse the pre-attention (and, for dense MLPs, pre-MLP) norms into the
# following linear layer; these aliases map its parameter names onto the local-spec names above.
TE_ALIASES = (
    (re.compile(r"self_attention\.linear_qkv\.layer_norm_weight$"), "input_layernorm.weight"),
    (re.compile(r"mlp\.linear_fc1\.layer_norm_weight$"), "pre_mlp_layernorm.weight"),
)


def canonical_name(name: str) -> str:
    """A megatron parameter name in local-spec form (TE fused-norm names mapped back)."""
    for rx, repl in TE_ALIASES:
        if rx.search(name):
            head = name[: rx.search(name).start()]
            return head + repl
    return name
