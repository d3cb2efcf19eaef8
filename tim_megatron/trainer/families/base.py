"""What every model family shares.

* :class:`Family`: the spec a family module fills in (torchtitan's model-spec habit). The registry in
  :mod:`tim_megatron.trainer.families` finds it by HF architecture name.
* :class:`ConfigReader`: reads config.json keys with named errors (key, value, what is allowed, the fix).
* The megatron-core side, driven by :class:`ModelDims` features: :func:`transformer_features` (the
  ``TransformerConfig`` arguments) and :func:`layer_specs` (one layer spec per layer, dense or MoE).
* :func:`count_params`, the parameter count behind ``tim plan``.
* Weight rules shared by the families' tables (the table format is :mod:`tim_megatron.trainer.weights.mapping`).

Nothing here imports torch or megatron at module level: ``tim plan`` and recipe validation use the registry.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tim_megatron.attention_kinds import attention_kind
from tim_megatron.recipe.schema import ModelDims
from tim_megatron.trainer.weights.mapping import Rule
from tim_megatron.untrusted import shown


class UnsupportedModelError(ValueError):
    """The checkpoint's architecture, or one of its features, cannot be built exactly."""


class HFConfigError(UnsupportedModelError):
    """A config.json key is missing, of the wrong type, or has an impossible value."""


# ------------------------------------------------------------------------------------------ the spec


@dataclass(frozen=True)
class ParamCount:
    """Parameter counts of a model, for memory planning."""

    total: int
    """Every parameter (and persistent buffer) of the HF checkpoint, MTP layers excluded."""
    active: int
    """Parameters one token passes through (routed experts: only its top-k)."""
    routed_experts: int
    """Parameters in routed experts (split over expert parallelism rather than tensor parallelism)."""

    @property
    def dense(self) -> int:
        return self.total - self.routed_experts


@dataclass(frozen=True)
class Family:
    """One model family: everything the trainer, the tiny-model builder and ``tim plan`` need to know."""

    name: str
    """HF ``model_type`` (used when ``architectures`` is absent), also the registry name and
    ``model.dims.family`` (e.g. ``glm4_moe``)."""
    architectures: tuple[str, ...]
    """HF ``architectures`` entries this family loads."""
    read_dims: Callable[[dict[str, Any]], ModelDims]
    """config.json -> :class:`ModelDims`; refuses what cannot be built exactly, naming the key."""
    hf_config: Callable[[ModelDims], Any]
    """:class:`ModelDims` -> a transformers config object (tiny checkpoints and tests build from it)."""
    weights: tuple[Rule, ...]
    """HF <-> megatron-core weight table (TP/EP aware through each rule's split)."""
    tiny: ModelDims
    """The family's tiny test model: 2 layers, hidden 128, head_dim 32, vocab 64."""
    transformer_config: Callable[[ModelDims], dict[str, Any]] = None  # type: ignore[assignment]
    """:class:`ModelDims` -> megatron-core ``TransformerConfig`` arguments (default: :func:`transformer_features`)."""
    layer_specs: Callable[..., list] = None  # type: ignore[assignment]
    """(dims, use transformer-engine, ``kernels=`` a :class:`~tim_megatron.trainer.attention.LayerKernels`) -> one
    layer spec per layer (default: :func:`layer_specs`)."""
    params: Callable[[ModelDims], ParamCount] = None  # type: ignore[assignment]
    """:class:`ModelDims` -> parameter counts for ``tim plan`` (default: :func:`count_params`)."""
    ignored_hf: Callable[[str, ModelDims], bool] = lambda name, dims: False
    """HF checkpoint tensors the model deliberately does not load (e.g. a multi-token-prediction layer)."""
    tiny_init: Callable[[Any, int], None] | None = None
    """Extra deterministic initialization of a freshly built tiny HF model (model, seed), e.g. a non-zero
    expert bias so the tests exercise it."""
    notes: tuple[str, ...] = ()
    """What the family leaves out on purpose (docs/families.md lists it too)."""

    @property
    def model_type(self) -> str:
        """HF ``model_type``: the family's name."""
        return self.name

    def __post_init__(self):
        defaults = {
            "transformer_config": transformer_features,
            "layer_specs": layer_specs,
            "params": count_params,
        }
        for k, v in defaults.items():
            if getattr(self, k) is None:
                object.__setattr__(self, k, v)


# ------------------------------------------------------------------------------------ reading config


_REQUIRED = object()


class ConfigReader:
    """Typed access to a config.json dict; every failure names the key, the value, what is allowed and a fix."""

    def __init__(self, cfg: dict[str, Any], where: str):
        self.cfg = cfg
        self.where = where

    def _fail(self, key: str, value: Any, allowed: str) -> HFConfigError:
        return HFConfigError(
            f"{self.where}: {key} = {shown(value)}: allowed: {allowed} (fix: use the model's published config.json)"
        )

    def get(self, key: str, default: Any = _REQUIRED) -> Any:
        if key in self.cfg and self.cfg[key] is not None:
            return self.cfg[key]
        if default is _REQUIRED:
            raise HFConfigError(
                f"{self.where}: key {key!r} is missing (fix: use the model's published config.json, which has it)"
            )
        return default

    def key_of(self, *keys: str) -> str:
        """The first of ``keys`` the config sets (configs saved by different transformers versions differ)."""
        for k in keys:
            if self.cfg.get(k) is not None:
                return k
        return keys[0]

    def int(self, key: str, default: Any = _REQUIRED, *, minimum: int = 1) -> int:
        v = self.get(key, default)
        if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
            raise self._fail(key, v, f"an integer >= {minimum}")
        return v

    def float(self, key: str, default: Any = _REQUIRED, *, zero_allowed: bool = False) -> float:
        v = self.get(key, default)
        number = not isinstance(v, bool) and isinstance(v, int | float) and math.isfinite(v)
        if not number or (v < 0 if zero_allowed else v <= 0):
            raise self._fail(key, v, f"a finite number {'>=' if zero_allowed else '>'} 0")
        return float(v)

    def bool(self, key: str, default: bool) -> bool:
        v = self.get(key, default)
        if not isinstance(v, bool):
            raise self._fail(key, v, "true or false")
        return v

    def unsupported(self, key: str, value: Any, why: str) -> UnsupportedModelError:
        return UnsupportedModelError(f"{self.where}: {key} = {shown(value)} is not supported: {why}")

    def require_silu(self, part: str) -> None:
        """Only SwiGLU (``hidden_act: silu``) is built; ``part`` names what uses it (MLPs, experts)."""
        act = self.get("hidden_act", "silu")
        if act != "silu":
            raise self.unsupported("hidden_act", act, f"only SwiGLU (silu) {part} are implemented")

    def refuse_attention_bias(self, model: str) -> None:
        """A family without q/k/v biases: a config that turns ``attention_bias`` on is refused."""
        if self.cfg.get("attention_bias"):
            raise self.unsupported("attention_bias", True, f"{model} has no attention bias")

    def require_full_rotary(self, fields: dict[str, Any], model: str) -> None:
        """A family that rotates every head channel: ``fields`` (:func:`common_fields`) must have no partial RoPE."""
        if fields["partial_rotary_factor"] != 1.0:
            raise self.unsupported(
                "partial_rotary_factor", fields["partial_rotary_factor"], f"{model} rotates every channel"
            )

    def refuse_sliding_window(self) -> None:
        """Qwen-style configs: ``sliding_window`` is a size that applies only where ``use_sliding_window`` is true
        (newer transformers also write it per layer, as ``layer_types``)."""
        if self.bool("use_sliding_window", False):
            raise self.unsupported(
                "use_sliding_window",
                True,
                f"sliding-window attention (sliding_window = {shown(self.cfg.get('sliding_window'))}) is not "
                "implemented; allowed: false (full attention in every layer)",
            )
        kinds = self.get("layer_types", [])
        if not isinstance(kinds, list):
            raise self._fail("layer_types", kinds, 'a list of "full_attention" (or no layer_types)')
        for i, kind in enumerate(kinds):
            if kind != "full_attention":
                raise self.unsupported(
                    f"layer_types[{i}]",
                    kind,
                    'only full attention is implemented; allowed: "full_attention" in every layer',
                )


def dims_from_fields(r: ConfigReader, keys: dict[str, str], **fields: Any) -> ModelDims:
    """Build :class:`ModelDims`, turning a range error into one that names the config.json key behind it."""
    from pydantic import ValidationError

    try:
        return ModelDims(**fields)
    except ValidationError as e:
        err = e.errors()[0]
        msg = err["msg"].removeprefix("Value error, ")
        if err["loc"]:
            names = [str(err["loc"][0])]
        else:  # a rule across fields: the schema's error lists the keys involved
            cause = err.get("ctx", {}).get("error")
            names = [k.removeprefix("model.dims.") for k in getattr(cause, "keys", [])]
        values = []
        for name in names:
            key = keys.get(name, name)
            value = r.cfg.get(key)
            values.append(f"{key} = {shown(fields.get(name) if value is None else value)}")
        where = ", ".join(f"model.dims.{n}" for n in names) + "; " if names else ""
        raise HFConfigError(
            f"{r.where}: {', '.join(values) or 'config.json'}: {msg} ({where}fix: use the model's published "
            "config.json)"
        ) from None


def rope_settings(r: ConfigReader) -> tuple[float, float]:
    """(rope_theta, partial_rotary_factor) from either config layout (top-level keys or ``rope_parameters``)."""
    scaling = r.cfg.get("rope_scaling") or {}
    params = r.cfg.get("rope_parameters") or {}
    if not isinstance(scaling, dict) or not isinstance(params, dict):
        raise r._fail("rope_scaling", scaling, "null or an object")
    kind = scaling.get("rope_type", scaling.get("type")) or params.get("rope_type") or "default"
    if kind != "default":
        raise r.unsupported("rope_scaling.rope_type", kind, "only default RoPE is implemented")
    theta = (
        r.cfg.get("rope_theta") if r.cfg.get("rope_theta") is not None else params.get("rope_theta", 10000.0)
    )
    partial = r.cfg.get("partial_rotary_factor")
    if partial is None:
        partial = params.get("partial_rotary_factor", 1.0)
    sub = ConfigReader({"rope_theta": theta, "partial_rotary_factor": partial}, r.where)
    return sub.float("rope_theta"), sub.float("partial_rotary_factor")


def common_fields(r: ConfigReader) -> dict[str, Any]:
    """The fields every family reads the same way."""
    heads = r.int("num_attention_heads")
    hidden = r.int("hidden_size")
    theta, partial = rope_settings(r)
    if hidden % heads and "head_dim" not in r.cfg:
        raise r._fail(
            "hidden_size", hidden, f"a multiple of num_attention_heads = {heads} when head_dim is absent"
        )
    return dict(
        hidden_size=hidden,
        num_layers=r.int("num_hidden_layers"),
        num_attention_heads=heads,
        num_key_value_heads=r.int("num_key_value_heads", heads),
        head_dim=r.int("head_dim", hidden // heads),
        vocab_size=r.int("vocab_size"),
        rope_theta=theta,
        partial_rotary_factor=partial,
        rms_norm_eps=r.float("rms_norm_eps", 1e-6),
        max_position_embeddings=r.int("max_position_embeddings", 32768),
        tie_word_embeddings=r.bool("tie_word_embeddings", False),
    )


def experts_only_fields(r: ConfigReader, *experts_keys: str) -> dict[str, Any]:
    """The MoE fields of a family with experts in every layer and no dense MLP (Mixtral, OLMoE): the expert count
    (the first of ``experts_keys`` the config sets), top-k, and config.json's ``intermediate_size`` as the
    experts' width (:data:`EXPERTS_ONLY_KEYS` names it back)."""
    expert = r.int("intermediate_size")
    return dict(
        num_experts=r.int(r.key_of(*experts_keys)),
        num_experts_per_tok=r.int("num_experts_per_tok"),
        moe_intermediate_size=expert,
        intermediate_size=expert,
    )


COMMON_KEYS = {
    "num_layers": "num_hidden_layers",
}
"""ModelDims fields whose config.json key has another name (the rest share their name)."""

EXPERTS_ONLY_KEYS = {**COMMON_KEYS, "moe_intermediate_size": "intermediate_size"}
"""The same for :func:`experts_only_fields`' families."""

SHARED_EXPERT_KEYS = {
    **COMMON_KEYS,
    "num_experts": "n_routed_experts",
    "first_k_dense_layers": "first_k_dense_replace",
    "shared_expert_intermediate_size": "n_shared_experts",
}
"""The same for the GLM-4.5 / DeepSeek-V3 MoE layout (:func:`hf_shared_expert_moe` writes these keys)."""


def hf_common(dims: ModelDims) -> dict[str, Any]:
    """transformers config arguments every family's tiny model shares (the tiny tokenizer: EOS = PAD = 0)."""
    return dict(
        vocab_size=dims.vocab_size,
        hidden_size=dims.hidden_size,
        num_hidden_layers=dims.num_layers,
        num_attention_heads=dims.num_attention_heads,
        num_key_value_heads=dims.num_key_value_heads,
        head_dim=dims.head_dim,
        rms_norm_eps=dims.rms_norm_eps,
        max_position_embeddings=dims.max_position_embeddings,
        tie_word_embeddings=dims.tie_word_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": dims.rope_theta},
        eos_token_id=0,
        pad_token_id=0,
        bos_token_id=None,
    )


def hf_shared_expert_moe(dims: ModelDims, family: str) -> dict[str, Any]:
    """transformers config arguments of the GLM-4.5 / DeepSeek-V3 MoE layout: leading dense layers, routed
    experts with a sigmoid router and routed scaling, shared experts counted in routed experts' widths. A dense
    model (``num_experts = 0``) is every layer a leading dense one."""
    shared, rest = divmod(dims.shared_expert_intermediate_size, dims.moe_intermediate_size or 1)
    if rest:
        raise ValueError(f"{family}'s shared expert width is a whole number of routed experts' widths")
    return dict(
        intermediate_size=dims.intermediate_size,
        moe_intermediate_size=dims.moe_intermediate_size,
        n_routed_experts=dims.num_experts,
        num_experts_per_tok=dims.num_experts_per_tok,
        n_shared_experts=shared,
        first_k_dense_replace=dims.first_k_dense_layers if dims.is_moe else dims.num_layers,
        routed_scaling_factor=dims.routed_scaling_factor,
        norm_topk_prob=dims.norm_topk_prob,
        n_group=dims.router_groups,
        topk_group=dims.router_group_topk,
        num_nextn_predict_layers=0,
    )


def random_correction_bias(model, seed: int) -> None:
    """``tiny_init`` of the families with a router correction bias: HF initializes it to zero; a random one (of
    the size of a sigmoid score's spread) makes the tiny model's routing, and its group choice, depend on it, so
    the tests exercise the bias."""
    import torch

    g = torch.Generator().manual_seed(seed + 7)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("mlp.gate.e_score_correction_bias"):
                buf.copy_(torch.randn(buf.shape, generator=g) * 0.05)


# ------------------------------------------------------------------------------------ megatron side


def transformer_features(dims: ModelDims) -> dict[str, Any]:
    """megatron-core ``TransformerConfig`` arguments that follow from the architecture features."""
    kw: dict[str, Any] = dict(
        qk_layernorm=dims.qk_norm != "none",
        add_qkv_bias=dims.attention_bias,
        ffn_hidden_size=dims.intermediate_size,
    )
    if not dims.is_moe:
        return kw
    kw.update(
        num_moe_experts=dims.num_experts,
        moe_router_topk=dims.num_experts_per_tok,
        moe_ffn_hidden_size=dims.moe_intermediate_size,
        moe_router_score_function=dims.router_score,
        # softmax: renormalized top-k (norm_topk_prob) equals a softmax over the top-k logits, megatron's
        # pre_softmax=False; without renormalization: softmax over all experts, then top-k (pre_softmax=True).
        # sigmoid: megatron always renormalizes the top-k scores (norm_topk_prob is required by ModelDims).
        moe_router_pre_softmax=dims.router_score == "softmax" and not dims.norm_topk_prob,
    )
    if dims.first_k_dense_layers:
        kw["moe_layer_freq"] = dims.moe_layer_pattern
    if dims.shared_expert_intermediate_size:
        kw["moe_shared_expert_intermediate_size"] = dims.shared_expert_intermediate_size
    if dims.router_expert_bias:
        # The pretrained score-correction bias is data: RL must not move it (megatron would nudge it towards
        # balanced loads after every step, changing the routing the rollout engine was given).
        kw.update(moe_router_enable_expert_bias=True, moe_router_bias_update_rate=0.0)
    if dims.routed_scaling_factor != 1.0:
        kw["moe_router_topk_scaling_factor"] = dims.routed_scaling_factor
    return kw


def layer_specs(dims: ModelDims, use_te: bool, *, kernels=None) -> list:
    """One megatron-core layer spec per layer: dense MLP for the leading dense layers, MoE for the rest, with the
    core attention (local spec; transformer-engine brings its own) and the expert path ``kernels`` (a
    :class:`~tim_megatron.trainer.attention.LayerKernels`) names."""
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )
    from megatron.core.transformer.spec_utils import ModuleSpec

    from tim_megatron.trainer.attention import LayerKernels, SdpaCoreAttention
    from tim_megatron.trainer.experts import use_grouped_experts
    from tim_megatron.trainer.norm import SequenceParallelRMSNorm, WholeProjectionRMSNorm

    qk = dims.qk_norm != "none"
    kernels = kernels or LayerKernels()
    grouped = kernels.experts == "grouped"

    def one(num_experts: int | None):
        # megatron-core's own grouped experts (moe_grouped_gemm=True) need transformer-engine or grouped_gemm;
        # the grouped path here (tim_megatron/trainer/experts.py) replaces SequentialMLP with stacked weights
        # that the weight tables read as SequentialMLP's per-expert ones
        if use_te:
            spec = get_gpt_layer_with_transformer_engine_spec(
                num_experts=num_experts, moe_grouped_gemm=False, qk_layernorm=qk
            )
        else:
            spec = get_gpt_layer_local_spec(
                num_experts=num_experts, moe_grouped_gemm=False, qk_layernorm=qk, normalization="RMSNorm"
            )
            spec.submodules.input_layernorm = SequenceParallelRMSNorm
            spec.submodules.pre_mlp_layernorm = SequenceParallelRMSNorm
            if kernels.attention == "sdpa":
                spec.submodules.self_attention.submodules.core_attention = SdpaCoreAttention
        if grouped and num_experts:
            use_grouped_experts(spec)
        attn = spec.submodules.self_attention.submodules
        if dims.qk_norm == "per_head" and not use_te:
            attn.q_layernorm = SequenceParallelRMSNorm
            attn.k_layernorm = SequenceParallelRMSNorm
        elif dims.qk_norm == "whole":
            attn.q_layernorm = ModuleSpec(module=WholeProjectionRMSNorm, params={"projection": "q"})
            attn.k_layernorm = ModuleSpec(module=WholeProjectionRMSNorm, params={"projection": "k"})
        return spec

    return per_layer(dims, one)


def per_layer(dims: ModelDims, one: Callable[[int | None], Any]) -> list:
    """One spec per layer from ``one(num_experts)``: ``one(None)`` for a dense layer (every layer of a dense
    model, the leading ``first_k_dense_layers`` of an MoE one), ``one(num_experts)`` for an MoE layer."""
    if not dims.is_moe:
        return [one(None) for _ in range(dims.num_layers)]
    dense, moe = one(None), one(dims.num_experts)
    return [moe if is_moe else dense for is_moe in dims.moe_layer_pattern]


# ---------------------------------------------------------------------------------------- param count


def count_params(d: ModelDims) -> ParamCount:
    """Parameters of the HF checkpoint, from the architecture features (checked against transformers)."""
    h = d.hidden_size
    attn = attention_kind(d).layer_params(d)
    layer_base = attn + 2 * h  # + input and pre-MLP norms
    dense_mlp = 3 * h * d.intermediate_size
    expert = 3 * h * d.moe_intermediate_size
    moe_fixed = h * d.num_experts + (d.num_experts if d.router_expert_bias else 0)
    moe_fixed += 3 * h * d.shared_expert_intermediate_size
    n_moe = d.num_moe_layers
    n_dense = d.num_layers - n_moe
    emb = d.vocab_size * h * (1 if d.tie_word_embeddings else 2) + h
    routed = n_moe * d.num_experts * expert
    total = emb + d.num_layers * layer_base + n_dense * dense_mlp + n_moe * moe_fixed + routed
    active = total - routed + n_moe * d.num_experts_per_tok * expert
    return ParamCount(total=total, active=active, routed_experts=routed)


# ---------------------------------------------------------------------------------------- weight rules


def layer_beyond(prefix: str = "model.layers.") -> Callable[[str, ModelDims], bool]:
    """A tensor of a layer past ``num_layers`` (where multi-token-prediction layers are stored)."""
    rx = re.compile(re.escape(prefix) + r"(\d+)\.")

    def ignored(name: str, dims: ModelDims) -> bool:
        m = rx.match(name)
        return m is not None and int(m.group(1)) >= dims.num_layers

    return ignored


ENDS = (
    Rule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), split="tp0"),
    Rule("decoder.final_layernorm.weight", ("model.norm.weight",)),
    Rule("output_layer.weight", ("lm_head.weight",), split="tp0"),
)

_QKV = (
    "model.layers.{L}.self_attn.q_proj.{P}",
    "model.layers.{L}.self_attn.k_proj.{P}",
    "model.layers.{L}.self_attn.v_proj.{P}",
)


def attention_rules(*, bias: bool = False, qk_norm: str = "per_head") -> tuple[Rule, ...]:
    """Norms and attention of a layer; ``qk_norm``: per_head, whole (OLMoE) or none."""
    rules = [
        Rule("decoder.layers.{L}.input_layernorm.weight", ("model.layers.{L}.input_layernorm.weight",)),
        Rule(
            "decoder.layers.{L}.self_attention.linear_qkv.weight",
            tuple(n.replace("{P}", "weight") for n in _QKV),
            combine="qkv",
            split="qkv",
        ),
        Rule(
            "decoder.layers.{L}.self_attention.linear_proj.weight",
            ("model.layers.{L}.self_attn.o_proj.weight",),
            split="tp1",
        ),
        Rule(
            "decoder.layers.{L}.pre_mlp_layernorm.weight",
            ("model.layers.{L}.post_attention_layernorm.weight",),
        ),
    ]
    if bias:
        rules.append(
            Rule(
                "decoder.layers.{L}.self_attention.linear_qkv.bias",
                tuple(n.replace("{P}", "bias") for n in _QKV),
                combine="qkv",
                split="qkv",
            )
        )
    if qk_norm != "none":  # per head or whole projection: replicated on every TP rank either way
        rules += [
            Rule(
                "decoder.layers.{L}.self_attention.q_layernorm.weight",
                ("model.layers.{L}.self_attn.q_norm.weight",),
            ),
            Rule(
                "decoder.layers.{L}.self_attention.k_layernorm.weight",
                ("model.layers.{L}.self_attn.k_norm.weight",),
            ),
        ]
    return tuple(rules)


def dense_mlp_rules(
    hf: str = "model.layers.{L}.mlp", megatron: str = "decoder.layers.{L}.mlp"
) -> tuple[Rule, ...]:
    """A SwiGLU MLP split by tensor parallelism (dense layers, shared experts)."""
    return (
        Rule(
            f"{megatron}.linear_fc1.weight",
            (f"{hf}.gate_proj.weight", f"{hf}.up_proj.weight"),
            combine="gate_up",
            split="gate_up",
        ),
        Rule(f"{megatron}.linear_fc2.weight", (f"{hf}.down_proj.weight",), split="tp1"),
    )


def expert_rules(
    experts: str = "model.layers.{L}.mlp.experts.{E}",
    names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"),
) -> tuple[Rule, ...]:
    """Routed experts (per-expert HF tensors), placed by expert parallelism and split by expert-TP."""
    gate, up, down = names
    return (
        Rule(
            "decoder.layers.{L}.mlp.experts.local_experts.{E}.linear_fc1.weight",
            (f"{experts}.{gate}.weight", f"{experts}.{up}.weight"),
            combine="gate_up",
            split="egate_up",
        ),
        Rule(
            "decoder.layers.{L}.mlp.experts.local_experts.{E}.linear_fc2.weight",
            (f"{experts}.{down}.weight",),
            split="etp1",
        ),
    )


def router_rules(gate: str = "model.layers.{L}.mlp.gate", *, expert_bias: bool = False) -> tuple[Rule, ...]:
    rules = [Rule("decoder.layers.{L}.mlp.router.weight", (f"{gate}.weight",))]
    if expert_bias:
        rules.append(
            Rule(
                "decoder.layers.{L}.mlp.router.expert_bias", (f"{gate}.e_score_correction_bias",), buffer=True
            )
        )
    return tuple(rules)


__all__ = [
    "ENDS",
    "EXPERTS_ONLY_KEYS",
    "ConfigReader",
    "Family",
    "HFConfigError",
    "ParamCount",
    "UnsupportedModelError",
    "attention_rules",
    "common_fields",
    "count_params",
    "dense_mlp_rules",
    "dims_from_fields",
    "expert_rules",
    "experts_only_fields",
    "hf_common",
    "layer_beyond",
    "layer_specs",
    "random_correction_bias",
    "router_rules",
    "shown",
    "transformer_features",
]
