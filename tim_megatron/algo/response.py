"""Response-length and entropy statistics (reducible across ranks)."""

from __future__ import annotations

import torch

from tim_megatron.algo.stats import Stats, safe_div, std_from_sums


def response_stats(
    *, mask: torch.Tensor, entropy: torch.Tensor | None = None, truncated: torch.Tensor | None = None
) -> Stats:
    """Lengths from ``mask [B, T]``; mean token entropy when ``entropy [B, T]`` is given; truncation count."""
    m = mask.bool()
    lengths = m.sum(-1).to(torch.float64)
    s = Stats()
    s.add_sum("n_seq", torch.tensor(float(lengths.numel()), dtype=torch.float64))
    s.add_sum("len", lengths.sum())
    s.add_sum("len2", (lengths * lengths).sum())
    s.add_max("len_max", lengths.max() if lengths.numel() else torch.tensor(0.0))
    s.add_min("len_min", lengths.min() if lengths.numel() else torch.tensor(0.0))
    if entropy is not None:
        s.add_sum("ent", entropy.detach().to(torch.float64)[m].sum())
        s.add_sum("ent_tokens", m.sum())
    if truncated is not None:
        s.add_sum("truncated", truncated.bool().sum())
    return s


def response_metrics(stats: Stats, prefix: str = "response/") -> dict[str, float]:
    n = float(stats.sum("n_seq"))
    out = {
        prefix + "length_mean": safe_div(stats.sum("len"), n),
        prefix + "length_std": std_from_sums(stats.sum("len"), stats.sum("len2"), n),
        prefix + "length_max": float(stats.max("len_max")),
        prefix + "length_min": float(stats.min("len_min")),
    }
    if "ent" in stats:
        out[prefix + "entropy_mean"] = safe_div(stats.sum("ent"), stats.sum("ent_tokens"))
    if "truncated" in stats:
        out[prefix + "truncated_frac"] = safe_div(stats.sum("truncated"), n)
    return out
