"""The TIM lab: the countdown task, the grid runner's aggregation and verdict rules, the early warning."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from tim_megatron.data.countdown import all_problems, chain_reward, chain_value, random_chain, warmup_batch
from tim_megatron.recipe import RecipeError, load_recipe
from tim_megatron.recipe.schema import TaskConfig

ROOT = Path(__file__).resolve().parents[1]
COUNTDOWN = TaskConfig(kind="countdown", min_target=10, max_target=40, max_terms=12)

# ------------------------------------------------------------------------------------ the countdown task


@pytest.mark.parametrize(
    ("response", "target", "reward"),
    [
        ("9+8=17+9=26+6=32+5=37", "37", 1.0),
        (" 9+8=17+9=26+6=32+5=37 ", "37", 1.0),  # surrounding whitespace is not part of the chain
        ("7", "7", 1.0),  # a lone digit is a chain
        ("5*7=35+2=37", "37", 1.0),  # left to right, no precedence
        ("9-4=5*8=40", "40", 1.0),
        ("9+8=17+9=26+6=32+5=38", "37", 0.0),  # a wrong running value
        ("9+8=17+9=26", "37", 0.0),  # stops short
        ("9+8=17+9=26+6=32+5=37+1=38", "37", 0.0),  # overshoots
        ("9+8=017", "17", 0.0),  # no leading zeros
        ("10+7=17", "17", 0.0),  # one digit per step
        ("9+0=9", "9", 0.0),  # digits are 1..9
        ("2-3=-1", "-1", 0.0),  # never below zero
        ("9+8=17 so 17", "17", 0.0),  # nothing but the chain
        ("", "17", 0.0),
    ],
)
def test_chain_reward(response, target, reward):
    assert chain_reward(response, target) == reward


def test_random_chains_are_correct_and_end_in_range():
    g = torch.Generator().manual_seed(0)
    task = TaskConfig(kind="countdown", min_target=10, max_target=40, max_terms=12, ops=["+", "-", "*"])
    lengths = set()
    for _ in range(300):
        target, chain = random_chain(task, g)
        assert 10 <= target <= 40
        assert chain_value(chain) == target and chain_reward(chain, str(target)) == 1.0
        lengths.add(len(chain))
    assert min(lengths) <= 10 and max(lengths) >= 40  # the chains' lengths vary widely


def test_warmup_batch_labels_the_chain_and_eos_only():
    from tim_megatron.models.tiny import build_tokenizer

    tok = build_tokenizer(64)
    ids, labels = warmup_batch(
        tokenizer=tok, task=COUNTDOWN, batch_size=8, generator=torch.Generator().manual_seed(1)
    )
    for row, lab in zip(ids.tolist(), labels.tolist(), strict=True):
        eq = row.index(tok.convert_tokens_to_ids("="))  # the prompt ends at its '='
        prompt = tok.decode(row[:eq])
        assert all(x == -100 for x in lab[: eq + 1])
        kept = [x for x in lab if x != -100]
        assert kept[-1] == tok.eos_token_id
        chain = tok.decode(kept[:-1])
        assert chain_reward(chain, prompt) == 1.0


def test_sft_batch_pads_right_and_labels_the_answer_only():
    from tim_megatron.data.arithmetic import sft_batch

    ids, labels = sft_batch([([5, 6], [7, 2]), ([5], [8, 9, 2])], pad=2)
    assert ids.tolist() == [[5, 6, 7, 2], [5, 8, 9, 2]]
    assert labels.tolist() == [[-100, -100, 7, 2], [-100, 8, 9, 2]]
    ids, labels = sft_batch([([4, 4, 4], [1]), ([4], [1])], pad=0)
    assert ids.tolist() == [[4, 4, 4, 1], [4, 1, 0, 0]]
    assert labels.tolist() == [[-100, -100, -100, 1], [-100, 1, -100, -100]]


def test_prompt_source_serves_countdown_targets_with_their_reward():
    from tim_megatron.data.rewards import reward
    from tim_megatron.data.sources import PromptSource

    r = load_recipe(ROOT / "recipes/tiny-moe/countdown.yaml").recipe
    src = PromptSource(r.data, seed=3)
    assert {it.prompt for it in src.train} == {p.prompt for p in all_problems(r.data.task)}
    assert all(it.reward == "countdown" for it in [*src.train, *src.val])
    item = src.step_items(1, 1)[0]
    assert reward(item.reward, "9", item.answer) == 0.0  # 9 is below every target


def test_countdown_target_range_is_checked_at_load():
    with pytest.raises(RecipeError, match="data.task.max_target"):
        load_recipe(None, ["data.task.kind=countdown", "data.task.min_target=50", "data.task.max_target=40"])
    with pytest.raises(RecipeError, match="max_terms"):
        load_recipe(None, ["data.task.kind=countdown", "data.task.max_target=200", "data.task.max_terms=12"])


def test_data_seed_fixes_the_prompt_order_whatever_the_run_seed():
    from tim_megatron.data.sources import PromptSource

    r = load_recipe(ROOT / "recipes/tiny-moe/countdown.yaml", ["data.seed=5"]).recipe
    a, b = PromptSource(r.data, seed=1), PromptSource(r.data, seed=2)
    assert [a.step_items(s, 16) for s in (1, 2, 3)] == [b.step_items(s, 16) for s in (1, 2, 3)]
    free = load_recipe(ROOT / "recipes/tiny-moe/countdown.yaml").recipe
    c, d = PromptSource(free.data, seed=1), PromptSource(free.data, seed=2)
    assert c.step_items(1, 16) != d.step_items(1, 16)  # without it, the run seed decides


# ---------------------------------------------------------------------------------------- statistics


def test_t_quantiles_and_intervals():
    from tim_megatron.lab.stats import mean_ci, paired_ci, t975, wilson

    assert t975(1) == pytest.approx(12.706) and t975(2) == pytest.approx(4.303)
    assert t975(60) == pytest.approx(2.000, abs=1e-3) and t975(1000) == pytest.approx(1.962, abs=1e-3)
    iv = mean_ci([1.0, 2.0, 3.0])
    assert (iv.mean, iv.n) == (2.0, 3)
    assert iv.high - iv.mean == pytest.approx(4.303 * 1.0 / 3**0.5, rel=1e-6)
    one = mean_ci([5.0, float("nan")])
    assert one.n == 1 and one.mean == 5.0 and one.low != one.low  # one value: no interval (NaN bounds)
    # Pairing by seed: seed 3 has no partner and drops out.
    pc = paired_ci({1: 3.0, 2: 5.0, 3: 100.0}, {1: 1.0, 2: 2.0})
    assert pc.n == 2 and pc.mean == pytest.approx(2.5)
    w = wilson(0, 10)
    assert w.mean == 0 and w.low == 0 and w.high == pytest.approx(0.2775, abs=1e-3)


# --------------------------------------------------------------------------------------------- the grid


def _grid(tmp_path: Path, body: str) -> Path:
    p = tmp_path / "g.yaml"
    p.write_text(f"base_recipe: {ROOT / 'recipes/tiny-moe/countdown.yaml'}\nseeds: [1, 2]\n" + body)
    return p


def test_grid_errors_name_the_key(tmp_path):
    from tim_megatron.lab.grid import GridError, load_grid, plan

    with pytest.raises(GridError, match="unknown key"):
        load_grid(_grid(tmp_path, "arms: [{name: a}]\nsteps: 3\n"))
    with pytest.raises(GridError, match="tune_seeds"):
        load_grid(_grid(tmp_path, "tune_seeds: [7]\narms: [{name: a}]\n"))
    with pytest.raises(GridError, match="used twice"):
        load_grid(_grid(tmp_path, "arms: [{name: a}, {name: a}]\n"))
    # An arm the schema rejects is an error (a typo must not silently drop an arm) ...
    typo = load_grid(_grid(tmp_path, "arms: [{name: a, overrides: [rl.clip.hihg=0.3]}]\n"))
    with pytest.raises(GridError, match="arm 'a' does not validate"):
        plan(typo)
    # ... unless it declares the feature it needs: then it is planned as not run, with the schema's reason.
    pending = load_grid(
        _grid(
            tmp_path,
            "arms: [{name: a}, {name: x, requires: a future mode, overrides: [diagnostics.future_mode=on]}]\n",
        )
    )
    plans = {p.arm.name: p for p in plan(pending)}
    assert plans["a"].runnable and not plans["x"].runnable
    assert plans["x"].reason == "needs a future mode" and "diagnostics.future_mode" in plans["x"].schema_error


def test_shipped_grids_plan_and_hold_the_claims_arms():
    from tim_megatron.lab.claims import CLAIMS
    from tim_megatron.lab.grid import load_grid, plan

    for name in ("quick", "full"):
        g = load_grid(ROOT / "lab" / f"{name}.yaml")
        plans = plan(g)
        names = {p.arm.name for p in plans}
        assert {
            "baseline",
            "clip-0.2",
            "clip-0.28",
            "gspo",
            "objective-delta",
            "tis",
            "length-decay",
            "lr-low",
        } <= names
        assert "exact" in names and g.weights == "seed"
        kinds = {p.loaded.recipe.diagnostics.sampling_injection.type for p in plans if p.arm.group}
        assert {"bias", "noise"} <= kinds  # C1-C2: a biased and an unbiased kind against the exact control
        # the lab base is on-policy; the clip arms take two minibatches so that the clip acts (C6)
        rl = {p.arm.name: p.loaded.recipe.rl for p in plans}
        assert rl["baseline"].minibatches == 1 and rl["baseline"].clip.high == 0.28
        assert rl["clip-0.2"].minibatches == rl["clip-0.28"].minibatches == 2
        assert (rl["clip-0.2"].clip.high, rl["clip-0.28"].clip.high) == (0.2, 0.28)
        assert all(p.loaded.recipe.rollout.max_tokens >= 256 for p in plans)
        assert (
            name == "quick" or "objective-sigma" in names
        )  # quick leaves C3's unbiased half out (its budget)
        # Exact mode and sampling-distribution injection are in the schema: every shipped arm runs, C1 and C2's
        # included (their overrides are the schema's own keys, not placeholders).
        assert all(p.runnable for p in plans), [(p.arm.name, p.schema_error) for p in plans if not p.runnable]
        injected = [p.loaded.recipe.diagnostics for p in plans if p.arm.group]
        assert injected and all(d.vexact == "exact" and d.sampling_injection.type != "off" for d in injected)
        assert next(p for p in plans if p.arm.name == "exact").loaded.recipe.diagnostics.vexact == "exact"
        assert len(g.seeds) >= (3 if name == "full" else 2)
        # Claims compare arms inside one family (the exact-sampling family for C1-C2, the vLLM arms for C3-C9):
        # a family's arms all run the same number of steps, or a paired comparison would mix run lengths.
        steps: dict[bool, set[int]] = {}
        for p in plans:
            exact = p.loaded.recipe.diagnostics.vexact == "exact"
            steps.setdefault(exact, set()).add(p.loaded.recipe.run.steps)
        assert all(len(v) == 1 for v in steps.values()), (name, steps)
    assert list(CLAIMS) == [f"C{i}" for i in range(1, 10)]


def test_preregistered_grids_match_their_preregistration():
    """lab/A.yaml and lab/B.yaml are what docs/prereg/A.md and B.md say: arms, seeds, steps, LRs, base."""
    from tim_megatron.lab.grid import load_grid, plan

    a = load_grid(ROOT / "lab" / "A.yaml")
    pa = {p.arm.name: p.loaded.recipe for p in plan(a)}
    assert a.seeds == [1, 2, 3, 4] and a.weights == "seed" and a.collapse_window == 10
    assert set(pa) == {"exact", "inject-bias-3", "inject-noise-0.3"}
    assert {
        (r.run.steps, r.optim.lr, r.diagnostics.vexact, r.remedies.fp32_lm_head) for r in pa.values()
    } == {(200, 5.0e-4, "exact", True)}
    inj = {n: r.diagnostics.sampling_injection for n, r in pa.items()}
    assert inj["exact"].type == "off"
    assert (inj["inject-bias-3"].type, inj["inject-bias-3"].delta, inj["inject-bias-3"].pi_low) == (
        "bias",
        3.0,
        0.1,
    )
    assert (inj["inject-noise-0.3"].type, inj["inject-noise-0.3"].std) == ("noise", 0.3)
    b = load_grid(ROOT / "lab" / "B.yaml")
    pb = {p.arm.name: p.loaded.recipe for p in plan(b)}
    assert b.seeds == [1, 2] and b.weights == "seed"
    assert {n: (r.run.steps, r.optim.lr, r.diagnostics.vexact) for n, r in pb.items()} == {
        "baseline": (300, 6.0e-4, "off"),
        "lr-low": (300, 3.0e-4, "off"),
    }
    for r in [*pa.values(), *pb.values()]:
        assert (r.rl.minibatches, r.rl.clip.low, r.rl.clip.high, r.rollout.max_tokens) == (1, 0.2, 0.28, 256)
        assert r.remedies.lr_schedule.type == "constant" and r.data.prompts_per_step == 8
    for name in ("A", "B"):
        text = (ROOT / "docs" / "prereg" / f"{name}.md").read_text()
        assert f"lab/{name}.yaml" in text and "Holm" in text


def test_long_grid_is_the_full_grid_at_200_steps():
    """lab/long.yaml runs the full grid's vLLM arms and its exact-sampling family unchanged but for their length
    (and length-decay's period, a quarter of the run in both), so its verdicts read as the same experiment run
    longer; the exact family runs on the KV-cached sampler (the default)."""
    from tim_megatron.lab.grid import load_grid, plan

    full, long = load_grid(ROOT / "lab" / "full.yaml"), load_grid(ROOT / "lab" / "long.yaml")
    assert (long.seeds, long.data_seed, long.tune_seeds) == (full.seeds, full.data_seed, full.tune_seeds)
    assert long.base == full.base
    assert [o for o in long.overrides if not o.startswith("run.steps=")] == [
        o for o in full.overrides if not o.startswith("run.steps=")
    ]
    plans = plan(long)
    assert all(p.runnable for p in plans), [(p.arm.name, p.schema_error) for p in plans if not p.runnable]
    assert {p.loaded.recipe.run.steps for p in plans} == {200}
    exact = {p.arm.name for p in plans if p.loaded.recipe.diagnostics.vexact == "exact"}
    assert exact and all(
        p.loaded.recipe.diagnostics.exact_sampler == "kv-cache" for p in plans if p.arm.name in exact
    )
    by_name = {a.name: a for a in full.arms}
    assert {a.name for a in long.arms} == set(by_name) - {"lr-high"}
    assert exact == {a.name for a in full.arms if "diagnostics.vexact=exact" in a.overrides}
    for arm in long.arms:
        if arm.name == "length-decay":
            period = {p.arm.name: p.loaded.recipe for p in plans}[
                "length-decay"
            ].remedies.lr_schedule.decay_period
            assert period == 200 // 4
        else:
            theirs = [o for o in by_name[arm.name].overrides if not o.startswith("run.steps=")]
            assert list(arm.overrides) == theirs, arm.name
            assert (arm.group, arm.dose) == (by_name[arm.name].group, by_name[arm.name].dose)


def _reward_rows(rewards: list[float]) -> list[dict]:
    return [{"step": i + 1, "reward/mean": r} for i, r in enumerate(rewards)]


def test_a_recovering_dip_is_not_a_collapse_and_a_sustained_drop_is():
    """Persistent collapse: the trailing 10-step mean at or below 70% of its best so far, and still there at the
    end. A dip that climbs back is not one (4 of 5 flagged 'collapses' of the old grid recovered)."""
    from tim_megatron.lab.runstats import collapse_step, score_series

    base = [0.40] * 15
    dip = base + [0.05] * 8 + [0.40] * 20
    x, score, _ = score_series(_reward_rows(dip))
    assert x[0] == 10 and score.min() == pytest.approx(0.12)  # (2 x 0.40 + 8 x 0.05) / 10: far below 0.28
    assert collapse_step(x, score) is None
    # the same fall, sustained: (6 x 0.40 + 4 x 0.05) / 10 = 0.26 <= 0.7 x 0.40 first at step 19
    assert collapse_step(*score_series(_reward_rows(base + [0.05] * 28))[:2]) == 19
    # a recovered dip, then a fall that lasts: the collapse is the second fall
    twice = dip + [0.05] * 30
    assert collapse_step(*score_series(_reward_rows(twice))[:2]) == len(dip) + 4
    # no best from a short window: a lucky first batch (0.40, then 0.20) is not a 30% fall
    lucky = [0.40] + [0.20] * 30
    assert collapse_step(*score_series(_reward_rows(lucky))[:2]) is None
    # the grid's collapse_window sets the window
    x5, _, what = score_series(_reward_rows(lucky), window=5)
    assert x5[0] == 5 and "5-step" in what


def score_series_of(rewards: list[float]):
    """(steps, scores) of the collapse rule for a run that logged ``rewards`` (default window)."""
    from tim_megatron.lab.runstats import score_series

    return score_series(_reward_rows(rewards))[:2]


def _flat_scores(rng, *, mean: float, sd: float = 0.05, steps: int = 200):
    return score_series_of(np.clip(rng.normal(mean, sd, steps), 0.0, 1.0).tolist())


def test_the_collapse_rule_flags_few_flat_series_and_every_sustained_halving():
    """Flat reward series at the lab's measured per-step noise (SD 0.05) over 200 steps: at most 5% flagged at mean
    0.15 (a fixed set of 400 series). Without the 20-step minimum the same series are flagged far more often (the
    rule that flagged A's collapse at step 189 of 200). A sustained 50% drop at step 100 is flagged in every
    series, within 15 steps of it."""
    from tim_megatron.lab.runstats import COLLAPSE_MIN_STEPS, collapse_step

    rng = np.random.default_rng(2024)
    flat = [_flat_scores(rng, mean=0.15) for _ in range(400)]
    flagged = [collapse_step(x, y) for x, y in flat]
    assert sum(f is not None for f in flagged) <= 0.05 * 400
    unguarded = sum(collapse_step(x, y, min_steps=1) is not None for x, y in flat)
    assert unguarded > 0.05 * 400, unguarded  # the minimum is what keeps them out
    assert COLLAPSE_MIN_STEPS == 20
    for _ in range(50):
        rewards = np.clip(
            np.concatenate([rng.normal(0.4, 0.05, 99), rng.normal(0.2, 0.05, 101)]), 0, 1
        ).tolist()
        step = collapse_step(*score_series_of(rewards))
        assert step is not None and 100 <= step <= 115, step


def test_a_drop_in_the_last_steps_is_censored_not_a_collapse():
    """A fall at step 189 of 200 cannot be seen persisting for 20 steps: censored. The same fall at step 150 is a
    collapse; a grid's collapse_min_steps sets the minimum (lab/A.yaml and B.yaml keep their registered 1)."""
    from tim_megatron.lab.grid import load_grid
    from tim_megatron.lab.runstats import censored_drop, collapse_step

    late = [0.4] * 188 + [0.05] * 12
    assert collapse_step(*score_series_of(late)) is None
    assert censored_drop(*score_series_of(late)) and not censored_drop(*score_series_of([0.4] * 200))
    assert collapse_step(*score_series_of(late), min_steps=1) == 192  # (6 x 0.40 + 4 x 0.05) / 10 <= 0.28
    early = [0.4] * 149 + [0.05] * 51
    assert collapse_step(*score_series_of(early)) == 153 and not censored_drop(*score_series_of(early))
    assert [load_grid(ROOT / "lab" / f"{g}.yaml").collapse_min_steps for g in ("A", "B", "long")] == [
        1,
        1,
        20,
    ]


def test_final_window_reward_is_the_last_tenth_of_the_run():
    from tim_megatron.lab.runstats import final_window

    rewards = [0.1] * 180 + [0.5] * 20
    assert final_window(_reward_rows(rewards)) == pytest.approx(0.5)  # 200 steps: the last 20
    assert final_window(_reward_rows([0.1] * 40 + [0.3] * 10)) == pytest.approx(
        0.3
    )  # at least the window, 10


def test_holm_adjusts_a_known_example_and_the_t_test_matches_the_t_table():
    from tim_megatron.lab.stats import fisher_fewer, holm, t975, t_sf, t_test_greater

    # Holm (1979) by hand: sorted 0.005 x 4, 0.01 x 3, 0.03 x 2, 0.04 x 1, each at least the one before
    adjusted = holm([0.01, 0.04, 0.03, 0.005, float("nan")])
    assert adjusted[:4] == pytest.approx([0.03, 0.06, 0.06, 0.02]) and adjusted[4] != adjusted[4]
    assert holm([0.5, 0.9]) == pytest.approx([1.0, 1.0])  # capped at 1, never below the previous
    for df in (1, 2, 3, 7, 30, 60):
        assert t_sf(t975(df), df) == pytest.approx(0.025, abs=2e-5)
    assert t_sf(1.0, 1) == pytest.approx(0.25)  # Cauchy: P(T > 1) = 1/4
    assert t_sf(-1.0, 1) == pytest.approx(0.75)
    assert t_test_greater([0.1]) != t_test_greater([0.1])  # NaN: one seed is no test
    assert t_test_greater([1.0, 1.0, 1.0]) == 0.0 and t_test_greater([-1.0, -1.0]) == 1.0
    # Fisher, one-sided: none of 4 vs all 8 collapse: 1 / C(12, 4); 7 of 8: 5 / 495; 6 of 8: 15 / 495
    assert fisher_fewer(0, 4, 8, 8) == pytest.approx(1 / 495)
    assert fisher_fewer(0, 4, 7, 8) == pytest.approx(5 / 495)
    assert fisher_fewer(0, 4, 6, 8) == pytest.approx(15 / 495)
    assert fisher_fewer(0, 4, 0, 8) == 1.0


# ------------------------------------------------------------------- aggregation, verdicts and the report


def _fake_run(d: Path, spec: dict, *, steps: int, growth: float, seed: int, collapse_at: int | None = None):
    """A completed run folder whose rho_std grows by exp(growth) over the run (with seeded wiggle)."""
    import json
    import math
    import random

    rng = random.Random(seed * 7919 + int(growth * 1000))
    rows = []
    for t in range(1, steps + 1):
        frac = (t - 1) / (steps - 1)
        reward = 0.3 + 0.4 * frac if collapse_at is None or t < collapse_at else 0.05
        rows.append(
            {
                "step": t,
                "reward/mean": reward,
                "mismatch/old_vs_rollout/rho_std": 0.03
                * math.exp(growth * frac)
                * math.exp(rng.gauss(0, 0.02)),
                "objective/J": 5.0 * frac + rng.gauss(0, 0.1),
                "response/length_mean": 40.0,
                "mismatch/old_vs_rollout/log_ppl_abs_diff_token_mean": 0.002
                * math.exp(growth * frac)
                * math.exp(rng.gauss(0, 0.02)),
                "mismatch/old_vs_rollout/log_ppl_abs_diff_seq_sum": 0.08
                * math.exp(growth * frac)
                * math.exp(rng.gauss(0, 0.02)),
                "mismatch/old_vs_rollout/bucket/0.01-0.1/count": 100.0,
                "mismatch/old_vs_rollout/bucket/0.01-0.1/rho_mean": 1.0 - 0.05 * frac,
                "mismatch/old_vs_rollout/bucket/0.9-1/count": 500.0,
                "mismatch/old_vs_rollout/bucket/0.9-1/rho_mean": 1.0,
            }
        )
    d.mkdir(parents=True)
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (d / "run.json").write_text(json.dumps({"status": "completed", "wall_seconds": 1.0}))
    (d / "lab.json").write_text(json.dumps(spec))


GRID = """name: fake
seeds: [1, 2, 3]
tune_seeds: [1, 2]
collapse_min_steps: 5
overrides: [run.steps=30]
arms:
  - {name: baseline}
  - {name: tis, overrides: [rl.correction.mode=tis]}
  - {name: lr-low, overrides: [optim.lr=3.0e-5]}
  - {name: lr-high, overrides: [optim.lr=1.0e-3]}
  - {name: exact, requires: a future exact mode, overrides: [diagnostics.future_mode=exact]}
"""


def test_lab_aggregates_runs_into_verdicts_and_a_report(tmp_path):
    import csv

    from tim_megatron.lab.grid import load_grid, plan
    from tim_megatron.lab.main import run_lab
    from tim_megatron.lab.runner import run_dir, run_spec

    path = tmp_path / "g.yaml"
    path.write_text(f"base_recipe: {ROOT / 'recipes/tiny-moe/countdown.yaml'}\n" + GRID)
    grid = load_grid(path)
    root = tmp_path / "runs"
    growth = {"baseline": 1.5, "tis": 0.2, "lr-low": 2.5, "lr-high": 3.0}
    for p in plan(grid):
        if p.runnable:
            for s in grid.seeds:
                collapse = 20 if p.arm.name == "lr-high" else None
                _fake_run(
                    run_dir(root, p.arm.name, s),
                    run_spec(grid, p, s),
                    steps=30,
                    growth=growth[p.arm.name] + 0.05 * s,
                    seed=s,
                    collapse_at=collapse,
                )
    res = run_lab(str(path), root=root, out=tmp_path / "report", aggregate_only=True)
    rows = {
        r["claim"]: r for r in csv.DictReader((tmp_path / "report" / "verdicts.csv").read_text().splitlines())
    }
    assert list(rows) == [f"C{i}" for i in range(1, 10)]
    assert rows["C7"]["verdict"] == "reproduced"  # baseline grows 1.3 more than TIS in every seed
    assert float(rows["C7"]["effect"]) == pytest.approx(1.3, abs=0.05)
    assert rows["C9"]["verdict"] == "not reproduced"  # the lower LR grows more here: CI below log 1.25
    assert (
        rows["C1"]["verdict"] == "inconclusive"
        and "not run: needs a future exact mode" in rows["C1"]["detail"]
    )
    assert "is not in this grid" in rows["C6"]["detail"]
    assert rows["C5"]["verdict"] == "reproduced"  # the low bucket drifts down by 0.05 in every seed
    page = res["page"].read_text()
    assert "tim lab" in page and "--only exact" in page and "reproduced" in page
    det = list(csv.DictReader((tmp_path / "report" / "detectors.csv").read_text().splitlines()))
    held = [r for r in det if r["seeds"].startswith("held out")]
    assert {r["rule"] for r in held} == {"median_ratio", "trend", "trend-tuned"}
    # tables.md: the same verdicts for the docs, one table row per claim, the CSV's numbers
    md = (tmp_path / "report" / "tables.md").read_text()
    c7 = next(line for line in md.splitlines() if line.startswith("| C7 |"))
    assert f"| {rows['C7']['verdict']} | {rows['C7']['effect']} |" in c7
    assert sum(line.startswith("| C") for line in md.splitlines()) == 9
    assert "| lr-high | 3 |" in md and "| median_ratio |" in md
    assert all(r["collapsing"] == "1" and r["runs"] == "4" for r in held)  # seed 3: lr-high collapses at 20
    assert (tmp_path / "report" / "curve_mismatch-old_vs_rollout-rho_std.png").exists()
    assert "Holm" in md and "Seeds vary the initial weights" in md and "| p_holm |" in md
    # --docs: the tables go between the grid's markers in a Markdown file, and nothing else there changes
    from tim_megatron.lab.docs import include_tables

    doc = tmp_path / "results.md"
    doc.write_text(
        "# Results\nkept\n<!-- tables:fake -->\nold, typed by hand\n<!-- /tables:fake -->\nalso kept\n"
    )
    include_tables(doc, "fake", md)
    text = doc.read_text()
    assert text.startswith("# Results\nkept\n<!-- tables:fake -->") and text.endswith(
        "<!-- /tables:fake -->\nalso kept\n"
    )
    assert (
        "typed by hand" not in text and c7 in text and "#### Verdicts" in text and "### fake: tables" in text
    )
    from tim_megatron.lab.grid import GridError

    with pytest.raises(GridError, match="<!-- tables:other -->"):
        include_tables(doc, "other", md)


def test_core_slots_split_the_cores_without_overlap():
    from tim_megatron.lab.runner import core_slots, slot_env

    assert core_slots(2, [0, 1]) == [[0], [1]]
    assert core_slots(2, [0, 1, 2, 3, 5]) == [[0, 1], [2, 3]]  # equal shares; the remainder stays unused
    assert core_slots(1, [4, 6]) == [[4, 6]]
    assert slot_env([2, 3]) == {"OMP_NUM_THREADS": "2", "VLLM_CPU_OMP_THREADS_BIND": "2,3"}
    with pytest.raises(ValueError, match=r"jobs = 3: more than the 2 core\(s\)"):
        core_slots(3, [0, 1])
    with pytest.raises(ValueError, match="jobs = 0"):
        core_slots(0, [0, 1])


def test_tim_lab_refuses_more_jobs_than_cores_before_running_anything(tmp_path):
    import os
    import subprocess
    import sys

    jobs = len(os.sched_getaffinity(0)) + 1
    cmd = [
        sys.executable,
        "-m",
        "tim_megatron.cli",
        "lab",
        "quick",
        "--jobs",
        str(jobs),
        "--root",
        str(tmp_path),
    ]
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert res.returncode != 0
    assert f"--jobs {jobs}: jobs = {jobs}: more than the" in res.stdout + res.stderr
    assert not any(tmp_path.iterdir())  # no run folder was made


# ------------------------------------------------------------------------------- end to end, real training

TINY_GRID = """name: tiny-lab
seeds: [1, 2]
tune_seeds: [1]
overrides: [run.steps=2, run.val_every=2, data.prompts_per_step=2, rollout.n=4, rollout.max_tokens=24,
            rollout.max_model_len=32, data.val_prompts=4, model.tiny_warmup_steps=20, trainer.micro_batch_size=8]
arms:
  - {name: baseline}
  - {name: pending, requires: a future mode, overrides: [diagnostics.future_mode=on]}
"""


@pytest.mark.slow
def test_tim_lab_runs_real_training_then_reuses_the_runs(tmp_path):
    """`tim lab --jobs 2` on a 1-arm x 2-seed grid of 2-step countdown runs from the lab's base recipe: real
    `tim train` subprocesses, two at a time on disjoint cores, a verdict row per claim, the pending arm named with
    its rerun command; a second invocation runs nothing."""
    import csv
    import os
    import subprocess
    import sys

    from tests.conftest import importable, require
    from tim_megatron.run_dir import RECIPE_FILE

    require(importable("megatron.core", "vllm"), "megatron-core and vLLM")
    grid = tmp_path / "g.yaml"
    grid.write_text(f"base_recipe: {ROOT / 'recipes/tiny-moe/lab.yaml'}\n" + TINY_GRID)
    cmd = [sys.executable, "-m", "tim_megatron.cli", "lab", str(grid), "--root", str(tmp_path / "runs")]
    cmd += ["--out", str(tmp_path / "report"), "--jobs", "2"]
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    first = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=1200)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert (
        first.stdout.count(": completed in ") == 2
        and "pending seed 1: not run, needs a future mode" in first.stdout
    )
    for arm in ("baseline",):  # one arm keeps this end-to-end run short; claims are tested on fakes above
        for seed in (1, 2):
            d = tmp_path / "runs" / arm / f"seed{seed}"
            rows = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()]
            assert [r["step"] for r in rows] == [1, 2]
            assert all(r["mismatch/old_vs_rollout/rho_std"] > 0 for r in rows)  # bf16 vs bf16: a real TIM
            assert "val/accuracy" in rows[-1]
            rl = yaml.safe_load((d / RECIPE_FILE).read_text())["rl"]  # the lab's base: on-policy, clip-higher
            assert (rl["minibatches"], rl["clip"]["low"], rl["clip"]["high"]) == (1, 0.2, 0.28)
    slots = [
        json.loads((tmp_path / "runs" / "baseline" / f"seed{k}" / "slot.json").read_text()) for k in (1, 2)
    ]
    assert all(x["jobs"] == 2 and x["OMP_NUM_THREADS"] == "1" for x in slots)
    assert {x["VLLM_CPU_OMP_THREADS_BIND"] for x in slots} == {
        str(c) for c in sorted(os.sched_getaffinity(0))[:2]
    }
    for k, slot in zip((1, 2), slots, strict=True):  # the whole process was confined to its slot's core
        meta = json.loads((tmp_path / "runs" / "baseline" / f"seed{k}" / "run.json").read_text())
        assert meta["cpu_affinity"] == [int(slot["VLLM_CPU_OMP_THREADS_BIND"])]
    verdicts = list(csv.DictReader((tmp_path / "report" / "verdicts.csv").read_text().splitlines()))
    assert [v["claim"] for v in verdicts] == [f"C{i}" for i in range(1, 10)]
    assert "--only pending" in (tmp_path / "report" / "index.html").read_text()
    again = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stdout.count(": reused ") == 2 and ": completed in " not in again.stdout


# ------------------------------------------------------------------------------ the claims on built run stats

VEXACT_GRID = """name: causal
seeds: [1, 2, 3, 4]
arms:
  - {name: exact, overrides: [diagnostics.vexact=exact, remedies.fp32_lm_head=true]}
  - name: inject-bias-3
    group: inject
    dose: 3
    overrides: [diagnostics.vexact=exact, remedies.fp32_lm_head=true, diagnostics.sampling_injection.type=bias,
                diagnostics.sampling_injection.delta=3.0, diagnostics.sampling_injection.engine=trainer]
  - name: inject-noise-0.3
    group: inject
    dose: 0.3
    overrides: [diagnostics.vexact=exact, remedies.fp32_lm_head=true, diagnostics.sampling_injection.type=noise,
                diagnostics.sampling_injection.std=0.3, diagnostics.sampling_injection.engine=trainer]
"""


def _stats(arm: str, seed: int, **kw):
    from tim_megatron.lab.runstats import RunStats

    nan = float("nan")
    base = dict(
        arm=arm, seed=seed, path="", status="completed", steps=200, wall_seconds=1.0, slope=nan, growth=nan,
        rho_std_start=nan, rho_std_end=nan, zero_mismatch=arm == "exact", j_step_pcc=nan, bucket_drift=nan,
        collapse_step=None, collapse_metric="", best_score=0.4, final_score=0.4, reward_start=0.2, reward_end=0.4,
        length_start=30.0, length_end=40.0, surge_step=None, final_reward=0.4, dose=0.0 if arm == "exact" else 0.01,
        policy_reward=0.4,
    )  # fmt: skip
    base.update(kw)
    return RunStats(**base)


def _lab(tmp_path, grid_text: str, runs: dict):
    from tim_megatron.lab.claims import LabData
    from tim_megatron.lab.grid import load_grid, plan

    path = tmp_path / "g.yaml"
    path.write_text(f"base_recipe: {ROOT / 'recipes/tiny-moe/lab.yaml'}\n" + grid_text)
    grid = load_grid(path)
    return LabData(grid=grid, plans={p.arm.name: p for p in plan(grid)}, runs=runs)


def _by_claim(lab) -> dict:
    from tim_megatron.lab.claims import verdicts

    return {v.claim: v for v in verdicts(lab)}


def test_c1_needs_a_contrast_against_the_matched_control(tmp_path):
    """C1 is not reproduced by a stable exact arm alone: when the injected runs did not collapse either there
    is no contrast (inconclusive, no test); when they collapsed and exact did not, Fisher's test decides."""
    seeds = (1, 2, 3, 4)
    arms = ("exact", "inject-bias-3", "inject-noise-0.3")
    stable = {a: {s: _stats(a, s) for s in seeds} for a in arms}
    v = _by_claim(_lab(tmp_path, VEXACT_GRID, stable))["C1"]
    assert v.verdict == "inconclusive" and "no contrast" in v.detail
    assert v.p_value != v.p_value  # no test
    fell = {a: {s: _stats(a, s, collapse_step=None if a == "exact" else 50, final_reward=0.4 if a == "exact" else 0.05)
                for s in seeds} for a in arms}  # fmt: skip
    v = _by_claim(_lab(tmp_path, VEXACT_GRID, fell))["C1"]
    assert v.verdict == "reproduced" and v.p_value == pytest.approx(1 / 495)
    assert "0 of 4 exact run(s) and 8 of 8 injected" in v.detail and v.effect == 1.0
    # exact collapsing as often as the injected arms, 4 seeds each: a rate difference of 0 whose interval still
    # reaches a 25-point rise (lab A's situation), so not "not reproduced" but inconclusive
    both = {a: {s: _stats(a, s, collapse_step=50 if s <= 2 else None) for s in seeds} for a in arms}
    v = _by_claim(_lab(tmp_path, VEXACT_GRID, both))["C1"]
    assert v.verdict == "inconclusive" and v.effect == 0.0 and v.ci_high >= 0.25, v
    # a censored run (a lasting drop too late to judge) is in neither count, and the row says so
    late = {
        **fell,
        "inject-bias-3": {**fell["inject-bias-3"], 4: _stats("inject-bias-3", 4, collapse_censored=True)},
    }
    v = _by_claim(_lab(tmp_path, VEXACT_GRID, late))["C1"]
    assert "and 7 of 7 injected" in v.detail and "1 run(s) left out as censored" in v.detail, v.detail
    # with 40 seeds the same rates give an interval below 0.25: ruled out, not reproduced
    many = {a: {s: _stats(a, s, collapse_step=50 if s % 2 else None) for s in range(1, 41)} for a in arms}
    v = _by_claim(_lab(tmp_path, VEXACT_GRID, many))["C1"]
    assert v.verdict == "not reproduced" and v.ci_high < 0.25, v
    # an exact run with rho_std > 0 is no zero-mismatch control
    leaky = {**fell, "exact": {**fell["exact"], 3: _stats("exact", 3, zero_mismatch=False)}}
    v = _by_claim(_lab(tmp_path, VEXACT_GRID, leaky))["C1"]
    assert v.verdict == "inconclusive" and "not a zero-mismatch control" in v.detail


def test_not_reproduced_needs_an_interval_that_excludes_the_smallest_effect(tmp_path):
    """'Not reproduced' is impossible while the interval reaches the smallest effect of interest, whatever the
    point estimate; and a significant effect whose interval lies wholly below that minimum is not reproduced (the
    minimum comes first), not 'reproduced'."""
    from tim_megatron.lab.claims import INCONCLUSIVE, NOT_REPRODUCED, decide
    from tim_megatron.lab.stats import Interval

    rng = np.random.default_rng(5)
    for _ in range(2000):
        low, high = np.sort(rng.uniform(-1, 1, 2))
        mean = float(rng.uniform(low, high))
        mi = float(rng.uniform(0.01, 0.5))
        verdict, _why = decide(Interval(mean, float(low), float(high), 4), min_effect=mi)
        assert verdict in (NOT_REPRODUCED, INCONCLUSIVE)
        assert (verdict == NOT_REPRODUCED) == (high < mi)
    # C5's drift: 4 seeds tightly at +0.005, significant (p ~ 1e-5) but below the 0.01 that counts
    seeds = (1, 2, 3, 4)
    grid = "name: drift\nseeds: [1, 2, 3, 4]\narms:\n  - {name: baseline}\n"
    runs = {"baseline": {s: _stats("baseline", s, bucket_drift=-0.005 - 0.0001 * s) for s in seeds}}
    v = _by_claim(_lab(tmp_path, grid, runs))["C5"]
    assert v.p_value < 0.001 and v.ci_high < 0.01 and v.verdict == "not reproduced", v


def test_c2_reads_the_policys_reward_deficit_against_the_dose(tmp_path):
    """C2: per seed, the policy reward deficit against exact (val/policy_reward: the trained policy sampled
    without the injection) regressed on the measured dose (KL per token) through the origin, read at the highest
    dose; deficits proportional to the dose give that deficit. The training reward (the distorted sampler's) is
    reported beside it and decides nothing; without a policy evaluation C2 is inconclusive."""
    seeds = (1, 2, 3, 4)
    dose = {"inject-bias-3": 0.02, "inject-noise-0.3": 0.01}
    runs = {"exact": {s: _stats("exact", s, policy_reward=0.40 + 0.01 * s) for s in seeds}}
    for a, d in dose.items():
        # deficit = 10 x dose, a little seed noise: 0.2 at the highest dose; the training reward far lower still
        runs[a] = {
            s: _stats(
                a, s, dose=d, policy_reward=0.40 + 0.01 * s - 10 * d - 0.002 * (s % 2), final_reward=0.05
            )
            for s in seeds
        }
    v = _by_claim(_lab(tmp_path, VEXACT_GRID, runs))["C2"]
    assert v.effect == pytest.approx(0.2, abs=0.01) and v.verdict == "reproduced"
    assert "highest arm-mean dose 0.02" in v.detail and "(training reward 0.050" in v.detail
    assert "no start-of-run policy evaluation" in v.detail
    # the manipulation check: the untrained policy's reward, per seed, in every arm
    from dataclasses import replace

    started = {a: {s: replace(r, policy_reward_start=0.2 + 0.01 * s) for s, r in by_seed.items()}
               for a, by_seed in runs.items()}  # fmt: skip
    started["inject-noise-0.3"][3] = replace(runs["inject-noise-0.3"][3], policy_reward_start=0.9)
    v = _by_claim(_lab(tmp_path, VEXACT_GRID, started))["C2"]
    assert "same in every arm for seed(s) [1, 2, 4], differs for seed(s) [3]" in v.detail, v.detail
    del started["inject-bias-3"][4]  # a seed one arm did not log is not counted as the same
    v = _by_claim(_lab(tmp_path, VEXACT_GRID, started))["C2"]
    assert "for seed(s) [1, 2], differs for seed(s) [3]; seed(s) [4] not logged by every arm" in v.detail, (
        v.detail
    )
    flat = {**runs, **{a: {s: _stats(a, s, dose=d, policy_reward=0.40 + 0.01 * s + 0.001 * (s % 2 - 0.5),
                                     final_reward=0.05) for s in seeds} for a, d in dose.items()}}  # fmt: skip
    v = _by_claim(_lab(tmp_path, VEXACT_GRID, flat))["C2"]
    # the sampler's reward collapsed, the policy's did not: no deficit, tightly: ruled out
    assert v.verdict == "not reproduced" and v.ci_high < 0.05
    nan = float("nan")
    unmeasured = {a: {s: _stats(a, s, policy_reward=nan, dose=dose.get(a, 0.0)) for s in seeds} for a in runs}
    v = _by_claim(_lab(tmp_path, VEXACT_GRID, unmeasured))["C2"]
    assert v.verdict == "inconclusive" and "run.val_samples = 0" in v.detail


SMALL_GRID = """name: small
seeds: [1, 2, 3]
collapse_min_steps: 5
overrides: [run.steps=30]
arms:
  - {name: baseline}
"""


def _small_root(tmp_path: Path, seeds=(1, 2, 3)):
    from tim_megatron.lab.grid import load_grid, plan
    from tim_megatron.lab.runner import run_dir, run_spec

    path = tmp_path / "g.yaml"
    path.write_text(f"base_recipe: {ROOT / 'recipes/tiny-moe/countdown.yaml'}\n" + SMALL_GRID)
    grid = load_grid(path)
    (p,) = plan(grid)
    root = tmp_path / "runs"
    for s in seeds:
        _fake_run(run_dir(root, "baseline", s), run_spec(grid, p, s), steps=30, growth=1.0, seed=s)
    return path, root


@pytest.mark.parametrize(
    ("key", "value", "typed"),
    [
        ("mismatch/old_vs_rollout/bucket/0.9-1/rho_mean", "abc", None),
        ("mismatch/old_vs_rollout/bucket/0.01-0.1/count", "100", None),
        ("val/policy_reward_start", [0.5], None),
        ("val/policy_reward_start", None, float("nan")),  # NaN as the tracker writes it: no notice
        ("mismatch/old_vs_rollout/bucket/0.9-1/count", "inf", float("inf")),  # the tracker's infinity
        ("reward/mean", {"a": 1}, None),
        ("objective/J", True, None),
    ],
)
def test_a_value_of_the_wrong_type_is_left_out_and_named(tmp_path, key, value, typed):
    """One string, list or object where the lab reads a number, in one row of one run, ended the report in a
    ValueError or TypeError (runstats sums bucket counts and takes float() of the start reward). Now the value is
    left out (the tracker's own spellings of NaN and infinity are read as such) and named: run, step, key."""
    from tim_megatron.lab.rows import checked_rows

    _, root = _small_root(tmp_path, seeds=(1,))
    d = root / "baseline" / "seed1"
    rows = [json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()]
    rows[6][key] = value
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    checked, notices, changed = checked_rows(d, run="baseline/seed1")
    assert changed
    if typed is None:
        assert key not in checked[6]
        (notice,) = notices
        assert notice.startswith("run baseline/seed1: metrics.jsonl holds 1 value(s) that are not numbers")
        assert f"step 7: {key!r} = " in notice
    else:
        assert not notices
        assert key not in checked[6] if value is None else checked[6][key] == typed
    assert all(
        r[k] == rows[i][k] for i, r in enumerate(checked) for k in r if (i, k) != (6, key)
    )  # nothing else


def test_a_report_over_a_run_with_a_wrong_typed_metric_is_still_written_and_lists_commits(tmp_path):
    """From a root: a string bucket count in one row of one run, one run of the grid missing, one run that
    recorded its commit: the report is written, names the value left out and the missing run, and lists the
    commits the runs came from ("not recorded" for the others)."""
    import csv

    from tim_megatron.lab.main import run_lab

    path, root = _small_root(tmp_path, seeds=(1, 2))
    d = root / "baseline" / "seed2"
    rows = [json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()]
    rows[4]["mismatch/old_vs_rollout/bucket/0.01-0.1/count"] = "abc"
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    meta = json.loads((d / "run.json").read_text())
    code = {"commit": "ab" * 20, "clean": True, "diff_sha256": None, "version": "0.1.0", "libraries": {}}
    (d / "run.json").write_text(json.dumps({**meta, "code": code}))
    res = run_lab(str(path), root=root, out=tmp_path / "report", aggregate_only=True, log=lambda m: None)
    md = (tmp_path / "report" / "tables.md").read_text()
    assert "Notice: run baseline/seed2: metrics.jsonl holds 1 value(s)" in md and "step 5: " in md
    assert "Notice: 1 of the grid's 3 runs are not in this report" in md and "baseline/seed3" in md
    assert f"{'ab' * 6} (clean, version '0.1.0') for 1 run(s) (baseline/seed2)" in md
    assert "not recorded for 1 run(s) (baseline/seed1)" in md
    assert {r["seed"]: (r["code_commit"], r["code_clean"]) for r in csv.DictReader(
        (tmp_path / "report" / "runs.csv").read_text().splitlines()
    )} == {"1": ("not recorded", ""), "2": ("ab" * 20, "true")}  # fmt: skip
    assert res["lab"].runs["baseline"][2].path == str(d)  # read through a checked copy, reported where it is
    page = (tmp_path / "report" / "index.html").read_text()
    assert "Code the runs came from" in page and "ab" * 20 in page


def test_a_preregistered_grid_runs_only_from_a_clean_tree_unless_told(tmp_path):
    import subprocess

    from tim_megatron.lab.grid import GridError
    from tim_megatron.lab.main import run_lab

    repo = tmp_path / "project"
    git = _git_repo(repo)
    (repo / "docs" / "prereg").mkdir(parents=True)
    (repo / "docs" / "prereg" / "pre.md").write_text("lab/pre.yaml\n")
    _commit(git, "prereg", authored="2026-03-01T12:00:00+00:00")
    (repo / "notes.txt").write_text("uncommitted\n")
    body = (
        f"base_recipe: {ROOT / 'recipes/tiny-moe/countdown.yaml'}\nseeds: [1]\n"
        "arms: [{name: a, requires: a future feature, overrides: [diagnostics.future=1]}]\n"
    )
    for name in ("pre", "free"):
        (tmp_path / f"{name}.yaml").write_text(f"name: {name}\n" + body)
    quiet = dict(out=tmp_path / "report", log=lambda m: None, repo=repo)
    with pytest.raises(
        GridError, match=r"pre-registered \(docs/prereg/pre.md\).*uncommitted changes.*\?\? notes.txt"
    ):
        run_lab(str(tmp_path / "pre.yaml"), root=tmp_path / "runs-pre", **quiet)
    assert not (tmp_path / "runs-pre").exists()  # refused before anything ran
    run_lab(str(tmp_path / "pre.yaml"), root=tmp_path / "runs-pre", allow_dirty=True, **quiet)
    run_lab(
        str(tmp_path / "pre.yaml"), root=tmp_path / "runs-pre", aggregate_only=True, **quiet
    )  # runs nothing
    run_lab(str(tmp_path / "free.yaml"), root=tmp_path / "runs-free", **quiet)  # not pre-registered
    subprocess.run([*git, "add", "-A"], check=True)
    _commit(git, "notes", authored="2026-03-01T13:00:00+00:00")
    run_lab(str(tmp_path / "pre.yaml"), root=tmp_path / "runs-pre", **quiet)  # clean now
    subprocess.run(["rm", "-rf", str(repo / ".git")], check=True)
    with pytest.raises(GridError, match="cannot be told .*not a git repository"):
        run_lab(str(tmp_path / "pre.yaml"), root=tmp_path / "runs-pre", **quiet)


def test_the_shipped_preregistered_grids_are_the_ones_with_a_preregistration():
    from tim_megatron.lab.checkout import registration
    from tim_megatron.lab.grid import load_grid

    marked = {p.stem for p in (ROOT / "lab").glob("*.yaml") if registration(load_grid(p), ROOT)}
    assert marked == {"A", "B", "D", "E"}


def test_lab_surge_detector_is_the_runs_own_recipe(tmp_path):
    from tim_megatron.lab.runstats import surge_detector
    from tim_megatron.recipe import load_recipe, recipe_to_yaml
    from tim_megatron.run_dir import RECIPE_FILE

    loaded = load_recipe(
        ROOT / "recipes/tiny-moe/lab.yaml",
        ["remedies.lr_schedule.surge.factor=3", "remedies.lr_schedule.surge.within=4"],
    )
    (tmp_path / RECIPE_FILE).write_text(recipe_to_yaml(loaded.recipe))
    det = surge_detector(tmp_path)
    assert (det.factor, det.within) == (3.0, 4)
    assert (surge_detector(tmp_path / "missing").factor, surge_detector(tmp_path / "missing").within) == (
        2.0,
        10,
    )


def test_false_alarms_count_only_runs_that_can_fire():
    from tim_megatron.lab.detectors import Trace, evaluate
    from tim_megatron.lab.runstats import TREND_RULE

    noisy = [0.03 * (1.0 + 0.01 * ((7 * t) % 5)) for t in range(40)]
    grows = noisy[:15] + [0.03 * 1.3**k for k in range(1, 26)]
    traces = [
        Trace("exact", 1, list(range(1, 41)), [0.0] * 40, None, can_warn=False),
        Trace("exact", 2, list(range(1, 41)), [0.0] * 40, 30, can_warn=False),
        Trace("baseline", 1, list(range(1, 41)), noisy, None),
        Trace("lr-high", 1, list(range(1, 41)), grows, 38),
    ]
    e = evaluate(TREND_RULE, traces, seeds="all")
    assert (e.runs, e.excluded, e.stable, e.collapsing) == (4, 2, 1, 1)
    assert e.warned == 1 and e.false_alarms == 0


# --------------------------------------------------- whether the rules were in place before the runs (provenance)

RULES = ("lab/rules.py", "lab/more.py")


def _git_repo(path: Path) -> list[str]:
    """A fresh repository at ``path``; the git command line to use in it."""
    import subprocess

    path.mkdir(parents=True, exist_ok=True)
    git = ["git", "-C", str(path), "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]
    subprocess.run([*git, "init", "-q"], check=True)
    return git


def _commit(git: list[str], message: str, *, authored: str, committed: str | None = None) -> str:
    import os
    import subprocess

    env = {**os.environ, "GIT_AUTHOR_DATE": authored, "GIT_COMMITTER_DATE": committed or authored}
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-q", "--allow-empty", "-m", message], check=True, env=env)
    return subprocess.run(
        [*git, "rev-parse", "HEAD"], check=True, capture_output=True, text=True
    ).stdout.strip()


def _rules_repo(tmp_path: Path) -> tuple[Path, list[str]]:
    """Two rule files committed at 2026-03-01 12:00 UTC, then an unrelated commit at 14:00."""
    repo = tmp_path / "repo"
    git = _git_repo(repo)
    (repo / "lab").mkdir()
    (repo / "lab" / "rules.py").write_text("RULE = 1\n")
    (repo / "lab" / "more.py").write_text("MORE = 1\n")
    _commit(git, "rules", authored="2026-03-01T12:00:00+00:00")
    (repo / "README").write_text("other\n")
    _commit(git, "other", authored="2026-03-01T14:00:00+00:00")
    return repo, git


def _run(name: str, created: object = "2026-03-01T13:00:00", **kw):
    from tim_megatron.lab.provenance import RunRules

    return RunRules(name=name, created=created, **kw)


def test_the_rules_sentence_dates_content_by_author_date_whatever_the_readers_zone(tmp_path, monkeypatch):
    """Run starts written without a zone are read as UTC, git's dates are epochs, and every time printed is UTC,
    named: the sentence is the same in Berlin, Los Angeles and UTC. A rebase that keeps the rule files' content
    (a new committer date, the author date kept) does not move the verdict."""
    import os
    import subprocess
    import time

    from tim_megatron.lab.provenance import rules_fixed_text

    repo, git = _rules_repo(tmp_path)
    runs = [_run("a/seed1"), _run("a/seed2", "2026-03-01T13:30:00+00:00")]
    said = {}
    try:
        for tz in ("UTC", "Europe/Berlin", "America/Los_Angeles"):
            monkeypatch.setenv("TZ", tz)
            time.tzset()
            said[tz] = rules_fixed_text(runs=runs, repo=repo, files=RULES)
    finally:
        monkeypatch.undo()
        time.tzset()
    assert len(set(said.values())) == 1, said
    text = said["UTC"]
    assert "the first run's start, 2026-03-01 13:00 UTC" in text and "2026-03-01 12:00 UTC" in text
    assert "rules.py and more.py have their current content since commits authored before that start" in text
    assert text.endswith("So the rules were fixed before the runs.")
    # rewrite the history (every commit anew, as a rebase does; content and author dates kept): the committer
    # dates move past the start
    env = {**os.environ, "FILTER_BRANCH_SQUELCH_WARNING": "1"}
    late = "export GIT_COMMITTER_DATE='2026-03-02T09:00:00+00:00'"
    subprocess.run(
        [*git, "filter-branch", "-f", "--env-filter", late], check=True, capture_output=True, env=env
    )
    rebased = rules_fixed_text(runs=runs, repo=repo, files=RULES)
    assert "current content since commits authored before that start" in rebased
    assert (
        "committed after it, 2026-03-02 09:00 UTC (a rebase or cherry-pick keeps the author date)" in rebased
    )
    assert rebased.endswith("So the rules were fixed before the runs.")


def test_the_rules_sentence_names_the_rule_file_changed_after_the_first_run(tmp_path):
    from tim_megatron.lab.provenance import rules_fixed_text

    repo, git = _rules_repo(tmp_path)
    (repo / "lab" / "more.py").write_text("MORE = 2\n")
    _commit(git, "more", authored="2026-03-01T15:00:00+00:00")
    text = rules_fixed_text(
        runs=[_run("a/seed1"), _run("a/seed2", "2026-03-01T16:00:00")], repo=repo, files=RULES
    )
    assert "rules.py has its current content since a commit authored before that start" in text
    assert "more.py has its current content only since commit" in text
    assert "authored 2026-03-01 15:00 UTC, after that start" in text
    assert text.endswith("So not every rule was fixed before the runs.")
    (repo / "lab" / "rules.py").write_text("RULE = 3\n")  # uncommitted: no commit dates it
    text = rules_fixed_text(runs=[_run("a/seed1")], repo=repo, files=RULES)
    assert "for rules.py it cannot be stated: this checkout has uncommitted changes to it" in text


def test_the_rules_sentence_cannot_be_stated_from_a_shallow_clone_or_where_git_refuses(tmp_path, monkeypatch):
    import subprocess

    from tim_megatron.lab.provenance import rules_fixed_text

    repo, _ = _rules_repo(tmp_path)
    shallow = tmp_path / "shallow"
    subprocess.run(
        ["git", "clone", "-q", "--depth", "1", f"file://{repo}", str(shallow)],
        check=True,
        capture_output=True,
    )
    text = rules_fixed_text(runs=[_run("a/seed1")], repo=shallow, files=RULES)
    assert "it cannot be stated: " in text and "is a shallow clone" in text, text
    assert text.endswith("So whether every rule was fixed before the runs cannot be stated.")
    tarball = tmp_path / "unpacked"  # the same files without .git
    (tarball / "lab").mkdir(parents=True)
    for f in RULES:
        (tarball / f).write_bytes((repo / f).read_bytes())
    text = rules_fixed_text(runs=[_run("a/seed1")], repo=tarball, files=RULES)
    assert "git refuses to read" in text and "not a git repository" in text, text
    monkeypatch.setenv("GIT_TEST_ASSUME_DIFFERENT_OWNER", "1")  # git's own test switch for a foreign owner
    text = rules_fixed_text(runs=[_run("a/seed1")], repo=repo, files=RULES)
    assert "dubious ownership" in text and "cannot be stated" in text, text


def test_a_recorded_hash_or_commit_decides_without_dates_and_implausible_starts_are_left_out(tmp_path):
    from tim_megatron.lab.checkout import RunCode
    from tim_megatron.lab.provenance import rule_hashes, rules_fixed_text

    repo, git = _rules_repo(tmp_path)
    now = rule_hashes(repo, RULES)
    tarball = tmp_path / "unpacked"  # no git at all: the hashes suffice
    (tarball / "lab").mkdir(parents=True)
    for f in RULES:
        (tarball / f).write_bytes((repo / f).read_bytes())
    hashed = [_run(f"a/seed{s}", "0001-01-01T00:00:00", hashes=dict(now)) for s in (1, 2)]
    text = rules_fixed_text(runs=hashed, repo=tarball, files=RULES)
    assert "Every one of the 2 runs recorded the rules' sha256 as it started (lab.json)" in text
    assert text.endswith(
        "rules.py and more.py are as every run started with. So the rules were fixed before the runs."
    )
    other = {**now, "lab/more.py": "0" * 64}
    text = rules_fixed_text(runs=[hashed[0], _run("a/seed2", hashes=other)], repo=tarball, files=RULES)
    assert "more.py differs from the sha256 that 1 run(s) recorded as they started (a/seed2)" in text
    # a clean commit recorded by the run: the blobs at that commit against today's files
    head = _commit(git, "head", authored="2026-03-01T15:00:00+00:00")
    code = (RunCode(commit=head, clean=True, diff_sha256=None, version="0.1"),)
    assert "So the rules were fixed" in rules_fixed_text(
        runs=[_run("a/seed1", codes=code)], repo=repo, files=RULES
    )
    (repo / "lab" / "rules.py").write_text("RULE = 2\n")
    _commit(git, "changed", authored="2026-03-01T16:00:00+00:00")
    text = rules_fixed_text(runs=[_run("a/seed1", codes=code)], repo=repo, files=RULES)
    assert f"rules.py differs from its content at commit {head[:12]}, which a/seed1 ran from" in text
    # starts of year 1 and in the future decide nothing: they are named and left out
    runs = [_run("a/seed1", "0001-01-01T00:00:00"), _run("a/seed2", "9999-01-01T00:00:00+00:00")]
    text = rules_fixed_text(runs=[*runs, _run("a/seed3", "2026-03-01T13:00:00")], repo=repo, files=RULES)
    assert "2 run(s) recorded no plausible start (2000 to now) and are left out of that comparison" in text
    assert "a/seed1 ('0001-01-01T00:00:00')" in text and "the first run's start, 2026-03-01 13:00 UTC" in text
    assert "cannot be stated: no run" in rules_fixed_text(runs=runs, repo=repo, files=RULES)


def test_the_policy_outcome_is_the_mean_of_the_last_two_evaluations():
    from tim_megatron.lab.runstats import policy_outcome

    rows = [{"step": s, "reward/mean": 0.1} for s in range(1, 31)]
    assert policy_outcome(rows) != policy_outcome(rows)  # none logged: NaN
    rows[29]["val/policy_reward"] = 0.7
    assert policy_outcome(rows) != policy_outcome(rows)  # one is not two: NaN
    for s, v in ((10, 0.2), (20, 0.5), (30, 0.7)):
        rows[s - 1]["val/policy_reward"] = v
    assert policy_outcome(rows) == pytest.approx(0.6)


def test_experiment_ds_policy_deficits_are_paired_per_arm_with_holm_across_arms(tmp_path):
    """D's primary analysis: per injected arm, the exact arm's policy reward minus the arm's, paired by seed,
    one-sided t, Holm across the arms, the smallest effect (0.1) first."""
    from dataclasses import replace

    from tim_megatron.lab.deficits import policy_deficits

    seeds = range(1, 9)
    runs = {
        "exact": {s: _stats("exact", s, policy_reward=0.5 + 0.02 * s) for s in seeds},
        # a deficit of 0.2 with a little seed noise: reproduced
        "inject-bias-3": {
            s: _stats("inject-bias-3", s, dose=0.02, policy_reward=0.3 + 0.02 * s + 0.01 * (s % 3))
            for s in seeds
        },
        # no deficit, tightly: below the 0.1 that counts, whatever the p
        "inject-noise-0.3": {
            s: _stats("inject-noise-0.3", s, dose=0.01, policy_reward=0.5 + 0.02 * s + 0.004 * (s % 2 - 0.5))
            for s in seeds
        },
    }
    rows = {r.arm: r for r in policy_deficits(_lab(tmp_path, VEXACT_GRID, runs))}
    bias, noise = rows["inject-bias-3"], rows["inject-noise-0.3"]
    assert bias.verdict == "reproduced" and bias.deficit == pytest.approx(0.2, abs=0.02) and bias.n_seeds == 8
    assert bias.p_value < noise.p_value and bias.p_holm == pytest.approx(min(1.0, 2 * bias.p_value))
    assert noise.verdict == "not reproduced" and noise.ci_high < 0.1 and noise.dose == pytest.approx(0.01)
    # significant (p < 0.001 after Holm) but wholly below the 0.1 that counts: not reproduced, whatever the p
    small = {**runs, "inject-noise-0.3": {s: replace(r, policy_reward=r.policy_reward - 0.03 - 0.001 * (s % 2))
                                         for s, r in runs["inject-noise-0.3"].items()}}  # fmt: skip
    row = {r.arm: r for r in policy_deficits(_lab(tmp_path, VEXACT_GRID, small))}["inject-noise-0.3"]
    assert row.p_holm < 0.001 and row.ci_high < 0.1 and row.verdict == "not reproduced", row
    nan = float("nan")
    unmeasured = {a: {s: _stats(a, s, policy_reward=nan) for s in seeds} for a in runs}
    assert policy_deficits(_lab(tmp_path, VEXACT_GRID, unmeasured)) == []


E_LIKE_GRID = (
    VEXACT_GRID
    + """contrasts:
  - {name: noise-cost, arm: inject-noise-0.3, reference: exact}
  - {name: bias-beyond-noise, arm: inject-bias-3, reference: inject-noise-0.3}
"""
)


def test_declared_contrasts_are_the_primary_tests_with_holm_across_them(tmp_path):
    """E's layout (issue 61, item 4): the grid names its primary tests, a contrast between two injected arms among
    them; each deficit is the reference minus the arm, paired by seed, Holm across the contrasts alone, and the
    sensitivity table follows the same contrasts."""
    from tim_megatron.lab.claims import ALPHA
    from tim_megatron.lab.deficits import policy_deficits
    from tim_megatron.lab.sensitivity import sensitivity_rows

    seeds = range(1, 9)
    runs = {
        "exact": {s: _stats("exact", s, policy_reward=0.5 + 0.02 * s) for s in seeds},
        "inject-noise-0.3": {
            s: _stats("inject-noise-0.3", s, dose=0.3, policy_reward=0.5 + 0.02 * s + 0.004 * (s % 2 - 0.5))
            for s in seeds
        },
        # 0.2 below the noise arm, paired by seed: the bias contrast finds it; against exact it is not tested
        "inject-bias-3": {
            s: _stats("inject-bias-3", s, dose=0.31, policy_reward=0.3 + 0.02 * s + 0.01 * (s % 3))
            for s in seeds
        },
    }
    lab = _lab(tmp_path, E_LIKE_GRID, runs)
    rows = policy_deficits(lab)
    assert [(r.arm, r.tested, r.reference) for r in rows] == [
        ("noise-cost", "inject-noise-0.3", "exact"),
        ("bias-beyond-noise", "inject-bias-3", "inject-noise-0.3"),
    ]
    noise, bias = rows
    assert bias.deficit == pytest.approx(0.2, abs=0.02) and bias.verdict == "reproduced" and bias.dose == 0.31
    assert noise.verdict == "not reproduced" and noise.ci_high < 0.1
    assert bias.p_holm == pytest.approx(min(1.0, 2 * bias.p_value))  # two contrasts, not three arms
    row = bias.row()
    assert list(row)[:3] == ["contrast", "arm", "reference"] and row["reference"] == "inject-noise-0.3"
    assert (
        "contrast" not in policy_deficits(_lab(tmp_path, VEXACT_GRID, runs))[0].row()
    )  # D's columns as before
    sens = sensitivity_rows(lab)
    assert [r["arm"] for r in sens] == ["noise-cost", "bias-beyond-noise"] and sens[0]["alpha"] == ALPHA / 2
    # a contrast whose reference has no runs is left out, not tested against nothing
    assert [
        r.arm for r in policy_deficits(_lab(tmp_path, E_LIKE_GRID, {**runs, "inject-noise-0.3": {}}))
    ] == []


@pytest.mark.parametrize(
    ("body", "match"),
    [
        ("contrasts: []\n", "contrasts = \\[\\]: expected a non-empty list"),
        ("contrasts: [{name: c, arm: a}]\n", "contrasts\\[0\\].*exactly the keys"),
        ("contrasts: [{name: c, arm: a, reference: z}]\n", "contrasts\\[0\\].reference = 'z': not an arm"),
        ("contrasts: [{name: c, arm: a, reference: a}]\n", "both 'a'"),
        ("contrasts: [{name: c, arm: a, reference: b}, {name: c, arm: b, reference: a}]\n", "used twice"),
        ("order: random\n", "order = 'random': expected one of \\['arm', 'seed'\\]"),
    ],
)
def test_grid_contrasts_and_order_errors_name_the_key(tmp_path, body, match):
    from tim_megatron.lab.grid import GridError, load_grid

    with pytest.raises(GridError, match=match):
        load_grid(_grid(tmp_path, "arms: [{name: a}, {name: b}]\n" + body))


def test_order_seed_interleaves_the_arms_within_each_seed(tmp_path):
    """``order: seed`` starts every arm of a seed before the next seed (E: arms interleaved in time); the default
    runs an arm's seeds one after another."""
    from tim_megatron.lab.grid import load_grid, plan
    from tim_megatron.lab.runner import _prepare

    def started(order: str) -> list[tuple[str, int]]:
        grid = load_grid(_grid(tmp_path, f"order: {order}\narms: [{{name: a}}, {{name: b}}]\n"))
        claims: dict = {}
        _, pending = _prepare(grid, plan(grid), tmp_path / order, None, None, sys.executable, claims, print)
        for lock in claims.values():
            lock.release()
        return [(p[1], p[2]) for p in pending]

    assert started("seed") == [("a", 1), ("b", 1), ("a", 2), ("b", 2)]
    assert started("arm") == [("a", 1), ("a", 2), ("b", 1), ("b", 2)]


def test_the_seed_count_for_80_percent_power_follows_the_paired_t_test():
    """t's one-sided critical values against the table; the power of the paired t test by a fixed simulation:
    Cohen's d = 1 at one-sided 0.025 needs 10-11 pairs (G*Power: 10, power 0.803), more pairs at a larger SD."""
    from tim_megatron.lab.stats import paired_power, seeds_for_power, t_critical

    assert t_critical(0.025, 9) == pytest.approx(2.262, abs=1e-3)
    assert t_critical(0.025, 1) == pytest.approx(12.706, abs=1e-3)
    assert t_critical(0.0125, 12) == pytest.approx(2.560, abs=2e-3)
    assert seeds_for_power(effect=1.0, sd=1.0, alpha=0.025) in (10, 11)
    assert paired_power(n=10, effect=1.0, sd=1.0, alpha=0.025) == pytest.approx(0.80, abs=0.015)
    # D's sizing (docs/prereg/D.md): SD 0.1, a 0.1 deficit, Holm's first step over two arms
    assert [seeds_for_power(effect=0.1, sd=sd, alpha=0.0125) for sd in (0.05, 0.1, 0.15)] == [6, 13, 24]


def test_the_detectable_deficit_is_where_the_power_reaches_80_percent():
    """Issue 61, item 3: D's pre-registration promised, should the paired SD exceed the 0.1 it was sized for, to say
    which deficit D could detect; tim_megatron/lab/sensitivity.py computes it (the D block shows 0.12 and 0.15)."""
    from tim_megatron.lab.sensitivity import detectable
    from tim_megatron.lab.stats import paired_power

    for n, sd in ((13, 0.124), (13, 0.154), (6, 0.1)):
        d = detectable(n=n, sd=sd, alpha=0.0125)
        assert paired_power(n=n, effect=d, sd=sd, alpha=0.0125) >= 0.8
        assert paired_power(n=n, effect=0.97 * d, sd=sd, alpha=0.0125) < 0.8
    assert detectable(n=13, sd=0.154, alpha=0.0125) > detectable(n=13, sd=0.124, alpha=0.0125)
    assert math.isnan(detectable(n=1, sd=0.1, alpha=0.0125))
