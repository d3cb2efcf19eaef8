"""RMSNorm for the local (no transformer-engine, no Apex) layer spec, usable with sequence parallelism.

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


class SequenceParallelRMSNorm(torch.nn.Module):
    def __init__(self, config, hidden_size: int, eps: float = 1e-6, **_unused):
        super().__init__()
        device = "cpu" if config.use_cpu_initialization else None
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype, device=device))
        self.weight.sequence_parallel = bool(config.sequence_parallel)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)
