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

Attention with sinks and sliding windows (gpt-oss) has no SDPA kernel: there ``sdpa`` is
:class:`SinkFlexCoreAttention`, torch's FlexAttention with the sink folded in through the log-sum-exp
(:func:`sink_correction`), on CUDA.
"""

from __future__ import annotations

import functools
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


def resolve_attention(setting: str, *, exact: bool, on_gpu: bool) -> str:
    """The core attention a run builds: exact mode keeps the materialized one (its invariant kernels replace that
    one's GEMMs); ``auto`` takes torch's fused kernel on CUDA (``on_gpu``) and keeps the materialized one on CPU,
    where the rollout mismatch figures of this project were measured."""
    if setting not in ATTENTION_KERNELS:
        raise ValueError(f"trainer.attention = {setting!r}; allowed: {', '.join(ATTENTION_KERNELS)}")
    if exact:
        return "materialized"
    if setting == "auto":
        return "sdpa" if on_gpu else "materialized"
    return setting


def refuse_cp_and_dropout(config, attention_dropout: float | None, *, who: str) -> None:
    """What no core attention of the project computes: context parallelism and dropout (RL scores tokens
    exactly)."""
    if config.context_parallel_size != 1:
        raise ValueError(
            f"context_parallel_size = {config.context_parallel_size}: {who} runs on one context-parallel rank "
            "(allowed: 1)"
        )
    dropout = config.attention_dropout if attention_dropout is None else attention_dropout
    if dropout:
        raise ValueError(f"attention_dropout = {dropout}: RL scores tokens exactly (allowed: 0)")


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
        refuse_cp_and_dropout(config, attention_dropout, who="SdpaCoreAttention")
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


# ------------------------------------------------------------------------------ sinks and sliding windows


def sink_correction(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """Attention with a sink logit per head, from attention without it and its log-sum-exp.

    The sink is one more softmax entry with no value: over scores ``s_j`` with ``Z = sum_j exp(s_j)`` the weights
    become ``exp(s_j) / (Z + exp(sink))``, the plain softmax times ``Z / (Z + exp(sink))``. So
    ``out_sink = out * sigmoid(lse - sink)`` with ``lse = log Z``: exact, and differentiable in ``out``, ``lse``
    and ``sink`` (the gradient through ``lse`` is what the attention kernel must carry back into the scores).
    ``out`` ``[b, heads, s, v]``, ``lse`` ``[b, heads, s]`` (natural log), ``sinks`` ``[heads]``; the weight is
    computed in float32 (or ``lse``'s dtype)."""
    weight = torch.sigmoid(lse - sinks.to(lse.dtype).view(1, -1, 1))
    return out * weight.unsqueeze(-1).to(out.dtype)


def windowed_causal(window: int | None, offset: int = 0):
    """FlexAttention's ``mask_mod``: query ``q`` sees key ``k`` when ``k <= q + offset`` (causal, aligned to the
    last key: ``offset = sk - sq``) and, with a ``window``, when ``q + offset - k < window`` (itself and the
    ``window - 1`` keys before it)."""

    def mask_mod(b, h, q, k):
        seen = k <= q + offset
        return seen & (q + offset - k < window) if window else seen

    return mask_mod


def materialized_lse_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, allowed: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention and its log-sum-exp with the scores materialized (``q [b, h, sq, d]``, ``k``/``v [b, h, sk, d]``,
    ``allowed [sq, sk]``): the reference that :func:`sink_correction` is checked with where FlexAttention has no
    backward (on CPU), differentiable in every input."""
    scores = (q @ k.transpose(-1, -2) * scale).masked_fill(~allowed, float("-inf"))
    scores = scores.to(torch.promote_types(scores.dtype, torch.float32))  # at least float32
    return torch.softmax(scores, -1).to(v.dtype) @ v, torch.logsumexp(scores, -1)


FLEX_BLOCK = 128
"""FlexAttention's block size: on CUDA the sink attention pads its sequence to a multiple of it."""


@functools.cache
def _compiled_flex_attention():
    """torch's FlexAttention compiled (its fused Triton kernels on CUDA), once per process."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention)


class SinkFlexCoreAttention(torch.nn.Module):
    """Core attention with attention sinks and sliding windows (gpt-oss) on torch's FlexAttention.

    FlexAttention computes causal (and, in the windowed layers, sliding-window) attention as a block-sparse fused
    kernel and returns the log-sum-exp of each row's scores; the sink enters through that log-sum-exp
    (:func:`sink_correction`), whose gradient FlexAttention's backward carries. Megatron-core's materialized
    ``DotProductAttention`` with ``softmax_type = learnable`` and ``window_size`` computes the same function with
    the scores and the softmax in memory: the parameter has its name (``softmax_offset``, this rank's heads), so
    weight tables and checkpoints are the same for both.

    On CUDA the kernel is compiled; on the CPU FlexAttention (torch 2.13) runs its unfused reference forward and
    has no backward, so the trainer builds this attention only on CUDA (``trainer.attention: sdpa``), and the CPU
    tests compare its forward with the materialized attention and the sink correction's gradient on
    :func:`materialized_lse_attention`. Inputs and output as :class:`SdpaCoreAttention`'s; no explicit mask (the
    mask is the layer's causal window)."""

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
        from megatron.core.transformer.utils import is_layer_window_attention

        refuse_cp_and_dropout(config, attention_dropout, who="SinkFlexCoreAttention")
        kind = getattr(attn_mask_type, "name", "causal")
        if kind != "causal":
            raise ValueError(
                f"attn_mask_type = {kind}: SinkFlexCoreAttention is causal attention (allowed: causal)"
            )
        softmax = getattr(config, "softmax_type", "vanilla")
        if softmax not in ("vanilla", "learnable"):
            raise ValueError(
                f"softmax_type = {softmax}: SinkFlexCoreAttention computes the plain softmax or one with a learned "
                "sink per head (allowed: vanilla, learnable)"
            )
        self.config = config
        if pg_collection is None:
            from megatron.core.process_groups_config import ProcessGroupCollection

            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp"])
        self.tp_group = pg_collection.tp
        heads = config.num_attention_heads // self.tp_group.size()
        self.window: int | None = None
        """Keys a query sees in this layer (itself included); None: the whole prefix."""
        if is_layer_window_attention(config.window_size, config.window_attn_skip_freq, layer_number):
            left, right = config.window_size
            if right != 0:
                raise ValueError(
                    f"window_size = {config.window_size}: a causal window has no keys ahead (allowed: (n, 0))"
                )
            self.window = left + 1
        self.k_channels = k_channels or config.kv_channels
        self.v_channels = v_channels or config.kv_channels
        self.scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(self.k_channels)
        self.softmax_offset = None
        if softmax == "learnable":
            self.softmax_offset = torch.nn.Parameter(
                torch.empty(heads, device=torch.cuda.current_device(), dtype=config.params_dtype)
            )
        self.pad_to = FLEX_BLOCK if torch.cuda.is_available() else 1
        """The sequence is padded to a multiple of this (on CUDA FlexAttention's block: fewer compiled shapes)."""
        self._block_masks: dict = {}
        """FlexAttention's block masks by (sq, sk, device), built once per shape."""
        self.current_max_attn_logits = None  # megatron-core's qk-clip bookkeeping reads it

    def block_mask(self, sq: int, sk: int, device):
        from torch.nn.attention.flex_attention import create_block_mask

        key = (sq, sk, str(device))
        if key not in self._block_masks:
            self._block_masks[key] = create_block_mask(
                windowed_causal(self.window, sk - sq), None, None, sq, sk, device=device
            )
        return self._block_masks[key]

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
        from torch.nn.attention.flex_attention import AuxRequest, flex_attention

        if packed_seq_params is not None or attention_bias is not None or attention_mask is not None:
            raise ValueError(
                "SinkFlexCoreAttention takes no packed sequences, attention bias or explicit mask (its mask is the "
                "layer's causal window)"
            )
        sq, b, heads, _ = query.shape
        sk, groups = key.shape[0], key.shape[2]
        if heads % groups:
            raise ValueError(f"{heads} query heads cannot share {groups} key/value heads")
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads or groups, s, channels]
        kernel = _compiled_flex_attention() if q.is_cuda else flex_attention
        # a whole number of pad_to tokens, so that few shapes are compiled: the padding keys come after every real
        # query (causal: never seen), the padding queries' rows are dropped
        pad = (-sq) % self.pad_to if sq == sk else 0
        if pad:
            q, k, v = (torch.nn.functional.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
        out, aux = kernel(
            q,
            k,
            v,
            block_mask=self.block_mask(sq + pad, sk + pad, q.device),
            scale=self.scale,
            enable_gqa=groups != heads,
            return_aux=AuxRequest(lse=True),
        )
        if self.softmax_offset is not None:
            out = sink_correction(out, aux.lse, self.softmax_offset)
        return out[:, :, :sq].permute(2, 0, 1, 3).reshape(sq, b, heads * self.v_channels)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        """The sinks' sharded state as megatron-core's ``DotProductAttention`` saves it (split over TP by head)."""
        from megatron.core.transformer.dot_product_attention import DotProductAttention

        return DotProductAttention.sharded_state_dict(self, prefix, sharded_offsets, metadata)
