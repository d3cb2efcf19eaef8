"""Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2, Moonlight) in megatron-core without transformer-engine.

megatron-core's ``MLASelfAttention`` (q_a/q_b with q-LoRA, kv_a with the compressed latent and the decoupled RoPE
key, kv_b, the norms between them, RoPE or YaRN on the rope part only) is used as it is. What it cannot get from
megatron-core's local modules is its core attention: it asks for key heads of ``qk_nope + qk_rope`` channels and
value heads of ``v_head_dim`` channels, and the local ``DotProductAttention`` has one head size
(``kv_channels``). :class:`~tim_megatron.trainer.attention.SdpaCoreAttention` takes both sizes; it is given
through the layer spec (no patch); with transformer-engine the same spec takes TE's attention, which accepts both
sizes.
"""

from __future__ import annotations

from tim_megatron.attention_kinds import LATENT_NORM_EPS
from tim_megatron.trainer.attention import SdpaCoreAttention
from tim_megatron.trainer.norm import SequenceParallelRMSNorm


class LatentRMSNorm(SequenceParallelRMSNorm):
    """MLA's q and kv latent norm: :class:`SequenceParallelRMSNorm` with :data:`LATENT_NORM_EPS`.

    megatron-core builds both with ``config.layernorm_epsilon`` (``rms_norm_eps``); for a checkpoint whose
    ``rms_norm_eps`` is not 1e-6 (Moonlight-16B-A3B: 1e-5) that is another function than the model's own code,
    by up to 1e-2 in logprob on the tiny DeepSeek models. The rollout engine's latent norms get the same epsilon
    (``patches/vllm/mla_latent_norm_eps.py``)."""

    def __init__(self, config, hidden_size: int, eps: float | None = None, **kwargs):
        # megatron-core passes its ``layernorm_epsilon`` (``rms_norm_eps``) as ``eps``: replaced, not used
        super().__init__(config, hidden_size, eps=LATENT_NORM_EPS, **kwargs)


def mla_layer_spec(*, num_experts: int | None, use_te: bool, grouped_experts: bool = False):
    """One MLA decoder layer spec: megatron-core's own (with the q and kv latent norms), and without
    transformer-engine :class:`~tim_megatron.trainer.attention.SdpaCoreAttention`, the sequence-parallel RMSNorm
    the other families use, and :class:`LatentRMSNorm` for the latent norms. (With transformer-engine the latent
    norms are fused into the up-projections with ``rms_norm_eps``: not yet matched to :data:`LATENT_NORM_EPS`.)
    ``grouped_experts``: the routed experts as grouped GEMMs (:mod:`tim_megatron.trainer.experts`)."""
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )

    if use_te:
        spec = get_gpt_layer_with_transformer_engine_spec(
            num_experts=num_experts, moe_grouped_gemm=False, qk_layernorm=True, multi_latent_attention=True
        )
        if grouped_experts and num_experts:
            from tim_megatron.trainer.experts import use_grouped_experts

            use_grouped_experts(spec)
        return spec
    spec = get_gpt_layer_local_spec(
        num_experts=num_experts,
        moe_grouped_gemm=False,
        qk_layernorm=True,
        multi_latent_attention=True,
        normalization="RMSNorm",
    )
    spec.submodules.input_layernorm = SequenceParallelRMSNorm
    spec.submodules.pre_mlp_layernorm = SequenceParallelRMSNorm
    attn = spec.submodules.self_attention.submodules
    attn.core_attention = SdpaCoreAttention
    attn.q_layernorm = LatentRMSNorm
    attn.kv_layernorm = LatentRMSNorm
    if grouped_experts and num_experts:
        from tim_megatron.trainer.experts import use_grouped_experts

        use_grouped_experts(spec)
    return spec
