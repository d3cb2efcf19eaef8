"""Training-inference mismatch metrics on the same sampled tokens.

Inputs are per-token logprobs of two policies on one padded batch ``[batch, time]`` with a mask; nothing
here sees a vocabulary-sized tensor. ``rho = pi_a / pi_b`` where ``a`` is the trainer-side policy
(old or current) and ``b`` the rollout policy (objective-level-hacking paper, Eq. 5). Metric names carry
both policy names: ``mismatch/<a>_vs_<b>/<metric>``.

Metrics (all from the sufficient statistics in :func:`mismatch_stats`):

=============================== ======================================================================
``rho_mean``, ``rho_std``        mean and std of rho over tokens (``rho_std`` is the paper's "mismatch")
``rho_min``, ``rho_max``         extremes of rho
``frac_abs_rho_minus_1_gt_<t>``  fraction of tokens with ``|rho - 1| > t``
``log_ratio_mean/std/abs_mean``  statistics of ``log rho`` per token
``prob_pearson``                 Pearson correlation of ``pi_a`` and ``pi_b`` in probability space
``kl_<b>_<a>_k1`` / ``_k3``      KL(b || a), estimators k1 = -log rho and k3 = rho - 1 - log rho
``kl_<a>_<b>_k1`` / ``_k3``      KL(a || b), estimators rho log rho and rho log rho - (rho - 1)
``chi2_token``, ``chi2_seq``     E[rho^2] - 1 per token, and per sequence with rho_seq = prod rho
``inv_rho_mean``                 E_b[1/rho] = mean of pi_b / pi_a; >= 1 in expectation when the tokens are
                                 sampled from b (objective-level-hacking Eq. 46-47)
``log_ppl_abs_diff_seq_sum``     mean over sequences of |sum_t log pi_a - sum_t log pi_b|: TIM-LR Eq. 8 as
                                 written. It grows with response length at a fixed per-token mismatch
``log_ppl_abs_diff_token_mean``  mean over sequences of |mean_t log pi_a - mean_t log pi_b|: per token, so
                                 comparable across lengths
``log_ppl_abs_diff_seq_sum_max`` the largest per-sequence |sum_t log pi_a - sum_t log pi_b|
``bucket/<lo>-<hi>/rho_mean|rho_std|count``  rho by pi_a probability bucket (objective-hacking Fig. 7)
=============================== ======================================================================
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch

from tim_megatron.algo.stats import Stats, safe_div, std_from_sums

DEFAULT_BUCKET_EDGES = (0.0, 0.01, 0.1, 0.3, 0.5, 0.7, 0.9, 1.0)
DEFAULT_RHO_THRESHOLDS = (1e-3, 1e-2, 1e-1)


def _fmt(x: float) -> str:
    return f"{x:g}"


def bucket_names(edges: Sequence[float]) -> list[str]:
    return [f"{_fmt(lo)}-{_fmt(hi)}" for lo, hi in itertools.pairwise(edges)]


def mismatch_stats(
    *,
    train_logprobs: torch.Tensor,
    infer_logprobs: torch.Tensor,
    mask: torch.Tensor,
    bucket_edges: Sequence[float] = DEFAULT_BUCKET_EDGES,
    rho_thresholds: Sequence[float] = DEFAULT_RHO_THRESHOLDS,
) -> Stats:
    """Sufficient statistics of rho = exp(train - infer) over the masked tokens of ``[B, T]`` inputs."""
    m = mask.bool()
    lt = train_logprobs.detach().to(torch.float64)
    li = infer_logprobs.detach().to(torch.float64)
    log_rho_bt = torch.where(m, lt - li, torch.zeros((), dtype=torch.float64, device=lt.device))
    log_rho = log_rho_bt[m]
    d = torch.expm1(log_rho)  # rho - 1, accurate near rho = 1
    rho = d + 1.0
    pa = torch.exp(lt[m])
    pb = torch.exp(li[m])

    s = Stats()
    n = torch.tensor(float(log_rho.numel()), dtype=torch.float64)
    s.add_sum("n_tok", n)
    s.add_sum("d", d.sum())
    s.add_sum("d2", (d * d).sum())
    s.add_sum("lr", log_rho.sum())
    s.add_sum("lr2", (log_rho * log_rho).sum())
    s.add_sum("lr_abs", log_rho.abs().sum())
    s.add_sum("inv_rho", torch.exp(-log_rho).sum())
    empty = log_rho.numel() == 0
    s.add_min("rho_min", torch.tensor(float("inf"), dtype=torch.float64) if empty else rho.min())
    s.add_max("rho_max", torch.tensor(float("-inf"), dtype=torch.float64) if empty else rho.max())
    thr = torch.as_tensor(list(rho_thresholds), dtype=torch.float64, device=d.device)
    s.add_sum("above", (d.abs().unsqueeze(-1) > thr).sum(0).to(torch.float64) if len(thr) else torch.zeros(0))
    # Pearson of probabilities.
    s.add_sum("pa", pa.sum())
    s.add_sum("pb", pb.sum())
    s.add_sum("pa2", (pa * pa).sum())
    s.add_sum("pb2", (pb * pb).sum())
    s.add_sum("papb", (pa * pb).sum())
    # KL estimators (samples come from the rollout policy b).
    s.add_sum("kl_ba_k1", (-log_rho).sum())
    s.add_sum("kl_ba_k3", (d - log_rho).sum())
    rho_log_rho = rho * log_rho
    s.add_sum("kl_ab_k1", rho_log_rho.sum())
    s.add_sum("kl_ab_k3", (rho_log_rho - d).sum())
    # Sequence level.
    seq_len = m.sum(-1).to(torch.float64)
    has = seq_len > 0
    seq_lr = log_rho_bt.sum(-1)[has]
    s.add_sum("n_seq", has.sum().to(torch.float64))
    s.add_sum("seq_abs", seq_lr.abs().sum())
    s.add_sum("seq_abs_mean", (seq_lr.abs() / seq_len[has]).sum())
    s.add_sum("seq_chi2", torch.expm1(2.0 * seq_lr.clamp(max=350.0)).sum())
    s.add_max(
        "seq_abs_max", torch.tensor(0.0, dtype=torch.float64) if seq_lr.numel() == 0 else seq_lr.abs().max()
    )
    # Buckets by trainer-side probability.
    edges = torch.as_tensor(list(bucket_edges), dtype=torch.float64, device=d.device)
    nb = len(bucket_edges) - 1
    idx = torch.bucketize(pa, edges[1:-1], right=True).clamp_(0, nb - 1)
    s.add_sum("b_n", torch.bincount(idx, minlength=nb).to(torch.float64))
    s.add_sum("b_d", torch.bincount(idx, weights=d, minlength=nb))
    s.add_sum("b_d2", torch.bincount(idx, weights=d * d, minlength=nb))
    return s


def mismatch_metrics(
    stats: Stats,
    *,
    a: str,
    b: str,
    bucket_edges: Sequence[float] = DEFAULT_BUCKET_EDGES,
    rho_thresholds: Sequence[float] = DEFAULT_RHO_THRESHOLDS,
    prefix: str = "mismatch",
) -> dict[str, float]:
    """Finalize (already reduced) statistics into named metrics ``mismatch/<a>_vs_<b>/...``."""
    p = f"{prefix}/{a}_vs_{b}/"
    n = float(stats.sum("n_tok"))
    out: dict[str, float] = {p + "tokens": n}
    mean_d = safe_div(stats.sum("d"), n)
    out[p + "rho_mean"] = 1.0 + mean_d
    out[p + "rho_std"] = std_from_sums(stats.sum("d"), stats.sum("d2"), n)
    out[p + "rho_min"] = float(stats.min("rho_min")) if n else float("nan")
    out[p + "rho_max"] = float(stats.max("rho_max")) if n else float("nan")
    for t, c in zip(rho_thresholds, stats.sum("above").tolist(), strict=True):
        out[p + f"frac_abs_rho_minus_1_gt_{_fmt(t)}"] = safe_div(c, n)
    out[p + "log_ratio_mean"] = safe_div(stats.sum("lr"), n)
    out[p + "log_ratio_std"] = std_from_sums(stats.sum("lr"), stats.sum("lr2"), n)
    out[p + "log_ratio_abs_mean"] = safe_div(stats.sum("lr_abs"), n)
    out[p + "inv_rho_mean"] = safe_div(stats.sum("inv_rho"), n)
    out[p + "prob_pearson"] = _pearson(stats, n)
    out[p + f"kl_{b}_{a}_k1"] = safe_div(stats.sum("kl_ba_k1"), n)
    out[p + f"kl_{b}_{a}_k3"] = safe_div(stats.sum("kl_ba_k3"), n)
    out[p + f"kl_{a}_{b}_k1"] = safe_div(stats.sum("kl_ab_k1"), n)
    out[p + f"kl_{a}_{b}_k3"] = safe_div(stats.sum("kl_ab_k3"), n)
    out[p + "chi2_token"] = safe_div(2.0 * float(stats.sum("d")) + float(stats.sum("d2")), n)
    n_seq = float(stats.sum("n_seq"))
    out[p + "chi2_seq"] = safe_div(stats.sum("seq_chi2"), n_seq)
    out[p + "log_ppl_abs_diff_seq_sum"] = safe_div(stats.sum("seq_abs"), n_seq)
    out[p + "log_ppl_abs_diff_token_mean"] = safe_div(stats.sum("seq_abs_mean"), n_seq)
    out[p + "log_ppl_abs_diff_seq_sum_max"] = float(stats.max("seq_abs_max")) if n_seq else float("nan")
    bn, bd, bd2 = stats.sum("b_n").tolist(), stats.sum("b_d").tolist(), stats.sum("b_d2").tolist()
    for name, cn, cd, cd2 in zip(bucket_names(bucket_edges), bn, bd, bd2, strict=True):
        out[p + f"bucket/{name}/count"] = cn
        out[p + f"bucket/{name}/rho_mean"] = 1.0 + safe_div(cd, cn)
        out[p + f"bucket/{name}/rho_std"] = std_from_sums(cd, cd2, cn)
    return out


def _pearson(stats: Stats, n: float) -> float:
    if n < 2:
        return float("nan")
    sx, sy = float(stats.sum("pa")), float(stats.sum("pb"))
    cov = float(stats.sum("papb")) - sx * sy / n
    vx = float(stats.sum("pa2")) - sx * sx / n
    vy = float(stats.sum("pb2")) - sy * sy / n
    if vx <= 0 or vy <= 0:
        return float("nan")
    return max(-1.0, min(1.0, cov / (vx * vy) ** 0.5))


def compute_mismatch(
    *,
    train_logprobs: torch.Tensor,
    infer_logprobs: torch.Tensor,
    mask: torch.Tensor,
    a: str = "old",
    b: str = "rollout",
    bucket_edges: Sequence[float] = DEFAULT_BUCKET_EDGES,
    rho_thresholds: Sequence[float] = DEFAULT_RHO_THRESHOLDS,
    group=None,
) -> dict[str, float]:
    """Single-call convenience: statistics, reduction over ``group`` and metrics."""
    s = mismatch_stats(
        train_logprobs=train_logprobs,
        infer_logprobs=infer_logprobs,
        mask=mask,
        bucket_edges=bucket_edges,
        rho_thresholds=rho_thresholds,
    )
    s.all_reduce(group)
    return mismatch_metrics(s, a=a, b=b, bucket_edges=bucket_edges, rho_thresholds=rho_thresholds)


SPLIT_PARTS = ("staleness", "tim", "total")
"""The parts of an off-policy token's log-ratio, ``mismatch/<part>/...``."""


def ratio_split_stats(
    *, current: torch.Tensor, behaviour: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor
) -> Stats:
    """Sufficient statistics of the per-token split of log pi_t - log mu_s over the masked tokens of ``[B, T]``
    inputs: staleness = log pi_t - log pi_s (``current`` - ``behaviour``: the trainer now, and at the weights that
    sampled the token), TIM = log pi_s - log mu_s (``behaviour`` - ``rollout``: trainer and sampler at those
    weights), and total = staleness + TIM, their sum by construction (so the parts add up exactly)."""
    m = mask.bool()
    lt = current.detach().to(torch.float64)
    ls = behaviour.detach().to(torch.float64)
    lm = rollout.detach().to(torch.float64)
    zero = torch.zeros((), dtype=torch.float64, device=lt.device)
    stale = torch.where(m, lt - ls, zero)[m]
    tim = torch.where(m, ls - lm, zero)[m]
    s = Stats()
    n = torch.tensor(float(stale.numel()), dtype=torch.float64)
    for part, v in zip(SPLIT_PARTS, (stale, tim, stale + tim), strict=True):
        s.add_sum(f"{part}_n", n)
        s.add_sum(f"{part}_lr", v.sum())
        s.add_sum(f"{part}_lr2", (v * v).sum())
        s.add_sum(f"{part}_abs", v.abs().sum())
        s.add_max(f"{part}_abs_max", zero if v.numel() == 0 else v.abs().max())
    return s


def ratio_split_metrics(stats: Stats, *, prefix: str = "mismatch") -> dict[str, float]:
    """Finalize (already reduced) :func:`ratio_split_stats` into ``mismatch/<part>/...``: the tokens, the
    log-ratio's mean, std and mean |.|, and its largest |.|, for staleness, TIM and their total."""
    out: dict[str, float] = {}
    for part in SPLIT_PARTS:
        p = f"{prefix}/{part}/"
        n = float(stats.sum(f"{part}_n"))
        out[p + "tokens"] = n
        out[p + "log_ratio_mean"] = safe_div(stats.sum(f"{part}_lr"), n)
        out[p + "log_ratio_std"] = std_from_sums(stats.sum(f"{part}_lr"), stats.sum(f"{part}_lr2"), n)
        out[p + "log_ratio_abs_mean"] = safe_div(stats.sum(f"{part}_abs"), n)
        out[p + "log_ratio_abs_max"] = float(stats.max(f"{part}_abs_max")) if n else float("nan")
    return out
