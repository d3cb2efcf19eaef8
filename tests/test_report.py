"""The TIM report: synthetic runs with known answers, real tiny runs, and bad input."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SLOPE = 0.05


def synthetic_run(
    root: Path, name: str, *, growing: bool, steps: int = 60, sweep: str | None = "s1", dumps: bool = True
) -> Path:
    d = root / name / "20260101-000000"
    d.mkdir(parents=True)
    rows = []
    for t in range(1, steps + 1):
        std = 1e-3 * math.exp(SLOPE * t) if growing else 1e-3 * (1 + 0.01 * ((t * 7) % 3 - 1))
        reward = min(0.1 + 0.02 * t, 0.8) if not growing or t < 40 else 0.8 - 0.05 * (t - 40)
        rows.append(
            {
                "step": t,
                "reward/mean": reward,
                "mismatch/old_vs_rollout/rho_std": std,
                "mismatch/old_vs_rollout/log_ppl_abs_diff": 10 * std,
                "mismatch/old_vs_rollout/prob_pearson": 1 - std,
                "mismatch/old_vs_rollout/rho_max": 1 + 5 * std,
                "mismatch/old_vs_rollout/kl_rollout_old_k3": std * std,
                "response/length_mean": 100.0 if t < 30 or not growing else 350.0,
                "response/entropy_mean": 0.5,
                "actor/grad_norm": 1.0 + std,
                "actor/lr": 1e-6,
                "actor/clipfrac_token_low": 0.001,
                "actor/clipfrac_token_high": 0.002,
                "actor/clipfrac_seq": 0.0,
                "objective/J": (0.1 * t if growing else 0.0),
                "rollout/tokens_per_s": 1000.0,
                "mismatch/old_vs_rollout/bucket/0-0.1/rho_mean": 1 - std,
                "mismatch/old_vs_rollout/bucket/0.9-1/rho_mean": 1.0,
                **({"val/accuracy": reward} if t % 10 == 0 else {}),
            }
        )
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (d / "run.json").write_text(json.dumps({"name": name, "sweep_id": sweep, "status": "completed"}))
    if dumps:
        import numpy as np
        import pyarrow as pa
        import pyarrow.parquet as pq

        (d / "dumps").mkdir()
        rng = np.random.default_rng(0)
        for step in (1, steps):
            p = rng.uniform(0, 1, 8000).astype("float32")
            q = np.clip(
                p * (1 + (0.2 if growing and step == steps else 0.01) * rng.standard_normal(8000)), 0, 1
            ).astype("float32")
            pq.write_table(
                pa.table({"step": np.full(8000, step, dtype="int32"), "pi_train": p, "pi_infer": q}),
                d / "dumps" / f"step_{step:08d}.parquet",
            )
    return d


def test_synthetic_runs_rank_slope_warning_and_figures(tmp_path):
    from tim_megatron.report.analysis import WarningSettings
    from tim_megatron.report.build import build_report

    grow = synthetic_run(tmp_path / "runs", "grow", growing=True)
    flat = synthetic_run(tmp_path / "runs", "flat", growing=False)
    s = WarningSettings(baseline_steps=5, window=5, threshold=2.0)
    res = build_report([flat, grow], tmp_path / "report", settings=s)
    rows = res["rows"]
    assert [r["variant"] for r in rows] == ["grow", "flat"]  # fastest growth first
    assert rows[0]["mismatch_growth_per_step"] == pytest.approx(SLOPE, abs=1e-9)
    assert abs(rows[1]["mismatch_growth_per_step"]) < 1e-3
    # The mismatch first reaches 2x its baseline (median of steps 1-5 = step 3) at step 3 + ln2 / SLOPE -> 17;
    # a median over 5 values needs up to 5 // 2 + 1 more steps.
    crossing = math.ceil(3 + math.log(2) / SLOPE)
    assert crossing <= rows[0]["first_warning_step"] <= crossing + s.window // 2 + 1
    assert rows[1]["first_warning_step"] is None
    assert rows[0]["length_surge_step"] == 31  # window mean (100 + 350 + 350) / 3 >= 2 x 100 first at step 31
    assert rows[0]["first_collapse_step"] is not None and rows[1]["first_collapse_step"] is None
    out = res["out"]
    pngs = sorted(out.glob("*.png"))
    assert {p.name for p in pngs} >= {
        "curve_reward-mean.png",
        "curve_mismatch-old_vs_rollout-rho_std.png",
        "scatter_grow.png",
        "buckets_grow.png",
        "surrogate_J.png",
    }
    assert all(p.stat().st_size > 5000 for p in pngs)
    page = (out / "index.html").read_text()
    assert "Variants ranked by mismatch growth" in page and "scatter_grow.png" in page
    csv = (out / "summary.csv").read_text().splitlines()
    assert csv[0].startswith("variant,") and csv[1].startswith("grow,")


def test_bad_input_never_crashes_the_report(tmp_path):
    from tim_megatron.report.build import build_report

    good = synthetic_run(tmp_path / "runs", "good", growing=False, dumps=False)
    other = synthetic_run(tmp_path / "runs", "other", growing=True, sweep="s2", dumps=False)
    with open(other / "metrics.jsonl", "a") as f:
        f.write('{"step": 61, "reward/mean": 0.5\n')  # a run killed mid-write
        f.write("not json at all\n")
    empty = tmp_path / "runs" / "empty" / "x"
    empty.mkdir(parents=True)
    res = build_report([good, other, empty], tmp_path / "report")
    notices = "\n".join(res["notices"])
    assert (
        "no metrics.jsonl" in notices and f"{other / 'metrics.jsonl'}:61: skipped a corrupt line" in notices
    )
    assert f"{other / 'metrics.jsonl'}:62:" in notices
    assert "different sweeps" in notices
    assert len(res["rows"]) == 2
    assert "No token dumps for: good, other" in (res["out"] / "index.html").read_text()


def test_single_run_and_run_in_progress(tmp_path):
    from tim_megatron.report.build import build_report

    d = synthetic_run(tmp_path / "runs", "solo", growing=True, steps=8, dumps=False)
    meta = json.loads((d / "run.json").read_text())
    meta["status"] = "running"
    (d / "run.json").write_text(json.dumps(meta))
    res = build_report([d], tmp_path / "report")
    assert len(res["rows"]) == 1 and "still running; shown up to step 8" in "\n".join(res["notices"])


def test_report_from_two_real_tiny_runs_builds_under_a_minute(tmp_path):
    from tests.conftest import train_in_one_process
    from tests.test_loop import FAST

    overrides = [
        "run.steps=4",
        *FAST[:2],
        "diagnostics.dumps.every=2",
        "checkpoint.every=0",
        "checkpoint.at_end=false",
    ]
    done = train_in_one_process(  # real runs, as make demo makes them (in one process: the imports once)
        [
            {
                "name": recipe,
                "recipe": f"recipes/tiny-moe/{recipe}.yaml",
                "overrides": overrides,
                "output_dir": str(tmp_path / "runs"),
            }
            for recipe in ("grpo", "gspo")
        ],
        tmp_path / "worker",
    )
    assert all(r["exit"] == 0 for r in done.values()), done
    runs = sorted((tmp_path / "runs").glob("*/*"))
    assert len(runs) == 2
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "tim_megatron.cli",
            "report",
            *map(str, runs),
            "--name",
            "real",
            "--out",
            str(tmp_path / "rep"),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=600,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    assert "tiny-moe-grpo" in res.stdout and "tiny-moe-gspo" in res.stdout
    assert (tmp_path / "rep" / "scatter_tiny-moe-grpo.png").stat().st_size > 5000


def test_sweep_is_found_by_id_by_file_and_as_latest(tmp_path):
    """`make sweep` then `make report`: the report finds the newest submission of a sweep by itself."""
    from tim_megatron.report.runs import resolve_sweep

    runs = tmp_path / "runs"
    old = [
        synthetic_run(runs, f"old-{n}", growing=False, sweep="clipping-tiny-20261101-090000", dumps=False)
        for n in "ab"
    ]
    new = [
        synthetic_run(runs, f"new-{n}", growing=True, sweep="clipping-tiny-20261102-080000", dumps=False)
        for n in "ab"
    ]
    synthetic_run(runs, "other", growing=True, sweep="clipping-qwen3-30b-a3b-20261101-100000", dumps=False)
    assert resolve_sweep("clipping-tiny-20261101-090000", runs) == (
        "clipping-tiny-20261101-090000",
        sorted(old),
    )
    assert resolve_sweep(str(ROOT / "recipes/sweeps/clipping-tiny.yaml"), runs) == (
        "clipping-tiny-20261102-080000",
        sorted(new),
    )
    assert resolve_sweep("latest", runs)[0] == "clipping-tiny-20261102-080000"
    with pytest.raises(ValueError, match=r"sweep id 'nope'.*clipping-qwen3-30b-a3b-20261101-100000"):
        resolve_sweep("nope", runs)
    with pytest.raises(ValueError, match="belongs to any sweep; sweep ids there: none"):
        resolve_sweep("latest", tmp_path / "empty")


def test_rolling_median_drops_spikes_and_keeps_a_trend():
    import numpy as np

    from tim_megatron.report.plots import rolling_median, smoothing_window

    y = np.arange(40, dtype=float)
    y[[7, 21]] = 1e3  # isolated spikes, as a single bad step makes
    out = rolling_median(y, 5)
    assert out.shape == y.shape and out.max() < 40
    far = np.array([abs(i - 7) > 2 and abs(i - 21) > 2 for i in range(40)])
    far[:2] = far[-2:] = False  # the window shrinks at the ends
    assert np.array_equal(out[far], y[far])  # a linear trend is left exactly as it is
    assert smoothing_window(30) == 5 and smoothing_window(400) == 17
