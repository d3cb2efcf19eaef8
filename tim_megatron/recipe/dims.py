"""The model's architecture numbers (``model.dims``) and their cross-field rules, feature by feature.

A family reads its own config.json keys into :class:`ModelDims`; the fields past ``tie_word_embeddings`` are the
architecture features some families have beside Qwen3's, grouped in :data:`FEATURES`: each feature names its
fields, the families whose config.json sets them, and the rule that checks them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pydantic import ConfigDict, Field, model_validator

from tim_megatron.family_names import FAMILIES
from tim_megatron.recipe.base import RecipeValueError, Section

# Sanity bounds on architecture numbers: far above any published model, far below what would overflow a plan.
_MAX_WIDTH = 1 << 17
_MAX_LAYERS = 1024
_MAX_HEADS = 1024
_MAX_HEAD_DIM = 4096
_MAX_VOCAB = 1 << 23
_MAX_EXPERTS = 4096
_MAX_POSITIONS = 1 << 24


class ModelDims(Section):
    """Architecture numbers of the policy model, as in its HF ``config.json``.

    The defaults describe the built-in tiny Qwen3-MoE. Each model family
    (:mod:`tim_megatron.trainer.families`) reads its own config.json keys into these fields; the fields after
    ``tie_word_embeddings`` are the features some families need beside Qwen3's, and their defaults are Qwen3's.
    """

    model_config = ConfigDict(
        extra="forbid", use_attribute_docstrings=True, validate_assignment=True, allow_inf_nan=False
    )

    hidden_size: int = Field(128, gt=0, le=_MAX_WIDTH)
    """Width of the residual stream (``hidden_size``)."""
    num_layers: int = Field(2, gt=0, le=_MAX_LAYERS)
    """Number of transformer layers (``num_hidden_layers``; a multi-token-prediction layer is not counted)."""
    num_attention_heads: int = Field(4, gt=0, le=_MAX_HEADS)
    """Query heads (``num_attention_heads``)."""
    num_key_value_heads: int = Field(2, gt=0, le=_MAX_HEADS)
    """Key/value heads for grouped-query attention (``num_key_value_heads``)."""
    head_dim: int = Field(32, gt=0, le=_MAX_HEAD_DIM)
    """Per-head width (``head_dim``). vLLM's CPU attention rejects 16."""
    vocab_size: int = Field(64, gt=0, le=_MAX_VOCAB)
    """Vocabulary size (``vocab_size``)."""
    num_experts: int = Field(8, ge=0, le=_MAX_EXPERTS)
    """Routed experts per MoE layer (``num_experts``, ``num_local_experts`` or ``n_routed_experts``); 0 means a
    dense model."""
    num_experts_per_tok: int = Field(2, ge=0, le=_MAX_EXPERTS)
    """Experts chosen per token (``num_experts_per_tok``, the router's top-k)."""
    moe_intermediate_size: int = Field(64, ge=0, le=_MAX_WIDTH * 16)
    """Hidden width of each routed expert's SwiGLU MLP (``moe_intermediate_size``; Mixtral and OLMoE:
    ``intermediate_size``)."""
    intermediate_size: int = Field(256, gt=0, le=_MAX_WIDTH * 16)
    """Hidden width of dense MLP layers (``intermediate_size``)."""
    norm_topk_prob: bool = True
    """Renormalize the top-k routing probabilities to sum to one (``norm_topk_prob``; Mixtral: always)."""
    rope_theta: float = Field(1_000_000.0, gt=0, le=1e12)
    """RoPE base frequency (``rope_theta``)."""
    rms_norm_eps: float = Field(1e-6, gt=0, lt=1)
    """RMSNorm epsilon (``rms_norm_eps``)."""
    max_position_embeddings: int = Field(512, gt=0, le=_MAX_POSITIONS)
    """Longest sequence the position encoding is set up for (``max_position_embeddings``)."""
    tie_word_embeddings: bool = False
    """Share the input embedding with the LM head (``tie_word_embeddings``)."""
    family: str | None = None
    """Model family, by registry name: one of ``FAMILIES``, each a module of tim_megatron/trainer/families.
    Unset: qwen3_moe when ``num_experts`` > 0, else qwen3."""
    qk_norm: Literal["per_head", "whole", "none"] = "per_head"
    """RMSNorm on queries and keys before RoPE: ``per_head`` (Qwen3: one head_dim-wide weight for every head),
    ``whole`` (OLMoE: over the whole q and k projections, one weight entry per channel), ``none`` (Mixtral,
    GLM-4.5-Air)."""
    attention_bias: bool = False
    """Biases on the q, k and v projections (``attention_bias``; GLM-4.5). The output projection has none."""
    partial_rotary_factor: float = Field(1.0, gt=0, le=1)
    """Fraction of each head's channels that RoPE rotates, the leading ones (``partial_rotary_factor``;
    GLM-4.5: 0.5). The rest pass through unrotated."""
    first_k_dense_layers: int = Field(0, ge=0, le=_MAX_LAYERS)
    """Leading layers with a dense MLP of width ``intermediate_size`` instead of experts
    (``first_k_dense_replace``; GLM-4.5: 1 for Air, 3 for the 355B model)."""
    shared_expert_intermediate_size: int = Field(0, ge=0, le=_MAX_WIDTH * 16)
    """Width of the shared-expert SwiGLU MLP that every token passes through beside its routed experts
    (``n_shared_experts`` x ``moe_intermediate_size``; GLM-4.5). 0: no shared expert."""
    router_score: Literal["softmax", "sigmoid"] = "softmax"
    """Router score function: softmax over the experts (Qwen3, Mixtral, OLMoE) or an independent sigmoid per
    expert (GLM-4.5), whose top-k scores are then renormalized."""
    router_expert_bias: bool = False
    """The router picks experts by score plus a per-expert correction bias (``e_score_correction_bias``) but
    weights them by the score alone (GLM-4.5). The bias is loaded from the checkpoint and kept fixed in RL."""
    routed_scaling_factor: float = Field(1.0, gt=0, le=1000)
    """Multiplier on the routed experts' gating weights (``routed_scaling_factor``; GLM-4.5-Air: 1.0)."""
    router_groups: int = Field(1, ge=1, le=_MAX_EXPERTS)
    """Group-limited routing (``n_group``; DeepSeek-V3: 8): the experts in this many equal groups, and a token's
    experts chosen only from its ``router_group_topk`` best groups (a group's score: the sum of its two best
    expert scores, bias included). 1: no groups."""
    router_group_topk: int = Field(1, ge=1, le=_MAX_EXPERTS)
    """Groups a token's experts may come from (``topk_group``; DeepSeek-V3: 4)."""
    kv_lora_rank: int = Field(0, ge=0, le=_MAX_WIDTH)
    """Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2, Moonlight): width of the compressed key/value
    latent that the KV cache holds (``kv_lora_rank``). 0: ordinary attention with heads of ``head_dim``."""
    q_lora_rank: int = Field(0, ge=0, le=_MAX_WIDTH)
    """MLA: width of the compressed query latent (``q_lora_rank``); 0: one query projection (DeepSeek-V2-Lite,
    Moonlight)."""
    qk_nope_head_dim: int = Field(0, ge=0, le=_MAX_HEAD_DIM)
    """MLA: per-head query/key channels without position encoding (``qk_nope_head_dim``)."""
    qk_rope_head_dim: int = Field(0, ge=0, le=_MAX_HEAD_DIM)
    """MLA: per-head query/key channels that RoPE rotates; the key's are one head shared by all
    (``qk_rope_head_dim``)."""
    v_head_dim: int = Field(0, ge=0, le=_MAX_HEAD_DIM)
    """MLA: per-head value channels (``v_head_dim``)."""
    rope_scaling: Literal["none", "yarn"] = "none"
    """RoPE scaling (``rope_scaling.type``): none, or YaRN (DeepSeek-V3, Kimi-K2) with the ``yarn_*`` fields."""
    yarn_factor: float = Field(1.0, ge=1, le=1e6)
    """YaRN: context extension factor (``rope_scaling.factor``)."""
    yarn_original_max_position_embeddings: int = Field(0, ge=0, le=_MAX_POSITIONS)
    """YaRN: the context the model was pretrained with (``rope_scaling.original_max_position_embeddings``)."""
    yarn_beta_fast: float = Field(32.0, gt=0, le=1e6)
    """YaRN: fast boundary of the frequency ramp (``rope_scaling.beta_fast``)."""
    yarn_beta_slow: float = Field(1.0, gt=0, le=1e6)
    """YaRN: slow boundary of the frequency ramp (``rope_scaling.beta_slow``)."""
    yarn_mscale: float = Field(1.0, ge=0, le=1e6)
    """YaRN: attention temperature coefficient of the rotary embedding (``rope_scaling.mscale``)."""
    yarn_mscale_all_dim: float = Field(0.0, ge=0, le=1e6)
    """YaRN: the coefficient that also scales the softmax (``rope_scaling.mscale_all_dim``; 0: none)."""
    yarn_truncate: bool = True
    """YaRN: round the bounds of the frequency ramp to whole dimensions (``rope_scaling.truncate``; DeepSeek's
    YaRN always does, gpt-oss's does not: ``truncate: false``)."""
    attention_sinks: bool = False
    """A learned logit per query head joins every softmax over the keys as one more entry with no value, so a head
    can put weight on nothing (``self_attn.sinks``; gpt-oss)."""
    sliding_window: int = Field(0, ge=0, le=_MAX_POSITIONS)
    """Sliding-window attention in the even layers (0, 2, ...): a query there sees itself and the
    ``sliding_window - 1`` tokens before it, while the odd layers see the whole prefix (``sliding_window`` with
    ``layer_types`` alternating sliding and full attention, as in gpt-oss). 0: full attention in every layer."""
    linear_biases: bool = False
    """Biases on the attention output projection, the router and both projections of every expert (gpt-oss;
    megatron-core's ``add_bias_linear``). The q/k/v biases are ``attention_bias``, which this needs."""
    swiglu_limit: float = Field(0.0, ge=0, le=1e6)
    """The MLPs' activation: 0 for SwiGLU, ``silu(gate) * up``; above 0 gpt-oss's clamped SwiGLU,
    ``g * sigmoid(1.702 g) * (u + 1)`` with ``g = min(gate, limit)`` and ``u = clamp(up, -limit, limit)``
    (``swiglu_limit``; gpt-oss: 7; its sigmoid gain ``swiglu_alpha`` is 1.702)."""

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def is_mla(self) -> bool:
        """Multi-head latent attention (``kv_lora_rank`` > 0)."""
        return self.kv_lora_rank > 0

    @property
    def resolved_family(self) -> str:
        """The registry name of the family: ``family``, or qwen3_moe / qwen3 by ``num_experts``."""
        if self.family is not None:
            return self.family
        return "qwen3_moe" if self.is_moe else "qwen3"

    @property
    def num_moe_layers(self) -> int:
        """Layers with routed experts (0 for a dense model)."""
        return self.num_layers - self.first_k_dense_layers if self.is_moe else 0

    @property
    def moe_layer_pattern(self) -> list[int]:
        """One entry per layer: 1 for an MoE layer, 0 for a dense one (megatron-core's ``moe_layer_freq``)."""
        dense = self.num_layers - self.num_moe_layers
        return [0] * dense + [1] * self.num_moe_layers

    @model_validator(mode="after")
    def _features_fit_together(self) -> ModelDims:
        _check_dims(self)
        return self


def _check_dims(d: ModelDims) -> None:
    """Cross-field rules of the architecture features, then each feature against the family. Each failure names
    the keys involved."""
    _check_features_fit(d)
    _check_family_features(d)


def _check_features_fit(d: ModelDims) -> None:
    if d.family is not None and d.family not in FAMILIES:
        raise RecipeValueError(
            ["model.dims.family"],
            f"model.dims.family = {d.family!r} is not a known model family; allowed: {', '.join(FAMILIES)} "
            "(or leave it unset for Qwen3)",
        )
    _check_mla(d)
    rot = d.head_dim * d.partial_rotary_factor
    if not d.is_mla and (rot != int(rot) or int(rot) % 2):
        raise RecipeValueError(
            ["model.dims.partial_rotary_factor", "model.dims.head_dim"],
            f"partial_rotary_factor = {d.partial_rotary_factor} x head_dim = {d.head_dim} must be an even "
            "whole number of rotated channels",
        )
    if d.rope_scaling == "yarn" and (d.yarn_factor <= 1 or d.yarn_original_max_position_embeddings < 1):
        raise RecipeValueError(
            ["model.dims.yarn_factor", "model.dims.yarn_original_max_position_embeddings"],
            f"rope_scaling = yarn needs yarn_factor > 1 (got {d.yarn_factor}) and "
            f"yarn_original_max_position_embeddings >= 1 (got {d.yarn_original_max_position_embeddings})",
        )
    if d.linear_biases and not d.attention_bias:
        raise RecipeValueError(
            ["model.dims.linear_biases", "model.dims.attention_bias"],
            "linear_biases = true needs attention_bias = true (megatron-core gives every linear layer a bias, the "
            "q/k/v projections included)",
        )
    if not d.is_moe:
        moe_only = {
            "first_k_dense_layers": d.first_k_dense_layers != 0,
            "shared_expert_intermediate_size": d.shared_expert_intermediate_size != 0,
            "router_score": d.router_score != "softmax",
            "router_expert_bias": d.router_expert_bias,
            "routed_scaling_factor": d.routed_scaling_factor != 1.0,
            "router_groups": d.router_groups != 1,
        }
        bad = [k for k, v in moe_only.items() if v]
        if bad:
            raise RecipeValueError(
                [f"model.dims.{k}" for k in bad] + ["model.dims.num_experts"],
                f"model.dims.{bad[0]} is an MoE setting, but num_experts = 0 (a dense model); remove it",
            )
        return
    if d.first_k_dense_layers >= d.num_layers:
        raise RecipeValueError(
            ["model.dims.first_k_dense_layers", "model.dims.num_layers"],
            f"first_k_dense_layers = {d.first_k_dense_layers} leaves no MoE layer of num_layers = {d.num_layers}",
        )
    if d.router_expert_bias and d.router_score != "sigmoid":
        raise RecipeValueError(
            ["model.dims.router_expert_bias", "model.dims.router_score"],
            "router_expert_bias = true needs router_score = sigmoid (the bias corrects sigmoid scores)",
        )
    if d.router_score == "sigmoid" and not d.norm_topk_prob:
        raise RecipeValueError(
            ["model.dims.router_score", "model.dims.norm_topk_prob"],
            "router_score = sigmoid needs norm_topk_prob = true (megatron-core renormalizes sigmoid top-k scores)",
        )
    _check_groups(d)


def _check_groups(d: ModelDims) -> None:
    """Group-limited routing as DeepSeek-V3 defines it (a group scored by its two best experts), which is what
    megatron-core computes when top-k / group top-k = 2; and only where it can route at all: two experts per group
    at least, and the chosen groups holding top-k experts or more (otherwise HF transformers and vLLM fail at the
    first forward, or pick experts from groups they left out)."""
    keys = ["model.dims.router_groups", "model.dims.router_group_topk", "model.dims.num_experts"]
    g, gk = d.router_groups, d.router_group_topk
    if d.num_experts % g or gk > g:
        raise RecipeValueError(
            keys,
            f"router_groups = {g} must divide num_experts = {d.num_experts}, and router_group_topk = {gk} must be "
            f"at most router_groups",
        )
    per_group = d.num_experts // g
    if (g > 1 or d.router_expert_bias) and per_group < 2:
        # HF transformers and vLLM score every group (the whole expert set when there is one) by its top 2 even
        # when every group is chosen: with one expert per group the first forward fails
        raise RecipeValueError(
            ["model.dims.router_groups", "model.dims.num_experts"],
            f"router_groups = {g} splits num_experts = {d.num_experts} into groups of {per_group} expert: a group "
            "is scored by the sum of its two best experts (HF transformers' and vLLM's DeepSeek-V3 and GLM-4.5 "
            "routers, even with one group), so each group needs at least 2 experts; allowed: num_experts / "
            "router_groups >= 2 "
            + (f"(router_groups <= {d.num_experts // 2})" if d.num_experts >= 2 else "(num_experts >= 2)"),
        )
    if g > 1 and gk * per_group < d.num_experts_per_tok:
        raise RecipeValueError(
            [*keys[:2], "model.dims.num_experts", "model.dims.num_experts_per_tok"],
            f"the router_group_topk = {gk} chosen groups hold {gk} x {per_group} = {gk * per_group} experts, fewer "
            f"than num_experts_per_tok = {d.num_experts_per_tok} (the rest would be picked from the groups left "
            "out); allowed: router_group_topk x num_experts / router_groups >= num_experts_per_tok",
        )
    if g > 1 and gk < g and d.num_experts_per_tok != 2 * gk:
        raise RecipeValueError(
            [*keys[:2], "model.dims.num_experts_per_tok"],
            f"group-limited routing scores a group by its two best experts; megatron-core scores it by its best "
            f"num_experts_per_tok / router_group_topk = {d.num_experts_per_tok} / {gk}, so the two agree only when "
            f"num_experts_per_tok = 2 x router_group_topk (DeepSeek-V3: 8 = 2 x 4)",
        )


def _check_mla(d: ModelDims) -> None:
    """MLA's head sizes are all set or all unset, and what the other attention features would change is off."""
    mla = {
        "qk_nope_head_dim": d.qk_nope_head_dim,
        "qk_rope_head_dim": d.qk_rope_head_dim,
        "v_head_dim": d.v_head_dim,
    }
    if not d.is_mla:
        stray = [k for k, v in {**mla, "q_lora_rank": d.q_lora_rank}.items() if v]
        if stray:
            raise RecipeValueError(
                [f"model.dims.{stray[0]}", "model.dims.kv_lora_rank"],
                f"model.dims.{stray[0]} is a multi-head latent attention setting, but kv_lora_rank = 0; remove it",
            )
        return
    unset = [k for k, v in mla.items() if not v]
    if unset or d.qk_rope_head_dim % 2:
        raise RecipeValueError(
            ["model.dims.kv_lora_rank", *(f"model.dims.{k}" for k in unset or ["qk_rope_head_dim"])],
            f"kv_lora_rank = {d.kv_lora_rank} (MLA) needs qk_nope_head_dim, qk_rope_head_dim (even) and v_head_dim "
            f"above 0 (got {mla})",
        )
    other = {
        "qk_norm": d.qk_norm != "none",
        "attention_bias": d.attention_bias,
        "partial_rotary_factor": d.partial_rotary_factor != 1.0,
    }
    bad = [k for k, v in other.items() if v]
    if bad:
        raise RecipeValueError(
            [f"model.dims.{bad[0]}", "model.dims.kv_lora_rank"],
            f"model.dims.{bad[0]} does not apply to multi-head latent attention (kv_lora_rank = {d.kv_lora_rank}); "
            "allowed: qk_norm none, attention_bias false, partial_rotary_factor 1 (the latents have their own norms, "
            "RoPE applies to qk_rope_head_dim)",
        )


@dataclass(frozen=True)
class Feature:
    """An architecture feature some families have beside Qwen3's."""

    name: str
    """What the feature is called in errors and docs."""
    fields: tuple[str, ...]
    """The :class:`ModelDims` fields that describe it; at their defaults the model does not have it."""
    families: tuple[str, ...]
    """The families whose config.json reading sets these fields (``trainer/families/<name>.py``)."""
    optional: bool = True
    """``tim new-recipe`` writes the fields only when the model uses the feature (False: always, as a record of
    what the model does not have)."""


FEATURES = (
    Feature(
        "multi-head latent attention",
        ("kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"),
        ("deepseek_v2", "deepseek_v3"),
    ),
    Feature("group-limited routing", ("router_groups", "router_group_topk"), ("deepseek_v3",)),
    Feature(
        "a sigmoid router with a score correction bias",
        ("router_score", "router_expert_bias"),
        ("deepseek_v3", "glm4_moe"),
        optional=False,
    ),
    Feature(
        "routed scaling",
        ("routed_scaling_factor",),
        ("deepseek_v2", "deepseek_v3", "glm4_moe"),
        optional=False,
    ),
    Feature(
        "YaRN RoPE scaling",
        (
            "rope_scaling",
            "yarn_factor",
            "yarn_original_max_position_embeddings",
            "yarn_beta_fast",
            "yarn_beta_slow",
            "yarn_mscale",
            "yarn_mscale_all_dim",
        ),
        ("deepseek_v2", "deepseek_v3", "gpt_oss"),
    ),
    Feature("partial rotary embeddings", ("partial_rotary_factor",), ("glm4_moe",), optional=False),
    Feature("a YaRN frequency ramp with unrounded bounds", ("yarn_truncate",), ("gpt_oss",)),
    Feature("attention sinks", ("attention_sinks",), ("gpt_oss",)),
    Feature("alternating sliding-window attention", ("sliding_window",), ("gpt_oss",)),
    Feature("biases on every linear layer", ("linear_biases",), ("gpt_oss",)),
    Feature("the clamped SwiGLU of gpt-oss", ("swiglu_limit",), ("gpt_oss",)),
)
"""The family-specific features: each family's own fields, validated through its family
(:func:`_check_family_features`)."""


def _check_family_features(d: ModelDims) -> None:
    """A feature's fields away from their defaults only for a family that has it: another family's layer specs
    and weight table would ignore them (a qwen3_moe model with a latent rank would be built without MLA)."""
    family = d.resolved_family
    for f in FEATURES:
        if family in f.families:
            continue
        for key in f.fields:
            value, default = getattr(d, key), ModelDims.model_fields[key].default
            if value != default:
                raise RecipeValueError(
                    [f"model.dims.{key}", "model.dims.family"],
                    f"model.dims.{key} = {value!r} is {f.name}, which model.dims.family = {family} does not have "
                    f"(families with it: {', '.join(f.families)}); allowed for {family}: {key} = {default!r}",
                )
