"""Agreement between the experts the rollout engine and the trainer chose for the same tokens.

Expert ids come as ``[layers, tokens, top_k]`` integer tensors (any order within the top-k). A token
agrees exactly in a layer when both chose the same set; the Jaccard index |A & B| / |A | B| grades
partial agreement.
"""

from __future__ import annotations

import torch

from tim_megatron.algo.stats import Stats, safe_div


def routing_agreement_stats(
    *, rollout_experts: torch.Tensor, trainer_experts: torch.Tensor, mask: torch.Tensor | None = None
) -> Stats:
    """Per-layer sums of exact-match and Jaccard over the tokens selected by ``mask`` (``[tokens]``)."""
    if rollout_experts.shape != trainer_experts.shape or rollout_experts.dim() != 3:
        raise ValueError(
            f"expert ids must both be [layers, tokens, top_k]; got {tuple(rollout_experts.shape)} and {tuple(trainer_experts.shape)}"
        )
    a, b = rollout_experts, trainer_experts.to(rollout_experts.dtype)
    if mask is not None:
        keep = mask.bool().reshape(-1)
        a, b = a[:, keep], b[:, keep]
    k = a.shape[-1]
    exact_l, jac_l = [], []
    for al, bl in zip(a, b, strict=True):  # one layer at a time bounds memory at [tokens, k]
        # |A & B| for distinct ids: compare against every cyclic shift of B (k cheap elementwise passes,
        # much faster than a [tokens, k, k] broadcast).
        hits = torch.zeros(al.shape, dtype=torch.int16, device=al.device)
        for shift in range(k):
            hits += al == torch.roll(bl, shift, -1)
        inter = hits.sum(-1, dtype=torch.int64).to(torch.float64)
        jac_l.append((inter / (2 * k - inter)).sum())
        exact_l.append((inter == k).sum().to(torch.float64))
    exact = torch.stack(exact_l) if exact_l else torch.zeros(0, dtype=torch.float64)
    jaccard = torch.stack(jac_l) if jac_l else torch.zeros(0, dtype=torch.float64)
    s = Stats()
    s.add_sum("tokens", torch.tensor(float(a.shape[1]), dtype=torch.float64))
    s.add_sum("exact", exact)
    s.add_sum("jaccard", jaccard)
    return s


def routing_agreement_metrics(stats: Stats, prefix: str = "routing/rollout_vs_trainer/") -> dict[str, float]:
    n = float(stats.sum("tokens"))
    exact = stats.sum("exact").tolist()
    jac = stats.sum("jaccard").tolist()
    out = {
        prefix + "exact_match": safe_div(sum(exact), n * len(exact)),
        prefix + "jaccard": safe_div(sum(jac), n * len(jac)),
    }
    for i, (e, j) in enumerate(zip(exact, jac, strict=True)):
        out[prefix + f"layer{i}/exact_match"] = safe_div(e, n)
        out[prefix + f"layer{i}/jaccard"] = safe_div(j, n)
    return out
