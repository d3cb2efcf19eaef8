"""Policy-gradient losses: PPO/GRPO token clipping (symmetric, clip-higher, dual clip) and GSPO.

Each returns ``(loss, stats)``: a differentiable scalar and :class:`~tim_megatron.algo.stats.Stats` with the
sums behind the clip fractions, which reduce across micro-batches and ranks.

``token_weights`` multiplies every token's loss term before aggregation. It carries the rollout
correction (TIS/MIS/IcePop weights, zero for masked tokens) and the controlled objective injections
(phi, xi); it must not require grad.
"""

from __future__ import annotations

import torch

from tim_megatron.algo.aggregation import Aggregation, aggregate
from tim_megatron.algo.stats import Stats


def _per_token_advantages(advantages: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    if advantages.dim() == 1:
        return advantages.unsqueeze(-1).expand_as(like)
    return advantages


def token_clip_loss(
    *,
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
    token_weights: torch.Tensor | None = None,
    aggregation: Aggregation = "token-mean",
    denominator: float | torch.Tensor | None = None,
    norm_length: int | None = None,
) -> tuple[torch.Tensor, Stats]:
    """-min(r A, clip(r, 1 - clip_low, 1 + clip_high) A) per token, with r = pi / pi_old (GRPO Eq. 2).

    dual_clip = c additionally bounds the loss of negative-advantage tokens by -c A.
    """
    m = mask.bool()
    adv = _per_token_advantages(advantages, logprobs).to(logprobs.dtype)
    log_ratio = (logprobs - old_logprobs.detach()).masked_fill(~m, 0.0)
    ratio = torch.exp(log_ratio)
    surr1 = -ratio * adv
    surr2 = -ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * adv
    loss_tok = torch.maximum(surr1, surr2)
    dual_active = torch.zeros_like(m)
    if dual_clip is not None:
        bound = -dual_clip * adv
        neg = adv < 0
        dual_active = neg & (loss_tok > bound)
        loss_tok = torch.where(neg, torch.minimum(loss_tok, bound), loss_tok)
    if token_weights is not None:
        loss_tok = loss_tok * token_weights.detach()
    loss = aggregate(
        values=loss_tok, mask=m, mode=aggregation, denominator=denominator, norm_length=norm_length
    )

    with torch.no_grad():
        clip_low_active = m & (ratio < 1.0 - clip_low) & (adv < 0)
        clip_high_active = m & (ratio > 1.0 + clip_high) & (adv > 0)
        s = Stats()
        s.add_sum("tokens", m.sum())
        s.add_sum("clip_low", clip_low_active.sum())
        s.add_sum("clip_high", clip_high_active.sum())
        s.add_sum("dual_clip", (dual_active & m).sum())
        s.add_sum("ratio", ratio[m].sum())
        s.add_sum("ratio2", (ratio[m] - 1).pow(2).sum())
        s.add_max("ratio_max", ratio[m].max() if m.any() else torch.tensor(float("-inf")))
        s.add_min("ratio_min", ratio[m].min() if m.any() else torch.tensor(float("inf")))
        s.add_sum("sequences", (m.sum(-1) > 0).sum())
        s.add_sum("seq_clipped", torch.zeros(()))
    return loss, s


def gspo_loss(
    *,
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
    token_weights: torch.Tensor | None = None,
    aggregation: Aggregation = "seq-mean-token-mean",
    denominator: float | torch.Tensor | None = None,
    norm_length: int | None = None,
) -> tuple[torch.Tensor, Stats]:
    """GSPO (objective-level-hacking Eq. 16): s_i = exp(mean_t log r_{i,t}), clipped per sequence.

    Written in GSPO's token form s_{i,t} = sg(s_i) * pi_t / sg(pi_t): its value is s_i for every token and
    its gradient equals the sequence-level one, while leaving a per-token term for ``token_weights``.
    """
    m = mask.bool()
    mf = m.to(logprobs.dtype)
    adv = advantages if advantages.dim() == 1 else _first_token_values(advantages, m)
    adv = adv.to(logprobs.dtype)
    log_ratio = (logprobs - old_logprobs.detach()).masked_fill(~m, 0.0)
    lengths = mf.sum(-1).clamp(min=1)
    seq_log_ratio = log_ratio.sum(-1) / lengths
    log_s_tok = seq_log_ratio.detach().unsqueeze(-1) + logprobs - logprobs.detach()
    s_tok = torch.exp(log_s_tok.masked_fill(~m, 0.0))
    a_tok = adv.unsqueeze(-1).expand_as(s_tok)
    surr1 = -s_tok * a_tok
    surr2 = -s_tok.clamp(1.0 - clip_low, 1.0 + clip_high) * a_tok
    loss_tok = torch.maximum(surr1, surr2)
    if token_weights is not None:
        loss_tok = loss_tok * token_weights.detach()
    loss = aggregate(
        values=loss_tok, mask=m, mode=aggregation, denominator=denominator, norm_length=norm_length
    )

    with torch.no_grad():
        s_seq = torch.exp(seq_log_ratio)
        has = m.sum(-1) > 0
        clipped = has & (((s_seq < 1.0 - clip_low) & (adv < 0)) | ((s_seq > 1.0 + clip_high) & (adv > 0)))
        ratio = torch.exp(log_ratio)
        s = Stats()
        s.add_sum("tokens", m.sum())
        s.add_sum("clip_low", (m & ((s_seq < 1.0 - clip_low) & (adv < 0)).unsqueeze(-1)).sum())
        s.add_sum("clip_high", (m & ((s_seq > 1.0 + clip_high) & (adv > 0)).unsqueeze(-1)).sum())
        s.add_sum("dual_clip", torch.zeros(()))
        s.add_sum("ratio", ratio[m].sum())
        s.add_sum("ratio2", (ratio[m] - 1).pow(2).sum())
        s.add_max("ratio_max", ratio[m].max() if m.any() else torch.tensor(float("-inf")))
        s.add_min("ratio_min", ratio[m].min() if m.any() else torch.tensor(float("inf")))
        s.add_sum("sequences", has.sum())
        s.add_sum("seq_clipped", clipped.sum())
    return loss, s


def _first_token_values(per_token: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    idx = mask.float().argmax(-1, keepdim=True)
    return per_token.gather(-1, idx).squeeze(-1)


def policy_loss_metrics(stats: Stats, prefix: str = "actor/") -> dict[str, float]:
    """Clip fractions and ratio statistics from (reduced) loss stats."""
    from tim_megatron.algo.stats import safe_div, std_from_sums

    n = float(stats.sum("tokens"))
    return {
        prefix + "clipfrac_token_low": safe_div(stats.sum("clip_low"), n),
        prefix + "clipfrac_token_high": safe_div(stats.sum("clip_high"), n),
        prefix + "clipfrac_dual": safe_div(stats.sum("dual_clip"), n),
        prefix + "clipfrac_seq": safe_div(stats.sum("seq_clipped"), stats.sum("sequences")),
        prefix + "ratio_mean": safe_div(stats.sum("ratio"), n),
        prefix + "ratio_std": std_from_sums(float(stats.sum("ratio")) - n, stats.sum("ratio2"), n),
        prefix + "ratio_max": float(stats.max("ratio_max")),
        prefix + "ratio_min": float(stats.min("ratio_min")),
    }
