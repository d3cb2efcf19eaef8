"""RMSNorms for the local (no transformer-engine, no Apex) layer spec: per-vector (usable with sequence
parallelism) and over a whole q or k projection (OLMoE, usable with tensor parallelism).

megatron-core's ``WrappedTorchNorm`` refuses sequence parallelism, and MoE with TP > 1 requires it. With
sequence parallelism each TP rank normalizes its own slice of the sequence, so the weight gradients are
partial sums; marking the weight ``sequence_parallel`` makes megatron-core's ``finalize_model_grads``
all-reduce them over the TP group, exactly as it does for transformer-engine's norms.

The arithmetic follows HF Qwen3 and vLLM: statistics in float32, the normalized value cast back to the
input dtype, then scaled by the weight. Matching the rollout engine's order of operations keeps the
mismatch we measure to what the engines really differ in.
"""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last axis: statistics in float32, the normalized value cast back to ``x``'s dtype, then
    scaled by ``weight`` (a pure function: :mod:`tim_megatron.trainer.compile` compiles it)."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


class SequenceParallelRMSNorm(torch.nn.Module):
    norm_fn = staticmethod(rms_norm)
    """What :meth:`forward` runs: :func:`rms_norm`, or its compiled form set on the instance
    (:mod:`tim_megatron.trainer.compile`)."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-6, **_unused):
        super().__init__()
        device = "cpu" if config.use_cpu_initialization else None
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype, device=device))
        self.weight.sequence_parallel = bool(config.sequence_parallel)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm_fn(x, self.weight, self.eps)


class _SumOverTensorParallel(torch.autograd.Function):
    """All-reduce (sum) over the TP group whose backward is an all-reduce too: every rank's partial sum feeds
    every rank's normalized heads, so each rank's gradient with respect to its partial sum collects all of them."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        y = x.clone()
        torch.distributed.all_reduce(y, group=group)
        return y

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        g = grad.clone()
        torch.distributed.all_reduce(g, group=ctx.group)
        return g, None


class WholeProjectionRMSNorm(torch.nn.Module):
    """RMSNorm over a whole q or k projection, all heads at once (OLMoE's ``q_norm`` / ``k_norm``).

    megatron-core applies ``q_layernorm`` / ``k_layernorm`` to ``[s, b, heads on this rank, head_dim]``. Here the
    mean square runs over every head of the projection: the local heads' sum of squares is summed over the TP
    group. The weight has one entry per channel of the whole projection and is replicated on every TP rank;
    each rank scales its own heads with its slice, so its gradient is non-zero on that slice only, and the
    all-reduce megatron-core applies to replicated norm weights under sequence parallelism (and to every
    ``q_layernorm`` / ``k_layernorm`` parameter, by name) sums the slices into the full gradient on every rank.
    Arithmetic as in HF and vLLM: statistics in float32, the normalized value cast back to the input dtype, then
    scaled.
    """

    def __init__(self, config, hidden_size: int, eps: float = 1e-6, projection: str = "q", **_unused):
        super().__init__()
        heads = config.num_attention_heads if projection == "q" else config.num_query_groups
        tp = config.tensor_model_parallel_size
        if heads % tp:
            raise ValueError(f"{projection} heads = {heads} do not split over tensor parallelism {tp}")
        self.heads = heads
        self.local_heads = heads // tp
        self.head_dim = hidden_size
        self.tp = tp
        self.eps = eps
        device = "cpu" if config.use_cpu_initialization else None
        self.weight = torch.nn.Parameter(
            torch.ones(heads * hidden_size, dtype=config.params_dtype, device=device)
        )
        self.weight.sequence_parallel = bool(config.sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        sq = x32.pow(2).sum(dim=(-2, -1), keepdim=True)
        weight = self.weight.view(self.heads, self.head_dim)
        if self.tp > 1:
            from megatron.core import parallel_state

            sq = _SumOverTensorParallel.apply(sq, parallel_state.get_tensor_model_parallel_group())
            r = parallel_state.get_tensor_model_parallel_rank()
            weight = weight[r * self.local_heads : (r + 1) * self.local_heads]
        x32 = x32 * torch.rsqrt(sq / (self.heads * self.head_dim) + self.eps)
        return weight * x32.to(dtype)
