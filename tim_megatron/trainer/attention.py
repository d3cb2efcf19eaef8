"""Core attention on torch's ``scaled_dot_product_attention`` for every family on megatron-core's local spec.

megatron-core's local ``DotProductAttention`` materializes the scores (``[batch * heads, sq, sk]`` in the compute
dtype, then a softmax and a second batched GEMM): at Qwen3-30B-A3B's layer shape on an H100 it runs at about 2%
of peak, where torch's own fused kernel (flash attention on CUDA in bfloat16) reaches about 38%
(``../shared/gpu/layer_kernels.txt``). :class:`SdpaCoreAttention` is that kernel behind megatron-core's core
attention interface: grouped-query attention without repeating the key and value heads, key and value heads of
sizes of their own (multi-head latent attention), and the causal mask given as ``is_causal`` whenever the model is
run without an explicit mask (:func:`tim_megatron.trainer.model.final_hidden_states`), so that the flash kernel
applies.

Which core attention a model gets is the trainer setting ``trainer.attention`` (:func:`resolve_attention`).
Exact mode keeps the materialized one, whose GEMMs its invariant kernels replace.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

ATTENTION_KERNELS = ("auto", "sdpa", "materialized")
"""Values of ``trainer.attention``."""


@dataclass(frozen=True)
class LayerKernels:
    """The kernels a layer spec is built with, resolved for the run (never ``auto``)."""

    attention: str = "materialized"
    """Core attention of the non-latent families: ``sdpa`` (:class:`SdpaCoreAttention`) or ``materialized``
    (megatron-core's ``DotProductAttention``). Latent attention always runs on :class:`SdpaCoreAttention`."""
    experts: str = "loop"
    """Routed experts: ``grouped`` (:mod:`tim_megatron.trainer.experts`) or ``loop`` (megatron-core's
    ``SequentialMLP``)."""


def resolve_attention(setting: str, *, exact: bool) -> str:
    """The core attention a run builds: exact mode keeps the materialized one (its invariant kernels replace that
    one's GEMMs); ``auto`` takes torch's fused kernel on CUDA and keeps the materialized one on CPU, where the
    rollout mismatch figures of this project were measured."""
    if setting not in ATTENTION_KERNELS:
        raise ValueError(f"trainer.attention = {setting!r}; allowed: {', '.join(ATTENTION_KERNELS)}")
    if exact:
        return "materialized"
    if setting == "auto":
        return "sdpa" if torch.cuda.is_available() else "materialized"
    return setting


class SdpaCoreAttention(torch.nn.Module):
    """``softmax(q k^T * scale + causal mask) v`` per head, through ``torch.nn.functional.scaled_dot_product_attention``.

    Inputs as megatron-core's core attentions take them: query ``[sq, b, heads, k_channels]``, key
    ``[sk, b, groups, k_channels]``, value ``[sk, b, groups, v_channels]`` (this rank's heads; ``groups`` divides
    ``heads``: grouped-query attention); returns ``[sq, b, heads * v_channels]``. With ``attention_mask`` None the
    mask is causal, aligned to the last key (``is_causal`` when ``sq == sk``, so the flash kernel applies); a
    given ``attention_mask`` (True = masked, megatron's convention) is applied on top of the causal one.

    It is the kernel HF transformers runs by default (``sdpa``): it takes a value head size of its own and
    accumulates scores, softmax and the weighted sum in float32 for bfloat16 inputs. Against an HF reference in
    float64 it is as accurate as the two-GEMM form; against HF in float32 it rounds as HF does (on 24 random
    batches of the tiny DeepSeek-V3 the two-GEMM form differed from HF by more than 1e-5 on 3, up to 2.5e-5, this
    kernel on none, at most 2.9e-6)."""

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
                f"context_parallel_size = {config.context_parallel_size}: SdpaCoreAttention runs on one "
                "context-parallel rank (allowed: 1)"
            )
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        if dropout:
            raise ValueError(f"attention_dropout = {dropout}: RL scores tokens exactly (allowed: 0)")
        if getattr(config, "window_size", None) is not None:
            raise ValueError(f"window_size = {config.window_size}: SdpaCoreAttention has no sliding window")
        softmax = getattr(config, "softmax_type", "vanilla")
        if softmax != "vanilla":
            raise ValueError(
                f"softmax_type = {softmax}: SdpaCoreAttention computes the plain softmax (allowed: vanilla)"
            )
        kind = getattr(attn_mask_type, "name", "causal")
        if kind != "causal":
            raise ValueError(
                f"attn_mask_type = {kind}: SdpaCoreAttention is causal attention (allowed: causal)"
            )
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
            raise ValueError("SdpaCoreAttention takes neither packed sequences nor an attention bias")
        sq, b, heads, _ = query.shape
        sk, groups = key.shape[0], key.shape[2]
        if heads % groups:
            raise ValueError(f"{heads} query heads cannot share {groups} key/value heads")
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads or groups, s, channels]
        gqa = {"enable_gqa": True} if groups != heads else {}
        if attention_mask is None and sq == sk:
            context = torch.nn.functional.scaled_dot_product_attention(
                q, k, v, is_causal=True, scale=self.scale, **gqa
            )
        else:
            allowed = torch.ones(sq, sk, dtype=torch.bool, device=query.device).tril(sk - sq)
            if attention_mask is not None:
                allowed = allowed & ~attention_mask.to(torch.bool)
            context = torch.nn.functional.scaled_dot_product_attention(
                q, k, v, attn_mask=allowed, scale=self.scale, **gqa
            )  # [b, heads, sq, v]
        return context.permute(2, 0, 1, 3).reshape(sq, b, heads * self.v_channels)


def uses_explicit_mask(gpt) -> bool:
    """Whether the model's core attention needs the causal mask as a tensor: megatron-core's local
    ``DotProductAttention`` does (its torch softmax builds a default one on CUDA only); :class:`SdpaCoreAttention`
    and transformer-engine's attention take causality from the mask type."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    layers = gpt.decoder.layers
    return any(isinstance(layer.self_attention.core_attention, DotProductAttention) for layer in layers)
