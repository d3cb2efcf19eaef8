"""Advantages, aggregation, policy losses and rollout corrections."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tim_megatron.algo import (
    aggregate,
    correction_metrics,
    group_advantages,
    gspo_loss,
    local_denominator,
    policy_loss_metrics,
    rollout_correction,
    token_clip_loss,
)
from tim_megatron.algo.stats import Stats

# ------------------------------------------------------------------------------------------ advantages


def test_grpo_advantages_closed_form_and_equal_group():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    a = group_advantages(rewards=r, group_size=4)
    std = torch.tensor([1.0, 0.0, 0.0, 1.0]).std()
    assert torch.allclose(a[:4], (torch.tensor([1.0, 0, 0, 1]) - 0.5) / (std + 1e-6))
    assert torch.equal(a[4:], torch.zeros(4))  # all-equal group: zero, not NaN
    assert torch.isfinite(a).all()


def test_grpo_variants():
    r = torch.tensor([3.0, 1.0, 2.0])
    assert torch.allclose(
        group_advantages(rewards=r, group_size=3, estimator="grpo_no_std"), torch.tensor([1.0, -1.0, 0.0])
    )
    # RLOO: r_i - mean of the others
    assert torch.allclose(
        group_advantages(rewards=r, group_size=3, estimator="rloo"), torch.tensor([1.5, -1.5, 0.0])
    )
    with pytest.raises(ValueError, match="group_size=4"):
        group_advantages(rewards=r, group_size=4)


# ----------------------------------------------------------------------------------------- aggregation


def test_aggregation_modes():
    v = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    m = torch.tensor([[1, 1, 1], [1, 0, 0]], dtype=torch.bool)
    assert aggregate(values=v, mask=m, mode="token-mean") == pytest.approx(10 / 4)
    assert aggregate(values=v, mask=m, mode="seq-mean-token-mean") == pytest.approx((2 + 4) / 2)
    assert aggregate(values=v, mask=m, mode="seq-mean-token-sum") == pytest.approx((6 + 4) / 2)
    assert aggregate(values=v, mask=m, mode="seq-mean-token-sum-norm", norm_length=5) == pytest.approx(
        10 / (2 * 5)
    )


@pytest.mark.parametrize(
    "mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
)
def test_global_denominator_makes_microbatches_sum_to_whole(mode):
    g = torch.Generator().manual_seed(0)
    v = torch.randn(8, 5, generator=g)
    m = torch.rand(8, 5, generator=g) > 0.3
    m[:, 0] = True
    whole = aggregate(values=v, mask=m, mode=mode, norm_length=5)
    den = sum(local_denominator(mask=mm, mode=mode) for mm in m.chunk(4))
    parts = sum(
        aggregate(values=vv, mask=mm, mode=mode, denominator=den, norm_length=5)
        for vv, mm in zip(v.chunk(4), m.chunk(4), strict=True)
    )
    assert float(parts) == pytest.approx(float(whole), rel=1e-6)


# ------------------------------------------------------------------------------------------- policy loss


def _rand(seed, b=4, t=6, scale=0.3):
    g = torch.Generator().manual_seed(seed)
    old = torch.log(torch.rand(b, t, generator=g).clamp(0.05))
    new = old + scale * torch.randn(b, t, generator=g)
    adv = torch.randn(b, generator=g)
    mask = torch.rand(b, t, generator=g) > 0.2
    mask[:, 0] = True
    return new, old, adv, mask


def test_token_clip_closed_form():
    old = torch.log(torch.tensor([[0.5, 0.5, 0.5]]))
    new = torch.log(torch.tensor([[0.75, 0.3, 0.5]]))  # ratios 1.5, 0.6, 1.0
    adv = torch.tensor([1.0])
    mask = torch.ones(1, 3, dtype=torch.bool)
    loss, s = token_clip_loss(
        logprobs=new, old_logprobs=old, advantages=adv, mask=mask, clip_low=0.2, clip_high=0.28
    )
    # A > 0: loss = -min(r, clip(r)) per token: -1.28, -0.6, -1.0
    assert float(loss) == pytest.approx(-(1.28 + 0.6 + 1.0) / 3, rel=1e-6)
    met = policy_loss_metrics(s)
    assert met["actor/clipfrac_token_high"] == pytest.approx(1 / 3)
    assert met["actor/clipfrac_token_low"] == 0.0  # low side only clips when A < 0
    loss_neg, s2 = token_clip_loss(
        logprobs=new, old_logprobs=old, advantages=-adv, mask=mask, clip_low=0.2, clip_high=0.28
    )
    # A < 0: loss = max(r, clip(r)) * 1 -> 1.5, 0.8, 1.0
    assert float(loss_neg) == pytest.approx((1.5 + 0.8 + 1.0) / 3, rel=1e-6)
    assert policy_loss_metrics(s2)["actor/clipfrac_token_low"] == pytest.approx(1 / 3)


def test_dual_clip_bounds_negative_advantage_loss():
    old = torch.log(torch.tensor([[0.1]]))
    new = torch.log(torch.tensor([[0.9]]))  # ratio 9
    loss, s = token_clip_loss(
        logprobs=new,
        old_logprobs=old,
        advantages=torch.tensor([-1.0]),
        mask=torch.ones(1, 1, dtype=torch.bool),
        dual_clip=3.0,
    )
    assert float(loss) == pytest.approx(3.0)
    assert policy_loss_metrics(s)["actor/clipfrac_dual"] == 1.0


def test_clip_zeroes_gradient_only_on_the_active_side():
    old = torch.log(torch.tensor([[0.5, 0.5]]))
    new = torch.log(torch.tensor([[0.75, 0.75]])).requires_grad_()
    adv = torch.tensor([[1.0, -1.0]])
    loss, _ = token_clip_loss(
        logprobs=new, old_logprobs=old, advantages=adv, mask=torch.ones(1, 2, dtype=torch.bool)
    )
    loss.backward()
    assert new.grad[0, 0] == 0.0  # ratio 1.5 > 1.2 with A > 0: clipped
    assert new.grad[0, 1] != 0.0  # same ratio with A < 0: not clipped


@given(seed=st.integers(0, 10_000), lo=st.floats(0.01, 0.5), hi=st.floats(0.01, 0.5))
@settings(max_examples=40, deadline=None)
def test_gspo_on_one_token_sequences_equals_token_clip(seed, lo, hi):
    new, old, adv, _ = _rand(seed, t=1)
    mask = torch.ones_like(new, dtype=torch.bool)
    new_a = new.clone().requires_grad_()
    new_b = new.clone().requires_grad_()
    la, _sa = gspo_loss(
        logprobs=new_a, old_logprobs=old, advantages=adv, mask=mask, clip_low=lo, clip_high=hi
    )
    lb, _sb = token_clip_loss(
        logprobs=new_b,
        old_logprobs=old,
        advantages=adv,
        mask=mask,
        clip_low=lo,
        clip_high=hi,
        aggregation="seq-mean-token-mean",
    )
    assert float(la) == pytest.approx(float(lb), rel=1e-6, abs=1e-7)
    la.backward()
    lb.backward()
    assert torch.allclose(new_a.grad, new_b.grad, atol=1e-6)


def test_gspo_gradient_equals_sequence_level_formula():
    new, old, adv, mask = _rand(1, b=3, t=5, scale=1e-4)
    x = new.clone().requires_grad_()
    loss, _ = gspo_loss(logprobs=x, old_logprobs=old, advantages=adv, mask=mask, clip_low=1.0, clip_high=1.0)
    loss.backward()
    # Unclipped GSPO: loss = -mean_i s_i A_i with s_i = exp(mean_t (logp - old)).
    y = new.clone().requires_grad_()
    lr = (y - old).masked_fill(~mask, 0).sum(-1) / mask.sum(-1)
    ref = -(torch.exp(lr) * adv).mean()
    ref.backward()
    assert float(loss) == pytest.approx(float(ref), rel=1e-6)
    assert torch.allclose(x.grad, y.grad, atol=1e-7)


def test_gspo_sequence_clip_fraction():
    old = torch.zeros(2, 2)
    new = torch.tensor([[0.01, 0.01], [0.0, 0.0]])  # seq ratios e^0.01 (clipped) and 1
    _, s = gspo_loss(
        logprobs=new,
        old_logprobs=old,
        advantages=torch.tensor([1.0, 1.0]),
        mask=torch.ones(2, 2, dtype=torch.bool),
    )
    assert policy_loss_metrics(s)["actor/clipfrac_seq"] == 0.5


def test_token_weights_scale_each_term():
    new, old, adv, mask = _rand(2)
    w = torch.rand_like(new)
    l1, _ = token_clip_loss(
        logprobs=new,
        old_logprobs=old,
        advantages=adv,
        mask=mask,
        token_weights=w,
        aggregation="seq-mean-token-sum",
    )
    l0, _ = token_clip_loss(
        logprobs=new,
        old_logprobs=old,
        advantages=adv,
        mask=mask,
        token_weights=torch.ones_like(w) * 2,
        aggregation="seq-mean-token-sum",
    )
    l_ref, _ = token_clip_loss(
        logprobs=new, old_logprobs=old, advantages=adv, mask=mask, aggregation="seq-mean-token-sum"
    )
    assert float(l0) == pytest.approx(2 * float(l_ref), rel=1e-6)
    assert float(l1) != pytest.approx(float(l_ref))


def test_loss_stats_reduce_across_microbatches():
    new, old, adv, mask = _rand(5, b=8)
    _, whole = token_clip_loss(
        logprobs=new, old_logprobs=old, advantages=adv, mask=mask, clip_low=0.1, clip_high=0.1
    )
    parts = [
        token_clip_loss(logprobs=n, old_logprobs=o, advantages=a, mask=m, clip_low=0.1, clip_high=0.1)[1]
        for n, o, a, m in zip(new.chunk(4), old.chunk(4), adv.chunk(4), mask.chunk(4), strict=True)
    ]
    assert policy_loss_metrics(Stats.combine(parts)) == pytest.approx(policy_loss_metrics(whole))


# ------------------------------------------------------------------------------------------ corrections


def test_tis_with_infinite_c_is_plain_is():
    new, old, _, mask = _rand(3, scale=2.0)
    w, _ = rollout_correction(old_logprobs=new, rollout_logprobs=old, mask=mask, mode="tis", c=math.inf)
    assert torch.allclose(w[mask], torch.exp(new - old)[mask])
    assert (w[~mask] == 0).all()


@given(seed=st.integers(0, 10_000), c=st.floats(1.0, 5.0))
@settings(max_examples=30, deadline=None)
def test_tis_truncates_and_mis_masks(seed, c):
    new, old, _, mask = _rand(seed, scale=1.0)
    ratio = torch.exp(new - old)
    w_tis, _ = rollout_correction(old_logprobs=new, rollout_logprobs=old, mask=mask, mode="tis", c=c)
    w_mis, _ = rollout_correction(old_logprobs=new, rollout_logprobs=old, mask=mask, mode="mis", c=c)
    assert torch.allclose(w_tis[mask], ratio.clamp(max=c)[mask], rtol=1e-5)
    keep = mask & (ratio <= c * (1 + 1e-6))
    assert torch.allclose(w_mis[keep], ratio[keep], rtol=1e-5)
    assert (w_mis[mask & (ratio > c * (1 + 1e-6))] == 0).all()


def test_icepop_non_reciprocal_bounds_mask_the_right_tokens():
    # Bounds [0.5, 3]: NOT reciprocal (1/0.5 = 2 != 3). A ratio of 2.5 must be kept; 0.4 and 3.5 dropped.
    ratios = torch.tensor([[0.4, 0.5, 0.9, 2.5, 3.0, 3.5]])
    old = torch.log(ratios * 0.1)
    roll = torch.log(torch.full_like(ratios, 0.1))
    w, s = rollout_correction(
        old_logprobs=old,
        rollout_logprobs=roll,
        mask=torch.ones_like(ratios, dtype=torch.bool),
        mode="icepop",
        low=0.5,
        high=3.0,
    )
    kept = (w > 0)[0].tolist()
    assert kept == [False, True, True, True, True, False]
    assert torch.allclose(w[0, 1:5], ratios[0, 1:5], rtol=1e-5)
    # A symmetric log-space bound |log r| <= log 3 would wrongly keep 0.4 (|log 0.4| = 0.92 < 1.10).
    assert abs(math.log(0.4)) < math.log(3.0)
    assert correction_metrics(s, mode="icepop", level="token")[
        "correction/icepop_token/dropped_token_frac"
    ] == pytest.approx(2 / 6)


def test_sequence_and_geometric_levels():
    old = torch.log(torch.tensor([[0.2, 0.4], [0.5, 0.5]]))
    roll = torch.log(torch.tensor([[0.1, 0.1], [0.5, 0.5]]))  # token ratios 2, 4 | 1, 1
    mask = torch.ones(2, 2, dtype=torch.bool)
    w_seq, _ = rollout_correction(
        old_logprobs=old, rollout_logprobs=roll, mask=mask, mode="tis", level="sequence", c=100
    )
    assert torch.allclose(w_seq, torch.tensor([[8.0, 8.0], [1.0, 1.0]]), rtol=1e-5)
    w_geo, _ = rollout_correction(
        old_logprobs=old, rollout_logprobs=roll, mask=mask, mode="tis", level="geometric", c=100
    )
    assert torch.allclose(w_geo, torch.tensor([[8**0.5] * 2, [1.0, 1.0]]), rtol=1e-5)
    w_mis, _ = rollout_correction(
        old_logprobs=old, rollout_logprobs=roll, mask=mask, mode="mis", level="sequence", c=5
    )
    assert w_mis[0].eq(0).all() and torch.allclose(w_mis[1], torch.ones(2))


def test_sequence_level_never_overflows():
    n = 5000
    old = torch.zeros(1, n)
    roll = torch.full((1, n), -0.5)  # product ratio e^2500
    w, _ = rollout_correction(
        old_logprobs=old,
        rollout_logprobs=roll,
        mask=torch.ones(1, n, dtype=torch.bool),
        mode="tis",
        level="sequence",
        c=2.0,
    )
    assert torch.isfinite(w).all() and torch.allclose(w, torch.full_like(w, 2.0))
