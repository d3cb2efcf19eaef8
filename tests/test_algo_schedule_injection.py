"""LR schedules (Algorithm 1 of the TIM-LR paper), early warning, injections, routing agreement."""

import copy
import json
import math

import pytest
import torch

from tim_megatron.algo import (
    CosineLR,
    EarlyWarning,
    GrowthDetector,
    LengthDecayLR,
    SurgeDetector,
    TrendDetector,
    add_drift,
    add_noise,
    biased_distortion,
    compute_mismatch,
    objective_surrogate,
    quantized_token_logprobs,
    round_mantissa,
    routing_agreement_metrics,
    routing_agreement_stats,
    unbiased_noise,
)

# ------------------------------------------------------------------------------------------- schedules


def algorithm_1(eta0, eta_inf, period, total):
    """The paper's pseudo-code, literally."""
    out, eta = [], eta0
    for t in range(1, total + 1):
        if t % period == 0:
            eta = max(eta / 2, eta_inf)
        out.append(eta)
    return out


def test_length_decay_reproduces_algorithm_1_step_by_step():
    ref = algorithm_1(1e-6, 1e-7, 204, 1000)
    sched = LengthDecayLR(base_lr=1e-6, min_lr_ratio=0.1, trigger="step", trigger_step=0, decay_period=204)
    got = [sched.lr(t) for t in range(1, 1001)]
    assert got == ref
    assert got[203] == 5e-7 and got[202] == 1e-6  # first halving at step 204
    assert min(got) == pytest.approx(1e-7)  # floor at 10%


def test_length_decay_resume_in_the_middle():
    ref = algorithm_1(1.0, 0.1, 7, 60)
    a = LengthDecayLR(base_lr=1.0, trigger="step", trigger_step=0, decay_period=7)
    first = [a.lr(t) for t in range(1, 31)]
    state = json.loads(json.dumps(a.state_dict()))  # survives a checkpoint as plain data
    b = LengthDecayLR(base_lr=1.0, trigger="step", trigger_step=0, decay_period=7)
    b.load_state_dict(state)
    rest = [b.lr(t) for t in range(31, 61)]
    assert first + rest == ref


def test_length_decay_triggered_by_surge_uses_1_8x_period():
    sched = LengthDecayLR(
        base_lr=1.0,
        min_lr_ratio=0.1,
        trigger="surge",
        surge=SurgeDetector(window=2, baseline_steps=3, factor=2.0),
    )
    lengths = [10, 10, 10, 11, 12, 30, 35, 36, 36] + [36] * 40
    lrs = []
    for t, length in enumerate(lengths, start=1):
        sched.observe(t, {"response/length_mean": length})
        lrs.append(sched.lr(t))
    # window=2 mean reaches 2 x 10 at step 7 ((30 + 35) / 2 = 32.5 >= 20 first there, step 6 = (12+30)/2 = 21 -> step 6)
    assert sched.triggered_at == 6
    assert sched.period == round(1.8 * 6)
    assert all(lr == 1.0 for lr in lrs[: sched.period - 1])
    assert lrs[sched.period - 1] == 0.5  # first halving at t = period (t % period == 0)
    assert lrs[2 * sched.period - 1] == 0.25


def test_fixed_trigger_step_derives_period():
    s = LengthDecayLR(base_lr=1.0, trigger="step", trigger_step=10, period_factor=1.8)
    lrs = []
    for t in range(1, 40):
        s.observe(t, {})
        lrs.append(s.lr(t))
    assert s.period == 18
    assert lrs[17] == 0.5 and lrs[16] == 1.0 and lrs[35] == 0.25


def test_cosine_with_warmup():
    c = CosineLR(base_lr=1.0, total_steps=10, warmup_steps=2, min_lr_ratio=0.1)
    assert c.lr(1) == 0.5 and c.lr(2) == 1.0
    assert c.lr(10) == pytest.approx(0.1)
    assert c.lr(6) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))


# --------------------------------------------------------------------------------------- early warning


def test_growth_detector_fires_within_the_implied_window():
    d = GrowthDetector("m", baseline_steps=5, window=5, threshold=2.0)
    fired = None
    for step in range(1, 60):
        value = 1.0 if step <= 20 else 1.0 * 1.15 ** (step - 20)  # crosses 2.0 at step 25
        if d.update(step, value):
            fired = step
            break
    cross = next(s for s in range(21, 60) if 1.15 ** (s - 20) >= 2.0)
    assert cross <= fired <= cross + 5 // 2
    assert d.update(fired + 1, 100.0) is None  # latched


def test_growth_detector_ignores_a_single_spike_and_nan():
    d = GrowthDetector("m", baseline_steps=3, window=5, threshold=2.0)
    for step in range(1, 30):
        v = 50.0 if step == 15 else (float("nan") if step == 16 else 1.0)
        assert d.update(step, v) is None


def _noisy(seed: int, n: int, sd: float, jump_at: int | None = None, factor: float = 1.0) -> list[float]:
    import random

    rng = random.Random(seed)
    return [
        1e-2 * math.exp(rng.gauss(0.0, sd)) * (factor if jump_at is not None and t >= jump_at else 1.0)
        for t in range(1, n + 1)
    ]


def _first_fire(det, values) -> int | None:
    for t, v in enumerate(values, start=1):
        if det.update(t, v):
            return t
    return None


def test_trend_detector_measures_the_runs_own_noise():
    """Stationary log-normal noise of SD 0.6 (rho_std's step-to-step scatter in the lab is of that order): the
    2x-median rule fires on noise alone, the noise-aware rule much less; a lasting 4x jump in the same noise
    fires the noise-aware rule within a few steps."""
    false_alarms_old = false_alarms_new = 0
    for seed in range(20):
        series = _noisy(seed, 300, 0.6)
        false_alarms_old += _first_fire(GrowthDetector("m", baseline_steps=5, window=5), series) is not None
        false_alarms_new += _first_fire(TrendDetector("m"), series) is not None
    assert false_alarms_old >= 10 and false_alarms_new <= 2, (false_alarms_old, false_alarms_new)
    lags = []
    for seed in range(20):
        fired = _first_fire(TrendDetector("m"), _noisy(seed, 200, 0.6, jump_at=100, factor=4.0))
        lags.append(None if fired is None else fired - 100)
    assert sum(lag is not None and 0 <= lag <= 10 for lag in lags) >= 18, lags


def test_trend_detector_is_more_sensitive_in_a_quiet_run():
    """The same 1.5x lasting step: caught within h / (z_cap - k) + 1 steps when the noise is 2%, later or not at
    all when it is 40%."""
    d = TrendDetector("m")
    quiet = _first_fire(d, _noisy(1, 200, 0.02, jump_at=50, factor=1.5))
    noisy = _first_fire(TrendDetector("m"), _noisy(1, 200, 0.4, jump_at=50, factor=1.5))
    assert quiet is not None and 50 <= quiet <= 50 + math.ceil(d.h / (d.z_cap - d.k))
    assert noisy is None or noisy > quiet + 5


def test_trend_detector_ignores_a_spike_zeros_and_nan_and_round_trips():
    d = TrendDetector("m", baseline_steps=5)
    for t in range(1, 60):
        v = {20: 1e3, 21: float("nan"), 22: 0.0}.get(t, 1e-2 * (1 + 0.001 * (t % 3)))
        assert d.update(t, v) is None
    state = json.loads(json.dumps(d.state_dict()))
    d2 = TrendDetector("m")
    d2.load_state_dict(state)
    rising = [1e-2 * 1.5**i for i in range(1, 10)]
    assert [d.update(60 + i, v) for i, v in enumerate(rising)] == [
        d2.update(60 + i, v) for i, v in enumerate(rising)
    ]
    assert d.fired_at is not None and d.fired_at == d2.fired_at


def test_early_warning_state_roundtrip():
    ew = EarlyWarning.create(
        metrics=["a"],
        baseline_steps=2,
        window=2,
        threshold=2.0,
        surge=SurgeDetector(window=1, baseline_steps=2),
    )
    for s in range(1, 6):
        ew.update(s, {"a": 1.0 * s, "response/length_mean": 10.0})
    state = json.loads(json.dumps(ew.state_dict()))
    ew2 = EarlyWarning.create(
        metrics=["a"],
        baseline_steps=2,
        window=2,
        threshold=2.0,
        surge=SurgeDetector(window=1, baseline_steps=2),
    )
    ew2.load_state_dict(state)
    for s in range(6, 9):
        assert ew.update(s, {"a": 1.0 * s, "response/length_mean": 30.0}) == ew2.update(
            s, {"a": 1.0 * s, "response/length_mean": 30.0}
        )
    assert [e.kind for e in ew.events] == [e.kind for e in ew2.events]
    assert {e.kind for e in ew.events} == {"mismatch_growth", "length_surge"}


# ------------------------------------------------------------------------------------------- injections


def test_biased_distortion_and_surrogate():
    old = torch.log(torch.tensor([[0.05, 0.5, 0.09, 0.9]]))
    mask = torch.tensor([[True, True, True, False]])
    phi = biased_distortion(old_logprobs=old, mask=mask, delta=2.0, pi_low=0.1)
    assert phi.tolist() == [[2.0, 1.0, 2.0, 0.0]]
    s = objective_surrogate(
        advantages=torch.tensor([0.5]), old_logprobs=old, mask=mask, delta=2.0, pi_low=0.1
    )
    assert float(s.sum("J")) == pytest.approx(0.5 * 2)  # two low tokens, A (phi - 1) = 0.5 each
    zero = biased_distortion(old_logprobs=old, mask=mask, delta=0.0, pi_low=0.1)
    assert zero.tolist() == [[0.0, 1.0, 0.0, 0.0]]


def test_unbiased_noise_is_seeded_and_has_the_right_moments():
    a = unbiased_noise(shape=(400, 500), sigma=0.2, seed=7)
    b = unbiased_noise(shape=(400, 500), sigma=0.2, seed=7)
    assert torch.equal(a, b)
    assert float(a.mean()) == pytest.approx(1.0, abs=2e-3)
    assert float(a.std()) == pytest.approx(0.2, rel=1e-2)
    assert not torch.equal(a, unbiased_noise(shape=(400, 500), sigma=0.2, seed=8))


def test_round_mantissa_matches_hardware_formats():
    x = torch.randn(200_000) * torch.exp(torch.randn(200_000) * 3)
    assert torch.equal(round_mantissa(x, 7), x.to(torch.bfloat16).float())
    normal = (x.abs() > 1e-4) & (x.abs() < 6e4)  # fp16 has a narrower exponent range
    assert torch.equal(round_mantissa(x, 10)[normal], x.to(torch.float16).float()[normal])


def test_precision_injection_matches_eq45_and_grows_with_fewer_bits():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(256, 500, generator=g) * 2
    tokens = torch.multinomial(torch.softmax(logits, -1), 1, generator=g).squeeze(-1)
    exact = torch.log_softmax(logits, -1).gather(-1, tokens[:, None]).squeeze(-1)
    q7 = quantized_token_logprobs(logits=logits, tokens=tokens, mantissa_bits=7)
    # Eq. 45 with torch's own bfloat16.
    zq = logits.to(torch.bfloat16).float()
    ref = (
        (torch.exp(zq - torch.logsumexp(zq, -1, keepdim=True)).to(torch.bfloat16).float())
        .gather(-1, tokens[:, None])
        .squeeze(-1)
    )
    assert torch.allclose(q7, torch.log(ref), atol=0, rtol=0)
    stds = []
    for bits in (10, 7, 4):
        q = quantized_token_logprobs(logits=logits, tokens=tokens, mantissa_bits=bits)
        m = compute_mismatch(
            train_logprobs=exact[None], infer_logprobs=q[None], mask=torch.ones(1, 256, dtype=torch.bool)
        )
        stds.append(m["mismatch/old_vs_rollout/rho_std"])
    assert 0 < stds[0] < stds[1] < stds[2]


def test_noise_and_drift_injection():
    lp = torch.log(torch.tensor([[0.5, 0.05, 0.9]]))
    d = add_drift(logprobs=lp, drift=0.1, pi_low=0.1)
    assert torch.allclose(d - lp, torch.tensor([[0.0, 0.1, 0.0]]))
    assert (add_drift(logprobs=torch.zeros(1, 2), drift=0.5) == 0).all()  # log p stays <= 0
    n1 = add_noise(logprobs=lp, std=0.01, seed=3)
    assert torch.equal(n1, add_noise(logprobs=lp, std=0.01, seed=3)) and not torch.equal(n1, lp)


# ------------------------------------------------------------------------------------------------ routing


def test_routing_agreement():
    roll = torch.tensor([[[0, 1], [2, 3], [4, 5]], [[0, 1], [2, 3], [6, 7]]])  # [L=2, N=3, k=2]
    train = torch.tensor([[[1, 0], [2, 4], [6, 7]], [[0, 1], [2, 3], [6, 7]]])
    m = routing_agreement_metrics(routing_agreement_stats(rollout_experts=roll, trainer_experts=train))
    p = "routing/rollout_vs_trainer/"
    assert m[p + "layer0/exact_match"] == pytest.approx(1 / 3)  # order within top-k does not matter
    assert m[p + "layer0/jaccard"] == pytest.approx((1 + 1 / 3 + 0) / 3)
    assert m[p + "layer1/exact_match"] == 1.0
    assert m[p + "exact_match"] == pytest.approx((1 / 3 + 1) / 2)
    masked = routing_agreement_metrics(
        routing_agreement_stats(
            rollout_experts=roll, trainer_experts=train, mask=torch.tensor([True, False, False])
        )
    )
    assert masked[p + "exact_match"] == 1.0


def test_schedule_state_is_a_deep_copyable_plain_dict():
    s = LengthDecayLR(base_lr=1.0, decay_period=7)
    st = copy.deepcopy(s.state_dict())
    assert json.loads(json.dumps(st)) == st
