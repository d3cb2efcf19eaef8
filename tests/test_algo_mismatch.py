"""Mismatch metrics: closed forms, properties, DP aggregation, the papers' numbers."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tim_megatron.algo.mismatch import compute_mismatch, mismatch_metrics, mismatch_stats
from tim_megatron.algo.stats import Stats

P = "mismatch/old_vs_rollout/"


def _batch(seed=0, b=6, t=9):
    g = torch.Generator().manual_seed(seed)
    infer = torch.log(torch.rand(b, t, generator=g).clamp(1e-3, 1))
    train = infer + 0.05 * torch.randn(b, t, generator=g)
    train = train.clamp(max=0)
    mask = torch.rand(b, t, generator=g) > 0.3
    mask[:, 0] = True
    return train, infer, mask


def test_closed_form_two_tokens():
    # rho = 2 and rho = 0.5 on one sequence of two tokens.
    train = torch.log(torch.tensor([[0.4, 0.1]]))
    infer = torch.log(torch.tensor([[0.2, 0.2]]))
    m = compute_mismatch(train_logprobs=train, infer_logprobs=infer, mask=torch.ones(1, 2, dtype=torch.bool))
    assert m[P + "rho_mean"] == pytest.approx(1.25)
    assert m[P + "rho_std"] == pytest.approx(0.75)  # population std of {2, 0.5}
    assert m[P + "rho_max"] == pytest.approx(2.0)
    assert m[P + "rho_min"] == pytest.approx(0.5)
    assert m[P + "log_ratio_mean"] == pytest.approx(0.0, abs=1e-7)
    assert m[P + "log_ratio_abs_mean"] == pytest.approx(math.log(2))
    # KL(rollout || old): k1 = mean(-log rho) = 0; k3 = mean(rho - 1 - log rho)
    assert m[P + "kl_rollout_old_k1"] == pytest.approx(0.0, abs=1e-7)
    assert m[P + "kl_rollout_old_k3"] == pytest.approx(((1 - math.log(2)) + (-0.5 + math.log(2))) / 2)
    assert m[P + "kl_old_rollout_k1"] == pytest.approx((2 * math.log(2) + 0.5 * math.log(0.5)) / 2)
    assert m[P + "chi2_token"] == pytest.approx((4 + 0.25) / 2 - 1)
    # log ppl: sequence sums are log 0.04 and log 0.04 -> no difference; per token |log 2 - log 2|... = 0.
    assert m[P + "log_ppl_abs_diff_seq_sum"] == pytest.approx(0.0, abs=1e-6)
    assert m[P + "chi2_seq"] == pytest.approx(0.0, abs=1e-6)
    assert m[P + "frac_abs_rho_minus_1_gt_0.1"] == 1.0
    # Probabilities (0.4, 0.1) vs (0.2, 0.2): the second has zero variance -> correlation undefined.
    assert math.isnan(m[P + "prob_pearson"])


def test_log_ppl_abs_diff_is_per_sequence_sum():
    train = torch.log(torch.tensor([[0.5, 0.5, 0.5], [0.9, 0.9, 0.0 + 1e-9]]))
    infer = torch.log(torch.tensor([[0.25, 0.5, 0.5], [0.9, 0.45, 0.5]]))
    mask = torch.tensor([[True, True, True], [True, True, False]])
    m = compute_mismatch(train_logprobs=train, infer_logprobs=infer, mask=mask)
    # seq 1: |log 2| = 0.693 over 3 tokens; seq 2: |log 2| over 2 tokens.
    assert m[P + "log_ppl_abs_diff_seq_sum"] == pytest.approx(math.log(2))
    assert m[P + "log_ppl_abs_diff_token_mean"] == pytest.approx((math.log(2) / 3 + math.log(2) / 2) / 2)
    assert m[P + "tokens"] == 5


def test_sum_form_grows_with_length_and_token_mean_does_not():
    """At one per-token mismatch, the sum form (TIM-LR Eq. 8 as written) scales with length: 1000 -> 3500
    tokens multiplies it by 3.5; the per-token form and rho_std stay put (issue 13: "length surge precedes
    mismatch growth" must not be built into the metric the console shows)."""
    g = torch.Generator().manual_seed(0)

    def metrics(length: int) -> dict:
        infer = torch.log(torch.rand(4, length, generator=g).clamp(0.05, 1.0))
        train = (infer + 0.01).clamp(max=0.0)  # a fixed biased drift per token
        return compute_mismatch(
            train_logprobs=train, infer_logprobs=infer, mask=torch.ones(4, length, dtype=torch.bool)
        )

    short, long = metrics(1000), metrics(3500)
    ratio = long[P + "log_ppl_abs_diff_seq_sum"] / short[P + "log_ppl_abs_diff_seq_sum"]
    assert ratio == pytest.approx(3.5, rel=0.02)
    assert long[P + "log_ppl_abs_diff_token_mean"] == pytest.approx(
        short[P + "log_ppl_abs_diff_token_mean"], rel=0.02
    )
    assert P + "log_ppl_abs_diff" not in long  # the ambiguous name is gone


def test_inv_rho_mean_closed_form():
    # rho = 2 and 0.5 -> 1/rho = 0.5 and 2 -> mean 1.25; on padding nothing counts.
    train = torch.log(torch.tensor([[0.4, 0.1, 0.3]]))
    infer = torch.log(torch.tensor([[0.2, 0.2, 0.9]]))
    mask = torch.tensor([[True, True, False]])
    m = compute_mismatch(train_logprobs=train, infer_logprobs=infer, mask=mask)
    assert m[P + "inv_rho_mean"] == pytest.approx(1.25)


def test_worked_example_of_the_explainer():
    p_rollout, p_policy = 0.7234, 0.7268
    rho = p_policy / p_rollout
    assert rho == pytest.approx(1.0047, abs=1e-4)
    n = 4096
    train = torch.full((1, n), math.log(p_policy))
    infer = torch.full((1, n), math.log(p_rollout))
    m = compute_mismatch(train_logprobs=train, infer_logprobs=infer, mask=torch.ones(1, n, dtype=torch.bool))
    summed = m[P + "log_ppl_abs_diff_seq_sum"]
    assert summed == pytest.approx(n * math.log(rho), rel=1e-4)
    assert 18.5 < summed < 19.5  # "about 19"
    assert m[P + "rho_std"] == pytest.approx(0.0, abs=1e-6)
    assert m[P + "rho_mean"] == pytest.approx(rho, rel=1e-6)


logprobs = st.lists(st.floats(min_value=-12.0, max_value=0.0, allow_nan=False), min_size=1, max_size=40)


@given(lp=logprobs, keep=st.lists(st.booleans(), min_size=1, max_size=40))
@settings(max_examples=60, deadline=None)
def test_rho_equal_one_gives_identity_values(lp, keep):
    t = torch.tensor([lp])
    mask = torch.tensor([(keep * 40)[: len(lp)]])
    mask[0, 0] = True
    m = compute_mismatch(train_logprobs=t, infer_logprobs=t.clone(), mask=mask)
    assert m[P + "rho_std"] == 0.0
    assert m[P + "rho_mean"] == 1.0
    assert m[P + "rho_max"] == 1.0 and m[P + "rho_min"] == 1.0
    for k in (
        "kl_rollout_old_k1",
        "kl_rollout_old_k3",
        "kl_old_rollout_k1",
        "kl_old_rollout_k3",
        "chi2_token",
        "chi2_seq",
    ):
        assert m[P + k] == 0.0, k
    assert m[P + "log_ppl_abs_diff_seq_sum"] == 0.0
    assert m[P + "inv_rho_mean"] == 1.0
    assert m[P + "frac_abs_rho_minus_1_gt_0.001"] == 0.0
    if not math.isnan(m[P + "prob_pearson"]):
        assert m[P + "prob_pearson"] == pytest.approx(1.0, abs=1e-9)


@given(seed=st.integers(0, 10_000), splits=st.integers(2, 5))
@settings(max_examples=25, deadline=None)
def test_dp_aggregation_equals_concatenated_batch(seed, splits):
    train, infer, mask = _batch(seed, b=10)
    whole = compute_mismatch(train_logprobs=train, infer_logprobs=infer, mask=mask)
    parts = [
        mismatch_stats(train_logprobs=tr, infer_logprobs=inf, mask=mk)
        for tr, inf, mk in zip(train.chunk(splits), infer.chunk(splits), mask.chunk(splits), strict=True)
    ]
    merged = mismatch_metrics(Stats.combine(parts), a="old", b="rollout")
    assert merged.keys() == whole.keys()
    for k in whole:
        assert merged[k] == pytest.approx(whole[k], rel=1e-9, abs=1e-12, nan_ok=True), k


def test_averaging_rank_stds_would_be_wrong():
    # Two ranks with different means: the true std is not the mean of per-rank stds.
    a = torch.log(torch.tensor([[0.5, 0.5]])), torch.log(torch.tensor([[0.5, 0.5]]))
    b = torch.log(torch.tensor([[0.6, 0.6]])), torch.log(torch.tensor([[0.5, 0.5]]))
    ones = torch.ones(1, 2, dtype=torch.bool)
    sa = mismatch_stats(train_logprobs=a[0], infer_logprobs=a[1], mask=ones)
    sb = mismatch_stats(train_logprobs=b[0], infer_logprobs=b[1], mask=ones)
    m = mismatch_metrics(Stats.combine([sa, sb]), a="old", b="rollout")
    assert m[P + "rho_std"] == pytest.approx(0.1, rel=1e-6)  # rho in {1, 1, 1.2, 1.2}


def test_buckets_by_train_probability():
    train = torch.log(torch.tensor([[0.005, 0.05, 0.95, 0.95]]))
    infer = torch.log(torch.tensor([[0.01, 0.05, 0.95 / 1.01, 0.95 / 0.99]]))
    m = compute_mismatch(
        train_logprobs=train,
        infer_logprobs=infer,
        mask=torch.ones(1, 4, dtype=torch.bool),
        bucket_edges=[0, 0.01, 0.1, 0.9, 1],
    )
    assert m[P + "bucket/0-0.01/count"] == 1
    assert m[P + "bucket/0-0.01/rho_mean"] == pytest.approx(0.5, rel=1e-5)
    assert m[P + "bucket/0.01-0.1/rho_mean"] == pytest.approx(1.0, abs=1e-6)
    assert m[P + "bucket/0.9-1/count"] == 2
    assert m[P + "bucket/0.9-1/rho_mean"] == pytest.approx(1.0, abs=1e-6)
    assert m[P + "bucket/0.9-1/rho_std"] == pytest.approx(0.01, rel=1e-4)
    assert m[P + "bucket/0.1-0.9/count"] == 0


def test_pearson_matches_numpy():
    import numpy as np

    train, infer, mask = _batch(3)
    m = compute_mismatch(train_logprobs=train, infer_logprobs=infer, mask=mask)
    lt, li = train[mask].double(), infer[mask].double()
    x, y = torch.exp(lt).numpy(), torch.exp(li).numpy()
    assert m[P + "prob_pearson"] == pytest.approx(float(np.corrcoef(x, y)[0, 1]), rel=1e-9)
    assert m[P + "rho_std"] == pytest.approx(float(np.std(torch.exp(lt - li).numpy())), rel=1e-9)


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_inverse_ratio_expectation_at_least_one(seed):
    """E_{x ~ pi_infer}[pi_infer / pi_train] >= 1, equality iff equal (objective-hacking Eq. 46)."""
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(50, generator=g, dtype=torch.float64) * 2, -1)
    q = torch.softmax(torch.randn(50, generator=g, dtype=torch.float64) * 2, -1)
    assert float((p * p / q).sum()) >= 1.0
    assert float((p * p / p).sum()) == pytest.approx(1.0, abs=1e-12)
    # The same through the metric: samples x ~ p (infer), rho = q/p (train/infer); chi2 of infer vs train.
    x = torch.multinomial(p, 200_000, replacement=True, generator=g)
    m = compute_mismatch(
        train_logprobs=torch.log(q[x]).unsqueeze(0),
        infer_logprobs=torch.log(p[x]).unsqueeze(0),
        mask=torch.ones(1, x.numel(), dtype=torch.bool),
    )
    # The logged E_infer[1/rho] (Eq. 46) is the sample mean of p/q: >= 1 and close to the exact value.
    exact = float((p * p / q).sum())
    assert m[P + "inv_rho_mean"] == pytest.approx(float((p[x] / q[x]).mean()), rel=1e-9)
    assert m[P + "inv_rho_mean"] > 1.0
    assert m[P + "inv_rho_mean"] == pytest.approx(exact, rel=0.05)
    # KL(rollout || old) = E_p[log p/q] >= 0 from the k1 estimator.
    assert m[P + "kl_rollout_old_k1"] > 0


def test_float64_accuracy_near_one():
    # Tiny mismatches of 1e-7 must not vanish in the std.
    n = 100_000
    g = torch.Generator().manual_seed(0)
    base = torch.log(torch.rand(1, n, generator=g).clamp(0.01))
    eps = 1e-6 * torch.randn(1, n, generator=g, dtype=torch.float64)
    m = compute_mismatch(
        train_logprobs=base.double() + eps,
        infer_logprobs=base.double(),
        mask=torch.ones(1, n, dtype=torch.bool),
    )
    assert m[P + "rho_std"] == pytest.approx(1e-6, rel=0.02)
