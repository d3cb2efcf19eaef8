"""Rollout corrections between the trainer's old policy and the rollout policy.

The ratio is ``w = pi_old / pi_rollout`` at one of three levels:

* ``token``: per token;
* ``sequence``: the product over the sequence, shared by its tokens;
* ``geometric``: the geometric mean over the sequence (exp of the mean log-ratio), shared by its tokens.

Modes (TIM-LR paper Eq. 5-6; IcePop):

* ``tis``: weight min(w, C);
* ``mis``: weight w where w <= C, token (or sequence) dropped otherwise;
* ``icepop``: weight w where low <= w <= high, dropped otherwise. ``low`` and ``high`` are compared with the
  ratio itself, never as a symmetric bound on |log w|, so non-reciprocal bounds work;
* ``none``: weight 1.

All comparisons happen in log space, so sequence products never overflow. Weights carry no gradient.
"""

from __future__ import annotations

import math
from typing import Literal

import torch

from tim_megatron.algo.stats import Stats, safe_div

Mode = Literal["none", "tis", "mis", "icepop"]
Level = Literal["token", "sequence", "geometric"]


def level_log_ratio(*, log_ratio: torch.Tensor, mask: torch.Tensor, level: Level) -> torch.Tensor:
    """Per-token log w broadcast from the chosen level (``[B, T]``; zero on padding)."""
    m = mask.bool()
    lr = log_ratio.masked_fill(~m, 0.0)
    if level == "token":
        return lr
    seq = lr.sum(-1, keepdim=True)
    if level == "geometric":
        seq = seq / m.sum(-1, keepdim=True).clamp(min=1)
    elif level != "sequence":
        raise ValueError(f"correction level {level!r}: allowed token, sequence, geometric")
    return seq.expand_as(lr).masked_fill(~m, 0.0)


def rollout_correction(
    *,
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    mask: torch.Tensor,
    mode: Mode = "none",
    level: Level = "token",
    c: float = 2.0,
    low: float = 0.5,
    high: float = 2.0,
) -> tuple[torch.Tensor, Stats]:
    """Per-token weights ``[B, T]`` (0 where dropped or padded) and the stats behind the correction metrics."""
    m = mask.bool()
    log_w = level_log_ratio(
        log_ratio=(old_logprobs.detach() - rollout_logprobs.detach()).to(torch.float32), mask=m, level=level
    )
    keep = m.clone()
    if mode == "none":
        weights = torch.ones_like(log_w)
    elif mode == "tis":
        weights = torch.exp(log_w.clamp(max=math.log(c)) if math.isfinite(c) else log_w)
    elif mode == "mis":
        keep &= log_w <= math.log(c)
        weights = torch.exp(log_w.clamp(max=math.log(c)))
    elif mode == "icepop":
        if not low < high:
            raise ValueError(f"icepop bounds need low < high (got low = {low}, high = {high})")
        keep &= (log_w >= math.log(low)) & (log_w <= math.log(high))
        weights = torch.exp(log_w.clamp(math.log(low), math.log(high)))
    else:
        raise ValueError(f"correction mode {mode!r}: allowed none, tis, mis, icepop")
    weights = torch.where(keep, weights, torch.zeros_like(weights))

    with torch.no_grad():
        s = Stats()
        n = m.sum()
        w = weights[m].to(torch.float64)
        s.add_sum("tokens", n)
        s.add_sum("kept", keep.sum())
        s.add_sum("w", w.sum())
        s.add_sum("w2", (w * w).sum())
        raw = log_w[m]
        s.add_sum(
            "truncated", (raw > math.log(c)).sum() if mode == "tis" and math.isfinite(c) else torch.zeros(())
        )
        has = m.sum(-1) > 0
        kept_seq = (keep.sum(-1) == m.sum(-1)) & has
        s.add_sum("sequences", has.sum())
        s.add_sum("seq_fully_kept", kept_seq.sum())
    return weights, s


def correction_metrics(
    stats: Stats, *, mode: str, level: str, prefix: str = "correction/"
) -> dict[str, float]:
    """Weight mean, effective sample size fraction, dropped and truncated fractions."""
    n = float(stats.sum("tokens"))
    sw, sw2 = float(stats.sum("w")), float(stats.sum("w2"))
    p = f"{prefix}{mode}_{level}/"
    return {
        p + "weight_mean": safe_div(sw, n),
        p + "ess_frac": safe_div(sw * sw, n * sw2) if sw2 > 0 else float("nan"),
        p + "dropped_token_frac": 1.0 - safe_div(stats.sum("kept"), n) if n else float("nan"),
        p + "dropped_seq_frac": 1.0 - safe_div(stats.sum("seq_fully_kept"), stats.sum("sequences")),
        p + "truncated_token_frac": safe_div(stats.sum("truncated"), n),
    }
