"""Attention kinds: what a model's attention means for the rest of the project, decided in one place.

A kind answers every question whose answer differs between grouped-query attention (Qwen3, Mixtral, OLMoE,
GLM-4.5), the same with attention sinks and sliding windows (gpt-oss) and multi-head latent attention
(DeepSeek-V2/V3, Kimi-K2, Moonlight): megatron-core's config class,
the bytes one token takes in vLLM's cache, the width the attention FLOPs scale with, the attention parameters
of a layer, the trainer's attention kernel, the megatron-core patches it needs, whether the exact sampler
caches it, and what vLLM's CPU attention accepts. :func:`attention_kind` picks the kind from the model's dims,
:func:`attention_kind_of_config` from an HF ``config.json``; nothing else in the package branches on it.

A new attention kind is a class here, its layer specs in its model family (``trainer/families/``), its
weight conversion, and the rollout engine's backend for it (``rollout/cpu_kernels.py``).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tim_megatron.recipe.schema import ModelDims


LATENT_NORM_EPS = 1e-6
"""The epsilon of MLA's latent norms (``q_a_layernorm``, ``kv_a_layernorm``) in DeepSeek's reference code and HF
transformers: their RMSNorm's default, whatever ``rms_norm_eps`` (the decoder layers' norms) says."""


class AttentionKind:
    """The interface; :data:`GROUPED_QUERY`, :data:`SINKS_AND_WINDOWS` and :data:`LATENT` implement it."""

    latent: bool
    """The cache holds a compressed latent rather than per-head keys and values."""
    exact_cache: bool
    """The exact sampler keeps a KV cache for it (:mod:`tim_megatron.exact.kv_cache`)."""

    def config_class(self):
        """megatron-core's transformer config class for the kind."""
        raise NotImplementedError

    def kv_cache_bytes_per_token(self, d: ModelDims, *, rollout_tp: int, dtype_bytes: int) -> float:
        """Bytes one token takes in the cache of every layer on one vLLM GPU."""
        raise NotImplementedError

    def score_width(self, d: ModelDims) -> float:
        """The per-head width that the attention FLOPs (scores and the sum over values) scale with."""
        raise NotImplementedError

    def layer_params(self, d: ModelDims) -> int:
        """One layer's attention parameters in the HF checkpoint."""
        raise NotImplementedError

    fixed_kernel: str | None
    """The trainer's core attention kernel when the kind fixes it; None: ``trainer.attention`` chooses
    (:func:`tim_megatron.trainer.attention.resolve_attention`)."""

    def patches(self, *, tp: int) -> tuple[str, ...]:
        """The megatron-core patches (``patches/megatron/``) the trainer applies for the kind."""
        raise NotImplementedError

    def check_with_te(self, d: ModelDims) -> None:
        """Warn about what transformer-engine's layers compute otherwise for the kind (nothing by default)."""

    def check_cpu_engine(self, hf_config: Mapping, *, head_sizes: Callable[[], Sequence[int]]) -> str | None:
        """What vLLM's CPU attention refuses in ``hf_config`` (``head_sizes()``: the sizes its CPU backend
        takes), as a sentence; None when it accepts the model."""
        raise NotImplementedError


class _GroupedQuery(AttentionKind):
    latent = False
    exact_cache = True
    fixed_kernel = None

    def config_class(self):
        from megatron.core.transformer import TransformerConfig

        return TransformerConfig

    def kv_cache_bytes_per_token(self, d, *, rollout_tp, dtype_bytes):
        heads = max(math.ceil(d.num_key_value_heads / rollout_tp), 1)  # replicated when TP exceeds them
        return 2 * d.num_layers * heads * d.head_dim * dtype_bytes

    def score_width(self, d):
        return d.head_dim

    def layer_params(self, d):
        h, hd = d.hidden_size, d.head_dim
        q, kv = d.num_attention_heads * hd, d.num_key_value_heads * hd
        attn = h * (q + 2 * kv) + q * h
        if d.attention_bias:
            attn += q + 2 * kv
        if d.linear_biases:  # the output projection's
            attn += h
        return attn + {"per_head": 2 * hd, "whole": q + kv, "none": 0}[d.qk_norm]

    def patches(self, *, tp):
        return ()

    def check_cpu_engine(self, hf_config, *, head_sizes):
        head_dim = hf_config.get("head_dim") or hf_config["hidden_size"] // hf_config["num_attention_heads"]
        sizes = head_sizes()
        if head_dim in sizes:
            return None
        return (
            f"head_dim = {head_dim} is not supported by vLLM's CPU attention (supported: {sizes}); "
            "use model.dims.head_dim = 32 or more for CPU runs"
        )


class _Latent(AttentionKind):
    latent = True
    exact_cache = False
    fixed_kernel = "sdpa"  # megatron-core's MLA runs its own dot-product attention

    def config_class(self):
        from megatron.core.transformer import MLATransformerConfig

        return MLATransformerConfig

    def kv_cache_bytes_per_token(self, d, *, rollout_tp, dtype_bytes):
        # one compressed latent and the shared rotated key per layer, on every TP rank
        return d.num_layers * (d.kv_lora_rank + d.qk_rope_head_dim) * dtype_bytes

    def score_width(self, d):
        return (d.qk_nope_head_dim + d.qk_rope_head_dim + d.v_head_dim) / 2  # scores over q/k, sum over v

    def layer_params(self, d):
        h, n = d.hidden_size, d.num_attention_heads
        q_head = d.qk_nope_head_dim + d.qk_rope_head_dim
        q = (
            h * d.q_lora_rank + d.q_lora_rank + d.q_lora_rank * n * q_head
            if d.q_lora_rank
            else h * n * q_head
        )
        kv = h * (d.kv_lora_rank + d.qk_rope_head_dim) + d.kv_lora_rank
        kv += d.kv_lora_rank * n * (d.qk_nope_head_dim + d.v_head_dim)
        return q + kv + n * d.v_head_dim * h

    def patches(self, *, tp):
        # without transformer-engine; and the RoPE key's gradient, summed over TP ranks
        return ("mla_without_te", "mla_tp_rope_grad") if tp > 1 else ("mla_without_te",)

    def check_with_te(self, d):
        if d.rms_norm_eps != LATENT_NORM_EPS:
            warnings.warn(
                f"model.dims.rms_norm_eps = {d.rms_norm_eps:g} with transformer-engine: its MLA latent norms "
                f"(fused into the q and kv up-projections) take it, where DeepSeek's code and the rollout engine "
                f"use {LATENT_NORM_EPS:g}; the trainer scores slightly other logprobs (run without "
                "transformer-engine for the matched norms)",
                stacklevel=3,
            )

    def check_cpu_engine(self, hf_config, *, head_sizes):
        latent, rope = hf_config["kv_lora_rank"], hf_config.get("qk_rope_head_dim")
        if (latent, rope) == (512, 64):
            return None
        return (
            f"kv_lora_rank = {latent}, qk_rope_head_dim = {rope}: vLLM's CPU MLA attention takes only 512 and 64 "
            "(a 576-wide cache entry, as DeepSeek-V2/V3 have); use model.dims.kv_lora_rank = 512 and "
            "model.dims.qk_rope_head_dim = 64 for CPU runs"
        )


class _SinksAndWindows(_GroupedQuery):
    """Grouped-query attention with a learned sink logit per head and sliding windows in alternate layers
    (gpt-oss): megatron-core's ``DotProductAttention`` with ``softmax_type = learnable`` and ``window_size``, or
    :class:`tim_megatron.trainer.attention.SinkFlexCoreAttention` (``trainer.attention: sdpa``, CUDA)."""

    exact_cache = (
        False  # exact mode's invariant kernels and its sampler's cache know neither sinks nor windows
    )

    def layer_params(self, d):
        return super().layer_params(d) + (d.num_attention_heads if d.attention_sinks else 0)

    def patches(self, *, tp):
        # megatron-core builds the sliding-window mask on "cuda" (needed only without CUDA)
        return ("sliding_window_mask",)


GROUPED_QUERY: AttentionKind = _GroupedQuery()
"""Grouped-query attention (multi-head attention when the KV heads equal the heads)."""
LATENT: AttentionKind = _Latent()
"""Multi-head latent attention (DeepSeek-V2's MLA)."""
SINKS_AND_WINDOWS: AttentionKind = _SinksAndWindows()
"""Grouped-query attention with attention sinks and alternating sliding windows (gpt-oss)."""


def attention_kind(d: ModelDims) -> AttentionKind:
    """The kind of ``d``'s attention: latent when it has a latent rank (``kv_lora_rank`` > 0), with sinks and
    windows when it has either (``attention_sinks``, ``sliding_window``), else grouped-query."""
    if d.kv_lora_rank > 0:
        return LATENT
    return SINKS_AND_WINDOWS if d.attention_sinks or d.sliding_window else GROUPED_QUERY


def attention_kind_of_config(hf_config: Mapping) -> AttentionKind:
    """The kind of an HF ``config.json``'s attention (the same rule, on its raw keys; gpt-oss by its model type)."""
    if hf_config.get("kv_lora_rank"):
        return LATENT
    return SINKS_AND_WINDOWS if hf_config.get("model_type") == "gpt_oss" else GROUPED_QUERY
