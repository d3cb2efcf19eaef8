"""Per-token logprobs (and entropy) of given tokens from vocab-parallel logits, chunked over the sequence.

The LM head runs here, one chunk of positions at a time, on the final hidden states: logits for a
chunk are ``[chunk, batch, vocab / tp]``, turned into logprobs by megatron-core's vocab-parallel
cross-entropy (never gathering the vocabulary), and freed before the next chunk. With gradients the head and the
logprob are one autograd function (:class:`_HeadLogprobs`): its forward keeps, per position, only the log-sum-exp
beside the hidden states and the weight it was given; its backward recomputes each chunk's logits with one GEMM,
turns them into the softmax with that log-sum-exp (no second cross-entropy), and adds the head's weight gradient
into megatron's fp32 ``main_grad`` directly. Peak extra memory is one chunk's logits whether or not we train.
Exact mode keeps the checkpointed chunk (its forward is recomputed whole), whose row-invariant kernels the
autograd function does not take.

Temperature: logits are divided by ``temperature`` before the softmax, the convention vLLM uses for
sampled-token logprobs when ``logprobs_mode`` is "processed_logprobs".

Exact mode samples through this same function (a :class:`ChunkSampler` picks each chunk's next tokens from its
logits before the cross-entropy runs), so a sampled token's logprob is computed by the very line, on the very
logits, that the old-logprob pass uses.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint


@dataclass(frozen=True)
class HeadSpec:
    temperature: float = 1.0
    """Logits are divided by it before the softmax."""
    chunk: int = 1024
    """Sequence positions per chunk."""
    fp32: bool = False
    """The FP32 LM head remedy: the head GEMM in float32 from a float32 copy of the (bf16/fp16) head weights,
    with float32 logits, as vLLM's ``head_dtype=float32`` does on the rollout side. The weights themselves stay
    in the model dtype on both sides (identical after every sync); the optimizer keeps their fp32 masters."""
    kernels: object | None = None
    """Exact mode's row-invariant kernels (:mod:`tim_megatron.exact.kernels`) for the head GEMM; None: stock."""
    fused: bool = True
    """With gradients: the head and logprob as one autograd function (:class:`_HeadLogprobs`). False: each chunk
    under activation checkpointing (its GEMM and cross-entropy run again in the backward; what exact mode uses)."""


def _tp():
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return None, 1, 0
    return (
        ps.get_tensor_model_parallel_group(),
        ps.get_tensor_model_parallel_world_size(),
        ps.get_tensor_model_parallel_rank(),
    )


def head_gemm(h: torch.Tensor, weight: torch.Tensor, spec: HeadSpec) -> torch.Tensor:
    """The LM-head GEMM, in float32 with the FP32 head remedy, else in the weight's dtype."""
    linear = torch.nn.functional.linear if spec.kernels is None else spec.kernels.linear
    if spec.fp32:
        # the kernels widen the weight themselves (once per held pass: ExactKernels.wide), the same float32 values
        return linear(h.float(), weight if spec.kernels is not None else weight.float())
    return linear(h.to(weight.dtype), weight)


def _logits(h: torch.Tensor, weight: torch.Tensor, spec: HeadSpec) -> torch.Tensor:
    out = head_gemm(h, weight, spec).float()
    return out / spec.temperature if spec.temperature != 1.0 else out


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor, spec: HeadSpec) -> torch.Tensor:
    """Megatron-core's vocab-parallel cross-entropy of ``logits [chunk, batch, V / tp]`` (consumed in place).

    With exact mode's kernels a chunk of fewer than ``kernels.min_rows`` rows is padded with zero rows first: ATen
    splits the reduction of a lone row of 32,768 or more entries over its threads, so a one-row chunk (a decode
    step's last entries, or ``trainer.logprob_chunk = 1``) would sum in another order than the same row among
    others."""
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    chunk, batch = targets.shape
    if spec.kernels is None or chunk * batch >= spec.kernels.min_rows:
        return vocab_parallel_cross_entropy(logits, targets)
    from tim_megatron.exact.kernels import pad_rows

    rows, need = chunk * batch, spec.kernels.min_rows
    flat = pad_rows(logits.reshape(rows, 1, -1), need)
    t = pad_rows(targets.reshape(rows, 1), need)
    return vocab_parallel_cross_entropy(flat, t)[:rows].reshape(chunk, batch)


def _chunk_logprobs(
    h: torch.Tensor, targets: torch.Tensor, weight: torch.Tensor, spec: HeadSpec
) -> torch.Tensor:
    return -cross_entropy(_logits(h, weight, spec), targets, spec)


def _all_reduce(t: torch.Tensor, op, group, size: int) -> torch.Tensor:
    if size > 1:
        dist.all_reduce(t, op=op, group=group)
    return t


def _local_targets(targets: torch.Tensor, vocab: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``targets`` as indices into this rank's vocabulary slice (0 where another rank holds the token) and the mask
    of those this rank holds."""
    start = rank * vocab
    mine = (targets >= start) & (targets < start + vocab)
    return torch.where(mine, targets - start, 0), mine


class _HeadLogprobs(torch.autograd.Function):
    """Logprobs of ``targets`` ``[s, b]`` under ``softmax(head(hidden) / T)``, chunked over positions (see the
    module docstring). Forward: the same logits and cross-entropy as the no-gradient pass, so a training forward
    gives the old-logprob pass's values bit for bit; it keeps one float32 log-sum-exp per position."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, spec: HeadSpec, group, size: int, rank: int):
        lps, lses = [], []
        for start in range(0, targets.shape[0], spec.chunk):
            t = targets[start : start + spec.chunk]
            logits = _logits(hidden[start : start + spec.chunk], weight, spec)
            local, mine = _local_targets(t, logits.shape[-1], rank)
            picked = torch.where(mine, logits.gather(-1, local.unsqueeze(-1)).squeeze(-1), 0.0)
            picked = _all_reduce(picked, dist.ReduceOp.SUM, group, size)  # the target's logit, from its rank
            lp = -cross_entropy(logits, t, spec)  # consumes ``logits``
            lps.append(lp)
            lses.append(picked - lp)  # log-sum-exp = target logit - logprob
        ctx.save_for_backward(hidden, weight, targets, torch.cat(lses))
        ctx.spec, ctx.rank = spec, rank
        return torch.cat(lps)

    @staticmethod
    def backward(ctx, grad):
        hidden, weight, targets, lse = ctx.saved_tensors
        spec, rank = ctx.spec, ctx.rank
        grad_h = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        main = getattr(weight, "main_grad", None) if ctx.needs_input_grad[1] else None
        acc = None
        if ctx.needs_input_grad[1] and main is None:
            acc = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        w = weight.float() if spec.fp32 else weight
        for start in range(0, targets.shape[0], spec.chunk):
            stop = start + spec.chunk
            h = hidden[start:stop]
            x = h.float() if spec.fp32 else h.to(w.dtype)
            g = grad[start:stop].float()
            # d logprob / d z = onehot(target) - softmax(z), z = logits / T; the softmax from the kept log-sum-exp
            dz = _logits(h, weight, spec).sub_(lse[start:stop].unsqueeze(-1)).exp_().mul_(-g.unsqueeze(-1))
            local, mine = _local_targets(targets[start:stop], dz.shape[-1], rank)
            dz.scatter_add_(-1, local.unsqueeze(-1), torch.where(mine, g, 0.0).unsqueeze(-1))
            if spec.temperature != 1.0:
                dz.div_(spec.temperature)
            dz = dz.to(w.dtype)
            if grad_h is not None:
                grad_h[start:stop] = torch.matmul(dz, w).to(hidden.dtype)
            if ctx.needs_input_grad[1]:
                part = torch.matmul(dz.flatten(0, 1).t(), x.flatten(0, 1))  # [V / tp, hidden]
                (main if main is not None else acc).add_(part)
        # Under megatron's DDP the gradient is in main_grad already (its hook would have added it there; with
        # overlap_grad_reduce off, which the trainer always builds, nothing else waits for it), so none goes back
        # through autograd: a tied embedding's own gradient still arrives through its hook.
        grad_w = acc.to(weight.dtype) if acc is not None else None
        return grad_h, grad_w, None, None, None, None, None


@torch.no_grad()
def _entropy(logits: torch.Tensor, group, size: int) -> torch.Tensor:
    m = _all_reduce(logits.max(-1).values, dist.ReduceOp.MAX, group, size)
    z = logits - m.unsqueeze(-1)
    e = torch.exp(z)
    s = _all_reduce(e.sum(-1), dist.ReduceOp.SUM, group, size)
    ez = _all_reduce((e * z).sum(-1), dist.ReduceOp.SUM, group, size)
    return torch.log(s) - ez / s


class ChunkSampler(Protocol):
    """Chooses the next token of each sequence from the logits of the chunk of positions that predicts it."""

    def wants(self, start: int, stop: int) -> bool:
        """Does any sequence predict its next token from a position in ``[start, stop)``? (Else the chunk is
        skipped: no logits, logprobs left at 0.)"""
        ...

    def choose(self, start: int, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Sample from ``logits`` ``[chunk, batch, vocab / tp]`` (copy what is needed: the cross-entropy consumes
        them) and return ``targets`` ``[chunk, batch]`` with each sampled token at the position predicting it."""
        ...


@dataclass
class TokenLogprobs:
    logprobs: torch.Tensor
    """``[batch, seq]``: log p(token_t | tokens_<t) at position t (0 at t = 0)."""
    entropy: torch.Tensor | None = None
    """``[batch, seq]``: entropy of the distribution that produced token_t (0 at t = 0)."""


def token_logprobs(
    *,
    hidden: torch.Tensor,
    input_ids: torch.Tensor,
    weight: torch.Tensor,
    spec: HeadSpec,
    sequence_parallel: bool,
    with_entropy: bool = False,
    sampler: ChunkSampler | None = None,
) -> TokenLogprobs:
    """Logprobs of ``input_ids`` (``[batch, seq]``) from final hidden states ``[seq(/tp), batch, hidden]``.

    ``weight`` is this rank's vocabulary slice of the LM head. Differentiable in ``hidden`` and ``weight``
    when gradients are enabled. With ``sampler`` (no gradients), each chunk's targets come from
    :meth:`ChunkSampler.choose` and chunks it does not want are skipped (logprob 0).
    """
    from megatron.core.tensor_parallel import (
        copy_to_tensor_model_parallel_region,
        gather_from_sequence_parallel_region,
    )

    group, size, _rank = _tp()
    if size > 1:
        hidden = (
            gather_from_sequence_parallel_region(hidden)
            if sequence_parallel
            else copy_to_tensor_model_parallel_region(hidden)
        )
    _b, s = input_ids.shape
    if hidden.shape[0] != s:
        raise ValueError(f"hidden states have {hidden.shape[0]} positions but input_ids has {s}")
    # Position t predicts token t + 1; the last position predicts nothing (target 0, dropped below).
    targets = torch.cat([input_ids[:, 1:], torch.zeros_like(input_ids[:, :1])], 1).t().contiguous()  # [s, b]
    grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    if grad and sampler is not None:
        raise ValueError("token_logprobs: sampling runs without gradients")
    if grad and spec.fused and spec.kernels is None:
        lp = _HeadLogprobs.apply(hidden, weight, targets, spec, group, size, _rank)
        x = lp.t()  # [b, s]: x[:, t] predicts token t + 1
        return TokenLogprobs(logprobs=torch.cat([torch.zeros_like(x[:, :1]), x[:, :-1]], 1))
    lps, ents = [], []
    for start in range(0, s, spec.chunk):
        h = hidden[start : start + spec.chunk]
        t = targets[start : start + spec.chunk].contiguous()
        if grad:
            lps.append(checkpoint(_chunk_logprobs, h, t, weight, spec, use_reentrant=False))
        elif sampler is not None and not sampler.wants(start, start + h.shape[0]):
            lps.append(torch.zeros(t.shape, dtype=torch.float32, device=t.device))
            if with_entropy:
                ents.append(torch.zeros(t.shape, dtype=torch.float32, device=t.device))
        else:
            logits = _logits(h, weight, spec)
            if sampler is not None:
                t = sampler.choose(start, logits, t)
            if with_entropy:
                ents.append(_entropy(logits, group, size))
            lps.append(-cross_entropy(logits, t, spec))  # consumes ``logits`` in place

    def shift(parts):
        x = torch.cat(parts, 0).t()  # [b, s]: x[:, t] predicts token t + 1
        return torch.cat([torch.zeros_like(x[:, :1]), x[:, :-1]], 1)

    return TokenLogprobs(logprobs=shift(lps), entropy=shift(ents) if ents else None)


def head_weight(model) -> torch.Tensor:
    """This rank's slice of the LM-head weight (the embedding when tied)."""
    from tim_megatron.trainer.model import unwrap

    gpt = unwrap(model)
    if gpt.share_embeddings_and_output_weights:
        return gpt.shared_embedding_or_output_weight()
    return gpt.output_layer.weight
