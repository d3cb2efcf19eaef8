"""Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2, Moonlight) in megatron-core without transformer-engine.

megatron-core's ``MLASelfAttention`` (q_a/q_b with q-LoRA, kv_a with the compressed latent and the decoupled RoPE
key, kv_b, the norms between them, RoPE or YaRN on the rope part only) is used as it is. What it cannot get from
megatron-core's local modules is its core attention: it asks for key heads of ``qk_nope + qk_rope`` channels and
value heads of ``v_head_dim`` channels, and the local ``DotProductAttention`` has one head size
(``kv_channels``). :class:`LatentCoreAttention` is that core attention, on torch's own operations, given through
the layer spec (no patch); with transformer-engine the same spec takes TE's attention, which accepts both sizes.
"""

from __future__ import annotations

import math

import torch

from tim_megatron.trainer.norm import SequenceParallelRMSNorm


class LatentCoreAttention(torch.nn.Module):
    """``softmax(q k^T * scale + causal mask) v`` per head, with key and value head sizes of their own.

    Inputs as megatron-core's core attentions take them: query ``[sq, b, heads, k_channels]``, key
    ``[sk, b, heads, k_channels]``, value ``[sk, b, heads, v_channels]`` (this rank's heads); returns
    ``[sq, b, heads * v_channels]``. ``attention_mask`` (True = masked, megatron's convention) is applied on top of
    the causal mask when given.

    It is torch's ``scaled_dot_product_attention``, the kernel HF transformers runs by default (``sdpa``), which
    takes a value head size of its own and accumulates scores, softmax and the weighted sum in float32 for
    bfloat16 inputs. Against an HF reference in float64 it is as accurate as the two-matmul form
    (``softmax(q k^T) v``); against HF in float32 it rounds as HF does: on 24 random batches of the tiny
    DeepSeek-V3 the two-matmul form differed from HF by more than 1e-5 on 3 (up to 2.5e-5, its scores of up to 30
    rounded another way in a padded batch), this kernel on none (at most 2.9e-6)."""

    def __init__(
        self,
        config,
        layer_number: int,
        attn_mask_type,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        k_channels: int | None = None,
        v_channels: int | None = None,
        cp_comm_type: str | None = None,
        pg_collection=None,
    ):
        super().__init__()
        if config.context_parallel_size != 1:
            raise ValueError(
                f"context_parallel_size = {config.context_parallel_size}: LatentCoreAttention runs on one "
                "context-parallel rank (allowed: 1)"
            )
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        if dropout:
            raise ValueError(f"attention_dropout = {dropout}: RL scores tokens exactly (allowed: 0)")
        self.k_channels = k_channels or config.kv_channels
        self.v_channels = v_channels or config.kv_channels
        self.scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(self.k_channels)
        self.current_max_attn_logits = None  # megatron-core's qk-clip bookkeeping reads it

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type=None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params=None,
        **_unused,
    ) -> torch.Tensor:
        if packed_seq_params is not None or attention_bias is not None:
            raise ValueError("LatentCoreAttention takes neither packed sequences nor an attention bias")
        sq, b, heads, _ = query.shape
        sk = key.shape[0]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, channels]
        allowed = torch.ones(sq, sk, dtype=torch.bool, device=query.device).tril(sk - sq)
        if attention_mask is not None:
            allowed = allowed & ~attention_mask.to(torch.bool)
        context = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=allowed, scale=self.scale
        )  # [b, heads, sq, v]
        return context.permute(2, 0, 1, 3).reshape(sq, b, heads * self.v_channels)


LATENT_NORM_EPS = 1e-6
"""The epsilon of MLA's latent norms (``q_a_layernorm``, ``kv_a_layernorm``) in DeepSeek's reference code and HF
transformers: their RMSNorm's default, whatever ``rms_norm_eps`` (the decoder layers' norms) says."""


class LatentRMSNorm(SequenceParallelRMSNorm):
    """MLA's q and kv latent norm: :class:`SequenceParallelRMSNorm` with :data:`LATENT_NORM_EPS`.

    megatron-core builds both with ``config.layernorm_epsilon`` (``rms_norm_eps``); for a checkpoint whose
    ``rms_norm_eps`` is not 1e-6 (Moonlight-16B-A3B: 1e-5) that is another function than the model's own code,
    by up to 1e-2 in logprob on the tiny DeepSeek models. The rollout engine's latent norms get the same epsilon
    (``patches/vllm/mla_latent_norm_eps.py``)."""

    def __init__(self, config, hidden_size: int, eps: float | None = None, **kwargs):
        # megatron-core passes its ``layernorm_epsilon`` (``rms_norm_eps``) as ``eps``: replaced, not used
        super().__init__(config, hidden_size, eps=LATENT_NORM_EPS, **kwargs)


def mla_layer_spec(*, num_experts: int | None, use_te: bool):
    """One MLA decoder layer spec: megatron-core's own (with the q and kv latent norms), and without
    transformer-engine :class:`LatentCoreAttention`, the sequence-parallel RMSNorm the other families use, and
    :class:`LatentRMSNorm` for the latent norms. (With transformer-engine the latent norms are fused into the
    up-projections with ``rms_norm_eps``: not yet matched to :data:`LATENT_NORM_EPS`.)"""
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )

    if use_te:
        return get_gpt_layer_with_transformer_engine_spec(
            num_experts=num_experts, moe_grouped_gemm=False, qk_layernorm=True, multi_latent_attention=True
        )
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
    attn.core_attention = LatentCoreAttention
    attn.q_layernorm = LatentRMSNorm
    attn.kv_layernorm = LatentRMSNorm
    return spec
