"""Issue 13, item 6: each fix, checked where it shows (console line, summary, recipes, schema, README)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.test_algo_schedule_injection import algorithm_1  # TIM-LR's Algorithm 1, literally
from tim_megatron.algo import SurgeDetector, build_schedule
from tim_megatron.algo.early_warning import surge_from_config
from tim_megatron.recipe import RecipeError, load_recipe
from tim_megatron.recipe.schema import CorrectionConfig, Recipe

ROOT = Path(__file__).resolve().parents[1]
P = "mismatch/old_vs_rollout/"
STEP = {
    "reward/mean": 0.5,
    P + "rho_std": 4.0e-3,
    P + "log_ppl_abs_diff_seq_sum": 0.25,
    P + "log_ppl_abs_diff_token_mean": 1.5e-3,
    "response/length_mean": 40.0,
    "actor/lr": 1e-3,
}


# ----------------------------------------------------- console line and summary.txt name what they show


def test_console_line_shows_rho_std_and_per_token_log_ppl_diff_next_to_length(tmp_path):
    from tim_megatron.logging.tracker import Tracker

    t = Tracker(Recipe(), run_dir=tmp_path, name="x", run_id="x", enabled=False)
    line = t.summary_line(3, 10, STEP)
    assert "rho_std 4.00e-03" in line
    assert re.search(r"len 40\.0  log_ppl_diff/tok 1\.50e-03", line), line
    assert "2.50e-01" not in line  # the per-sequence sum is not on the console


def test_summary_names_rho_std_and_per_token_log_ppl_diff(tmp_path):
    from tim_megatron.logging.summary import write_summary

    rows = [{"step": s, **STEP} for s in range(1, 11)]
    text = write_summary(tmp_path, rows, name="x", wall_seconds=1.0, events=[])
    assert "rho_std (old vs rollout), first 20%: 4.000e-03" in text
    assert "response length (tokens), first 20%: 40.0" in text
    assert "log-ppl |diff| per token (old vs rollout), first 20%: 1.500e-03" in text
    assert (tmp_path / "summary.txt").read_text() == text


# ---------------------------------------------------------------- length decay: Algorithm 1 by default


@pytest.mark.parametrize(("model", "period"), [("qwen3-4b-base", 204), ("qwen3-8b-base", 160)])
def test_length_decay_recipes_are_algorithm_1(model, period):
    r = load_recipe(ROOT / "recipes" / model / "length-decay.yaml").recipe
    sched = build_schedule(r.remedies.lr_schedule, base_lr=r.optim.lr, total_steps=r.run.steps)
    got = []
    for t in range(1, r.run.steps + 1):
        sched.observe(t, {"response/length_mean": 1000.0})  # a flat length: no surge ever
        got.append(sched.lr(t))
    assert got == algorithm_1(1e-6, 1e-7, period, r.run.steps)
    assert got[period - 2] == 1e-6 and got[period - 1] == 5e-7


def test_length_decay_defaults_to_the_fixed_period_and_needs_one():
    r = load_recipe(None, ["remedies.lr_schedule.type=length_decay", "remedies.lr_schedule.decay_period=5"])
    assert r.recipe.remedies.lr_schedule.trigger == "step"
    with pytest.raises(RecipeError, match="decay_period"):
        load_recipe(None, ["remedies.lr_schedule.type=length_decay"])


def _fires(lengths: list[float], **kw) -> int | None:
    det = SurgeDetector(**kw)
    for t, x in enumerate(lengths, start=1):
        if det.update(t, x):
            return t
    return None


def test_surge_fires_on_a_tripling_within_5_steps_and_not_on_a_slow_drift():
    """TIM-LR's surge is a rapid multiplication: a tripling within 5 steps fires, a 1%/step drift never does
    (it triples over 110 steps, which the earlier first-steps-baseline rule called a surge)."""
    flat_then_triple = [30.0] * 20 + [30.0 + 12 * k for k in range(1, 6)] + [90.0] * 30  # 30 -> 90 in 5 steps
    fired = _fires(flat_then_triple)  # defaults: window 3, factor 2, within 10
    # window means: (54 + 66 + 78) / 3 = 66 at step 24 is the first >= 2 x 30 (step 23: 54 < 60)
    assert fired == 24
    drift = [30.0 * 1.01**t for t in range(300)]  # 1%/step: 20x over the run
    assert _fires(drift) is None
    assert drift[-1] / drift[0] > 19
    # A curve that starts high and dips (base models) fires when it surges back: the reference is the recent
    # past, not the first steps (TIM-LR Fig. 6's 1000 -> 3000).
    base_like = [2500 - 75 * t for t in range(20)] + [1000] * 30 + [3000] * 50
    assert _fires(base_like, window=5, baseline_steps=20) == 53  # (1000 x 2 + 3000 x 3) / 5 = 2200 at step 53
    doc = type(Recipe().remedies.lr_schedule).model_fields["trigger"].description
    assert "1%/step" in doc and "within" in doc


def test_surge_detector_state_round_trips_and_reads_the_recipe():
    r = load_recipe(None, ["remedies.lr_schedule.surge.within=4", "remedies.lr_schedule.surge.factor=3"])
    det = surge_from_config(r.recipe.remedies.lr_schedule.surge)
    assert (det.within, det.factor, det.window) == (4, 3.0, 3)
    lengths = [10.0] * 8 + [40.0] * 6
    for t, x in enumerate(lengths[:9], start=1):
        det.update(t, x)
    twin = surge_from_config(r.recipe.remedies.lr_schedule.surge)
    twin.load_state_dict(json.loads(json.dumps(det.state_dict())))
    a = [det.update(t, x) for t, x in enumerate(lengths[9:], start=10)]
    b = [twin.update(t, x) for t, x in enumerate(lengths[9:], start=10)]
    assert a == b and any(a)
    old = SurgeDetector()
    old.load_state_dict({"history": [1.0], "baseline": 3.0, "fired_at": None, "window": 3})  # earlier format
    assert old.update(1, 5.0) is None and not hasattr(old, "baseline")


# -------------------------------------------------------------- clipping sweeps: aggregation held fixed


def test_every_sweep_holds_aggregation_fixed_across_its_arms():
    from tim_megatron.recipe.sweep import load_sweep

    sweeps = sorted((ROOT / "recipes" / "sweeps").glob("*.yaml"))
    assert sweeps
    for path in sweeps:
        sw = load_sweep(path)
        aggs = {v.name: sw.load_variant(v).recipe.rl.aggregation for v in sw.variants}
        assert len(set(aggs.values())) == 1, f"{path.name}: {aggs}"
        assert set(aggs.values()) == {"seq-mean-token-mean"}, f"{path.name}: Eq. 2 writes per-sequence means"


# ----------------------------------------------------------------- bypass with a correction: rejected


@pytest.mark.parametrize("mode", ["tis", "mis", "icepop"])
def test_bypass_with_a_correction_mode_is_rejected_naming_both_keys(mode):
    with pytest.raises(RecipeError) as e:
        load_recipe(None, [f"rl.correction.mode={mode}", "rl.correction.bypass=true"])
    msg = str(e.value)
    assert "rl.correction.bypass" in msg and "rl.correction.mode" in msg and mode in msg


def test_bypass_without_a_correction_still_loads():
    assert load_recipe(None, ["rl.correction.bypass=true"]).recipe.rl.correction.bypass


# ------------------------------------------------------------------ sources and the paper's numbers


def test_icepop_default_bounds_state_their_source():
    fields = CorrectionConfig.model_fields
    assert (fields["low"].default, fields["high"].default) == (0.5, 2.0)
    doc = fields["low"].description
    assert "slime" in doc and "icepop_function" in doc and "0.5_2.0" in doc and "2510.18855" in doc


def test_the_docs_say_the_table_2_kl_column_is_not_reproduced():
    text = (ROOT / "docs" / "metrics.md").read_text()
    block = text[text.index("tim simulate precision --vocab 2048") :][:1500]
    assert "KL column is not reproduced" in block
    assert "KL(mu || p_fp32) over the whole" in block  # and what ours is
