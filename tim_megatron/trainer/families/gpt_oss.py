"""gpt-oss (``GptOssForCausalLM``: gpt-oss-20b, gpt-oss-120b): every layer MoE, with

* attention sinks: a learned logit per query head that joins every softmax as an entry with no value
  (``self_attn.sinks``; megatron-core's ``softmax_type = learnable``);
* sliding-window attention (``sliding_window`` tokens) in the even layers, full attention in the odd ones
  (``layer_types``; megatron-core's ``window_size`` with ``window_attn_skip_freq = 2``);
* YaRN RoPE (rotating halves, as Llama) with an unrounded frequency ramp (``truncate: false``);
* biases on q, k, v, the output projection, the router and both expert projections (``add_bias_linear``);
* a softmax router over its top-k logits (``norm_topk_prob``), and the clamped SwiGLU
  ``min(gate, 7) * sigmoid(1.702 min(gate, 7)) * (clamp(up, -7, 7) + 1)`` (megatron-core's ``quick_gelu`` with
  ``activation_func_clamp_value = 7`` and ``glu_linear_offset = 1``);
* experts stored fused per layer (``mlp.experts.gate_up_proj`` ``[experts, hidden, 2 x width]`` with gate and up in
  alternating columns, ``down_proj`` ``[experts, width, hidden]``, their biases): the weight table de-interleaves
  them into each expert's ``linear_fc1`` (gate rows, then up rows) and transposes, and exports them fused again;
* the published checkpoints in MXFP4 (:mod:`tim_megatron.trainer.weights.mxfp4`), read dequantized; the rollout
  engine serves the bfloat16 copy ``tim dequantize`` writes.

Refused by key, because vLLM 0.32 computes otherwise whatever config.json says: ``layer_types`` other than
sliding and full attention alternating from layer 0 (vLLM windows the even layers), ``rms_norm_eps`` other than
1e-5 (hard-coded), ``swiglu_limit`` other than 7 and ``swiglu_alpha`` other than 1.702 (its ``swigluoai`` takes
only its name), RoPE other than YaRN and YaRN's ``attention_factor``, ``mscale`` or ``mscale_all_dim`` (never
passed on), and tied embeddings. In the trainer: ``trainer.experts: grouped`` (the stacked experts have no
biases), expert tensor parallelism above 1 (each expert-TP rank would add the whole fc2 bias), exact mode (its
invariant kernels and KV cache know neither sinks nor windows), and ``trainer.attention: sdpa`` on CPU
(FlexAttention has no CPU backward in torch 2.13); on CUDA ``sdpa`` is
:class:`~tim_megatron.trainer.attention.SinkFlexCoreAttention`.
"""

from __future__ import annotations

from typing import Any

from tim_megatron.recipe.schema import ModelDims
from tim_megatron.trainer.families import base
from tim_megatron.trainer.weights.mapping import Rule

ARCH = "GptOssForCausalLM"
SWIGLU_ALPHA = 1.702
"""The clamped SwiGLU's sigmoid gain: megatron-core's ``quick_gelu`` and vLLM's ``swigluoai`` hard-code it."""
SWIGLU_LIMIT = 7.0
"""The clamp vLLM's ``swigluoai`` applies, whatever config.json says."""
RMS_NORM_EPS = 1e-5
"""The epsilon of every RMSNorm in vLLM's gpt-oss, whatever config.json says."""


def layer_types(num_layers: int) -> list[str]:
    """gpt-oss's layer kinds (transformers' default): sliding-window attention in the even layers, full in the odd."""
    return ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)]


def _yarn(r: base.ConfigReader) -> dict[str, Any]:
    """rope_theta and YaRN from ``rope_scaling`` (published config.json) or ``rope_parameters`` (transformers 5)."""
    scaling = r.cfg.get("rope_scaling") or r.cfg.get("rope_parameters") or {}
    key = "rope_scaling" if r.cfg.get("rope_scaling") else "rope_parameters"
    if not isinstance(scaling, dict):
        raise r._fail(key, scaling, "an object with rope_type yarn")
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind != "yarn":
        raise r.unsupported(
            f"{key}.rope_type", kind, "vLLM's gpt-oss always builds YaRN RoPE; allowed: yarn (as published)"
        )
    y = base.ConfigReader(scaling, f"{r.where} {key}")
    for extra in ("attention_factor", "mscale", "mscale_all_dim"):
        if scaling.get(extra) is not None:
            raise y.unsupported(
                extra,
                scaling[extra],
                "vLLM's gpt-oss passes only factor, beta_fast, beta_slow, truncate and "
                "original_max_position_embeddings to its YaRN; allowed: no such key (as published)",
            )
    theta = r.cfg.get("rope_theta", scaling.get("rope_theta", 150000.0))
    return dict(
        rope_theta=base.ConfigReader({"rope_theta": theta}, r.where).float("rope_theta"),
        rope_scaling="yarn",
        yarn_factor=y.float("factor"),
        yarn_original_max_position_embeddings=y.int("original_max_position_embeddings"),
        yarn_beta_fast=y.float("beta_fast", 32.0),
        yarn_beta_slow=y.float("beta_slow", 1.0),
        yarn_truncate=y.bool("truncate", True),
    )


def _refuse_what_vllm_ignores(r: base.ConfigReader, num_layers: int) -> None:
    eps = r.float("rms_norm_eps", RMS_NORM_EPS)
    if eps != RMS_NORM_EPS:
        raise r.unsupported(
            "rms_norm_eps",
            eps,
            f"vLLM's gpt-oss builds every RMSNorm with {RMS_NORM_EPS:g}; allowed: {RMS_NORM_EPS:g}",
        )
    for key, want in (("swiglu_limit", SWIGLU_LIMIT), ("swiglu_alpha", SWIGLU_ALPHA)):
        got = r.float(key, want)
        if got != want:
            raise r.unsupported(
                key,
                got,
                f"vLLM's swigluoai activation hard-codes {want:g} (it takes only its name); allowed: {want:g}",
            )
    kinds = r.get("layer_types", None)
    if kinds is None or kinds == layer_types(num_layers):
        return
    why = (
        "vLLM's gpt-oss windows the even layers and no others, whatever layer_types says; allowed: "
        "sliding_attention in the even layers and full_attention in the odd ones (or no layer_types)"
    )
    if not isinstance(kinds, list) or len(kinds) != num_layers:
        raise r.unsupported("layer_types", kinds, f"one entry per layer ({num_layers}): {why}")
    bad = next(i for i, k in enumerate(kinds) if k != layer_types(num_layers)[i])
    raise r.unsupported(f"layer_types[{bad}]", kinds[bad], why)


def read_dims(cfg: dict[str, Any]) -> ModelDims:
    r = base.ConfigReader(cfg, ARCH)
    r.require_silu("experts")  # gpt-oss publishes silu; its clamped SwiGLU is swiglu_limit's
    if not r.bool("attention_bias", True):
        raise r.unsupported(
            "attention_bias", False, "vLLM's gpt-oss always has q/k/v and output biases; allowed: true"
        )
    if r.bool("tie_word_embeddings", False):
        raise r.unsupported(
            "tie_word_embeddings", True, "vLLM's gpt-oss has its own LM head; allowed: false (as published)"
        )
    layers = r.int("num_hidden_layers")
    _refuse_what_vllm_ignores(r, layers)
    heads = r.int("num_attention_heads")
    hidden = r.int("hidden_size")
    expert = r.int("intermediate_size")
    fields = dict(
        family="gpt_oss",
        hidden_size=hidden,
        num_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=r.int("num_key_value_heads", heads),
        head_dim=r.int("head_dim", hidden // heads),
        vocab_size=r.int("vocab_size"),
        rms_norm_eps=RMS_NORM_EPS,
        max_position_embeddings=r.int("max_position_embeddings", 131072),
        tie_word_embeddings=False,
        num_experts=r.int(r.key_of("num_local_experts", "num_experts")),
        num_experts_per_tok=r.int(r.key_of("num_experts_per_tok", "experts_per_token")),
        moe_intermediate_size=expert,
        intermediate_size=expert,
        norm_topk_prob=True,
        qk_norm="none",
        attention_bias=True,
        linear_biases=True,
        attention_sinks=True,
        sliding_window=r.int("sliding_window"),
        swiglu_limit=SWIGLU_LIMIT,
        **_yarn(r),
    )
    keys = {
        **base.EXPERTS_ONLY_KEYS,
        "num_experts": r.key_of("num_local_experts", "num_experts"),
        "yarn_factor": "factor",
        "yarn_original_max_position_embeddings": "original_max_position_embeddings",
    }
    return base.dims_from_fields(r, keys, **fields)


def hf_config(dims: ModelDims):
    from transformers import GptOssConfig

    common = base.hf_common(dims)
    common["rope_parameters"] = {
        "rope_type": "yarn",
        "rope_theta": dims.rope_theta,
        "factor": dims.yarn_factor,
        "original_max_position_embeddings": dims.yarn_original_max_position_embeddings,
        "beta_fast": dims.yarn_beta_fast,
        "beta_slow": dims.yarn_beta_slow,
        "truncate": dims.yarn_truncate,
    }
    return GptOssConfig(
        **common,
        num_local_experts=dims.num_experts,
        num_experts_per_tok=dims.num_experts_per_tok,
        intermediate_size=dims.moe_intermediate_size,
        sliding_window=dims.sliding_window,
        layer_types=layer_types(dims.num_layers),
        attention_bias=True,
        swiglu_limit=dims.swiglu_limit,
        swiglu_alpha=SWIGLU_ALPHA,
        output_router_logits=False,
    )


def transformer_config(dims: ModelDims) -> dict[str, Any]:
    """megatron-core ``TransformerConfig`` arguments: the MoE features every family shares, every linear layer's
    bias and the clamped SwiGLU (the sinks, windows and YaRN follow from the dims in
    :mod:`tim_megatron.trainer.model`)."""
    kw = base.transformer_features(dims)
    kw.update(
        add_bias_linear=dims.linear_biases,
        activation_func=swiglu_gate,
        activation_func_clamp_value=dims.swiglu_limit,
        glu_linear_offset=1.0,
    )
    return kw


def swiglu_gate(x):
    """The gate's activation, ``x * sigmoid(1.702 x)``, as HF transformers computes it; megatron-core clamps the gate
    and the up half before it and adds ``glu_linear_offset`` (1) to the up half. (megatron-core's own
    ``quick_gelu`` is the same function under ``torch.compile``, which recompiles at every new token count.)"""
    import torch

    return x * torch.sigmoid(x * SWIGLU_ALPHA)


def layer_specs(dims: ModelDims, use_te: bool, *, kernels=None) -> list:
    """The shared layer specs on megatron-core's local spec (transformer-engine's attention with a learned softmax
    offset is not verified here), with the materialized attention (``DotProductAttention``, which takes the sinks
    and windows from the config) or, for ``trainer.attention: sdpa``, FlexAttention with the sinks through its
    log-sum-exp. The grouped experts have no biases and are refused."""
    import dataclasses

    import torch

    from tim_megatron.trainer.attention import LayerKernels, SinkFlexCoreAttention

    kernels = kernels or LayerKernels()
    if kernels.experts == "grouped":
        raise ValueError(
            "trainer.experts = grouped: the grouped experts (tim_megatron/trainer/experts.py) have no biases, and "
            "gpt-oss's experts have them; allowed for gpt-oss: loop, auto"
        )
    flex = kernels.attention == "sdpa"
    if flex and not torch.cuda.is_available():
        raise ValueError(
            "trainer.attention = sdpa with attention sinks: FlexAttention (torch 2.13) has no backward on the CPU; "
            "allowed here: materialized, auto"
        )
    specs = base.layer_specs(dims, False, kernels=dataclasses.replace(kernels, attention="materialized"))
    if flex:
        for spec in {id(s): s for s in specs}.values():
            spec.submodules.self_attention.submodules.core_attention = SinkFlexCoreAttention
    return specs


def count_params(d: ModelDims) -> base.ParamCount:
    """The shared count (the attention kind counts the output bias and the sinks), plus the router's bias and every
    expert's two biases."""
    c = base.count_params(d)
    expert_bias = 2 * d.moe_intermediate_size + d.hidden_size
    router = d.num_moe_layers * d.num_experts
    routed = d.num_moe_layers * d.num_experts * expert_bias
    active = d.num_moe_layers * d.num_experts_per_tok * expert_bias
    return base.ParamCount(
        total=c.total + router + routed,
        active=c.active + router + active,
        routed_experts=c.routed_experts + routed,
    )


_EXPERTS_HF = "model.layers.{L}.mlp.experts."
_EXPERTS = "decoder.layers.{L}.mlp.experts.local_experts.{E}."

WEIGHTS = (
    *base.ENDS,
    *base.attention_rules(bias=True, qk_norm="none"),
    Rule("decoder.layers.{L}.self_attention.linear_proj.bias", ("model.layers.{L}.self_attn.o_proj.bias",)),
    Rule(
        "decoder.layers.{L}.self_attention.core_attention.softmax_offset",
        ("model.layers.{L}.self_attn.sinks",),
        split="tp0",
    ),
    Rule("decoder.layers.{L}.mlp.router.weight", ("model.layers.{L}.mlp.router.weight",)),
    Rule("decoder.layers.{L}.mlp.router.bias", ("model.layers.{L}.mlp.router.bias",)),
    Rule(
        _EXPERTS + "linear_fc1.weight",
        (_EXPERTS_HF + "gate_up_proj",),
        combine="interleaved_gate_up",
        split="egate_up",
        stacked_experts=True,
    ),
    Rule(
        _EXPERTS + "linear_fc1.bias",
        (_EXPERTS_HF + "gate_up_proj_bias",),
        combine="interleaved_gate_up",
        split="egate_up",
        stacked_experts=True,
    ),
    Rule(
        _EXPERTS + "linear_fc2.weight",
        (_EXPERTS_HF + "down_proj",),
        combine="transpose",
        split="etp1",
        stacked_experts=True,
    ),
    # replicated over expert-TP ranks: each would add it whole, so expert-TP above 1 is refused (recipe rules)
    Rule(_EXPERTS + "linear_fc2.bias", (_EXPERTS_HF + "down_proj_bias",), stacked_experts=True),
)


def tiny_init(model, seed: int) -> None:
    """Make the tiny model use what it has: sinks of the size of its attention scores (HF starts them near 0),
    random biases everywhere, and expert weights large enough that the clamp at 7 cuts some gate and up channels."""
    import torch

    g = torch.Generator().manual_seed(seed + 11)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("self_attn.sinks"):
                p.copy_(torch.randn(p.shape, generator=g) + 1.0)
            elif name.endswith("mlp.experts.gate_up_proj"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.4)
            elif name.endswith("mlp.experts.down_proj"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
            elif name.endswith(("_bias", ".bias")):
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)


FAMILY = base.Family(
    name="gpt_oss",
    architectures=(ARCH,),
    read_dims=read_dims,
    hf_config=hf_config,
    weights=WEIGHTS,
    transformer_config=transformer_config,
    layer_specs=layer_specs,
    params=count_params,
    tiny=ModelDims(
        family="gpt_oss",
        intermediate_size=64,
        qk_norm="none",
        attention_bias=True,
        linear_biases=True,
        attention_sinks=True,
        sliding_window=4,
        swiglu_limit=SWIGLU_LIMIT,
        rms_norm_eps=RMS_NORM_EPS,
        rope_theta=150000.0,
        rope_scaling="yarn",
        yarn_factor=32.0,
        yarn_original_max_position_embeddings=16,
        yarn_truncate=False,
    ),
    tiny_init=tiny_init,
    notes=(
        "layer_types, rms_norm_eps, swiglu_limit and swiglu_alpha other than what vLLM hard-codes are refused",
        "MXFP4 checkpoints load dequantized; the engine serves the bfloat16 copy tim dequantize writes",
    ),
)
