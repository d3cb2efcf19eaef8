"""Turning per-token losses into one scalar (the four modes of verl/DAPO/Dr. GRPO).

For gradient accumulation and data parallelism pass the *global* ``denominator`` (tokens or sequences in
the whole minibatch); then summing the micro-batch losses over all ranks gives exactly the minibatch loss.
"""

from __future__ import annotations

from typing import Literal

import torch

Aggregation = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]


def aggregate(
    *,
    values: torch.Tensor,
    mask: torch.Tensor,
    mode: Aggregation,
    denominator: float | torch.Tensor | None = None,
    norm_length: int | None = None,
) -> torch.Tensor:
    """Aggregate ``values [B, T]`` over the masked tokens.

    token-mean: sum / tokens. seq-mean-token-mean: mean over sequences of each sequence's token mean.
    seq-mean-token-sum: mean over sequences of token sums. seq-mean-token-sum-norm: sum / (sequences x
    norm_length), Dr. GRPO's constant normalizer (norm_length defaults to T).
    ``denominator`` replaces the local token count (token-mean) or sequence count (the others).
    """
    m = mask.to(values.dtype)
    if mode == "token-mean":
        den = m.sum() if denominator is None else denominator
        return (values * m).sum() / _clamp(den)
    seq_tokens = m.sum(-1)
    valid = (seq_tokens > 0).to(values.dtype)
    n_seq = valid.sum() if denominator is None else denominator
    if mode == "seq-mean-token-mean":
        per_seq = (values * m).sum(-1) / seq_tokens.clamp(min=1)
        return (per_seq * valid).sum() / _clamp(n_seq)
    if mode == "seq-mean-token-sum":
        return (values * m).sum() / _clamp(n_seq)
    if mode == "seq-mean-token-sum-norm":
        length = values.shape[-1] if norm_length is None else norm_length
        return (values * m).sum() / (_clamp(n_seq) * length)
    raise ValueError(
        f"aggregation {mode!r}: allowed token-mean, seq-mean-token-mean, seq-mean-token-sum, seq-mean-token-sum-norm"
    )


def _clamp(x):
    if isinstance(x, torch.Tensor):
        return x.clamp(min=1)
    return max(float(x), 1.0)


def local_denominator(*, mask: torch.Tensor, mode: Aggregation) -> float:
    """This batch's share of the global denominator (sum it over micro-batches and ranks)."""
    if mode == "token-mean":
        return float(mask.sum())
    return float((mask.sum(-1) > 0).sum())
